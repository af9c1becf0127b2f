"""Late and sparse feedback: which rollouts a round may train on now (``tracerl train --feedback-window``).

In production a user's verdict comes minutes to days after the request, and most requests get none.
A rollout's feedback window opens when its last call ends and closes ``--feedback-window`` later; a
round trains only rollouts whose window has closed, so a thumbs-down that comes an hour late (or a
correction of an earlier verdict) is in the reward the rollout trains with. At the close:

- a rollout with a reward trains (its latest conversion: the converter converts a rollout again when
  feedback arrives after it was converted, and the ``transitions`` view shows the latest);
- a rollout without one (no reward row, only ``convert --missing-reward fill``'s placeholder) is left
  out, counted, and consumed, so it is not counted again by every later round.

Rollouts whose window is still open are not trained and not consumed: a later round takes them (with
``--max-staleness`` >= 1 when a publish happened meanwhile: their calls are then stale, and the loss
corrects each by its importance weight). Window 0 (the default) keeps the behaviour without a window:
every complete rewarded rollout trains at once, a filled reward included.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)\s*$")
FILL_SOURCE = "fill"
"""``reward_source`` of a rollout given ``convert --missing-reward fill``'s reward: no feedback came."""


def parse_duration(text: str | float) -> float:
    """Seconds in ``600``, ``600s``, ``10m``, ``2h``, ``1.5d``; a ValueError that names the accepted forms."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        m = _DURATION.match(str(text).lower())
        if m is None:
            raise ValueError(
                f"--feedback-window {text!r} is not a duration: give seconds (600) or a number with "
                "a unit s, m, h or d (10m, 2h, 1d); 0 trains without waiting"
            )
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"--feedback-window must be a finite duration >= 0, got {text!r}")
    return seconds


@dataclass(frozen=True)
class RolloutEnd:
    """What the window needs of one rollout: when its last call ended and whether feedback rewarded it."""

    rollout_id: str
    ended_ns: int | None  # None: recorded without times; its window counts as closed
    rewarded: bool


@dataclass
class WindowSplit:
    """The rollouts of a round by their feedback window."""

    closed: set[str] = field(default_factory=set)  # closed and rewarded: trainable now
    waiting: dict[str, float] = field(default_factory=dict)  # open: rollout -> seconds until it closes
    unrewarded: set[str] = field(default_factory=set)  # closed without feedback: left out (and consumed)

    def note(self) -> str:
        """What the train log says about the rollouts this round did not train for the window."""
        parts = []
        if self.waiting:
            parts.append(
                f"{len(self.waiting)} wait on their feedback window (the next closes in "
                f"{_human(min(self.waiting.values()))})"
            )
        if self.unrewarded:
            parts.append(f"{len(self.unrewarded)} got no feedback before their window closed (left out)")
        return "; ".join(parts)


def split_by_window(rollouts: Iterable[RolloutEnd], window_s: float, now_ns: int) -> WindowSplit:
    """Sort rollouts into closed-and-rewarded, waiting (window open at ``now_ns``) and closed-unrewarded."""
    out = WindowSplit()
    window_ns = int(window_s * 1e9)
    for r in rollouts:
        left_ns = 0 if r.ended_ns is None else r.ended_ns + window_ns - now_ns
        if window_ns > 0 and left_ns > 0:
            out.waiting[r.rollout_id] = left_ns / 1e9
        elif r.rewarded or window_ns == 0:
            out.closed.add(r.rollout_id)
        else:
            out.unrewarded.add(r.rollout_id)
    return out


def rollout_ends(rows: pa.Table) -> list[RolloutEnd]:
    """Per rollout of ``trainer.dataset.load_transitions`` rows: the end of its last call, and whether any
    reward other than the fill placeholder reached it."""
    if not len(rows):
        return []
    ended = pc.cast(rows.column("ended_at"), pa.int64())
    real = pc.and_(
        pc.invert(pc.is_null(rows.column("rollout_reward_used"))),
        pc.fill_null(pc.not_equal(rows.column("reward_source"), FILL_SOURCE), True),
    )
    per = (
        pa.table({"rollout_id": rows.column("rollout_id"), "ended": ended, "real": real})
        .group_by("rollout_id")
        .aggregate([("ended", "max"), ("real", "any")])
    )
    return [
        RolloutEnd(r, e, bool(ok))
        for r, e, ok in zip(
            per.column("rollout_id").to_pylist(),
            per.column("ended_max").to_pylist(),
            per.column("real_any").to_pylist(),
        )
    ]


def feedback_split(window: str | float, rows: pa.Table, used: set[str], now_ns: int) -> WindowSplit:
    """The not yet ``used`` rollouts of ``rows`` by their window; with window 0, none waits or is left out
    (the behaviour without a window: a filled reward trains too)."""
    window_s = parse_duration(window)
    if window_s == 0:
        return WindowSplit()
    return split_by_window([r for r in rollout_ends(rows) if r.rollout_id not in used], window_s, now_ns)


def _human(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds / n:.1f}{unit}"
    return f"{seconds:.0f}s"
