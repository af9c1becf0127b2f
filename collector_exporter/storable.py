"""What "storable" means: the one definition shared by the receiver and the compactor.

The receiver drops (and reports in ``partial_success``) every item the compactor could not turn
into a row, before it acknowledges anything; the compactor runs the same checks on what it
replays (a WAL written by an older version) and quarantines what fails. Because both call these
functions, they cannot drift apart.

Integer limits come from the Arrow schemas (``schemas/tables.py``), not from constants here:
OTLP carries times as ``fixed64`` and counts as ``uint32``, the store keeps them as ``int64`` and
``int32``, so a value that fits the protobuf field can still overflow the column.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pyarrow as pa
import pyarrow.compute as pc
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from schemas.tables import LOGS_SCHEMA, SPANS_SCHEMA


def column_max(schema: pa.Schema, path: str) -> int:
    """Largest value the integer column at ``path`` (``a`` or ``a.b`` into a list of structs) holds."""
    name, _, child = path.partition(".")
    t = schema.field(name).type
    if child:
        t = t.value_type.field(child).type
    return (1 << (t.bit_width - 1)) - 1


# proto field → store column (the reason names both, so the sender can find its field)
SPAN_TIMES = {"start_time_unix_nano": "start_time_ns", "end_time_unix_nano": "end_time_ns"}
SPAN_COUNTS = {
    "dropped_attributes_count": "dropped_attributes_count",
    "dropped_events_count": "dropped_events_count",
    "dropped_links_count": "dropped_links_count",
}
LOG_TIMES = {"time_unix_nano": "time_ns", "observed_time_unix_nano": "observed_time_ns"}
LOG_COUNTS = {"flags": "flags", "dropped_attributes_count": "dropped_attributes_count"}

_SPAN_TIME_MAX = min(column_max(SPANS_SCHEMA, c) for c in SPAN_TIMES.values())
_SPAN_COUNT_MAX = min(column_max(SPANS_SCHEMA, c) for c in SPAN_COUNTS.values())
_EVENT_TIME_MAX = column_max(SPANS_SCHEMA, "events.time_ns")
_LOG_TIME_MAX = min(column_max(LOGS_SCHEMA, c) for c in LOG_TIMES.values())
_LOG_COUNT_MAX = min(column_max(LOGS_SCHEMA, c) for c in LOG_COUNTS.values())


_ZERO_TRACE, _ZERO_SPAN = bytes(16), bytes(8)


def _bad_id(raw: bytes, size: int) -> bool:
    return len(raw) != size or raw == bytes(size)


def _over(msg: object, fields: dict[str, str], limit: int, what: str) -> str:
    name = next(f for f in fields if getattr(msg, f) > limit)
    return f"{what}: {name} = {getattr(msg, name)} exceeds {limit}, the largest value the store's {fields[name]} column holds"


def span_problem(sp: object) -> str | None:
    """Why this span cannot be stored, naming the field; None when it can.

    On the ack path for every span, so the common case is one expression: each field read once,
    the integer fields ORed so each group costs one comparison, spans with events looked at closer.
    """
    tid, sid = sp.trace_id, sp.span_id
    if (
        len(tid) == 16
        and len(sid) == 8
        and tid != _ZERO_TRACE
        and sid != _ZERO_SPAN
        and len(sp.parent_span_id) in (0, 8)
        and (sp.start_time_unix_nano | sp.end_time_unix_nano) <= _SPAN_TIME_MAX
        and (sp.dropped_attributes_count | sp.dropped_events_count | sp.dropped_links_count)
        <= _SPAN_COUNT_MAX
        and not sp.events
    ):
        return None
    if _bad_id(sp.trace_id, 16):
        return f"span {sp.name!r}: trace_id must be 16 non-zero bytes, got {len(sp.trace_id)}"
    if _bad_id(sp.span_id, 8):
        return f"span {sp.name!r}: span_id must be 8 non-zero bytes, got {len(sp.span_id)}"
    if sp.parent_span_id and len(sp.parent_span_id) != 8:
        return f"span {sp.name!r}: parent_span_id must be empty or 8 bytes"
    if (sp.start_time_unix_nano | sp.end_time_unix_nano) > _SPAN_TIME_MAX:
        return _over(sp, SPAN_TIMES, _SPAN_TIME_MAX, f"span {sp.name!r}")
    if (sp.dropped_attributes_count | sp.dropped_events_count | sp.dropped_links_count) > _SPAN_COUNT_MAX:
        return _over(sp, SPAN_COUNTS, _SPAN_COUNT_MAX, f"span {sp.name!r}")
    if sp.events:
        for e in sp.events:
            if e.time_unix_nano > _EVENT_TIME_MAX:
                return _over(
                    e,
                    {"time_unix_nano": "events.time_ns"},
                    _EVENT_TIME_MAX,
                    f"span {sp.name!r} event {e.name!r}",
                )
    return None


def log_problem(rec: object) -> str | None:
    """Why this log record cannot be stored, naming the field; None when it can."""
    if (rec.trace_id and len(rec.trace_id) != 16) or (rec.span_id and len(rec.span_id) != 8):
        return "log record trace_id/span_id must be 16/8 bytes when present"
    if (rec.time_unix_nano | rec.observed_time_unix_nano) > _LOG_TIME_MAX:
        return _over(rec, LOG_TIMES, _LOG_TIME_MAX, "log record")
    if (rec.flags | rec.dropped_attributes_count) > _LOG_COUNT_MAX:
        return _over(rec, LOG_COUNTS, _LOG_COUNT_MAX, "log record")
    return None


def _hex_ids_ok(column: pa.ChunkedArray | pa.Array, n_bytes: int, *, optional: bool) -> pa.Array:
    """Per row: the hex id has ``n_bytes`` bytes and is not all zeros (or is null, when ``optional``)."""
    ok = pc.equal(pc.utf8_length(column), 2 * n_bytes)
    if not optional:
        ok = pc.and_(ok, pc.not_equal(column, "0" * (2 * n_bytes)))
    return pc.fill_null(ok, optional)


def spans_rows_storable(table: pa.Table) -> bool:
    """Whether every row of a converted spans table passes ``span_problem``: the compactor's fast path,
    one check on the columns instead of a walk over the spans. Only the ids need checking here: the
    integer limits were enforced when the int64/int32 columns were built (``pa.array`` raises on a value
    its column cannot hold, and the compactor then goes item by item, where ``span_problem`` names it)."""
    ok = pc.and_(
        pc.and_(
            _hex_ids_ok(table["trace_id"], 16, optional=False),
            _hex_ids_ok(table["span_id"], 8, optional=False),
        ),
        _hex_ids_ok(table["parent_span_id"], 8, optional=True),
    )
    return len(table) == 0 or pc.all(ok).as_py()


def logs_rows_storable(table: pa.Table) -> bool:
    """``log_problem`` for every row of a converted logs table, on the columns (as ``spans_rows_storable``)."""
    ok = pc.and_(
        _hex_ids_ok(table["trace_id"], 16, optional=True), _hex_ids_ok(table["span_id"], 8, optional=True)
    )
    return len(table) == 0 or pc.all(ok).as_py()


def _drop(containers: Iterable, problem: Callable[[object], str | None]) -> tuple[int, int, str]:
    kept = rejected = 0
    reason = ""
    for items in containers:
        bad = []
        for i, item in enumerate(items):
            why = problem(item)
            if why is not None:
                bad.append(i)
                reason = reason or why
        for i in reversed(bad):
            del items[i]
        rejected += len(bad)
        kept += len(items)
    return kept, rejected, reason


def drop_unstorable_spans(req: ExportTraceServiceRequest) -> tuple[int, int, str]:
    """Remove every span ``span_problem`` refuses, in place: (kept, rejected, first reason)."""
    return _drop((ss.spans for rs in req.resource_spans for ss in rs.scope_spans), span_problem)


def drop_unstorable_logs(req: ExportLogsServiceRequest) -> tuple[int, int, str]:
    """Remove every log record ``log_problem`` refuses, in place: (kept, rejected, first reason)."""
    return _drop((sl.log_records for rl in req.resource_logs for sl in rl.scope_logs), log_problem)
