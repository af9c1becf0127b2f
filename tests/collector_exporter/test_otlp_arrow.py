"""OTLP → Arrow: what users will query must be what the agent recorded."""

from __future__ import annotations

import json
import time

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from collector_exporter.compactor import DedupeWindow
from collector_exporter.otlp_arrow import any_to_py, any_to_text, trace_request_to_table
from schemas.tables import SPANS_SCHEMA


def _record(resource: dict, build) -> list:
    mem = InMemorySpanExporter()
    tp = TracerProvider(resource=Resource.create(resource))
    tp.add_span_processor(SimpleSpanProcessor(mem))
    build(tp.get_tracer("agent.scope", "0.9"))
    return list(mem.get_finished_spans())


def test_every_field_survives_with_typed_values_json_encoded():
    def build(tracer):
        with tracer.start_as_current_span("root", kind=SpanKind.SERVER) as root:
            with tracer.start_as_current_span(
                "openai.chat",
                kind=SpanKind.CLIENT,
                attributes={
                    "gen_ai.request.model": "policy@2",
                    "n": 3,
                    "t": 0.5,
                    "ok": True,
                    "ids": [1, 2, 3],
                    "names": ["a", "b"],
                },
                links=[Link(root.get_span_context(), {"why": "retry"})],
            ) as call:
                call.add_event("gen_ai.evaluation.result", {"gen_ai.evaluation.score.value": 0.75})
                call.set_status(Status(StatusCode.ERROR, "boom"))

    spans = _record({"service.name": "agent", "deployment": "prod"}, build)
    table = trace_request_to_table(encode_spans(spans), received_at_ns=time.time_ns())
    assert table.schema == SPANS_SCHEMA
    rows = {r["name"]: r for r in table.drop_columns(["received_at"]).to_pylist()}
    call, root = rows["openai.chat"], rows["root"]
    attrs = dict(call["attributes"])
    assert attrs["gen_ai.request.model"] == "policy@2"
    assert (attrs["n"], attrs["t"], attrs["ok"]) == ("3", "0.5", "true")
    assert json.loads(attrs["ids"]) == [1, 2, 3] and json.loads(attrs["names"]) == ["a", "b"]
    assert call["parent_span_id"] == root["span_id"] and root["parent_span_id"] is None
    assert call["trace_id"] == root["trace_id"] and len(call["trace_id"]) == 32 and len(call["span_id"]) == 16
    assert (call["kind"], root["kind"]) == ("client", "server")
    assert (call["status_code"], call["status_message"]) == ("error", "boom")
    assert call["events"][0]["name"] == "gen_ai.evaluation.result"
    assert dict(call["events"][0]["attributes"]) == {"gen_ai.evaluation.score.value": "0.75"}
    assert call["links"][0]["span_id"] == root["span_id"] and dict(call["links"][0]["attributes"]) == {
        "why": "retry"
    }
    assert dict(call["resource_attributes"])["deployment"] == "prod"
    assert (call["scope_name"], call["scope_version"]) == ("agent.scope", "0.9")
    assert call["end_time_ns"] >= call["start_time_ns"] > 0


def test_rollout_id_prefers_span_attribute_then_resource_then_trace_id():
    def build(tracer):
        with tracer.start_as_current_span("a", attributes={"tracerl.rollout_id": "from-span"}):
            pass
        with tracer.start_as_current_span("b"):
            pass

    with_resource = _record({"tracerl.rollout_id": "from-resource"}, build)
    rows = {
        r["name"]: r["rollout_id"]
        for r in trace_request_to_table(encode_spans(with_resource), 1)
        .drop_columns(["received_at"])
        .to_pylist()
    }
    assert rows == {"a": "from-span", "b": "from-resource"}

    plain = _record({}, build)
    rows = {
        r["name"]: (r["rollout_id"], r["trace_id"])
        for r in trace_request_to_table(encode_spans(plain), 1).drop_columns(["received_at"]).to_pylist()
    }
    assert rows["a"][0] == "from-span"
    assert rows["b"][0] == rows["b"][1]


def test_dedupe_window_skips_spans_already_seen():
    spans = _record({}, lambda t: [t.start_span(f"s{i}").end() for i in range(5)])
    window = DedupeWindow()
    first = trace_request_to_table(encode_spans(spans), 1, seen=window)
    again = trace_request_to_table(
        encode_spans(spans[2:] + _record({}, lambda t: t.start_span("new").end())), 1, seen=window
    )
    assert first.num_rows == 5
    assert again.column("name").to_pylist() == ["new"]


def test_dedupe_window_evicts_oldest_batches_beyond_its_size():
    w = DedupeWindow(max_keys=4)
    w.update(["a", "b", "c"])
    w.end_batch()
    w.update(["d", "e", "f"])
    w.end_batch()
    assert "a" not in w and "f" in w and len(w) == 3


def test_structured_values_are_encoded_as_the_public_json_encoder_does():
    """The prebuilt C encoder (``schemas.compact_json``, which otlp_arrow uses) gives the text ``JSONEncoder.encode`` gives."""
    public = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
    values = [
        AnyValue(
            array_value=ArrayValue(values=[AnyValue(string_value="stop"), AnyValue(string_value='é "q"\n')])
        ),
        AnyValue(
            array_value=ArrayValue(
                values=[
                    AnyValue(double_value=float("nan")),
                    AnyValue(double_value=1e16),
                    AnyValue(int_value=-3),
                    AnyValue(bool_value=True),
                    AnyValue(),
                ]
            )
        ),
        AnyValue(
            kvlist_value=KeyValueList(
                values=[
                    KeyValue(key="k", value=AnyValue(string_value="\U0001f600")),
                    KeyValue(
                        key="nested",
                        value=AnyValue(array_value=ArrayValue(values=[AnyValue(double_value=0.1)])),
                    ),
                ]
            )
        ),
        AnyValue(array_value=ArrayValue()),
    ]
    expected = [
        '["stop","é \\"q\\"\\n"]',
        "[NaN,1e+16,-3,true,null]",
        '{"k":"\U0001f600","nested":[0.1]}',
        "[]",
    ]
    assert [any_to_text(v) for v in values] == [public(any_to_py(v)) for v in values] == expected


def test_string_arrays_take_the_short_path_to_the_same_json_text():
    """Arrays of strings (``gen_ai.response.finish_reasons``) skip ``any_to_py``; their text is still the encoder's."""
    public = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
    for strings in (["stop"], ["a", 'é "q"\n\\', "\U0001f600", "\x00\x1f\x7f"], ["x", ""], []):
        value = AnyValue(array_value=ArrayValue(values=[AnyValue(string_value=s) for s in strings]))
        assert any_to_text(value) == public(strings)


def test_rows_keep_their_own_resource_scope_events_and_rollout_across_several_resources():
    req = ExportTraceServiceRequest()
    for r in range(2):
        rs = req.resource_spans.add()
        rs.resource.attributes.add(key="service.name", value=AnyValue(string_value=f"svc{r}"))
        if r == 1:
            rs.resource.attributes.add(key="tracerl.rollout_id", value=AnyValue(string_value="res-rollout"))
        for s in range(2):
            ss = rs.scope_spans.add()
            ss.scope.name, ss.scope.version = f"scope{r}{s}", "" if s else "1.0"
            for i in range(3):
                sp = ss.spans.add(trace_id=bytes([r + 1]) * 16, span_id=bytes([r * 16 + s * 4 + i + 1]) * 8)
                sp.name = f"{r}{s}{i}"
                if i == 1:
                    sp.events.add(name="ev", time_unix_nano=5)
                    sp.attributes.add(key="tracerl.rollout_id", value=AnyValue(string_value=f"span-{r}{s}"))
    rows = {
        row["name"]: row for row in trace_request_to_table(req, 1).drop_columns(["received_at"]).to_pylist()
    }
    assert len(rows) == 12
    for name, row in rows.items():
        r, s, i = (int(c) for c in name)
        assert dict(row["resource_attributes"])["service.name"] == f"svc{r}"
        assert (row["scope_name"], row["scope_version"]) == (f"scope{r}{s}", None if s else "1.0")
        assert [e["name"] for e in row["events"]] == (["ev"] if i == 1 else [])
        expected = f"span-{r}{s}" if i == 1 else ("res-rollout" if r == 1 else row["trace_id"])
        assert row["rollout_id"] == expected
