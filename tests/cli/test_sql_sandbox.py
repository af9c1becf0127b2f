"""`tracerl sql` is read-only over the store: no file anywhere can be written or read by a query,
including DuckDB's default spill directory ``<cwd>/.tmp``, which DuckDB allows even with external
access switched off."""

from __future__ import annotations

import subprocess

import pytest
from tracerl_testing import BIN

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)


@pytest.mark.parametrize("query", [
    "COPY (SELECT 42 AS x) TO '.tmp/x.csv'",
    "COPY (SELECT 42 AS x) TO 'x.csv'",
    "SELECT * FROM read_csv('.tmp/secret.csv')",
])
def test_sql_queries_cannot_touch_files_even_in_cwd_tmp(tmp_path, query):
    (tmp_path / ".tmp").mkdir()
    (tmp_path / ".tmp" / "secret.csv").write_text("a\n1\n")
    (tmp_path / "store").mkdir()
    run = subprocess.run([str(BIN / "tracerl"), "sql", "--store", str(tmp_path / "store"), query], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    # COPY is refused as a statement that writes; a file read, by DuckDB's locked configuration
    assert "only reads: COPY" in run.stderr if query.startswith("COPY") else "disabled by configuration" in run.stderr
    assert not list(tmp_path.rglob("x.csv"))


@pytest.mark.parametrize("query", ["CREATE TABLE t AS SELECT 1", "INSERT INTO spans SELECT * FROM spans",
                                   "SET threads = 1", "ATTACH ':memory:' AS other"])
def test_sql_runs_only_statements_that_read(tmp_path, query):
    (tmp_path / "store").mkdir()
    run = subprocess.run([str(BIN / "tracerl"), "sql", "--store", str(tmp_path / "store"), query],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "tracerl sql only reads" in run.stderr, run.stdout + run.stderr


def test_sql_on_a_missing_store_is_an_error_not_zero_rows(tmp_path):
    run = subprocess.run([str(BIN / "tracerl"), "sql", "--store", str(tmp_path / "nope"), "SELECT 1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "no store at" in run.stderr
