"""Helpers of the ui tests: one rollout whose every string is hostile HTML, through the real exporter.

The hostile rollout goes through the real in-process exporter (``OTEL_TRACES_EXPORTER=tracerl``'s
class) and the real converter: a semconv chat span whose prompt holds ``<script>`` and
``<img onerror>``, a tool span that failed, and an in-band reward.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from store.location import parse_store

XSS_ROLLOUT = "xss-<b>rollout</b>"
XSS_TASK = "task-<i>hostile</i>"
XSS_PROMPT = '<script>window.__pwned = 1; alert("pwned")</script><img src=x onerror="window.__pwned = 2">'
XSS_REPLY = "<img src=y onerror=\"window.__pwned = 3\">answer"


def add_rollout(store: Path, rollout_id: str = XSS_ROLLOUT, task_id: str = XSS_TASK, prompt_text: str = XSS_PROMPT,
                reply: str = XSS_REPLY) -> None:
    """One agent run's spans through the real exporter into ``store``, converted by the real converter
    (by default the hostile one: HTML in every string a span carries)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.trace import Status, StatusCode

    from collector_exporter.sdk_exporter import TracerlSpanExporter
    from span_to_transition.convert import ConvertConfig
    from span_to_transition.store import convert_store

    exporter = TracerlSpanExporter(str(store))
    provider = TracerProvider(resource=Resource.create({"tracerl.rollout_id": rollout_id,
                                                        "tracerl.task_id": task_id,
                                                        "service.name": "<svg onload=alert(1)>"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("hostile-agent")
    prompt = [{"role": "system", "parts": [{"type": "text", "content": "You are <b>helpful</b>."}]},
              {"role": "user", "parts": [{"type": "text", "content": prompt_text}]}]
    with tracer.start_as_current_span("<script>root()</script>") as root:
        root.set_attribute("tracerl.reward", 0.5)
        with tracer.start_as_current_span("invoke_agent <u>agent</u>") as agent:
            agent.set_attribute("gen_ai.operation.name", "invoke_agent")
            agent.set_attribute("gen_ai.agent.name", "<b>agent</b>")
            with tracer.start_as_current_span("chat policy") as chat:
                chat.set_attribute("gen_ai.operation.name", "chat")
                chat.set_attribute("gen_ai.provider.name", "openai")
                chat.set_attribute("gen_ai.request.model", "policy")
                chat.set_attribute("gen_ai.response.id", "resp-xss-1")
                chat.set_attribute("gen_ai.input.messages", json.dumps(prompt))
                chat.set_attribute("gen_ai.output.messages", json.dumps(
                    [{"role": "assistant", "parts": [{"type": "text", "content": reply}],
                      "finish_reason": "stop"}]))
                time.sleep(0.002)
            with tracer.start_as_current_span("execute_tool <img src=z onerror=alert(4)>") as tool:
                tool.set_attribute("gen_ai.operation.name", "execute_tool")
                tool.set_attribute("gen_ai.tool.name", "lookup")
                tool.set_status(Status(StatusCode.ERROR, "<script>boom()</script> tool failed"))
    provider.shutdown()
    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=0.0, workers=1))
    assert stats.rollouts_converted >= 1, stats.summary()


def ensure_hostile_rollout(store: Path) -> None:
    """Add the hostile rollout once per store (the modules share the session's store)."""
    if not store_sql(store, "SELECT count(*) FROM transitions WHERE rollout_id = ?", [XSS_ROLLOUT])[0][0]:
        add_rollout(store)


def store_sql(store: Path, query: str, params: list | None = None) -> list[tuple]:
    """Rows of a query over the store, through the same read-only connection the viewer uses."""
    from store.views import connect_readonly

    con = connect_readonly(parse_store(store))
    try:
        return con.execute(query, params or []).fetchall()
    finally:
        con.close()
