"""One WAL record → Arrow rows, or quarantined items with their reason.

Pure logic under the compactor (``compactor.py`` does the I/O): a request is converted whole
when every item passes ``storable.py`` (the fast path: for spans, first straight from the bytes,
``otlp_columnar.py``); otherwise, or when conversion fails,
item by item, so one bad item costs only itself. Dedupe keys are staged (``StagedKeys``) and
reach the window only when the compactor commits them, after the Parquet files are durable.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass

import pyarrow as pa
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from collector_exporter.otlp_arrow import logs_request_to_table, trace_request_to_table
from collector_exporter.otlp_columnar import trace_payload_to_table, trace_payloads_to_table
from collector_exporter.quarantine import Quarantined
from collector_exporter.rewards import dedupe_keys, rewards_to_table
from collector_exporter.storable import log_problem, logs_rows_storable, span_problem, spans_rows_storable
from collector_exporter.wal import Kind, Record

log = logging.getLogger("tracerl.collector")


class DedupeWindow:
    """The most recent ``max_keys`` keys, evicted a whole segment at a time.

    Keys are exact (no hashing), so a collision can never drop a real span. Retries arrive
    within the exporter's timeout and backoff (seconds to about a minute), far inside the window.
    """

    def __init__(self, max_keys: int = 1_000_000):
        self.max_keys = max_keys
        self._keys: set[Hashable] = set()
        self._batches: deque[list[Hashable]] = deque()
        self._current: list[Hashable] = []

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: Hashable) -> None:
        self._keys.add(key)
        self._current.append(key)

    def update(self, keys: Iterable[Hashable]) -> None:
        keys = list(keys)
        self._keys.update(keys)
        self._current.extend(keys)

    def isdisjoint(self, keys: set[Hashable]) -> bool:
        return self._keys.isdisjoint(keys)

    def add_new(self, keys: list[Hashable]) -> list[int] | None:
        """``_add_new`` on this window."""
        return _add_new(self, keys)

    def end_batch(self) -> None:
        if self._current:
            self._batches.append(self._current)
            self._current = []
        while len(self._keys) > self.max_keys and len(self._batches) > 1:
            for k in self._batches.popleft():
                self._keys.discard(k)


def _add_new(seen: DedupeWindow | StagedKeys, keys: list[Hashable]) -> list[int] | None:
    """Add the keys ``seen`` does not hold yet, in order; the indices of those, or None when every key
    was new. The common case (a request of new, distinct keys) is a few set operations in C instead
    of a membership test and an insertion per key."""
    batch = set(keys)
    if len(batch) == len(keys) and seen.isdisjoint(batch):
        seen.update(keys)
        return None
    keep = []
    for i, key in enumerate(keys):
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return keep


class StagedKeys:
    """Keys taken by the segment being converted, checked together with the dedupe window.

    Nothing reaches the window until ``commit``, which the compactor calls only once the
    segment's Parquet files are durably written; ``roll_back`` forgets the keys of a record
    whose conversion failed part-way."""

    def __init__(self, window: DedupeWindow):
        self.window = window
        self.keys: set[Hashable] = set()
        self.order: list[Hashable] = []

    def __contains__(self, key: Hashable) -> bool:
        return key in self.keys or key in self.window

    def add(self, key: Hashable) -> None:
        self.keys.add(key)
        self.order.append(key)

    def update(self, keys: list[Hashable]) -> None:
        self.keys.update(keys)
        self.order.extend(keys)

    def isdisjoint(self, keys: set[Hashable]) -> bool:
        return self.keys.isdisjoint(keys) and self.window.isdisjoint(keys)

    def add_new(self, keys: list[Hashable]) -> list[int] | None:
        """``_add_new`` on the staged keys."""
        return _add_new(self, keys)

    def mark(self) -> int:
        return len(self.order)

    def roll_back(self, mark: int) -> None:
        for key in self.order[mark:]:
            self.keys.discard(key)
        del self.order[mark:]

    def commit(self) -> None:
        self.window.update(self.order)
        self.window.end_batch()
        self.keys, self.order = set(), []


def _filter_new(table: pa.Table, column: str, seen: StagedKeys, keys: list | None = None) -> pa.Table:
    """The rows whose key (``column``, or ``keys`` given per row) neither the window nor this segment has seen."""
    keys = table.column(column).to_pylist() if keys is None else keys
    keep = []
    for i, k in enumerate(keys):
        if k not in seen:
            seen.add(k)
            keep.append(i)
    return table if len(keep) == len(keys) else table.take(pa.array(keep, type=pa.int64()))


def _reward_rows_new(table: pa.Table, seen: StagedKeys) -> pa.Table:
    """A retried POST is dropped; a correction (same ``reward_id``, other value) is kept (``rewards.dedupe_keys``)."""
    return _filter_new(table, "reward_id", seen, dedupe_keys(table))


_SPAN_PATH = ("resource_spans", "scope_spans", "spans")
_LOG_PATH = ("resource_logs", "scope_logs", "log_records")


def _count(req: object, path: tuple[str, str, str]) -> int:
    """How many spans (or log records) an OTLP request holds, through its resource and scope levels."""
    outer, inner, leaf = path
    return sum(len(getattr(s, leaf)) for r in getattr(req, outer) for s in getattr(r, inner))


def _single_items(req: object, path: tuple[str, str, str]) -> Iterator[tuple[object, object]]:
    """Each span (or log record) alone in a request with its resource and scope: the unit of quarantine."""
    outer, inner, leaf = path
    for r in getattr(req, outer):
        for s in getattr(r, inner):
            for item in getattr(s, leaf):
                one = type(req)()
                level = getattr(one, outer).add(resource=r.resource, schema_url=r.schema_url)
                getattr(getattr(level, inner).add(scope=s.scope, schema_url=s.schema_url), leaf).append(item)
                yield item, one


@dataclass(frozen=True)
class _Signal:
    """How one WAL record kind becomes rows, and how it splits into items when it does not."""

    table: str
    parse: Callable[[bytes], object]
    count: Callable[[object], int]  # the spans, log records or reward rows of a request
    split: Callable[[object], Iterator[tuple[object, object]]]  # (item, a request of just that item)
    problem: Callable[[object], str | None]  # storable.py: the receiver's own rules, for one item
    to_table: Callable[[object, int, StagedKeys], pa.Table]
    rows_storable: Callable[[pa.Table], bool]  # storable.py: the same rules on the converted rows at once
    encode: Callable[[object], bytes]
    fast: Callable[[bytes, int, StagedKeys], tuple[pa.Table, int] | None] | None = None
    """The whole record straight from its bytes, (new rows, items), or None when it cannot: tried first."""


_SIGNALS = {
    Kind.TRACES: _Signal(
        "spans",
        ExportTraceServiceRequest.FromString,
        lambda req: _count(req, _SPAN_PATH),
        lambda req: _single_items(req, _SPAN_PATH),
        span_problem,
        lambda req, ts, seen: trace_request_to_table(req, ts, seen=seen),
        spans_rows_storable,
        lambda req: req.SerializeToString(),
        trace_payload_to_table,
    ),
    Kind.LOGS: _Signal(
        "logs",
        ExportLogsServiceRequest.FromString,
        lambda req: _count(req, _LOG_PATH),
        lambda req: _single_items(req, _LOG_PATH),
        log_problem,
        lambda req, ts, seen: _filter_new(logs_request_to_table(req, ts), "log_id", seen),
        logs_rows_storable,
        lambda req: req.SerializeToString(),
    ),
    Kind.REWARDS: _Signal(
        "rewards",
        json.loads,
        lambda rows: sum(1 for _ in rows),
        lambda rows: ((row, [row]) for row in rows),
        lambda row: None,
        lambda rows, ts, seen: _reward_rows_new(rewards_to_table(rows, ts), seen),
        lambda table: True,
        lambda rows: json.dumps(rows).encode(),
    ),
}


Converted = tuple[str, list[pa.Table], list[Quarantined], int]
"""(table name, tables of new rows, quarantined items, items seen before): what ``convert_record`` returns."""


def convert_record(rec: Record, staged: dict[str, StagedKeys]) -> Converted:
    """One WAL record as (table name, tables of new rows, quarantined items, items seen before).

    The whole request is converted at once and its rows checked together (the fast path); when a
    row is not storable, or conversion fails, it is done again item by item, so one bad item costs
    only itself and is quarantined with the reason ``storable.py`` gives for it."""
    signal = _SIGNALS.get(rec.kind)
    if signal is None:
        return _quarantined_whole("unknown", f"unknown WAL record kind {rec.kind}", rec)
    seen = staged[signal.table]
    fast = _from_bytes(signal, rec, seen)
    if fast is not None:
        return fast
    try:
        msg = signal.parse(rec.payload)
        n_items = signal.count(msg)
    except Exception as e:  # passed the CRC yet does not parse: keep the bytes, say why
        return _quarantined_whole(signal.table, f"record does not parse: {type(e).__name__}: {e}", rec)
    table = _whole_request(signal, msg, rec, seen)
    if table is not None:
        return signal.table, [table], [], n_items - table.num_rows
    return _item_by_item(signal, msg, rec, seen)


def _quarantined_whole(table: str, why: str, rec: Record) -> Converted:
    """The whole record kept as it arrived, with the reason no item of it could be converted."""
    return table, [], [Quarantined(table, why, int(rec.kind), rec.received_at_ns, rec.payload)], 0


def _from_bytes(signal: _Signal, rec: Record, seen: StagedKeys) -> Converted | None:
    """The record straight from its bytes (``signal.fast``), when the signal has that path and every row
    it gives is storable; otherwise None, with the keys it staged rolled back."""
    if signal.fast is None:
        return None
    mark = seen.mark()
    fast = signal.fast(rec.payload, rec.received_at_ns, seen)
    if fast is not None and signal.rows_storable(fast[0]):
        return signal.table, [fast[0]], [], fast[1] - fast[0].num_rows
    seen.roll_back(mark)
    return None


def _whole_request(signal: _Signal, msg: object, rec: Record, seen: StagedKeys) -> pa.Table | None:
    """The parsed request converted at once, or None (keys rolled back) when a row is not storable or
    conversion fails: the caller then goes item by item, which names the bad ones."""
    mark = seen.mark()
    try:
        table = signal.to_table(msg, rec.received_at_ns, seen)
        if signal.rows_storable(table):
            return table
    except (OverflowError, pa.ArrowInvalid):  # a value its column cannot hold: named item by item
        pass
    except Exception:
        log.exception("converting a %s record failed; retrying item by item", signal.table)
    seen.roll_back(mark)
    return None


def _item_by_item(signal: _Signal, msg: object, rec: Record, seen: StagedKeys) -> Converted:
    """Each item of the request alone: the storable ones converted, the others quarantined with their reason."""
    tables, bad, dups = [], [], 0
    for item, one in signal.split(msg):
        why = signal.problem(item)
        if why is None:
            mark = seen.mark()
            try:
                table = signal.to_table(one, rec.received_at_ns, seen)
            except Exception as e:
                seen.roll_back(mark)
                why = f"conversion failed: {type(e).__name__}: {e}"
            else:
                tables.append(table)
                dups += 1 - table.num_rows
                continue
        bad.append(Quarantined(signal.table, why, rec.kind, rec.received_at_ns, signal.encode(one)))
    return signal.table, tables, bad, dups


def convert_traces_at_once(records: list[Record], staged: StagedKeys) -> tuple[pa.Table, int] | None:
    """Every trace record of a segment in one columnar conversion: (new rows, spans), or None when it
    cannot be done at once (a record the columnar path does not cover, a row that is not storable);
    the keys it staged are then rolled back and the records go through ``convert_record`` one by one."""
    mark = staged.mark()
    got = trace_payloads_to_table([r.payload for r in records], [r.received_at_ns for r in records], staged)
    if got is not None and spans_rows_storable(got[0]):
        return got
    staged.roll_back(mark)
    return None
