"""Collectors on several hosts write one bucket: each keeps its WAL on its own disk, compaction puts
Parquet in the bucket, and file names carry the writer (host, pid, random), so nothing collides.

The bucket is served by moto's standalone server, a stand-in for S3 on 127.0.0.1 (s3_server.py);
the collectors are real ``tracerl collect`` processes reaching it through pyarrow's S3 client.
"""

from __future__ import annotations

import json

import httpx
import pytest
from tracerl_testing import free_port, start_tracerl, stop_tracerl, tracerl, traces_request

from store.location import parse_store

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)


def test_two_collectors_with_local_wals_fill_one_bucket_without_collisions(s3_store, tmp_path):
    ports = [free_port(), free_port()]
    procs = [start_tracerl("collect", "--store", s3_store, "--wal", str(tmp_path / f"wal-{i}"), "--grpc", "off",
                           "--http", f"127.0.0.1:{port}", health=f"http://127.0.0.1:{port}/healthz")
             for i, port in enumerate(ports)]
    try:
        for port, n in zip(ports, (7, 5)):
            for _ in range(2):  # two requests each, so each collector may write more than one file
                r = httpx.post(f"http://127.0.0.1:{port}/v1/traces", content=traces_request(n, "tests.store"),
                               headers={"content-type": "application/x-protobuf"}, timeout=30)
                assert r.status_code == 200, r.text
    finally:
        for p in procs:
            stop_tracerl(p)  # the final compaction writes what is left in each WAL to the bucket
    assert not list(tmp_path.glob("wal-*/*/seg-*")), "every acknowledged segment was compacted and removed"
    out = tracerl("sql", "--store", s3_store, "--format", "json",
                  "SELECT count(*) AS n, count(DISTINCT (trace_id, span_id)) AS k FROM spans").stdout
    assert json.loads(out) == [{"n": 24, "k": 24}]
    loc = parse_store(s3_store)
    writers = {f.rsplit("/", 1)[1].rsplit("-", 1)[0] for f in loc.files("spans")}
    assert len(writers) == 2 and all(w.startswith("part-collector-") for w in writers)
    assert not list(tmp_path.glob("spans")) and loc.files("wal", suffix="") == []  # no WAL in the bucket
