"""A small span-tree factory, so tests read like the rollouts they describe.

    t = TraceBuilder()
    root = t.span("invoke_agent writer", agent="writer")
    t.chat(root, prompt=[user("hi")], reply="hello", response_id="r1")
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from collector_exporter.otlp_arrow import logs_request_to_table, trace_request_to_table
from schemas.tables import SPANS_SCHEMA
from span_to_transition.records import Span, SpanEvent

FIXTURES = Path(__file__).parent / "fixtures"
DIALECT_FIXTURES = ["openllmetry", "openllmetry-legacy", "openai-v2", "openai-v2-events", "openai-v2-details",
                    "openinference"]
# The same agent written with the Vercel AI SDK (TypeScript, ``record_vercel.mjs``): ``ai.*`` attributes
# (``LegacyOpenTelemetry``) and the SDK's semconv integration (``OpenTelemetry``), each with its streamed twin.
VERCEL_FIXTURES = ["vercel-ai", "vercel-ai-stream", "vercel-ai-otel", "vercel-ai-otel-stream"]
# The same agent as Agent Lightning runs it with AgentOps 0.4.21 (an ``@agent`` class, an ``@operation`` reward;
# tool calls only as ``tool_call.<name>`` child spans), with its streamed twin.
AGENTOPS_FIXTURES = ["agentops", "agentops-stream"]
# The same agent recorded with ``stream=True`` (``record.py --stream``), one per dialect fixture.
STREAM_FIXTURES = [f"{name}-stream" for name in DIALECT_FIXTURES]


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def system(text: str) -> dict[str, Any]:
    return {"role": "system", "content": text}


def parts(messages: list[dict[str, Any]]) -> str:
    """OpenAI messages as semconv ``gen_ai.input.messages`` JSON (text parts only)."""
    return json.dumps([{"role": m["role"], "parts": [{"type": "text", "content": m["content"]}]} for m in messages])


class TraceBuilder:
    """Spans of one trace, with a monotonically advancing clock (1 ms per span start)."""

    def __init__(self, trace_id: str = "a" * 32, rollout_id: str | None = None, received_at_ns: int = 1_000):
        self.trace_id = trace_id
        self.rollout_id = rollout_id or trace_id
        self.clock = 1_700_000_000_000_000_000
        self.received_at_ns = received_at_ns
        self.spans: list[Span] = []
        self._n = 0

    def span(self, name: str, parent: Span | None = None, attrs: dict[str, Any] | None = None, *,
             agent: str | None = None, events: Iterable[SpanEvent] = (), duration_ns: int = 500_000) -> Span:
        self._n += 1
        self.clock += 1_000_000
        a = {k: v if isinstance(v, str) else json.dumps(v) for k, v in (attrs or {}).items()}
        if agent:
            a["gen_ai.agent.name"] = agent
            a.setdefault("gen_ai.operation.name", "invoke_agent")
        s = Span(self.trace_id, f"{self._n:016x}", parent.span_id if parent else None, name, self.clock,
                 self.clock + duration_ns, a, {}, tuple(events), self.received_at_ns, self.rollout_id)
        self.spans.append(s)
        return s

    def chat(self, parent: Span | None, prompt: list[dict[str, Any]], reply: str, *, response_id: str | None = None,
             model: str = "policy@1", extra: dict[str, Any] | None = None) -> Span:
        """A semconv LLM-call span (what OpenLLMetry >= 0.55 writes)."""
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": model,
            "gen_ai.response.model": model,
            "gen_ai.input.messages": parts(prompt),
            "gen_ai.output.messages": json.dumps(
                [{"role": "assistant", "parts": [{"type": "text", "content": reply}], "finish_reason": "stop"}]),
            "gen_ai.usage.input_tokens": 10,
            "gen_ai.usage.output_tokens": 5,
        }
        if response_id:
            attrs["gen_ai.response.id"] = response_id
        attrs.update(extra or {})
        return self.span(f"chat {model}", parent, attrs)

    def reward(self, parent: Span | None, value: float, name: str | None = None) -> Span:
        attrs: dict[str, Any] = {"tracerl.reward": value}
        if name:
            attrs["tracerl.reward.name"] = name
        return self.span("reward", parent, attrs, duration_ns=0)


def spans_table(spans: Iterable[Span]) -> pa.Table:
    """Span records as SPANS_SCHEMA rows (what the collector would have stored)."""
    rows = [
        {
            "trace_id": s.trace_id, "span_id": s.span_id, "parent_span_id": s.parent_span_id, "name": s.name,
            "kind": "internal", "start_time_ns": s.start_time_ns, "end_time_ns": s.end_time_ns,
            "status_code": "unset", "attributes": list(s.attributes.items()),
            "resource_attributes": list(s.resource_attributes.items()),
            "events": [{"name": e.name, "time_ns": e.time_ns, "attributes": list(e.attributes.items())}
                       for e in s.events],
            "links": [], "received_at": s.received_at_ns, "rollout_id": s.rollout_id,
        }
        for s in spans
    ]
    cols = {f.name: [r.get(f.name) for r in rows] for f in SPANS_SCHEMA}
    arrays = [pa.array(cols[f.name], pa.int64()).cast(f.type) if pa.types.is_timestamp(f.type)
              else pa.array(cols[f.name], f.type) for f in SPANS_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=SPANS_SCHEMA)


def fixture_tables(name: str, received_at_ns: int = 1_000) -> tuple[pa.Table, pa.Table | None]:
    """A recorded fixture pushed through the collector's real OTLP decode path."""
    traces = trace_request_to_table(
        ExportTraceServiceRequest.FromString((FIXTURES / f"{name}.traces.pb").read_bytes()), received_at_ns)
    logs_path = FIXTURES / f"{name}.logs.pb"
    logs = None
    if logs_path.exists():
        logs = logs_request_to_table(ExportLogsServiceRequest.FromString(logs_path.read_bytes()), received_at_ns)
    return traces, logs
