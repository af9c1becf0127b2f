"""Trace assembly: group spans into rollouts, build and repair the span tree, decide completion.

Spans arrive in any order, possibly twice (OTLP retries) and possibly without their parent
(a process crashed, or the parent is still in flight). Everything here is a pure function of
the set of spans, never of their arrival order, so streaming conversion inside the collector
and a batch ``tracerl convert`` produce the same transitions.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from schemas.attributes import (
    ROLLOUT_END as END_MARKER,  # (bool) ends a rollout explicitly: converted without waiting
)
from span_to_transition.records import Span, as_bool

Key = tuple[str, str]


def dedupe(spans: Iterable[Span]) -> tuple[list[Span], int]:
    """Keep one copy of each (trace_id, span_id), the earliest received; return (spans, n_dropped).

    Retried deliveries carry the same span, so which copy is kept cannot change the output;
    picking the earliest received (ties: the smaller ``repr``) keeps the choice deterministic.
    """
    spans = list(spans)
    if len(set(map(_KEY, spans))) == len(spans):  # the common case: nothing was delivered twice
        return spans, 0
    best: dict[Key, Span] = {}
    for s in spans:
        cur = best.get(s.key)
        if cur is None or (s.received_at_ns, repr(s)) < (cur.received_at_ns, repr(cur)):
            best[s.key] = s
    n = len(spans)
    return list(best.values()), n - len(best)


_KEY = operator.attrgetter("trace_id", "span_id")
_ORDER = operator.attrgetter("start_time_ns", "trace_id", "span_id")


@dataclass
class SpanTree:
    """A repaired span tree of one rollout (one or more traces). ``spans`` iterates in
    (start time, trace id, span id) order, so every walk over it is delivery-order independent."""

    rollout_id: str
    spans: dict[Key, Span]
    children: dict[Key, list[Key]]
    parent: dict[Key, Key | None]
    roots: list[Key]
    orphans: list[Key] = field(default_factory=list)  # spans whose parent never arrived
    duplicates: int = 0
    problems: list[str] = field(default_factory=list)

    def path_up(self, key: Key, *, include_self: bool = False) -> list[Key]:
        """The keys from ``key`` up to its root (a cycle in corrupt input stops the walk). A list, not a
        generator: the per-call rules (agents, nested calls) walk it for every call."""
        parent = self.parent
        out: list[Key] = []
        cur: Key | None = key if include_self else parent.get(key)
        while cur is not None and cur not in out:  # (span trees are shallow: a list beats a set here)
            out.append(cur)
            cur = parent.get(cur)
        return out

    def ancestors(self, key: Key, *, include_self: bool = False) -> Iterator[Span]:
        """Walk up from ``key`` to its root (a cycle in corrupt input stops the walk)."""
        return (self.spans[k] for k in self.path_up(key, include_self=include_self))

    def depth(self, key: Key) -> int:
        return sum(1 for _ in self.ancestors(key))


def build_tree(rollout_id: str, spans: Iterable[Span], *, quiet_flag: str = "--quiet-s") -> SpanTree:
    """Deduplicate, link children to parents, and repair what is missing.

    Repair rule: a span whose parent is not in the rollout becomes a root of its own subtree
    (it keeps its descendants) and is listed in ``orphans`` with a problem that names the fix.
    Children sort by (start time, span id) so sibling order never depends on arrival order.
    """
    unique, n_dup = dedupe(spans)
    # one global sort: children lists, roots and orphans are then built already in order
    unique.sort(key=_ORDER)
    by_key = dict(zip(map(_KEY, unique), unique))
    parent: dict[Key, Key | None] = {}
    children: dict[Key, list[Key]] = {k: [] for k in by_key}
    roots: list[Key] = []
    orphans: list[Key] = []
    problems: list[str] = []
    for key, s in by_key.items():
        pkey = (s.trace_id, s.parent_span_id) if s.parent_span_id else None
        if pkey is not None and pkey not in by_key:
            orphans.append(key)
            problems.append(
                f"span {s.span_id} has parent {s.parent_span_id}, which is missing from trace "
                f"{s.trace_id}; it was converted as a root of its own subtree (agent names above it "
                f"are lost); raise {quiet_flag} if traces arrive late"
            )
            pkey = None
        parent[key] = pkey
        if pkey is None:
            roots.append(key)
        else:
            children[pkey].append(key)
    return SpanTree(rollout_id, by_key, children, parent, roots, orphans, n_dup, problems)


@dataclass(frozen=True)
class RolloutStatus:
    """What completion needs to know about a rollout; computed vectorised by the store shell."""

    rollout_id: str
    n_traces: int
    n_traces_with_root: int  # traces whose root span (no parent) has arrived, i.e. ended
    last_received_ns: int
    end_marker: bool = False


@dataclass(frozen=True)
class Completion:
    complete: bool
    reason: str  # end_marker|root_ended_quiet|timeout_without_root|waiting_quiet|waiting_root


def decide_completion(status: RolloutStatus, now_ns: int, quiet_ns: int, max_wait_ns: int) -> Completion:
    """A rollout is complete when an explicit end marker arrived, or every trace's root span has
    ended and nothing arrived for ``quiet_ns``. A rollout whose root never arrives is converted
    anyway (with repair) after ``max_wait_ns`` of silence, so it is never stuck forever.
    """
    idle = now_ns - status.last_received_ns
    if status.end_marker:
        return Completion(True, "end_marker")
    if status.n_traces_with_root >= status.n_traces:
        if idle >= quiet_ns:
            return Completion(True, "root_ended_quiet")
        return Completion(False, "waiting_quiet")
    if idle >= max_wait_ns:
        return Completion(True, "timeout_without_root")
    return Completion(False, "waiting_root")


def rollout_status(rollout_id: str, spans: Iterable[Span]) -> RolloutStatus:
    """The pure (row-by-row) version of the shell's vectorised status query, for tests and small inputs."""
    traces: dict[str, bool] = {}
    last = 0
    marker = False
    for s in spans:
        traces[s.trace_id] = traces.get(s.trace_id, False) or not s.parent_span_id
        last = max(last, s.received_at_ns)
        marker = marker or as_bool(s.attributes.get(END_MARKER))
    return RolloutStatus(rollout_id, len(traces), sum(traces.values()), last, marker)
