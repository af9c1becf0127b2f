"""OTLP trace requests → the spans table with no Python object per span: the compactor's fast path.

``ptars`` (Rust, on PyPI) parses the protobuf wire format straight into Arrow arrays, and Arrow
compute shapes them into ``SPANS_SCHEMA``; only values that need Python to be spelled as the store
spells them (doubles, non-string arrays, kvlists, bytes: ``otlp_arrow.any_to_text``) are converted
one by one, and only those. On the ingest bench's requests (512 spans, 10 attributes, a 1 KB prompt)
the walk over upb messages in ``otlp_arrow.trace_request_to_table`` costs ~11 µs a span, most of it
Python reading protobuf fields; this path ~4.5 µs (ptars ~2.5 of it).

The result must equal ``trace_request_to_table`` row for row (the tests compare both on every
recorded fixture). A request this path does not cover (a value the store cannot spell without the
message, a kind or status code outside the enum, a payload ptars rejects) gives None, and the
caller falls back to that function, which stays the one definition of the conversion.
"""

from __future__ import annotations

import base64
import functools
import logging
from collections.abc import Callable
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList

from collector_exporter.otlp_arrow import any_to_text, double_text
from schemas.attributes import ROLLOUT_ID as ROLLOUT_ATTR
from schemas.tables import ATTRS, SPANS_SCHEMA, TS

log = logging.getLogger("tracerl.collector")

_KINDS = pa.array(["unspecified", "internal", "server", "client", "producer", "consumer"])
_STATUS = pa.array(["unset", "ok", "error"])
_JSON_ESCAPED = r'["\\\x00-\x1f]'
"""Characters ``json.encoder.encode_basestring`` escapes: a string without them is its JSON text in quotes."""


class NewKeys(Protocol):
    """What this path needs of a dedupe window (``records.DedupeWindow``, ``records.StagedKeys``)."""

    def add_new(self, keys: list[tuple[bytes, bytes]]) -> list[int] | None:
        """Add the keys not held yet; their indices, or None when all were new."""


class Unsupported(Exception):
    """The request holds something this path does not convert; the caller uses ``trace_request_to_table``."""


@functools.cache
def _handler() -> object | None:
    """ptars' decoder of ExportTraceServiceRequest; None (once logged) where ptars is not installed:
    the conversion is then ``trace_request_to_table``'s, the same rows at its cost."""
    try:
        import ptars  # imported on first use: the collector's ack path never needs it
    except ImportError:
        log.warning(
            "ptars is not installed: compaction decodes OTLP in Python, at about twice the CPU (pip install ptars)"
        )
        return None
    pool = ptars.HandlerPool([ExportTraceServiceRequest.DESCRIPTOR.file])
    return pool.get_for_message(ExportTraceServiceRequest.DESCRIPTOR)


def _field(arr: pa.Array, name: str) -> pa.Array:
    """A struct's member; null where the struct is null (``StructArray.field`` is the cheap way when none is)."""
    return arr.field(name) if arr.null_count == 0 else pc.struct_field(arr, name)


def _offsets(lists: pa.Array) -> np.ndarray:
    """Offsets into ``pc.list_flatten(lists)`` (which skips null lists: they count as empty)."""
    lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False)
    out = np.zeros(len(lengths) + 1, np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


def hex_ids(ids: pa.Array, *, empty_is_null: bool = False) -> pa.StringArray:
    """Each binary id as lowercase hex (what ``bytes.hex`` gives), vectorised: the ids' bytes are
    contiguous, so one ``bytes.hex`` of all of them is every id's hex in turn, at twice the offsets.
    ``empty_is_null``: an empty id (a root span's parent) becomes null."""
    if ids.null_count:
        raise Unsupported("null id")
    buffers = ids.buffers()
    offsets = np.frombuffer(buffers[1], np.int32, len(ids) + 1, ids.offset * 4)
    start, end = int(offsets[0]), int(offsets[-1])
    text = buffers[2][start:end].to_pybytes().hex().encode() if end > start else b""
    validity = None
    if empty_is_null:
        present = np.diff(offsets) > 0
        if not present.all():
            validity = pa.py_buffer(np.packbits(present, bitorder="little"))
    return pa.StringArray.from_buffers(
        len(ids), pa.py_buffer((offsets - start) * 2), pa.py_buffer(text), validity
    )


def _empty_to_null(strings: pa.Array) -> pa.Array:
    """What ``x or None`` does to each string (and a null stays null)."""
    return pc.if_else(pc.equal(strings, ""), pa.scalar(None, pa.string()), strings)


def _python_texts(kind: str, values: pa.Array) -> list[str | None]:
    """The store's text of values that need Python (``any_to_text`` on the message they came from)."""
    if kind == "double":  # spelled once per distinct value (by bits: 0.0 and -0.0 are spelled apart)
        bits = values.to_numpy(zero_copy_only=False).view(np.int64)
        distinct, where = np.unique(bits, return_inverse=True)
        texts = [double_text(d) for d in distinct.view(np.float64).tolist()]
        return [texts[i] for i in where.tolist()]
    if kind == "bytes":
        return [base64.b64encode(b).decode() for b in values.to_pylist()]
    if kind == "array":
        return [
            any_to_text(AnyValue(array_value=ArrayValue(values=[AnyValue.FromString(b) for b in row])))
            for row in values.to_pylist()
        ]
    return [  # kvlist
        any_to_text(AnyValue(kvlist_value=KeyValueList(values=[KeyValue.FromString(b) for b in row])))
        for row in values.to_pylist()
    ]


def _string_arrays(elements: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """JSON text of arrays whose elements are all strings, from their serialized AnyValue elements
    (``list<binary>``): (texts, per row whether it was such an array). A string element is encoded as
    tag 0x0a, a one-byte length (under 128), the UTF-8 bytes; other rows go through Python."""
    flat = pc.list_flatten(elements)
    offsets = _offsets(elements)
    buffers = flat.buffers()
    eoff = np.frombuffer(buffers[1], np.int32, len(flat) + 1, flat.offset * 4)
    data = np.frombuffer(buffers[2], np.uint8) if buffers[2] is not None else np.empty(0, np.uint8)
    data = np.concatenate([data, np.zeros(2, np.uint8)])  # an empty element reads two zero bytes
    lengths = np.diff(eoff)
    starts = eoff[:-1]
    simple = (lengths >= 2) & (data[starts] == 0x0A) & (data[starts + 1] == lengths - 2) & (lengths < 130)
    # the strings' bytes: each simple element less its two-byte header; other elements become ""
    first = int(eoff[0])
    element_of_byte = np.repeat(np.arange(len(flat)), lengths)
    keep = simple[element_of_byte] & (np.arange(first, int(eoff[-1])) - starts[element_of_byte] >= 2)
    sizes = np.where(simple, lengths - 2, 0)
    text_offsets = np.zeros(len(flat) + 1, np.int32)
    np.cumsum(sizes, out=text_offsets[1:])
    strings = pa.StringArray.from_buffers(
        len(flat), pa.py_buffer(text_offsets), pa.py_buffer(data[first : int(eoff[-1])][keep])
    )
    strings.validate(full=True)  # UTF-8, as the protobuf string field must be
    if len(flat):
        escaped = pc.match_substring_regex(strings, _JSON_ESCAPED).to_numpy(zero_copy_only=False)
        simple &= ~escaped
    row_ok = np.ones(len(elements), bool)
    row_of = np.repeat(np.arange(len(elements)), np.diff(offsets))
    row_ok[row_of[~simple]] = False
    quoted = pc.binary_join_element_wise('"', strings, '"', "")
    joined = pc.binary_join(pa.ListArray.from_arrays(pa.array(offsets), quoted), ",")
    return pc.binary_join_element_wise("[", joined, "]", ""), row_ok


def value_texts(values: pa.Array) -> pa.Array:
    """The store's text of each AnyValue (ptars' struct of the oneof's members): what
    ``otlp_arrow.any_to_text`` gives. Strings (most values) are used as they are; the rest are
    picked out and spelled member by member, then put back in one pass over the strings."""
    strings = _field(values, "string_value")
    if strings.null_count == 0:
        return strings
    others = pc.is_null(strings)
    return pc.replace_with_mask(strings, others, _non_string_texts(pc.filter(values, others)))


def _non_string_texts(values: pa.Array) -> pa.Array:
    """``value_texts`` of values with no string member: null when no member is set, as ``any_to_text``."""
    if _field(values, "string_value_strindex").null_count < len(values):
        raise Unsupported("string_value_strindex")
    out = pc.cast(_field(values, "int_value"), pa.string())
    bools = _field(values, "bool_value")
    if bools.null_count < len(bools):
        out = pc.coalesce(out, pc.if_else(bools, "true", "false"))
    arrays = _field(values, "array_value")
    if arrays.null_count < len(arrays):
        mask = pc.is_valid(arrays)
        elements = _field(pc.filter(arrays, mask), "values")
        texts, ok = _string_arrays(elements)
        if not ok.all():
            slow = np.nonzero(~ok)[0]
            texts = pc.replace_with_mask(
                texts, pa.array(~ok), pa.array(_python_texts("array", elements.take(slow)), pa.string())
            )
        out = pc.replace_with_mask(out, mask, texts)
    for kind, member in (("double", "double_value"), ("bytes", "bytes_value"), ("kvlist", "kvlist_value")):
        col = _field(values, member)
        if col.null_count < len(col):
            mask = pc.is_valid(col)
            picked = pc.filter(col, mask)
            if kind == "kvlist":
                picked = _field(picked, "values")
            out = pc.replace_with_mask(out, mask, pa.array(_python_texts(kind, picked), pa.string()))
    return out


def attribute_map(lists: pa.Array) -> pa.MapArray:
    """``list<KeyValue>`` (one row per span, resource, event or link) → the store's map<string,string>."""
    kvs = pc.list_flatten(lists)
    return pa.MapArray.from_arrays(
        pa.array(_offsets(lists)), _field(kvs, "key"), value_texts(_field(kvs, "value"))
    )


def _nested(lists: pa.Array, struct_type: pa.StructType, columns: dict[str, pa.Array]) -> pa.ListArray:
    """A list<struct> column (events, links) from the flattened items' columns."""
    items = pa.StructArray.from_arrays([columns[f.name] for f in struct_type], fields=list(struct_type))
    return pa.ListArray.from_arrays(pa.array(_offsets(lists)), items, type=pa.list_(struct_type))


def _empty_lists(n: int, type_: pa.ListType) -> pa.ListArray:
    """n empty lists: the events and links of most spans."""
    return pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)), pa.array([], type_.value_type))


def _list_column(
    lists: pa.Array, name: str, columns: Callable[[pa.Array], dict[str, pa.Array]]
) -> pa.ListArray:
    """The ``name`` list<struct> column of SPANS_SCHEMA (events, links): ``columns`` of the flattened items."""
    t = SPANS_SCHEMA.field(name).type
    items = pc.list_flatten(lists)
    if not len(items):
        return _empty_lists(len(lists), t)
    return _nested(lists, t.value_type, columns(items))


def _event_columns(ev: pa.Array) -> dict[str, pa.Array]:
    return {
        "name": _field(ev, "name"),
        "time_ns": pc.cast(_field(ev, "time_unix_nano"), pa.int64()),
        "attributes": attribute_map(_field(ev, "attributes")),
    }


def _link_columns(ln: pa.Array) -> dict[str, pa.Array]:
    return {
        "trace_id": hex_ids(_field(ln, "trace_id")),
        "span_id": hex_ids(_field(ln, "span_id")),
        "trace_state": _empty_to_null(_field(ln, "trace_state")),
        "attributes": attribute_map(_field(ln, "attributes")),
    }


def _enum_names(codes: pa.Array, names: pa.Array, what: str) -> pa.Array:
    if len(codes) and (pc.min(codes).as_py() < 0 or pc.max(codes).as_py() >= len(names)):
        raise Unsupported(f"{what} outside the enum")
    return names.take(codes)


def _rollout_ids(
    trace_ids: pa.Array, attrs: pa.MapArray, resource_rollout: pa.Array, resource_of_span: pa.Array
) -> pa.Array:
    """Per span: its first ``tracerl.rollout_id`` attribute when non-empty, else its resource's, else
    its trace id (``otlp_arrow._SpanRows.rollout_ids``)."""
    out = pc.coalesce(resource_rollout.take(resource_of_span), trace_ids)
    keys = attrs.keys
    hits = np.nonzero(pc.fill_null(pc.equal(keys, ROLLOUT_ATTR), False).to_numpy(zero_copy_only=False))[0]
    if not len(hits):
        return out
    offsets = attrs.offsets.to_numpy() - attrs.offsets[0].as_py()
    span_of_hit = np.searchsorted(offsets, hits, side="right") - 1
    spans, first = np.unique(span_of_hit, return_index=True)  # keys.index: the first occurrence counts
    values = _empty_to_null(attrs.items.take(pa.array(hits[first])))
    keep = pc.is_valid(values).to_numpy(zero_copy_only=False)
    mask = np.zeros(len(out), bool)
    mask[spans[keep]] = True
    return pc.replace_with_mask(out, pa.array(mask), values.filter(pa.array(keep)))


def _resource_rollouts(attrs: pa.MapArray) -> pa.Array:
    """Per resource: its first ``tracerl.rollout_id`` attribute, or null when absent or empty."""
    out = []
    for row in attrs.to_pylist():  # a request has few resources
        value = next((v for k, v in row if k == ROLLOUT_ATTR), None)
        out.append(value or None)
    return pa.array(out, pa.string())


def trace_payload_to_table(
    payload: bytes, received_at_ns: int, seen: NewKeys | None = None
) -> tuple[pa.Table, int] | None:
    """(rows of SPANS_SCHEMA, spans in the request) for a serialized ExportTraceServiceRequest, or None
    when this path does not cover it (then nothing was added to ``seen``). ``seen``: the dedupe window,
    as in ``trace_request_to_table``: spans already in it are skipped and new keys added."""
    return trace_payloads_to_table([payload], [received_at_ns], seen)


_CHUNK_BYTES = 2 << 20
"""Requests per ptars call, by size: ptars holds the GIL while it parses (~2 ms a MB here), and the
gRPC threads need it to acknowledge; 2 MB keeps each hold near Python's own 5 ms switch interval,
and still pays the fixed cost of the Arrow calls once for several requests."""


def _chunks(sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """[start, end) ranges of consecutive items, each adding up to about ``limit`` (at least one item)."""
    out, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if total and total + size > limit:
            out.append((start, i))
            start, total = i, 0
        total += size
    if start < len(sizes) or not sizes:
        out.append((start, len(sizes)))
    return out


def trace_payloads_to_table(
    payloads: list[bytes], received_at_ns: list[int], seen: NewKeys | None = None
) -> tuple[pa.Table, int] | None:
    """``trace_payload_to_table`` of several requests at once (each with its receive time): the rows in
    request order, as if converted one after another. Converting a WAL segment's requests together
    pays the fixed cost of each Arrow call once for several of them instead of once per request."""
    handler = _handler()
    if handler is None:
        return None
    times = np.asarray(received_at_ns, np.int64)
    try:
        tables = [
            _spans_table(handler.list_to_record_batch(payloads[i:j]), times[i:j])
            for i, j in _chunks([len(p) for p in payloads], _CHUNK_BYTES)
        ]
    except (Unsupported, pa.ArrowInvalid, OverflowError, ValueError):
        return None  # outside what this path covers, past a column's range, or bytes ptars cannot decode
    except Exception as e:  # not expected (a payload ptars reads otherwise than upb, a newer ptars): say so
        log.warning("columnar OTLP conversion failed (%s: %s); using the Python decoder", type(e).__name__, e)
        return None
    table = pa.concat_tables(t for t, _, _ in tables)
    trace_raw = pa.chunked_array([t for _, t, _ in tables], pa.binary())
    span_raw = pa.chunked_array([s for _, _, s in tables], pa.binary())
    n = table.num_rows
    if seen is not None:
        keep = seen.add_new(list(zip(trace_raw.to_pylist(), span_raw.to_pylist())))
        if keep is not None:
            table = table.take(pa.array(keep, pa.int64()))
    return table, n


def _spans_table(batch: pa.RecordBatch, received_at_ns: np.ndarray) -> tuple[pa.Table, pa.Array, pa.Array]:
    """The spans table of the batch's requests (``received_at_ns``: one per request), with the raw
    trace and span ids (the dedupe keys)."""
    rs_lists = batch.column("resource_spans")
    rs = pc.list_flatten(rs_lists)
    ss_lists = _field(rs, "scope_spans")
    ss = pc.list_flatten(ss_lists)
    sp_lists = _field(ss, "spans")
    spans = pc.list_flatten(sp_lists)
    scope_of_span = pc.list_parent_indices(sp_lists)
    resource_of_span = pc.list_parent_indices(ss_lists).take(scope_of_span)
    request_of_span = pc.list_parent_indices(rs_lists).take(resource_of_span).to_numpy()
    resource_attrs = attribute_map(_field(_field(rs, "resource"), "attributes"))
    scope = _field(ss, "scope")
    status = _field(spans, "status")
    trace_raw, span_raw = _field(spans, "trace_id"), _field(spans, "span_id")
    trace_ids = hex_ids(trace_raw)
    attrs = attribute_map(_field(spans, "attributes"))
    cols = {
        "trace_id": trace_ids,
        "span_id": hex_ids(span_raw),
        "parent_span_id": hex_ids(_field(spans, "parent_span_id"), empty_is_null=True),
        "trace_state": _empty_to_null(_field(spans, "trace_state")),
        "name": _field(spans, "name"),
        "kind": _enum_names(_field(spans, "kind"), _KINDS, "span kind"),
        "start_time_ns": pc.cast(_field(spans, "start_time_unix_nano"), pa.int64()),
        "end_time_ns": pc.cast(_field(spans, "end_time_unix_nano"), pa.int64()),
        "status_code": _enum_names(pc.fill_null(_field(status, "code"), 0), _STATUS, "status code"),
        "status_message": _empty_to_null(_field(status, "message")),
        "attributes": attrs,
        "resource_attributes": resource_attrs.take(resource_of_span),
        "scope_name": pc.fill_null(_field(scope, "name"), "").take(scope_of_span),
        "scope_version": _empty_to_null(_field(scope, "version")).take(scope_of_span),
        "events": _list_column(_field(spans, "events"), "events", _event_columns),
        "links": _list_column(_field(spans, "links"), "links", _link_columns),
        "dropped_attributes_count": pc.cast(_field(spans, "dropped_attributes_count"), pa.int32()),
        "dropped_events_count": pc.cast(_field(spans, "dropped_events_count"), pa.int32()),
        "dropped_links_count": pc.cast(_field(spans, "dropped_links_count"), pa.int32()),
        "received_at": pa.array(received_at_ns[request_of_span]).cast(TS),
        "rollout_id": _rollout_ids(trace_ids, attrs, _resource_rollouts(resource_attrs), resource_of_span),
    }
    arrays = [cols[f.name].cast(f.type) if f.type == ATTRS else cols[f.name] for f in SPANS_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=SPANS_SCHEMA), trace_raw, span_raw


__all__ = [
    "Unsupported",
    "attribute_map",
    "hex_ids",
    "trace_payload_to_table",
    "trace_payloads_to_table",
    "value_texts",
]
