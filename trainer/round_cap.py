"""A cap on a round's rollouts (``tracerl train --max-rollouts N``): the newest N of the serving version.

A busy service makes rollouts faster than a small trainer trains them. Without a cap, ``train --once``
takes every unused rollout, so each cron round is larger (and slower) than the last: the round that
trained while traffic piled up has to train the whole pile, and never catches up. With a cap a round
takes at most N rollouts, chosen to keep it as on-policy as it can be:

1. rollouts that started on the newest version first (the version being trained: its calls need no
   importance correction), then each older one within ``--max-staleness``;
2. within a version, the most recently ended first (the traffic most like what the policy sees now).

The rollouts left out are not consumed: a later round may still take them while they are within
``--max-staleness``; older ones are dropped and counted as too stale, like any unused rollout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc


@dataclass(frozen=True)
class Candidate:
    """What the cap orders a rollout by: the version it started on and when its last call ended."""

    rollout_id: str
    version: int
    ended_ns: int | None  # None: recorded without times; ordered after every timed rollout of its version


def newest_first(candidates: Iterable[Candidate], max_rollouts: int) -> tuple[list[str], set[str]]:
    """(the kept rollout ids, newest first; the ones over the cap). ``max_rollouts`` 0 keeps all."""
    ordered = sorted(
        candidates,
        key=lambda c: (-c.version, c.ended_ns is None, -(c.ended_ns or 0), c.rollout_id),
    )
    if max_rollouts <= 0:
        return [c.rollout_id for c in ordered], set()
    return [c.rollout_id for c in ordered[:max_rollouts]], {c.rollout_id for c in ordered[max_rollouts:]}


def candidates(rows: pa.Table, exclude: set[str]) -> list[Candidate]:
    """The rollouts of ``trainer.dataset.load_transitions`` rows a round could train: complete, with a
    reward, not in ``exclude`` (used earlier, waiting on their window, closed without feedback)."""
    if not len(rows):
        return []
    keep = pc.and_(
        pc.fill_null(rows.column("rollout_complete"), False),
        pc.invert(pc.is_null(rows.column("rollout_reward_used"))),
    )
    if exclude:
        keep = pc.and_(
            keep, pc.invert(pc.is_in(rows.column("rollout_id"), pa.array(sorted(exclude), pa.string())))
        )
    kept = rows.filter(keep)
    per = (
        pa.table(
            {
                "rollout_id": kept.column("rollout_id"),
                "version": kept.column("rollout_version"),
                "ended": pc.cast(kept.column("ended_at"), pa.int64()),
            }
        )
        .group_by("rollout_id")
        .aggregate([("version", "max"), ("ended", "max")])
    )
    return [
        Candidate(r, int(v), e)
        for r, v, e in zip(
            per.column("rollout_id").to_pylist(),
            per.column("version_max").to_pylist(),
            per.column("ended_max").to_pylist(),
        )
    ]


def over_cap(rows: pa.Table, exclude: set[str], max_rollouts: int) -> set[str]:
    """The rollouts a round capped at ``max_rollouts`` leaves out (not trained, not consumed)."""
    if max_rollouts <= 0:
        return set()
    return newest_first(candidates(rows, exclude), max_rollouts)[1]
