"""The official OpenTelemetry JS SDK exports to the collector over http/json, http/protobuf (gzip)
and grpc: every span stored once, with the ids, parents, nanosecond times and integers it sent.

The JS exporters send chunked request bodies (no Content-Length), which the stdlib server refused
with 411; TypeScript agents (Vercel AI SDK, LangChain.js, Mastra) default to OTLP/HTTP. The SDK
is installed by npm from the pinned lock file into ``.node-otel/`` (gitignored), once per lock hash.
Skipped only when the npm registry cannot be reached, and never under ``CI``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from tracerl_testing import npm_ci

from collector_exporter.testing import running_collector
from store.location import parse_store
from store.views import connect_readonly

HERE = Path(__file__).resolve().parent / "js_otel"
CACHE = Path(__file__).resolve().parents[2] / ".node-otel" / "collector-js"


def js_sdk() -> Path:
    """A directory with the JS SDK installed and ``export.mjs`` beside its node_modules."""
    CACHE.mkdir(parents=True, exist_ok=True)
    for name in ("package.json", "package-lock.json", "export.mjs"):
        shutil.copy(HERE / name, CACHE / name)
    return npm_ci(CACHE)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http/json", "http/protobuf", "grpc"])
def test_official_js_sdk_exports_every_span_once(store, protocol):
    sdk = js_sdk()
    env = {**os.environ, "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20js-t0k",
           "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip" if protocol == "http/protobuf" else "none"}
    with running_collector(store, token="js-t0k") as c:
        endpoint = c.grpc_endpoint if protocol == "grpc" else c.http_endpoint
        run = subprocess.run(["node", "export.mjs", protocol, endpoint, "20"], cwd=sdk, env=env,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        sent = json.loads(run.stdout.strip().splitlines()[-1])
        c.flush()
    assert len(sent) == 20
    rows = connect_readonly(parse_store(store)).execute(
        "SELECT span_id, trace_id, parent_span_id, start_time_ns, end_time_ns, attributes FROM spans").fetchall()
    assert sorted(r[0] for r in rows) == sorted(s["span_id"] for s in sent)  # each stored exactly once
    stored = {r[0]: r for r in rows}
    for s in sent:
        _, trace_id, parent, start_ns, end_ns, attrs = stored[s["span_id"]]
        assert (trace_id, parent) == (s["trace_id"], s["parent_span_id"])
        assert (start_ns, end_ns) == (int(s["start_ns"]), int(s["end_ns"]))  # past 2**53: exact int64
        for key, value in s["attributes"].items():
            assert attrs[key] == str(value), (key, attrs)
    assert any(s["attributes"].get("big.int") == 2**53 - 1 for s in sent)
