"""End to end: unmodified openai agent under opentelemetry-instrument -> collector -> transitions -> SQL."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import urllib.request
from pathlib import Path

import pytest
from tracerl_testing import BIN, tracerl

from collector_exporter.testing import running_collector
from span_to_transition.convert import ConvertConfig
from span_to_transition.store import convert_store
from store.location import parse_store

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


def scripted_server():
    spec = importlib.util.spec_from_file_location("tracerl_fixture_record", HERE / "fixtures" / "record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.start_server()


def test_openai_agent_run_becomes_rewarded_transitions_queryable_with_sql(store: Path) -> None:
    assert importlib.util.find_spec("opentelemetry.instrumentation.openai") is not None, (
        "the OpenLLMetry openai instrumentation is missing: pip install opentelemetry-instrumentation-openai==0.62.4")
    server = scripted_server()
    try:
        with running_collector(store) as c:
            base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
            proc = subprocess.run(
                [str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(HERE / "openai_agent.py")],
                env={**base, "OPENAI_BASE_URL": f"http://127.0.0.1:{server.server_port}/v1", "OPENAI_API_KEY": "sk-x",
                     "OTEL_SERVICE_NAME": "weather-agent",
                     "OTEL_RESOURCE_ATTRIBUTES": "tracerl.rollout_id=run-1,tracerl.task_id=paris-weather",
                     "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
                     "OTEL_EXPORTER_OTLP_ENDPOINT": c.grpc_endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true"},
                capture_output=True, text=True, timeout=90,
            )
            assert proc.returncode == 0, proc.stderr
            assert proc.stdout.strip() == "It is 18C and sunny in Paris."
            # the reward arrives on the side channel, keyed by the rollout id the agent's env declared
            req = urllib.request.Request(f"{c.http_endpoint}/v1/rewards", method="POST",
                                         data=json.dumps({"rollout_id": "run-1", "value": 1.0}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 200
            c.flush()
    finally:
        server.shutdown()

    stats = convert_store(parse_store(store), ConvertConfig(quiet_s=0))
    assert (stats.rollouts_converted, stats.transitions_written, stats.problems) == (1, 2, [])
    out = tracerl("sql", "--store", str(store), "--format", "json",
                  "SELECT rollout_id, task_id, step, finish_reason, reward, reward_source, token_source, model, "
                  "policy_version, input_tokens, json_extract_string(response_message, '$.content') AS answer "
                  "FROM transitions ORDER BY step")
    assert json.loads(out.stdout) == [
        {"rollout_id": "run-1", "task_id": "paris-weather", "step": 0, "finish_reason": "tool_calls", "reward": 1.0,
         "reward_source": "side_channel", "token_source": "retokenized", "model": "policy@3", "policy_version": 3,
         "input_tokens": 42, "answer": None},
        {"rollout_id": "run-1", "task_id": "paris-weather", "step": 1, "finish_reason": "stop", "reward": 1.0,
         "reward_source": "side_channel", "token_source": "retokenized", "model": "policy@3", "policy_version": 3,
         "input_tokens": 61, "answer": "It is 18C and sunny in Paris."},
    ]
    rollouts = tracerl("sql", "--store", str(store), "--format", "json",
                       "SELECT rollout_id, reward, n_calls, token_coverage FROM rollouts")
    assert json.loads(rollouts.stdout) == [{"rollout_id": "run-1", "reward": 1.0, "n_calls": 2, "token_coverage": 0.0}]
    again = convert_store(parse_store(store), ConvertConfig(quiet_s=0))
    assert again.transitions_written == 0
