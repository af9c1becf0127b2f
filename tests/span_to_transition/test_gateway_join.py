"""Exact tokens end to end: agent (OpenLLMetry) -> real gateway -> embedded engine; both span
streams -> collector -> converter joins each gateway span to its agent call span."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from tracerl_testing import BIN

from collector_exporter.testing import running_collector
from span_to_transition.convert import ConvertConfig
from span_to_transition.store import convert_store
from store.layout import StoreLayout
from store.location import parse_store
from store.parquet import read_table

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


def test_gateway_token_ids_are_joined_to_the_agent_calls_and_not_counted_twice(tmp_path: Path) -> None:
    from serving.embedded.server import EmbeddedServer
    from serving.gateway.config import GatewayConfig, make_tracer_provider
    from serving.gateway.proxy import Gateway
    from serving.models.tiny_model import build_tiny_model

    engine = EmbeddedServer.start(str(build_tiny_model(tmp_path / "tiny", seed=0)))
    store = tmp_path / "store"
    try:
        with running_collector(store) as c:
            provider = make_tracer_provider(c.grpc_endpoint)
            gw = Gateway(("127.0.0.1", 0), GatewayConfig(upstreams=[engine.url]), provider).start_background()
            try:
                env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
                env.update(
                    {
                        "OTEL_SERVICE_NAME": "agent",
                        "OTEL_TRACES_EXPORTER": "otlp",
                        "OTEL_METRICS_EXPORTER": "none",
                        "OTEL_LOGS_EXPORTER": "none",
                        "OTEL_RESOURCE_ATTRIBUTES": "tracerl.rollout_id=gw-run",
                        "OTEL_EXPORTER_OTLP_ENDPOINT": c.grpc_endpoint,
                        "OTEL_EXPORTER_OTLP_INSECURE": "true",
                        "OPENAI_BASE_URL": f"{gw.url}/v1",
                        "OPENAI_API_KEY": "x",
                    }
                )
                agent = subprocess.run(
                    [
                        str(BIN / "opentelemetry-instrument"),
                        str(BIN / "python"),
                        str(HERE / "gateway_agent.py"),
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert agent.returncode == 0, agent.stderr
            finally:
                gw.stop()
                provider.shutdown()  # flushes the gateway's spans to the collector
            c.flush()
    finally:
        engine.stop()

    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=0, missing_reward="fill"))
    assert stats.problems == [] and stats.transitions_written == 2  # 2 agent calls; gateway spans joined
    rows = (
        read_table(StoreLayout.at(store).table("transitions"), "transitions")
        .drop_columns(["started_at", "ended_at"])
        .to_pylist()
    )
    for row in rows:
        assert row["token_source"] == "gateway"
        assert row["prompt_token_ids"] and row["response_token_ids"]
        assert len(row["response_logprobs"]) == len(row["response_token_ids"])
        assert len(row["response_token_ids"]) == row["output_tokens"]
        assert json.loads(row["prompt_messages"]) == [
            {"role": "user", "content": "What is the weather in Paris?"}
        ]


def test_an_agent_that_sends_no_traceparent_and_no_response_id_joins_by_content(tmp_path: Path) -> None:
    """The real gateway records what it forwarded and returned; the agent's own spans record the same messages
    and reply but no response id, and its client sends no traceparent: the content join gives exact ids."""
    from serving.embedded.server import EmbeddedServer
    from serving.gateway.config import GatewayConfig, make_tracer_provider
    from serving.gateway.proxy import Gateway
    from serving.models.tiny_model import build_tiny_model

    engine = EmbeddedServer.start(str(build_tiny_model(tmp_path / "tiny", seed=0)))
    store = tmp_path / "store"
    try:
        with running_collector(store) as c:
            provider = make_tracer_provider(c.grpc_endpoint)
            gw = Gateway(("127.0.0.1", 0), GatewayConfig(upstreams=[engine.url]), provider).start_background()
            try:
                env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
                env.update(
                    {
                        "OTEL_SERVICE_NAME": "agent",
                        "OTEL_EXPORTER_OTLP_ENDPOINT": c.grpc_endpoint,
                        "OTEL_EXPORTER_OTLP_INSECURE": "true",
                        "OPENAI_BASE_URL": f"{gw.url}/v1",
                        "OPENAI_API_KEY": "x",
                    }
                )
                agent = subprocess.run(
                    [str(BIN / "python"), str(HERE / "content_agent.py")],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert agent.returncode == 0, agent.stderr
            finally:
                gw.stop()
                provider.shutdown()
            c.flush()
    finally:
        engine.stop()

    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=0, missing_reward="fill"))
    assert stats.problems == [] and stats.transitions_written == 2 and stats.content_joined == 2
    rows = (
        read_table(StoreLayout.at(store).table("transitions"), "transitions")
        .drop_columns(["started_at", "ended_at"])
        .to_pylist()
    )
    assert len({r["rollout_id"] for r in rows}) == 1  # the gateway traces joined the agent's rollout
    for row in rows:
        assert row["token_source"] == "gateway" and row["agent_name"] == "solver"
        assert row["prompt_token_ids"] and len(row["response_logprobs"]) == len(row["response_token_ids"])
