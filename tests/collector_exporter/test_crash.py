"""kill -9 during a sustained export: every acknowledged span is stored exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult
from tracerl_testing import BIN, free_port

from store.location import parse_store
from store.views import connect_readonly

from .helpers import make_spans, span_key

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)


def start_collector(store, port: int) -> subprocess.Popen:
    # Segments stay open 5 s, so the kill (1 s in) always hits acknowledged spans that exist only in
    # the open WAL segment: exactly what the restart must replay.
    proc = subprocess.Popen(
        [str(BIN / "tracerl"), "collect", "--store", str(store), "--grpc", f"127.0.0.1:{port}", "--http", "off",
         "--segment-age-s", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()  # printed once both receivers are bound
    assert "OTLP/gRPC" in line, proc.stderr.read()
    return proc


def test_kill_9_then_restart_loses_and_duplicates_no_acknowledged_span(store):
    port = free_port()
    collector = start_collector(store, port)
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=30)
    acked: list[tuple[str, str]] = []
    sent = 0
    stop = threading.Event()
    restarted = threading.Event()

    def produce() -> None:
        nonlocal sent
        while not stop.is_set():
            batch = make_spans(100)
            sent += len(batch)
            if exporter.export(batch) == SpanExportResult.SUCCESS:
                acked.extend(span_key(s) for s in batch)

    producer = threading.Thread(target=produce)
    producer.start()
    time.sleep(1.0)
    before_kill = len(acked)
    os.kill(collector.pid, signal.SIGKILL)  # mid-stream: requests in flight, segments open
    collector.wait()
    left_in_wal = list((store / "wal").glob("*/seg-*.open"))
    collector = start_collector(store, port)
    restarted.set()
    deadline = time.monotonic() + 30
    while len(acked) < before_kill + 1000 and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    producer.join()
    exporter.shutdown()
    collector.send_signal(signal.SIGTERM)
    assert collector.wait(timeout=30) == 0, collector.stderr.read()

    assert left_in_wal, "the kill should leave an open WAL segment of acknowledged spans to replay"
    assert before_kill > 0 and len(acked) >= before_kill + 1000, (before_kill, len(acked))
    con = connect_readonly(parse_store(store))
    rows = con.execute("SELECT trace_id, span_id, count(*) FROM spans GROUP BY ALL").fetchall()
    counts = {(t, s): n for t, s, n in rows}
    missing = [k for k in acked if k not in counts]
    assert not missing, f"{len(missing)} acknowledged spans lost of {len(acked)}"
    assert max(counts.values()) == 1, "a span was stored twice"
    assert len(counts) <= sent
