"""The product promise, end to end over real processes and real HTTP on 127.0.0.1.

`tracerl serve` (embedded engine) <- `tracerl gateway` <- an unmodified `openai` agent run under
`opentelemetry-instrument` (OpenLLMetry's openai instrumentation). The collector receives the
agent's `openai.chat` spans and the gateway's spans; each gateway span is the child of its
agent span (W3C traceparent injected by the instrumentation), carries the agent's response id,
and its token ids decode to exactly the text the client saw, with logprobs that match a
recomputation with the model.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from tracerl_testing import BIN

from store.location import parse_store
from store.views import connect_readonly
from tracerl.stack import StackConfig, running_stack

from .helpers import chat_prompt_ids, recompute_logprobs

AGENT = Path(__file__).with_name("agent_openai.py")
pytestmark = pytest.mark.slow


def test_instrumented_openai_agent_through_gateway_joins_exact_tokens_to_agent_spans(
    tmp_path, tiny_model_dir, tokenizer, reference_model
):
    store = tmp_path / "store"
    cfg = StackConfig(
        store=str(store),
        logs=tmp_path / "logs",
        model=str(tiny_model_dir),
        collect_args=("--segment-age-s", "0.2"),
    )
    with running_stack(cfg) as stack:  # stopped gateway first: it flushes its BatchSpanProcessor
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
        env.update(
            {
                "OTEL_SERVICE_NAME": "weather-agent",
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_METRICS_EXPORTER": "none",
                "OTEL_LOGS_EXPORTER": "none",
                "OTEL_EXPORTER_OTLP_ENDPOINT": stack.urls.otlp,
                "OTEL_EXPORTER_OTLP_INSECURE": "true",
                "OPENAI_BASE_URL": f"{stack.urls.gateway}/v1",
                "OPENAI_API_KEY": "x",
            }
        )
        agent = subprocess.run(
            [str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(AGENT)],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert agent.returncode == 0, agent.stderr
        seen = json.loads(agent.stdout.strip().splitlines()[-1])
    assert all(c.proc.returncode == 0 for c in stack.started.values()), [
        c.log_tail() for c in stack.started.values()
    ]

    con = connect_readonly(parse_store(store))
    rows = con.execute("""
        SELECT g.trace_id = a.trace_id, a.name, a.resource_attributes['service.name'],
               g.resource_attributes['service.name'], g.kind, g.attributes, a.attributes
        FROM spans g JOIN spans a ON g.parent_span_id = a.span_id
        WHERE g.name = 'tracerl.gateway policy' ORDER BY g.start_time_ns""").fetchall()
    assert len(rows) == 2, "each gateway span must be the child of the agent's openai span (traceparent)"
    prompt_ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": "What is the weather in Paris?"}])
    for (same_trace, agent_name, agent_svc, gw_svc, kind, g, a), client_saw in zip(rows, seen, strict=True):
        assert same_trace and agent_name == "openai.chat" and kind == "client"
        assert (agent_svc, gw_svc) == ("weather-agent", "tracerl-gateway")
        assert g["tracerl.gateway"] == "true" and g["gen_ai.operation.name"] == "chat"
        assert g["gen_ai.response.id"] == client_saw["id"] == a["gen_ai.response.id"]
        ids = json.loads(g["tracerl.response_token_ids"])
        assert json.loads(g["tracerl.prompt_token_ids"]) == prompt_ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == client_saw["text"]
        assert json.loads(g["tracerl.response_logprobs"]) == pytest.approx(
            recompute_logprobs(reference_model, prompt_ids, ids), abs=1e-4
        )
        assert json.loads(g["gen_ai.response.finish_reasons"]) == [client_saw["finish"]]
