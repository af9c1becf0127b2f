"""Colour scales for tokens: by the sampling logprob, or by the advantage the trainer gave the call.

Discrete buckets rather than a continuous gradient, for two reasons: a reader can match a token to
the legend by eye, and each bucket is a CSS class, so the page needs no inline ``style`` attribute
(its Content-Security-Policy forbids them). ``scale_css`` writes the classes from the same tables
the legend is drawn from, so legend and tokens cannot disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Bucket:
    """One step of a scale: tokens in ``[low, high)`` get ``background`` with ``text`` on it."""

    low: float
    high: float
    label: str
    background: str
    text: str


# Sequential, colour-blind safe (ColorBrewer YlOrRd, reversed): tokens the policy was sure of stay
# pale, unlikely tokens stand out in dark red. Bounds are probabilities (exp(logprob)).
LOGPROB_SCALE: tuple[Bucket, ...] = (
    Bucket(0.00, 0.05, "p < 0.05", "#800026", "#ffffff"),
    Bucket(0.05, 0.10, "0.05–0.1", "#bd0026", "#ffffff"),
    Bucket(0.10, 0.20, "0.1–0.2", "#e31a1c", "#ffffff"),
    Bucket(0.20, 0.35, "0.2–0.35", "#fc4e2a", "#ffffff"),
    Bucket(0.35, 0.50, "0.35–0.5", "#fd8d3c", "#1a1a1a"),
    Bucket(0.50, 0.70, "0.5–0.7", "#feb24c", "#1a1a1a"),
    Bucket(0.70, 0.90, "0.7–0.9", "#fed976", "#1a1a1a"),
    Bucket(0.90, 1.01, "p ≥ 0.9", "#ffffcc", "#1a1a1a"),
)

# Diverging (ColorBrewer RdBu): negative advantages red (the update pushes these tokens down),
# positive blue (pushed up), near zero white. Bounds are advantages in the estimator's units (grpo:
# standard deviations of the group's reward), clipped at ±2.
ADVANTAGE_SCALE: tuple[Bucket, ...] = (
    Bucket(-math.inf, -1.5, "≤ −1.5", "#b2182b", "#ffffff"),
    Bucket(-1.5, -0.75, "−1.5…−0.75", "#ef8a62", "#1a1a1a"),
    Bucket(-0.75, -0.1, "−0.75…−0.1", "#fddbc7", "#1a1a1a"),
    Bucket(-0.1, 0.1, "≈ 0", "#f7f7f7", "#1a1a1a"),
    Bucket(0.1, 0.75, "0.1…0.75", "#d1e5f0", "#1a1a1a"),
    Bucket(0.75, 1.5, "0.75…1.5", "#67a9cf", "#1a1a1a"),
    Bucket(1.5, math.inf, "≥ 1.5", "#2166ac", "#ffffff"),
)
NO_VALUE = Bucket(math.nan, math.nan, "none", "#e0e0e0", "#555555")
"""Tokens with no logprob recorded, or calls the trainer gave no advantage (a group with no spread)."""


def _bucket(value: float, scale: tuple[Bucket, ...]) -> int:
    for i, b in enumerate(scale):
        if value < b.high:
            return i
    return len(scale) - 1


def logprob_bucket(logprob: float | None) -> int | None:
    """Index into ``LOGPROB_SCALE`` of a token's sampling logprob; None when it has none (or it is NaN)."""
    if logprob is None or math.isnan(logprob):
        return None
    return _bucket(math.exp(min(logprob, 0.0)), LOGPROB_SCALE)


def advantage_bucket(advantage: float | None) -> int | None:
    """Index into ``ADVANTAGE_SCALE``; None for a call the estimator dropped (no advantage)."""
    if advantage is None or math.isnan(advantage):
        return None
    return _bucket(advantage, ADVANTAGE_SCALE)


def token_classes(logprob: float | None, advantage: float | None) -> str:
    """The CSS classes of one token: its logprob bucket and its advantage bucket (``-na`` for none)."""
    lp, adv = logprob_bucket(logprob), advantage_bucket(advantage)
    return f"tok lp-{'na' if lp is None else lp} adv-{'na' if adv is None else adv}"


def scale_css() -> str:
    """CSS for both scales: ``.by-lp .lp-N`` and ``.by-adv .adv-N`` colour the tokens, ``.sw-lp-N`` /
    ``.sw-adv-N`` the legend swatches. The page's ``by-lp`` / ``by-adv`` class picks the scale."""
    out = []
    for prefix, scale in (("lp", LOGPROB_SCALE), ("adv", ADVANTAGE_SCALE)):
        for i, b in [*enumerate(scale), ("na", NO_VALUE)]:
            rule = f"background:{b.background};color:{b.text}"
            out.append(f".by-{prefix} .tok.{prefix}-{i},.sw-{prefix}-{i}{{{rule}}}")
    return "\n".join(out) + "\n"
