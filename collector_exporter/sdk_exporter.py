"""``OTEL_TRACES_EXPORTER=tracerl``: store spans straight into a tracerl store, no collector.

Registered under the ``opentelemetry_traces_exporter`` entry point, so the SDK's auto
configuration (``opentelemetry-instrument``) wraps it in a BatchSpanProcessor like any other
exporter. Same durability as the collector: each batch is encoded to OTLP protobuf (the SDK's
own encoder), appended to a per-process WAL with fsync, and compacted to Parquet by a
background thread and on shutdown. A process that dies leaves its WAL, which the next
collector or exporter that opens the store replays.

Settings: ``TRACERL_STORE`` (default ``./tracerl-store``; ``s3://bucket/prefix`` writes the tables to a
bucket, as ``tracerl collect`` does) and ``TRACERL_WAL`` (where the WAL lives, always on this host's disk;
default ``STORE/wal`` for a local store, ``./tracerl-wal`` for a bucket).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from collector_exporter.compactor import Compactor, drain, wal_and_store
from collector_exporter.storable import drop_unstorable_spans
from collector_exporter.wal import Kind, WriteAheadLog
from store.layout import default_store

log = logging.getLogger("tracerl.exporter")


class TracerlSpanExporter(SpanExporter):
    def __init__(self, store: str | None = None, *, compact_interval_s: float = 1.0, wal: str | None = None):
        self.store, out = wal_and_store(store or default_store(), wal or os.environ.get("TRACERL_WAL") or None)
        self.wal_dir = self.store.wal / f"exporter-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.compactor = Compactor(self.store, out=out)
        self.wal = WriteAheadLog(self.wal_dir, max_segment_age_s=compact_interval_s)
        self.compactor.start(own=self.wal_dir, interval_s=compact_interval_s)
        self._shutdown = False
        self.problems: list[str] = []  # what shutdown could not finish (see collector.drain)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Store the batch durably, with the collector's rules: spans the store cannot hold are
        dropped (and logged) before the WAL, a failed write is a FAILURE, never a success."""
        if self._shutdown:
            return SpanExportResult.FAILURE
        req = encode_spans(spans)
        kept, rejected, reason = drop_unstorable_spans(req)
        if rejected:
            log.warning("tracerl exporter: %d span(s) cannot be stored and were dropped: %s", rejected, reason)
        if not kept:
            return SpanExportResult.SUCCESS
        try:
            self.wal.append(Kind.TRACES, req.SerializeToString())
        except Exception as e:
            log.warning("tracerl exporter: batch of %d span(s) not stored: %s", kept, e)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Make what was exported visible in Parquet now; False when compaction failed (the WAL keeps it)."""
        self.wal.seal()
        try:
            self.compactor.run_once(own=self.wal_dir)
        except Exception as e:
            log.warning("tracerl exporter: flush could not compact (%s); the WAL keeps the spans", e)
            return False
        return True

    def shutdown(self) -> None:
        if self._shutdown:
            return
        self._shutdown = True
        self.problems = drain(self.wal, self.compactor, self.wal_dir)  # logged; the next writer replays the WAL
