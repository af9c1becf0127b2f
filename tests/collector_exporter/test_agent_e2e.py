"""The product promise: an unmodified agent + env vars → every span in Parquet, queryable."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from tracerl_testing import BIN, tracerl

from collector_exporter.testing import running_collector
from store.location import parse_store
from store.views import connect_readonly

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)

AGENT = Path(__file__).with_name("agent_app.py")


def run_instrumented_agent(env: dict, n_calls: int = 3) -> list[tuple[str, str]]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = subprocess.run(
        [str(BIN / "opentelemetry-instrument"), str(BIN / "python"), str(AGENT), str(n_calls)],
        env={**base, "OTEL_SERVICE_NAME": "writer-agent", "OTEL_RESOURCE_ATTRIBUTES": "tracerl.task_id=t-7,team=rl",
             "OTEL_PYTHON_LOGGING_AUTO_INSTRUMENTATION_ENABLED": "true", **env},
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return [tuple(x) for x in json.loads(proc.stdout.strip().splitlines()[-1])]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_instrumented_agent_exports_every_span_with_its_details(store, protocol):
    with running_collector(store) as c:
        endpoint = c.grpc_endpoint if protocol == "grpc" else c.http_endpoint
        made = run_instrumented_agent({
            "OTEL_TRACES_EXPORTER": "otlp", "OTEL_LOGS_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
        })
        c.flush()
    con = connect_readonly(parse_store(store))
    got = con.execute("SELECT trace_id, span_id FROM spans").fetchall()
    assert sorted(got) == sorted(made)
    row = con.execute("""
        SELECT attributes['gen_ai.usage.input_tokens'], attributes['gen_ai.input.messages'],
               resource_attributes['service.name'], resource_attributes['tracerl.task_id'],
               events[1].name, events[1].attributes['gen_ai.evaluation.score.value'], kind, scope_name, rollout_id = trace_id
        FROM spans WHERE name = 'chat policy' ORDER BY start_time_ns LIMIT 1 OFFSET 1""").fetchone()
    assert row == ("11", json.dumps([{"role": "user", "content": "q1"}]), "writer-agent", "t-7",
                   "gen_ai.evaluation.result", "0.1", "client", "demo.agent", True)
    logs = con.execute("SELECT count(*), count(DISTINCT span_id) FROM logs WHERE body LIKE 'call % done'").fetchone()
    assert logs == (3, 3)  # the logging bridge's records, each joined to its span


def test_tracerl_sql_reads_what_the_agent_sent(store):
    with running_collector(store) as c:
        made = run_instrumented_agent({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_LOGS_EXPORTER": "none",
                                       "OTEL_METRICS_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": c.grpc_endpoint,
                                       "OTEL_EXPORTER_OTLP_INSECURE": "true"}, n_calls=2)
    out = tracerl("sql", "--store", str(store), "--format", "json",
                  "SELECT name, count(*) AS n FROM spans GROUP BY name ORDER BY name")
    assert json.loads(out.stdout) == [{"name": "chat policy", "n": 2}, {"name": "invoke_agent writer", "n": 1}]
    table = tracerl("sql", "--store", str(store), "SELECT span_id FROM spans ORDER BY span_id").stdout
    assert all(span_id in table for _, span_id in made) and "(3 rows)" in table
    status = json.loads(tracerl("status", "--store", str(store), "--json").stdout)
    assert status["rows"]["spans"] == 3 and status["wal"]["backlog_bytes"] == 0


def test_tracerl_exporter_plugin_writes_the_store_without_a_collector(store):
    made = run_instrumented_agent({"OTEL_TRACES_EXPORTER": "tracerl", "OTEL_LOGS_EXPORTER": "none",
                                   "OTEL_METRICS_EXPORTER": "none", "TRACERL_STORE": str(store)}, n_calls=4)
    con = connect_readonly(parse_store(store))
    assert sorted(con.execute("SELECT trace_id, span_id FROM spans").fetchall()) == sorted(made)
    assert con.execute("SELECT DISTINCT resource_attributes['service.name'] FROM spans").fetchall() == [("writer-agent",)]
    assert not list((store / "wal").glob("*/seg-*"))  # drained on shutdown


def test_tracerl_exporter_plugin_writes_a_bucket_with_its_wal_on_local_disk(s3_store, tmp_path):
    """TRACERL_STORE=s3://…: the tables go to the bucket (moto's S3 server, a stand-in for S3), the WAL
    to TRACERL_WAL on this host, drained on shutdown."""
    wal = tmp_path / "wal"
    made = run_instrumented_agent({"OTEL_TRACES_EXPORTER": "tracerl", "OTEL_LOGS_EXPORTER": "none",
                                   "OTEL_METRICS_EXPORTER": "none", "TRACERL_STORE": s3_store,
                                   "TRACERL_WAL": str(wal)}, n_calls=2)
    out = tracerl("sql", "--store", s3_store, "--format", "json", "SELECT trace_id, span_id FROM spans").stdout
    assert sorted((r["trace_id"], r["span_id"]) for r in json.loads(out)) == sorted(made)
    assert wal.is_dir() and not list(wal.glob("*/seg-*"))  # its WAL was on this disk, and drained
    assert parse_store(s3_store).files("wal", suffix="") == []  # none of it in the bucket


def test_sql_command_cannot_write_or_read_outside_the_store(store, tmp_path):
    store.mkdir()
    evil = tmp_path / "evil.csv"
    for query in (f"COPY (SELECT 1) TO '{evil}'", f"COPY (SELECT 1) TO '{store}/x.csv'", "SELECT * FROM read_csv('/etc/passwd')",
                  f"ATTACH '{store}/db.duckdb'", "SET enable_external_access = true"):
        proc = tracerl("sql", "--store", str(store), query, check=False)
        assert proc.returncode == 2, (query, proc.stdout)
        # statements that write are refused by kind; a read outside the store by DuckDB's locked configuration
        assert "only reads" in proc.stderr or "disabled" in proc.stderr, (query, proc.stderr)
    assert not evil.exists() and not (store / "x.csv").exists() and not (store / "db.duckdb").exists()
    assert tracerl("sql", "--store", str(store), "--format", "csv", "SELECT count(*) AS n FROM spans").stdout.split() == ["n", "0"]
