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

import pyarrow as pa
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from schemas.attributes import ROLLOUT_ID as ROLLOUT_ATTR
from schemas.compact_json import compact_json
from schemas.tables import ATTRS, LOGS_SCHEMA, SPANS_SCHEMA, TS

_KINDS = ("unspecified", "internal", "server", "client", "producer", "consumer")
_STATUS = ("unset", "ok", "error")


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
        d = v.double_value
        return repr(d) if d - d == 0 else json.dumps(d)  # NaN/Infinity spelled as Python's json does
    if which is None:
        return None
    if which == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    return compact_json(any_to_py(v))


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


def trace_request_to_table(
    request: ExportTraceServiceRequest, received_at_ns: int, seen: KeySet | None = None
) -> pa.Table:
    """Rows of SPANS_SCHEMA for every span in ``request``.

    ``seen`` (optional) is the dedupe window keyed by (trace_id, span_id) raw bytes: spans
    already in it are skipped, and new keys are added, so exporter retries never duplicate a
    span. Spans with invalid ids are expected to have been removed by ``receive.drop_invalid_spans``.
    """
    cols: dict[str, list] = {
        n: [] for n in SPANS_SCHEMA.names if n not in ("attributes", "resource_attributes")
    }
    attrs, resources = _MapBuilder(), _MapBuilder()
    resource_index: list[int] = []  # per span: which resource_spans it came from
    trace_id, span_id, parent = cols["trace_id"], cols["span_id"], cols["parent_span_id"]
    for r, rs in enumerate(request.resource_spans):
        rkeys, rvals = _kv_lists(rs.resource.attributes)
        resources.add_flat(rkeys, rvals)
        resource_rollout = _lookup(rkeys, rvals, ROLLOUT_ATTR)
        for ss in rs.scope_spans:
            scope_name, scope_version = ss.scope.name, ss.scope.version
            for sp in ss.spans:
                tid, sid = sp.trace_id, sp.span_id
                if seen is not None:
                    key = (tid, sid)
                    if key in seen:
                        continue
                    seen.add(key)
                tid_hex = tid.hex()
                trace_id.append(tid_hex)
                span_id.append(sid.hex())
                parent.append(sp.parent_span_id.hex() if sp.parent_span_id else None)
                cols["trace_state"].append(sp.trace_state or None)
                cols["name"].append(sp.name)
                cols["kind"].append(_KINDS[sp.kind] if 0 <= sp.kind < len(_KINDS) else str(sp.kind))
                cols["start_time_ns"].append(sp.start_time_unix_nano)
                cols["end_time_ns"].append(sp.end_time_unix_nano)
                code = sp.status.code
                cols["status_code"].append(_STATUS[code] if 0 <= code < len(_STATUS) else str(code))
                cols["status_message"].append(sp.status.message or None)
                start = len(attrs.keys)
                attrs.add_kvs(sp.attributes)
                resource_index.append(r)
                cols["scope_name"].append(scope_name)
                cols["scope_version"].append(scope_version or None)
                cols["events"].append(
                    [
                        {
                            "name": e.name,
                            "time_ns": e.time_unix_nano,
                            "attributes": list(zip(*_kv_lists(e.attributes))),
                        }
                        for e in sp.events
                    ]
                    if sp.events
                    else []
                )
                cols["links"].append(
                    [
                        {
                            "trace_id": ln.trace_id.hex(),
                            "span_id": ln.span_id.hex(),
                            "trace_state": ln.trace_state or None,
                            "attributes": list(zip(*_kv_lists(ln.attributes))),
                        }
                        for ln in sp.links
                    ]
                    if sp.links
                    else []
                )
                cols["dropped_attributes_count"].append(sp.dropped_attributes_count)
                cols["dropped_events_count"].append(sp.dropped_events_count)
                cols["dropped_links_count"].append(sp.dropped_links_count)
                try:  # searched in place: no copy of the span's keys on the hot path
                    span_rollout = attrs.values[attrs.keys.index(ROLLOUT_ATTR, start)]
                except ValueError:
                    span_rollout = None
                cols["rollout_id"].append(span_rollout or resource_rollout or tid_hex)
    maps = {
        "attributes": attrs.array(),
        "resource_attributes": resources.array().take(pa.array(resource_index, type=pa.int32())),
    }
    return _assemble(SPANS_SCHEMA, cols, maps, received_at_ns)


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
