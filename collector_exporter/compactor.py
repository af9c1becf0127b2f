"""Sealed WAL segments → Parquet tables (spans, logs, rewards), then delete the segment.

Idempotent by construction: the files a segment produces are named after it
(``part-<writer>-<segment>.parquet`` in the date partition of the record's receive time), so a
crash between writing them and deleting the segment only means the same files are written
again on replay. Exporter retries (an ack lost on the wire) are dropped by a dedupe window
keyed on (trace_id, span_id) for spans, ``log_id`` for logs and ``reward_id`` for rewards.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from collector_exporter.otlp_arrow import logs_request_to_table, trace_request_to_table
from collector_exporter.rewards import rewards_to_table
from collector_exporter.wal import (
    Kind,
    Record,
    iter_wal_dirs,
    read_records,
    recover,
    sealed_segments,
    try_lock,
)
from schemas.parquet import write_table_atomic
from schemas.store import StoreLayout

log = logging.getLogger("tracerl.collector")


class DedupeWindow:
    """The most recent ``max_keys`` keys, evicted a whole segment at a time.

    Keys are exact (no hashing), so a collision can never drop a real span. Retries arrive
    within the exporter's timeout and backoff (seconds to about a minute), far inside the window.
    """

    def __init__(self, max_keys: int = 1_000_000):
        self.max_keys = max_keys
        self._keys: set[Hashable] = set()
        self._batches: deque[list[Hashable]] = deque()
        self._current: list[Hashable] = []

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: Hashable) -> None:
        self._keys.add(key)
        self._current.append(key)

    def update(self, keys: Iterable[Hashable]) -> None:
        for k in keys:
            self.add(k)

    def end_batch(self) -> None:
        if self._current:
            self._batches.append(self._current)
            self._current = []
        while len(self._keys) > self.max_keys and len(self._batches) > 1:
            for k in self._batches.popleft():
                self._keys.discard(k)


@dataclass
class CompactorStats:
    segments: int = 0
    spans: int = 0
    logs: int = 0
    rewards: int = 0
    duplicates: int = 0
    files: int = 0
    last_error: str | None = None


def _date_of(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).strftime("%Y-%m-%d")


def _filter_new(table: pa.Table, column: str, window: DedupeWindow) -> tuple[pa.Table, int]:
    keys = table.column(column).to_pylist()
    keep = []
    for i, k in enumerate(keys):
        if k not in window:
            window.add(k)
            keep.append(i)
    if len(keep) == len(keys):
        return table, 0
    return table.take(pa.array(keep, type=pa.int64())), len(keys) - len(keep)


class Compactor:
    """Turns every sealed segment under ``store/wal`` into Parquet, oldest first."""

    def __init__(self, store: StoreLayout, *, dedupe_keys: int = 1_000_000):
        self.store = store
        self.stats = CompactorStats()
        self._spans_seen = DedupeWindow(dedupe_keys)
        self._logs_seen = DedupeWindow(dedupe_keys)
        self._rewards_seen = DedupeWindow(dedupe_keys)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._load_windows()

    # -- dedupe window bootstrap -----------------------------------------------------------
    def _pending_names(self) -> set[str]:
        return {
            f"part-{d.name}-{seg.stem.split('-', 1)[1]}.parquet"
            for d in iter_wal_dirs(self.store.wal)
            for seg in list(d.glob("seg-*.wal")) + list(d.glob("seg-*.open"))
        }

    def _load_windows(self) -> None:
        """Refill the dedupe windows from the newest stored files (so a restart still drops a
        retry of a span stored just before the crash), skipping files that a pending segment
        is about to rewrite: their rows must be rewritten, not deduped against themselves."""
        pending = self._pending_names()
        for table, column, window in (
            ("spans", ("trace_id", "span_id"), self._spans_seen),
            ("logs", ("log_id",), self._logs_seen),
            ("rewards", ("reward_id",), self._rewards_seen),
        ):
            root = self.store.table(table)
            if not root.exists():
                continue
            files = sorted(
                (p for p in root.rglob("part-*.parquet") if p.name not in pending),
                key=lambda p: p.stat().st_mtime,
                reverse=True,
            )
            loaded = 0
            for path in files:
                if loaded >= window.max_keys:
                    break
                t = pq.read_table(path, columns=list(column))
                if table == "spans":
                    keys = [
                        (bytes.fromhex(a), bytes.fromhex(b))
                        for a, b in zip(t.column(0).to_pylist(), t.column(1).to_pylist())
                    ]
                else:
                    keys = t.column(0).to_pylist()
                window.update(keys)
                window.end_batch()
                loaded += len(keys)

    # -- one segment -----------------------------------------------------------------------
    def compact_segment(self, writer: str, segment: Path) -> None:
        records, _ = read_records(segment)
        seg_id = segment.stem.split("-", 1)[1]
        tables: dict[tuple[str, str], list[pa.Table]] = {}
        for rec in records:
            name, table, dups = self._decode(rec)
            self.stats.duplicates += dups
            if table.num_rows:
                tables.setdefault((name, _date_of(rec.received_at_ns)), []).append(table)
        for (name, date), parts in sorted(tables.items()):
            table = pa.concat_tables(parts)
            path = self.store.partition(name, date) / f"part-{writer}-{seg_id}.parquet"
            write_table_atomic(table, path, name)
            self.stats.files += 1
            setattr(self.stats, name, getattr(self.stats, name) + table.num_rows)
        for w in (self._spans_seen, self._logs_seen, self._rewards_seen):
            w.end_batch()
        segment.unlink()
        self.stats.segments += 1

    def _decode(self, rec: Record) -> tuple[str, pa.Table, int]:
        """One WAL record as (table name, new rows, duplicates dropped)."""
        if rec.kind == Kind.TRACES:
            req = ExportTraceServiceRequest()
            req.ParseFromString(rec.payload)
            n_in = sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
            table = trace_request_to_table(req, rec.received_at_ns, seen=self._spans_seen)
            return "spans", table, n_in - table.num_rows
        if rec.kind == Kind.LOGS:
            req = ExportLogsServiceRequest()
            req.ParseFromString(rec.payload)
            table, dups = _filter_new(logs_request_to_table(req, rec.received_at_ns), "log_id", self._logs_seen)
            return "logs", table, dups
        rows = json.loads(rec.payload)
        table, dups = _filter_new(rewards_to_table(rows, rec.received_at_ns), "reward_id", self._rewards_seen)
        return "rewards", table, dups

    # -- passes ------------------------------------------------------------------------------
    def run_once(self, own: Path | None = None) -> int:
        """Compact every sealed segment: this process's own WAL directory, and directories
        left by writers that died (their lock is free). Returns segments compacted."""
        done = 0
        with self._lock:
            for wal_dir in iter_wal_dirs(self.store.wal):
                lock_fd = None
                if own is None or wal_dir.resolve() != own.resolve():
                    lock_fd = try_lock(wal_dir)
                    if lock_fd is None:
                        continue  # a live writer owns it; its own compactor handles it
                    recover(wal_dir)
                try:
                    for seg in sealed_segments(wal_dir):
                        self.compact_segment(wal_dir.name, seg)
                        done += 1
                    if lock_fd is not None and not any(wal_dir.glob("seg-*")):
                        (wal_dir / "LOCK").unlink(missing_ok=True)
                        os.rmdir(wal_dir)
                finally:
                    if lock_fd is not None:
                        os.close(lock_fd)
        return done

    def start(self, own: Path | None, interval_s: float = 0.2) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.run_once(own)
                    self.stats.last_error = None
                except Exception as e:  # keep serving; the segment stays and is retried
                    self.stats.last_error = f"{type(e).__name__}: {e}"
                    log.exception("compaction failed; will retry")
                self._wake.wait(interval_s)
                self._wake.clear()

        self._thread = threading.Thread(target=loop, name="tracerl-compactor", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()


def backlog_bytes(store: StoreLayout) -> int:
    """Bytes in the WAL not yet compacted (sealed and open segments of every writer)."""
    total = 0
    for d in iter_wal_dirs(store.wal):
        for p in d.glob("seg-*"):
            with contextlib.suppress(FileNotFoundError):
                total += p.stat().st_size
    return total

