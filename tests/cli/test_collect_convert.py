"""`tracerl collect --convert`: transitions appear while the collector runs, with no second command."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from tracerl_testing import BIN, free_port, tracerl

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)

FIXTURES = Path(__file__).parents[1] / "span_to_transition"


def scripted_openai_server():
    spec = importlib.util.spec_from_file_location("tracerl_fixture_record", FIXTURES / "fixtures" / "record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.start_server()


def test_collect_with_convert_turns_a_rewarded_rollout_into_transitions(store):
    grpc_port, http_port = free_port(), free_port()
    collector = subprocess.Popen(
        [str(BIN / "tracerl"), "collect", "--store", str(store), "--grpc", f"127.0.0.1:{grpc_port}",
         "--http", f"127.0.0.1:{http_port}", "--segment-age-s", "0.2", "--convert", "--convert-every-s", "0.3",
         "--quiet-s", "0", "--agents", "nobody"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server = scripted_openai_server()
    try:
        assert "converting every 0.3s" in collector.stdout.readline()
        base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
        agent = subprocess.run(
            [str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(FIXTURES / "openai_agent.py")],
            env={**base, "OPENAI_BASE_URL": f"http://127.0.0.1:{server.server_port}/v1", "OPENAI_API_KEY": "sk-x",
                 "OTEL_RESOURCE_ATTRIBUTES": "tracerl.rollout_id=run-9,tracerl.task_id=paris",
                 "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
                 "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{grpc_port}", "OTEL_EXPORTER_OTLP_INSECURE": "true"},
            capture_output=True, text=True, timeout=90)
        assert agent.returncode == 0, agent.stderr
        req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/rewards", method="POST",
                                     data=json.dumps({"rollout_id": "run-9", "value": 0.5}).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).close()
        query = "SELECT step, reward, task_id, trainable FROM transitions ORDER BY step"
        deadline, rows = time.monotonic() + 30, []
        while time.monotonic() < deadline and len(rows) < 2:
            time.sleep(0.3)
            rows = json.loads(tracerl("sql", "--store", str(store), "--format", "json", query).stdout)
        assert rows == [{"step": 0, "reward": 0.5, "task_id": "paris", "trainable": False},
                        {"step": 1, "reward": 0.5, "task_id": "paris", "trainable": False}]  # --agents reached it
    finally:
        server.shutdown()
        collector.send_signal(signal.SIGTERM)
        assert collector.wait(timeout=60) == 0, collector.stderr.read()
