"""Where a demo run's wall time went: pure interval arithmetic for ``bench/async_round.py``.

The bench feeds this the run's own record (each training batch's and each round's start/end, the
trainer's per-phase timings from the rounds manifest) and what the store recorded (each LLM call's
start/end from its gateway span, each agent process's start and exit from the driver's records).
Everything is in one clock (seconds since the epoch); the figures are seconds of the measured window.

Why these figures: with rollouts and the trainer on the same 2 cores, asynchronous rounds can only
gain the time in which the machine did less than it could (the engine with no request in flight,
the trainer not training). The table names each such gap so it can be removed where it arises.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

Span = tuple[float, float]


def merged(spans: Iterable[Span], lo: float, hi: float) -> list[Span]:
    """The spans clipped to [lo, hi], overlaps joined, in order."""
    out: list[Span] = []
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in spans):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def covered(spans: Iterable[Span], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by at least one span."""
    return sum(e - s for s, e in merged(spans, lo, hi))


def both(a: Iterable[Span], b: Iterable[Span], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by a span of ``a`` and a span of ``b`` at once."""
    ma, mb = merged(a, lo, hi), merged(b, lo, hi)
    total, i, j = 0.0, 0, 0
    while i < len(ma) and j < len(mb):
        s, e = max(ma[i][0], mb[j][0]), min(ma[i][1], mb[j][1])
        total += max(0.0, e - s)
        if ma[i][1] < mb[j][1]:
            i += 1
        else:
            j += 1
    return total


def mean_in_flight(spans: list[Span], lo: float, hi: float) -> float:
    """Mean number of spans open while at least one is (the engine's batch size, time-weighted)."""
    busy = covered(spans, lo, hi)
    work = sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in spans)
    return work / busy if busy else 0.0


@dataclass(frozen=True)
class Agent:
    """One agent process of a training batch: its start and exit, and its LLM calls' spans."""

    start: float
    end: float
    calls: list[Span]


@dataclass(frozen=True)
class Phases:
    """Seconds of the window per phase (see ``phases``); the rows of the bench's split table."""

    window: float
    engine_busy: float  # at least one training-batch call in flight
    engine_heldout_only: float  # only held-out evaluation calls in flight
    engine_idle: float  # no call in flight at all
    mean_in_flight: float  # training-batch calls in flight, time-weighted over engine_busy
    trainer_busy: float  # a round training (dataset .. publish)
    trainer_parts: dict[
        str, float
    ]  # the manifest's timings, summed over rounds (dataset, train, publish, ...)
    both_idle: float  # no call in flight and no round training: the machine waited
    convert: float  # converting batches in the loop, between a batch and its round (on the trainer's path)
    wait_batch: float  # the loop waiting for the batch its round trains on
    agent_start: float  # mean seconds from an agent's process start to its first call
    agent_exit: float  # mean seconds from an agent's last call's end to its process exit
    batch_head: float  # summed over batches: batch start to its first call
    batch_tail: float  # summed over batches: its last call's end to the batch stored

    def rows(self) -> list[tuple[str, float]]:
        """(label, seconds) in print order."""
        rows = [
            ("window", self.window),
            ("engine busy (train calls)", self.engine_busy),
            ("engine busy (held-out only)", self.engine_heldout_only),
            ("engine idle", self.engine_idle),
            ("  mean calls in flight", self.mean_in_flight),
            ("trainer busy", self.trainer_busy),
        ]
        rows += [(f"  trainer {k}", v) for k, v in sorted(self.trainer_parts.items())]
        rows += [
            ("both idle", self.both_idle),
            ("convert (in the loop)", self.convert),
            ("wait for batch", self.wait_batch),
            ("batch head (start -> 1st call)", self.batch_head),
            ("batch tail (last call -> stored)", self.batch_tail),
            ("  agent start -> 1st call (mean)", self.agent_start),
            ("  agent last call -> exit (mean)", self.agent_exit),
        ]
        return rows


def phases(
    window: Span,
    batches: list[Span],
    rounds: list[Span],
    agents: list[Agent],
    heldout_calls: list[Span],
    trainer_timings: list[Mapping[str, float]],
    convert_s: float,
    wait_s: float,
) -> Phases:
    """The split of ``window`` (first training batch's start .. last round's end).

    ``batches``: each training batch's (start, end), end = every span stored; ``rounds``: each round's
    training; ``agents``: the training batches' agent processes with their calls."""
    lo, hi = window
    calls = [c for a in agents for c in a.calls]
    engine = merged(calls, lo, hi)
    any_call = merged(calls + heldout_calls, lo, hi)
    parts: dict[str, float] = {}
    for t in trainer_timings:
        for k, v in t.items():
            parts[k] = parts.get(k, 0.0) + float(v)
    with_calls = [a for a in agents if a.calls]
    head = tail = 0.0
    for bs, be in batches:
        mine = [c for a in agents if bs <= a.start <= be for c in a.calls]
        if mine:
            head += min(s for s, _ in mine) - bs
            tail += be - max(e for _, e in mine)
    return Phases(
        window=hi - lo,
        engine_busy=covered(engine, lo, hi),
        engine_heldout_only=covered(any_call, lo, hi) - covered(engine, lo, hi),
        engine_idle=(hi - lo) - covered(any_call, lo, hi),
        mean_in_flight=mean_in_flight(calls, lo, hi),
        trainer_busy=covered(rounds, lo, hi),
        trainer_parts=parts,
        both_idle=(hi - lo) - covered(any_call + list(rounds), lo, hi),
        convert=convert_s,
        wait_batch=wait_s,
        agent_start=(
            sum(min(s for s, _ in a.calls) - a.start for a in with_calls) / len(with_calls)
            if with_calls
            else 0.0
        ),
        agent_exit=(
            sum(a.end - max(e for _, e in a.calls) for a in with_calls) / len(with_calls)
            if with_calls
            else 0.0
        ),
        batch_head=head,
        batch_tail=tail,
    )
