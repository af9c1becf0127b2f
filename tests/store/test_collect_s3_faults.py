"""Capture's fault rule on a bucket: a failed PUT is never taken as stored.

A collector acknowledges spans once its local WAL has them; compaction removes a WAL segment only
after the bucket accepted the Parquet file. Here the bucket disappears under a running collector
(moto's standalone server, a stand-in for S3 on 127.0.0.1, answers every PUT with NoSuchBucket),
spans keep arriving, and nothing may be lost or written twice once the bucket is back.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import boto3
import httpx
import pytest
from s3_server import make_bucket
from tracerl_testing import free_port, start_tracerl, stop_tracerl, tracerl, traces_request

from collector_exporter.compactor import COMPACTION_ERROR

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)


def _wait(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _segments(wal: Path) -> list[Path]:
    return [p for p in wal.glob("*/seg-*") if p.is_file()]


def test_spans_acked_while_the_bucket_is_gone_are_stored_once_it_is_back(s3_store, s3_endpoint, tmp_path):
    bucket = s3_store.removeprefix("s3://").split("/", 1)[0]
    wal, port = tmp_path / "wal", free_port()
    proc = start_tracerl("collect", "--store", s3_store, "--wal", str(wal), "--grpc", "off",
                         "--http", f"127.0.0.1:{port}", health=f"http://127.0.0.1:{port}/healthz")
    try:
        boto3.client("s3").delete_bucket(Bucket=bucket)  # empty so far: every PUT now fails
        for n in (6, 4):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/traces", content=traces_request(n, "tests.store"),
                           headers={"content-type": "application/x-protobuf"}, timeout=30)
            assert r.status_code == 200, r.text  # acknowledged: the WAL holds them
        _wait(lambda: any(wal.glob(f"*/{COMPACTION_ERROR}")), "the collector to report its failing compaction")
        assert _segments(wal), "a segment whose PUT failed was removed"
        error = json.loads(next(wal.glob(f"*/{COMPACTION_ERROR}")).read_text())
        # the report names the cause (S3's NoSuchBucket, as pyarrow words it) and counts the failed passes
        assert "bucket" in error["error"].lower() and error["failures"] >= 1, error

        make_bucket(s3_endpoint, bucket)
        _wait(lambda: not _segments(wal) and not any(wal.glob(f"*/{COMPACTION_ERROR}")),
              "the retried compaction to store the kept segments")
    finally:
        stop_tracerl(proc)
    out = tracerl("sql", "--store", s3_store, "--format", "json",
                  "SELECT count(*) AS n, count(DISTINCT (trace_id, span_id)) AS k FROM spans").stdout
    assert json.loads(out) == [{"n": 10, "k": 10}]
