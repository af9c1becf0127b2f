"""OTLP protobuf requests → Arrow tables of the spans and logs contracts (schemas/tables.py).

Pure functions, no I/O: the compactor calls them on WAL records, and the converter's tests call
them on recorded fixtures, so there is exactly one decoding of OTLP into rows.

Maps are built from flat key/value lists plus offsets (``pa.MapArray.from_arrays``) rather than
lists of tuples: it is the hot loop of the collector, and this halves its cost per span.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import pyarrow as pa
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from schemas.attributes import ROLLOUT_ID as ROLLOUT_ATTR
from schemas.compact_json import compact_json
from schemas.tables import ATTRS, LOGS_SCHEMA, SPANS_SCHEMA, TS

_KIND_NAMES = dict(enumerate(("unspecified", "internal", "server", "client", "producer", "consumer")))
_STATUS_NAMES = dict(enumerate(("unset", "ok", "error")))


def any_to_py(v: AnyValue) -> object:
    """An AnyValue as a plain Python value (for JSON encoding of non-string attributes)."""
    which = v.WhichOneof("value")
    if which == "string_value":
        return v.string_value
    if which == "int_value":
        return v.int_value
    if which == "double_value":
        return v.double_value
    if which == "bool_value":
        return v.bool_value
    if which == "array_value":
        return [any_to_py(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: any_to_py(kv.value) for kv in v.kvlist_value.values}
    if which == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    return None


def any_to_text(v: AnyValue) -> str | None:
    """The store's encoding of one value: strings as-is, everything else as JSON text.

    Scalars take a fast path (``json.dumps`` costs ~2 µs a call, the budget is ~5 µs a span).
    """
    which = v.WhichOneof("value")
    if which == "string_value":
        return v.string_value
    if which == "int_value":
        return str(v.int_value)
    if which == "bool_value":
        return "true" if v.bool_value else "false"
    if which == "double_value":
        return double_text(v.double_value)
    if which is None:
        return None
    if which == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    if which == "array_value":  # most often strings (``gen_ai.response.finish_reasons``): no Python detour
        texts = [x.string_value for x in v.array_value.values]
        if all(texts):  # every element a non-empty string, so a string: the JSON text compact_json gives
            return "[" + ",".join(map(_json_string, texts)) + "]"
    return compact_json(any_to_py(v))


def double_text(d: float) -> str:
    """A double as the store spells it: Python's shortest repr, NaN/Infinity spelled as Python's json does."""
    return repr(d) if d - d == 0 else json.dumps(d)


_json_string = json.encoder.encode_basestring
"""One string as JSON text, non-ASCII kept (what ``compact_json`` writes for a string; its C function)."""


class KeySet(Protocol):
    """What the decoder needs of a dedupe window: membership and insertion."""

    def __contains__(self, key: object) -> bool: ...
    def add(self, key: tuple[bytes, bytes]) -> None: ...


@dataclass
class _MapBuilder:
    """Accumulates one map<string,string> column as flat keys/values + offsets."""

    keys: list[str] = field(default_factory=list)
    values: list[str | None] = field(default_factory=list)
    offsets: list[int] = field(default_factory=lambda: [0])

    def add_kvs(self, kvs: Iterable) -> None:
        add_key, add_value = self.keys.append, self.values.append
        for kv in kvs:
            add_key(kv.key)
            v = kv.value
            text = v.string_value  # most attributes are strings: skip WhichOneof for them
            add_value(text if text else any_to_text(v))
        self.offsets.append(len(self.keys))

    def add_flat(self, keys: list[str], values: list[str | None]) -> None:
        self.keys.extend(keys)
        self.values.extend(values)
        self.offsets.append(len(self.keys))

    def array(self) -> pa.MapArray:
        return pa.MapArray.from_arrays(
            pa.array(self.offsets, type=pa.int32()),
            pa.array(self.keys, type=pa.string()),
            pa.array(self.values, type=pa.string()),
        )


def _kv_lists(kvs: Iterable) -> tuple[list[str], list[str | None]]:
    keys, values = [], []
    for kv in kvs:
        keys.append(kv.key)
        values.append(any_to_text(kv.value))
    return keys, values


def _lookup(keys: list[str], values: list[str | None], key: str) -> str | None:
    try:
        return values[keys.index(key)]
    except ValueError:
        return None


def _assemble(
    schema: pa.Schema, cols: dict[str, list], maps: dict[str, pa.Array], received_at_ns: int
) -> pa.Table:
    """The table from per-column lists, prebuilt map arrays, and one receive time for every row."""
    n = len(cols[schema.names[0]])
    arrays = []
    for f in schema:
        if f.name in maps:
            arrays.append(maps[f.name])
        elif f.name == "received_at":
            arrays.append(pa.array([received_at_ns] * n, type=pa.int64()).cast(TS))
        else:
            arrays.append(pa.array(cols[f.name], type=f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _new_spans(spans: Iterable, seen: KeySet) -> list:
    """The spans whose (trace_id, span_id) key ``seen`` does not hold yet; their keys are added."""
    keep = []
    for sp in spans:
        key = (sp.trace_id, sp.span_id)
        if key not in seen:
            seen.add(key)
            keep.append(sp)
    return keep


def _events(sp: object) -> list[dict]:
    return [
        {"name": e.name, "time_ns": e.time_unix_nano, "attributes": list(zip(*_kv_lists(e.attributes)))}
        for e in sp.events
    ]


def _links(sp: object) -> list[dict]:
    return [
        {
            "trace_id": ln.trace_id.hex(),
            "span_id": ln.span_id.hex(),
            "trace_state": ln.trace_state or None,
            "attributes": list(zip(*_kv_lists(ln.attributes))),
        }
        for ln in sp.links
    ]


def _sparse_list_column(by_row: dict[int, list], n: int, type_: pa.DataType) -> pa.Array:
    """A list column where only the rows in ``by_row`` are non-empty (most spans have no events or links)."""
    if not by_row:
        return pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)), pa.array([], type_.value_type))
    return pa.array([by_row.get(i, []) for i in range(n)], type=type_)


class _SpanRows:
    """The spans of one request, accumulated column by column (the collector's hot loop)."""

    def __init__(self) -> None:
        self.cols: dict[str, list] = {n: [] for n in _SCALAR_COLUMNS}
        self.attrs, self.resources = _MapBuilder(), _MapBuilder()
        self.resource_index: list[int] = []  # per span: which resource_spans it came from
        self.resource_rollout: list[str | None] = []  # per resource_spans
        self.events: dict[int, list] = {}
        self.links: dict[int, list] = {}

    def add_resource(self, kvs: Iterable) -> int:
        """Record a resource's attributes; returns its index."""
        keys, values = _kv_lists(kvs)
        self.resources.add_flat(keys, values)
        self.resource_rollout.append(_lookup(keys, values, ROLLOUT_ATTR) or None)
        return len(self.resource_rollout) - 1

    def add_spans(self, spans: Iterable, resource: int, scope: object) -> None:
        """One scope's spans; fields inherited from the scope and resource are repeated once per scope."""
        c = self.cols
        trace_id, span_id, parent = c["trace_id"].append, c["span_id"].append, c["parent_span_id"].append
        trace_state, name, kind = c["trace_state"].append, c["name"].append, c["kind"].append
        start, end = c["start_time_ns"].append, c["end_time_ns"].append
        code, message = c["status_code"].append, c["status_message"].append
        d_attrs, d_events = c["dropped_attributes_count"].append, c["dropped_events_count"].append
        d_links = c["dropped_links_count"].append
        keys, values, offsets = self.attrs.keys, self.attrs.values, self.attrs.offsets
        add_key, add_value, add_offset = keys.append, values.append, offsets.append
        kind_name, code_name = _KIND_NAMES.get, _STATUS_NAMES.get
        first = len(c["name"])
        for i, sp in enumerate(spans, first):
            trace_id(sp.trace_id.hex())
            span_id(sp.span_id.hex())
            p = sp.parent_span_id
            parent(p.hex() if p else None)
            trace_state(sp.trace_state or None)
            name(sp.name)
            k = sp.kind
            kind(kind_name(k) or str(k))
            start(sp.start_time_unix_nano)
            end(sp.end_time_unix_nano)
            st = sp.status
            k = st.code
            code(code_name(k) or str(k))
            message(st.message or None)
            for kv in sp.attributes:
                add_key(kv.key)
                v = kv.value
                text = v.string_value  # most attributes are strings: skip WhichOneof for them
                add_value(text if text else any_to_text(v))
            add_offset(len(keys))
            if sp.events:
                self.events[i] = _events(sp)
            if sp.links:
                self.links[i] = _links(sp)
            d_attrs(sp.dropped_attributes_count)
            d_events(sp.dropped_events_count)
            d_links(sp.dropped_links_count)
        n = len(c["name"]) - first
        self.resource_index += [resource] * n
        c["scope_name"] += [scope.name] * n
        c["scope_version"] += [scope.version or None] * n

    def rollout_ids(self) -> list[str]:
        """Per span: its ``tracerl.rollout_id`` attribute, else its resource's, else its trace id."""
        trace_ids, by_resource = self.cols["trace_id"], self.resource_rollout
        if any(by_resource):
            out = [by_resource[r] or t for r, t in zip(self.resource_index, trace_ids)]
        else:
            out = list(trace_ids)
        keys, values, offsets = self.attrs.keys, self.attrs.values, self.attrs.offsets
        if ROLLOUT_ATTR in keys:  # rare: one C-level scan decides, instead of a search per span
            for i in range(len(out)):
                try:  # searched in place: no copy of the span's keys
                    value = values[keys.index(ROLLOUT_ATTR, offsets[i], offsets[i + 1])]
                except ValueError:
                    continue
                out[i] = value or out[i]
        return out

    def table(self, received_at_ns: int) -> pa.Table:
        n = len(self.cols["name"])
        self.cols["rollout_id"] = self.rollout_ids()
        maps = {
            "attributes": self.attrs.array(),
            "resource_attributes": self.resources.array().take(
                pa.array(self.resource_index, type=pa.int32())
            ),
            "events": _sparse_list_column(self.events, n, SPANS_SCHEMA.field("events").type),
            "links": _sparse_list_column(self.links, n, SPANS_SCHEMA.field("links").type),
        }
        return _assemble(SPANS_SCHEMA, self.cols, maps, received_at_ns)


_SCALAR_COLUMNS = [
    n for n in SPANS_SCHEMA.names if n not in ("attributes", "resource_attributes", "events", "links")
]


def trace_request_to_table(
    request: ExportTraceServiceRequest, received_at_ns: int, seen: KeySet | None = None
) -> pa.Table:
    """Rows of SPANS_SCHEMA for every span in ``request``.

    ``seen`` (optional) is the dedupe window keyed by (trace_id, span_id) raw bytes: spans
    already in it are skipped, and new keys are added, so exporter retries never duplicate a
    span. Spans with invalid ids are expected to have been removed by ``receive.drop_invalid_spans``.
    """
    rows = _SpanRows()
    for rs in request.resource_spans:
        r = rows.add_resource(rs.resource.attributes)
        for ss in rs.scope_spans:
            rows.add_spans(ss.spans if seen is None else _new_spans(ss.spans, seen), r, ss.scope)
    return rows.table(received_at_ns)


def logs_request_to_table(request: ExportLogsServiceRequest, received_at_ns: int) -> pa.Table:
    """Rows of LOGS_SCHEMA. GenAI semconv events (``gen_ai.user.message``, ``gen_ai.choice``…)
    arrive as log records; ``event_name`` holds the record's event name, or the legacy
    ``event.name`` attribute when the field is empty."""
    cols: dict[str, list] = {
        n: [] for n in LOGS_SCHEMA.names if n not in ("attributes", "resource_attributes")
    }
    attrs, res_attrs = _MapBuilder(), _MapBuilder()
    for rl in request.resource_logs:
        rkeys, rvals = _kv_lists(rl.resource.attributes)
        resource_rollout = _lookup(rkeys, rvals, ROLLOUT_ATTR)
        for sl in rl.scope_logs:
            for rec in sl.log_records:
                keys, values = _kv_lists(rec.attributes)
                attrs.add_flat(keys, values)
                res_attrs.add_flat(rkeys, rvals)
                tid = rec.trace_id.hex() if rec.trace_id else None
                cols["time_ns"].append(rec.time_unix_nano)
                cols["observed_time_ns"].append(rec.observed_time_unix_nano)
                cols["severity_number"].append(rec.severity_number)
                cols["severity_text"].append(rec.severity_text or None)
                cols["event_name"].append(
                    getattr(rec, "event_name", "") or _lookup(keys, values, "event.name") or None
                )
                cols["body"].append(any_to_text(rec.body) if rec.HasField("body") else None)
                cols["scope_name"].append(sl.scope.name)
                cols["scope_version"].append(sl.scope.version or None)
                cols["trace_id"].append(tid)
                cols["span_id"].append(rec.span_id.hex() if rec.span_id else None)
                cols["flags"].append(rec.flags)
                cols["dropped_attributes_count"].append(rec.dropped_attributes_count)
                # Log records carry no id; the serialized record identifies a retry of the same record.
                cols["log_id"].append(
                    hashlib.blake2b(rec.SerializeToString(deterministic=True), digest_size=16).hexdigest()
                )
                cols["rollout_id"].append(_lookup(keys, values, ROLLOUT_ATTR) or resource_rollout or tid)
    return _assemble(
        LOGS_SCHEMA,
        cols,
        {"attributes": attrs.array(), "resource_attributes": res_attrs.array()},
        received_at_ns,
    )


__all__ = ["ATTRS", "any_to_py", "any_to_text", "logs_request_to_table", "trace_request_to_table"]
