"""``OTEL_TRACES_EXPORTER=tracerl``: store spans straight into a local tracerl store, no collector.

Registered under the ``opentelemetry_traces_exporter`` entry point, so the SDK's auto
configuration (``opentelemetry-instrument``) wraps it in a BatchSpanProcessor like any other
exporter. Same durability as the collector: each batch is encoded to OTLP protobuf (the SDK's
own encoder), appended to a per-process WAL with fsync, and compacted to Parquet by a
background thread and on shutdown. A process that dies leaves its WAL, which the next
collector or exporter that opens the store replays.

Settings: ``TRACERL_STORE`` (default ``./tracerl-store``).
"""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from collector_exporter.compactor import Compactor
from collector_exporter.wal import Kind, WriteAheadLog
from schemas.store import StoreLayout, default_store


class TracerlSpanExporter(SpanExporter):
    def __init__(self, store: str | None = None, *, compact_interval_s: float = 1.0):
        self.store = StoreLayout.at(store or default_store())
        self.store.root.mkdir(parents=True, exist_ok=True)
        self.wal_dir = self.store.wal / f"exporter-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.compactor = Compactor(self.store)
        self.wal = WriteAheadLog(self.wal_dir, max_segment_age_s=compact_interval_s)
        self.compactor.start(own=self.wal_dir, interval_s=compact_interval_s)
        self._shutdown = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown:
            return SpanExportResult.FAILURE
        try:
            self.wal.append(Kind.TRACES, encode_spans(spans).SerializeToString())
        except Exception:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        self.wal.seal()
        self.compactor.run_once(own=self.wal_dir)
        return True

    def shutdown(self) -> None:
        if self._shutdown:
            return
        self._shutdown = True
        self.wal.close()
        self.compactor.stop()
        self.compactor.run_once(own=self.wal_dir)
        if not any(self.wal_dir.glob("seg-*")):
            shutil.rmtree(self.wal_dir, ignore_errors=True)
