"""``tracerl collect --store s3://… --convert``: the collector's conversion loop works in the bucket.

A real agent (``openai`` under ``opentelemetry-instrument``) sends spans to a real collector whose
store is a bucket; its loop converts each rewarded rollout there, under the store's lease, while it
runs. A second rollout arriving later is converted by a later pass without writing the first again.

The bucket is served by moto's standalone server, a stand-in for S3 on 127.0.0.1 (s3_server.py); the
collector is a real ``tracerl`` process reaching it through pyarrow's S3 client (and boto3 for the
lease), configured only by the standard AWS variables.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pyarrow.dataset as ds
import pytest
from tracerl_testing import BIN, free_port, start_tracerl, stop_tracerl, tracerl

from store.lease import ObjectLease
from store.location import StoreLocation, parse_store

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)

AGENTS = Path(__file__).parents[1] / "span_to_transition"


def _scripted_openai_server() -> ThreadingHTTPServer:
    """The scripted OpenAI-compatible server the converter tests record against."""
    spec = importlib.util.spec_from_file_location("tracerl_fixture_record_cs3", AGENTS / "fixtures" / "record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.start_server()


def _run_agent(rollout: str, grpc_port: int, openai_port: int) -> None:
    """tests/span_to_transition/openai_agent.py, unchanged, under ``opentelemetry-instrument``: two calls."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
    agent = subprocess.run(
        [str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(AGENTS / "openai_agent.py")],
        env={**base, "OPENAI_BASE_URL": f"http://127.0.0.1:{openai_port}/v1", "OPENAI_API_KEY": "sk-x",
             "OTEL_RESOURCE_ATTRIBUTES": f"tracerl.rollout_id={rollout},tracerl.task_id=paris",
             "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
             "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{grpc_port}", "OTEL_EXPORTER_OTLP_INSECURE": "true"},
        capture_output=True, text=True, timeout=90)
    assert agent.returncode == 0, agent.stderr


def _reward(http_port: int, rollout: str, value: float) -> None:
    r = httpx.post(f"http://127.0.0.1:{http_port}/v1/rewards", json={"rollout_id": rollout, "value": value},
                   timeout=10)
    assert r.status_code == 200, r.text


def _rows_when(store: str, n: int, timeout_s: float = 60) -> list[dict]:
    """The transitions view (``tracerl sql`` on the bucket), polled until it holds ``n`` rows."""
    query = "SELECT rollout_id, step, reward, conversion FROM transitions ORDER BY rollout_id, step"
    deadline, rows = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        rows = json.loads(tracerl("sql", "--store", store, "--format", "json", query).stdout)
        if len(rows) >= n:
            return rows
        time.sleep(0.3)
    raise AssertionError(f"{len(rows)} transitions after {timeout_s:g}s, expected {n}: {rows}")


def _lease(loc: StoreLocation) -> dict:
    """The converter's lease record, read as the next holder reads it (``ObjectLease.read``)."""
    record, _ = ObjectLease.at(loc, "transitions/_state").read()
    assert record is not None, "no lease object"
    return record


def _after_another_pass(loc: StoreLocation, timeout_s: float = 30) -> None:
    """Wait until a conversion pass has both started and finished since now: every pass writes a fresh
    lease record (new nonce) when it takes the lease and an expired one when it releases it."""
    before = _lease(loc)["nonce"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lease = _lease(loc)
        if lease["nonce"] != before and lease["expires_at"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"no conversion pass released the lease within {timeout_s:g}s")


def _raw_rows(loc: StoreLocation) -> list[tuple[str, int]]:
    """Every row in the transitions files, superseded conversions included (the view hides those)."""
    t = ds.dataset(loc.files("transitions"), format="parquet", filesystem=loc.fs).to_table(
        columns=["rollout_id", "step"])
    return sorted(zip(t.column("rollout_id").to_pylist(), t.column("step").to_pylist()))


def test_collect_convert_on_a_bucket_converts_each_rollout_once_while_it_runs(s3_store, tmp_path):
    server = _scripted_openai_server()
    grpc_port, http_port = free_port(), free_port()
    collector = start_tracerl(
        "collect", "--store", s3_store, "--wal", str(tmp_path / "wal"), "--grpc", f"127.0.0.1:{grpc_port}",
        "--http", f"127.0.0.1:{http_port}", "--segment-age-s", "0.2", "--convert", "--convert-every-s", "0.3",
        "--quiet-s", "0", health=f"http://127.0.0.1:{http_port}/healthz")
    loc = parse_store(s3_store)
    try:
        _run_agent("run-a", grpc_port, server.server_port)
        _reward(http_port, "run-a", 0.5)
        first = _rows_when(s3_store, 2)
        assert [(r["rollout_id"], r["step"], r["reward"]) for r in first] == [("run-a", 0, 0.5), ("run-a", 1, 0.5)]

        # more spans arrive: the next passes convert the new rollout only
        _run_agent("run-b", grpc_port, server.server_port)
        _reward(http_port, "run-b", 1.0)
        _rows_when(s3_store, 4)
        _after_another_pass(loc)  # and one more pass with nothing new to convert
        rows = _rows_when(s3_store, 4)
        assert [(r["rollout_id"], r["step"], r["reward"]) for r in rows] == [
            ("run-a", 0, 0.5), ("run-a", 1, 0.5), ("run-b", 0, 1.0), ("run-b", 1, 1.0)]
        assert rows[:2] == first  # run-a's rows are the first pass's, not rewritten
        assert rows[2]["conversion"] > first[0]["conversion"]
        assert _raw_rows(loc) == [("run-a", 0), ("run-a", 1), ("run-b", 0), ("run-b", 1)]  # no duplicates
    finally:
        server.shutdown()
        stop_tracerl(collector)  # exits 0 after the final compaction and a final conversion pass
    assert _raw_rows(loc) == [("run-a", 0), ("run-a", 1), ("run-b", 0), ("run-b", 1)]
    assert json.loads(loc.read_bytes(loc.path("transitions", "_state.json")))["converted"].keys() == {
        "run-a", "run-b"}
    assert _lease(loc)["expires_at"] == 0  # released: a `tracerl convert` after it need not wait
    assert not list((tmp_path / "wal").glob("*/seg-*")), "every acknowledged segment was compacted and removed"
