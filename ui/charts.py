"""Small line charts as inline SVG geometry, computed here and drawn by the template.

No JavaScript chart library (the app works offline and ships every asset), and no inline styles
(the page's CSP forbids them): the template draws ``<polyline>`` and ``<circle>`` elements from the
coordinates below, and CSS classes give them colour.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Series:
    """One line: ``points`` are (x, y) in data units; y None leaves a gap."""

    name: str
    points: Sequence[tuple[float, float | None]]
    css: str = "s0"


@dataclass
class Chart:
    """Everything the template needs, in SVG user units."""

    title: str
    width: int
    height: int
    plot: tuple[float, float, float, float]  # left, top, right, bottom of the plotting area
    lines: list[tuple[str, str, str]] = field(default_factory=list)  # (css, name, "x,y x,y ...")
    dots: list[tuple[str, float, float, str]] = field(default_factory=list)  # (css, cx, cy, tooltip)
    x_ticks: list[tuple[float, str]] = field(default_factory=list)  # (x, label)
    y_ticks: list[tuple[float, str]] = field(default_factory=list)  # (y, label)
    keys: list[tuple[str, str]] = field(default_factory=list)  # (css, name) of each series drawn
    x_label: str = ""
    empty: bool = True


def nice_ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    """About ``n`` round values covering [lo, hi] (1, 2, 5 × 10^k steps)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi - lo < 1e-12:
        lo, hi = (0.0, 1.0) if lo == 0 else (lo - abs(lo) / 2, hi + abs(hi) / 2)
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    out, v = [], start
    while v < hi + step * 0.999:
        out.append(round(v, 12))
        v += step
    return out


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.1e}"


def line_chart(title: str, series: Sequence[Series], *, x_label: str = "round", width: int = 360,
               height: int = 190) -> Chart:
    """Lay out ``series`` on shared axes; integer x ticks (rounds are integers)."""
    left, top, right, bottom = 46.0, 24.0, width - 10.0, height - 30.0
    chart = Chart(title, width, height, (left, top, right, bottom), x_label=x_label)
    pts = [(x, y) for s in series for x, y in s.points if y is not None and math.isfinite(y)]
    if not pts:
        return chart
    chart.empty = False
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    yt = nice_ticks(min(ys), max(ys))
    y_lo, y_hi = yt[0], yt[-1]
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1

    def sx(x: float) -> float:
        return round(left + (x - x_lo) / (x_hi - x_lo) * (right - left), 1)

    def sy(y: float) -> float:
        return round(bottom - (y - y_lo) / ((y_hi - y_lo) or 1) * (bottom - top), 1)

    chart.y_ticks = [(sy(v), _fmt(v)) for v in yt]
    step = max(1, math.ceil((x_hi - x_lo) / 8))
    chart.x_ticks = [(sx(v), str(int(v))) for v in range(math.ceil(x_lo), math.floor(x_hi) + 1, step)]
    for s in series:
        if any(y is not None and math.isfinite(y) for _x, y in s.points):
            chart.keys.append((s.css, s.name))
        run: list[str] = []
        for x, y in [*s.points, (math.nan, None)]:  # a sentinel ends the last run
            if y is None or not math.isfinite(y):
                if len(run) > 1:
                    chart.lines.append((s.css, s.name, " ".join(run)))
                run = []
                continue
            run.append(f"{sx(x)},{sy(y)}")
            chart.dots.append((s.css, sx(x), sy(y), f"{s.name}: {_fmt(y)} at {x_label} {x:g}"))
    return chart
