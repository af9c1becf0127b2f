"""``tracerl sql`` and ``tracerl status`` over an ``s3://`` store.

The bucket is served by moto's standalone server, a stand-in for S3 on 127.0.0.1; tracerl reaches it
through pyarrow's real S3 client, configured only by the standard AWS variables (see s3_server.py).
DuckDB reads the bucket through pyarrow datasets: no DuckDB extension is downloaded.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from tracerl_testing import tracerl

from schemas.tables import SPANS_SCHEMA
from store.atomic import write_atomic
from store.location import parse_store
from store.parquet import write_table_atomic

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)


def _spans(trace: str, n: int) -> pa.Table:
    return pa.Table.from_pylist([{"trace_id": trace, "span_id": f"{i:016x}", "name": "chat"} for i in range(n)],
                                schema=SPANS_SCHEMA)


def _fill(store: str) -> None:
    loc = parse_store(store)
    write_table_atomic(_spans("a" * 32, 3), loc.path("spans", "date=2026-11-24", "part-h1-1.parquet"), "spans",
                       fs=loc.fs)
    write_table_atomic(_spans("b" * 32, 2), loc.path("spans", "date=2026-11-25", "part-h2-1.parquet"), "spans",
                       fs=loc.fs)
    write_atomic(loc.path("quarantine", "h1-1.jsonl"), b'{"table": "spans", "reason": "bad"}\n', loc.fs)


def test_sql_reads_a_bucket_with_hive_partitions(s3_store):
    _fill(s3_store)
    out = tracerl("sql", "--store", s3_store, "--format", "json",
                  "SELECT date, count(*) AS n FROM spans GROUP BY date ORDER BY date").stdout
    assert json.loads(out) == [{"date": "2026-11-24", "n": 3}, {"date": "2026-11-25", "n": 2}]


def test_sql_views_name_the_bucket_for_a_users_own_duckdb(s3_store):
    out = tracerl("sql", "--store", s3_store, "--views").stdout
    assert f"read_parquet('{s3_store}/spans/**/*.parquet'" in out


def test_status_counts_rows_and_quarantine_in_a_bucket(s3_store):
    _fill(s3_store)
    s = json.loads(tracerl("status", "--store", s3_store, "--json").stdout)
    assert s["store"] == s3_store and s["rows"]["spans"] == 5 and s["rows"]["transitions"] == 0
    assert s["quarantined"] == {"spans": 1} and s["wal"]["writers"] == []


def test_status_reports_the_wal_it_is_given_beside_a_bucket(s3_store, tmp_path):
    """A bucket's WALs are on the collectors' disks: ``--wal`` names this host's."""
    _fill(s3_store)
    writer = tmp_path / "wal" / "collector-h-1-abc"
    writer.mkdir(parents=True)
    (writer / "seg-000000000001.wal").write_bytes(b"x" * 100)
    (writer / "compaction-error.json").write_text(json.dumps({"error": "NO_SUCH_BUCKET", "failures": 3,
                                                              "retry_in_s": 1.6}))
    s = json.loads(tracerl("status", "--store", s3_store, "--wal", str(tmp_path / "wal"), "--json").stdout)
    assert s["wal"]["writers"] == ["collector-h-1-abc"] and s["wal"]["backlog_bytes"] == 100
    assert s["wal"]["compaction_errors"]["collector-h-1-abc"]["error"] == "NO_SUCH_BUCKET"


def test_status_names_who_holds_the_leases_of_a_bucket(s3_store):
    from store.lease import ObjectLease
    from store.location import parse_store

    _fill(s3_store)
    held = ObjectLease.at(parse_store(s3_store), "checkpoints/.train", ttl_s=60.0, holder="trainer-host-1")
    assert held.try_take()
    s = json.loads(tracerl("status", "--store", s3_store, "--json").stdout)
    assert list(s["leases"]) == ["trainer"] and s["leases"]["trainer"]["holder"] == "trainer-host-1"
    assert 0 < s["leases"]["trainer"]["expires_in_s"] <= 60
    assert "lease  trainer: held by trainer-host-1" in tracerl("status", "--store", s3_store).stdout
    held.release()
    assert "lease  trainer: free (last held by trainer-host-1)" in tracerl("status", "--store", s3_store).stdout


def test_a_missing_prefix_is_no_store(s3_store):
    run = tracerl("sql", "--store", s3_store + "-nothing-here", "SELECT 1", check=False)
    assert run.returncode == 2 and "no store at" in run.stderr
