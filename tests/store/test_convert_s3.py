"""``tracerl convert --store s3://…``: spans a real agent sent to a real collector become transitions in
the bucket, under the store's lease, and converting again writes nothing (the ledger is in the bucket);
``tracerl doctor`` reads the same bucket.

The bucket is served by moto's standalone server, a stand-in for S3 on 127.0.0.1 (s3_server.py); the
collector and the converter are real ``tracerl`` processes reaching it through pyarrow's S3 client
(and boto3 for the lease), configured only by the standard AWS variables.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from tracerl_testing import BIN, free_port, start_tracerl, stop_tracerl, tracerl

from store.location import parse_store

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)

AGENTS = Path(__file__).parents[1] / "span_to_transition"


def _counting_openai_server(calls: list[str]) -> ThreadingHTTPServer:
    """The scripted OpenAI-compatible server the converter tests record against, counting its calls."""
    spec = importlib.util.spec_from_file_location("tracerl_fixture_record_s3", AGENTS / "fixtures" / "record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class Counting(module._Handler):
        def do_POST(self) -> None:
            calls.append(self.path)
            super().do_POST()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Counting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _run_agent(grpc_port: int, openai_port: int) -> None:
    """tests/span_to_transition/openai_agent.py, unchanged, under ``opentelemetry-instrument``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
    agent = subprocess.run(
        [str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(AGENTS / "openai_agent.py")],
        env={**base, "OPENAI_BASE_URL": f"http://127.0.0.1:{openai_port}/v1", "OPENAI_API_KEY": "sk-x",
             "OTEL_RESOURCE_ATTRIBUTES": "tracerl.rollout_id=run-s3,tracerl.task_id=paris",
             "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
             "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{grpc_port}", "OTEL_EXPORTER_OTLP_INSECURE": "true"},
        capture_output=True, text=True, timeout=90)
    assert agent.returncode == 0, agent.stderr


def test_collect_then_convert_on_a_bucket_yields_one_transition_per_call_once(s3_store, tmp_path):
    calls: list[str] = []
    server = _counting_openai_server(calls)
    grpc_port, http_port = free_port(), free_port()
    collector = start_tracerl("collect", "--store", s3_store, "--wal", str(tmp_path / "wal"),
                              "--grpc", f"127.0.0.1:{grpc_port}", "--http", f"127.0.0.1:{http_port}",
                              health=f"http://127.0.0.1:{http_port}/healthz")
    try:
        _run_agent(grpc_port, server.server_port)
        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/rewards", json={"rollout_id": "run-s3", "value": 0.5},
                       timeout=10)
        assert r.status_code == 200, r.text
    finally:
        server.shutdown()
        stop_tracerl(collector)  # the final compaction puts every acknowledged span in the bucket
    assert len(calls) == 2

    first = json.loads(tracerl("convert", "--store", s3_store, "--quiet-s", "0", "--json").stdout)
    assert first["rollouts_converted"] == 1 and first["transitions_written"] == len(calls)
    loc = parse_store(s3_store)
    files = loc.files("transitions")
    assert files and all(f.startswith(loc.path("transitions", "date=")) for f in files)
    assert json.loads(loc.read_bytes(loc.path("transitions", "_state.json")))["converted"].keys() == {"run-s3"}
    lease = json.loads(loc.read_bytes(loc.path("transitions", "_state.lease")))
    assert lease["expires_at"] == 0  # released on exit, so the next converter need not wait

    out = tracerl("sql", "--store", s3_store, "--format", "json",
                  "SELECT count(*) AS n, min(task_id) AS task, max(reward) AS r FROM transitions").stdout
    assert json.loads(out) == [{"n": len(calls), "task": "paris", "r": 0.5}]

    second = json.loads(tracerl("convert", "--store", s3_store, "--quiet-s", "0", "--json").stdout)
    assert second["transitions_written"] == 0 and second["span_files_read"] == 0
    assert loc.files("transitions") == files

    # doctor reads the bucket too: spans, calls, content and rewards are fine; the agent had no gateway, and
    # its calls were served as policy@3 while this store's first round trains policy@0
    doctor = tracerl("doctor", "--store", s3_store, "--json", check=False)
    assert doctor.returncode == 1 and [f["problem"] for f in json.loads(doctor.stdout)] == [
        "no token ids", "nothing for the next round to train"]


def test_convert_names_a_bucket_prefix_without_spans(s3_store):
    run = tracerl("convert", "--store", s3_store, check=False)
    assert run.returncode == 2 and "has no spans/ directory" in run.stderr
