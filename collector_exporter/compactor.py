"""Sealed WAL segments → Parquet tables (spans, logs, rewards), then delete the segment.

Idempotent by construction: the files a segment produces are named after it
(``part-<writer>-<segment>.parquet`` in the date partition of the record's receive time), so a
crash between writing them and deleting the segment only means the same files are written
again on replay. Exporter retries (an ack lost on the wire) are dropped by a dedupe window
keyed on (trace_id, span_id) for spans, ``log_id`` for logs and ``reward_id`` for rewards.

Nothing acknowledged is lost or blocks the pipeline:
- the window learns a segment's keys only after its Parquet files are durably in place, so a
  failed write is retried with the same rows instead of being mistaken for duplicates;
- an item that cannot be converted goes to ``quarantine/`` with its reason (``quarantine.py``);
- an environmental failure (ENOSPC, EIO) keeps the segment; the background loop retries with
  backoff and reports the error (``CompactorStats.last_error``, the log, ``tracerl status``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from collector_exporter.otlp_arrow import logs_request_to_table, trace_request_to_table
from collector_exporter.quarantine import Quarantined, quarantine_dir, write_quarantine
from collector_exporter.rewards import rewards_to_table
from collector_exporter.storable import log_problem, span_problem
from collector_exporter.wal import (
    Kind,
    Record,
    WalError,
    WriteAheadLog,
    iter_wal_dirs,
    read_records,
    recover,
    sealed_segments,
    try_lock,
)
from schemas.parquet import write_table_atomic
from schemas.store import StoreLayout

log = logging.getLogger("tracerl.collector")

COMPACTION_ERROR = "compaction-error.json"
"""Written into a live writer's WAL directory while its compaction is failing; read by ``tracerl status``."""


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
class _Staged:
    """Keys taken by the segment being converted, checked together with the dedupe window.

    Nothing reaches the window until ``commit``, which the compactor calls only once the
    segment's Parquet files are durably written; ``roll_back`` forgets the keys of a record
    whose conversion failed part-way."""

    def __init__(self, window: DedupeWindow):
        self.window = window
        self.keys: set[Hashable] = set()
        self.order: list[Hashable] = []

    def __contains__(self, key: Hashable) -> bool:
        return key in self.keys or key in self.window

    def add(self, key: Hashable) -> None:
        self.keys.add(key)
        self.order.append(key)

    def mark(self) -> int:
        return len(self.order)

    def roll_back(self, mark: int) -> None:
        for key in self.order[mark:]:
            self.keys.discard(key)
        del self.order[mark:]

    def commit(self) -> None:
        self.window.update(self.order)
        self.window.end_batch()
        self.keys, self.order = set(), []


@dataclass
class CompactorStats:
    segments: int = 0
    spans: int = 0
    logs: int = 0
    rewards: int = 0
    duplicates: int = 0
    quarantined: int = 0
    files: int = 0
    bytes: int = 0  # WAL bytes compacted
    failures: int = 0  # passes that failed (the segment was kept and retried)
    last_error: str | None = None


def _date_of(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).strftime("%Y-%m-%d")


def _filter_new(table: pa.Table, column: str, seen: _Staged) -> pa.Table:
    keys = table.column(column).to_pylist()
    keep = []
    for i, k in enumerate(keys):
        if k not in seen:
            seen.add(k)
            keep.append(i)
    return table if len(keep) == len(keys) else table.take(pa.array(keep, type=pa.int64()))


_SPAN_PATH = ("resource_spans", "scope_spans", "spans")
_LOG_PATH = ("resource_logs", "scope_logs", "log_records")


def _items(req: object, path: tuple[str, str, str]) -> Iterator[object]:
    """The spans (or log records) of an OTLP request, through its resource and scope levels."""
    outer, inner, leaf = path
    return (item for r in getattr(req, outer) for s in getattr(r, inner) for item in getattr(s, leaf))


def _single_items(req: object, path: tuple[str, str, str]) -> Iterator[tuple[object, object]]:
    """Each span (or log record) alone in a request with its resource and scope: the unit of quarantine."""
    outer, inner, leaf = path
    for r in getattr(req, outer):
        for s in getattr(r, inner):
            for item in getattr(s, leaf):
                one = type(req)()
                level = getattr(one, outer).add(resource=r.resource, schema_url=r.schema_url)
                getattr(getattr(level, inner).add(scope=s.scope, schema_url=s.schema_url), leaf).append(item)
                yield item, one


@dataclass(frozen=True)
class _Signal:
    """How one WAL record kind becomes rows, and how it splits into items when it does not."""

    table: str
    parse: Callable[[bytes], object]
    items: Callable[[object], Iterator[object]]  # the spans, log records or reward rows of a request
    split: Callable[[object], Iterator[tuple[object, object]]]  # (item, a request of just that item)
    problem: Callable[[object], str | None]  # storable.py: the receiver's own rules
    to_table: Callable[[object, int, _Staged], pa.Table]
    encode: Callable[[object], bytes]


_SIGNALS = {
    Kind.TRACES: _Signal("spans", ExportTraceServiceRequest.FromString, lambda req: _items(req, _SPAN_PATH),
                         lambda req: _single_items(req, _SPAN_PATH), span_problem,
                         lambda req, ts, seen: trace_request_to_table(req, ts, seen=seen),
                         lambda req: req.SerializeToString()),
    Kind.LOGS: _Signal("logs", ExportLogsServiceRequest.FromString, lambda req: _items(req, _LOG_PATH),
                       lambda req: _single_items(req, _LOG_PATH), log_problem,
                       lambda req, ts, seen: _filter_new(logs_request_to_table(req, ts), "log_id", seen),
                       lambda req: req.SerializeToString()),
    Kind.REWARDS: _Signal("rewards", json.loads, iter, lambda rows: ((row, [row]) for row in rows), lambda row: None,
                          lambda rows, ts, seen: _filter_new(rewards_to_table(rows, ts), "reward_id", seen),
                          lambda rows: json.dumps(rows).encode()),
}


def _convert(rec: Record, staged: dict[str, _Staged]) -> tuple[str, list[pa.Table], list[Quarantined], int]:
    """One WAL record as (table name, tables of new rows, quarantined items, items seen before).

    The whole request is converted at once when every item is storable (the fast path); otherwise,
    or when conversion fails, item by item, so one bad item costs only itself."""
    signal = _SIGNALS.get(rec.kind)
    if signal is None:
        return "unknown", [], [Quarantined("unknown", f"unknown WAL record kind {rec.kind}", int(rec.kind),
                                           rec.received_at_ns, rec.payload)], 0
    seen = staged[signal.table]
    try:
        msg = signal.parse(rec.payload)
        n_items, storable = 0, True
        for item in signal.items(msg):
            n_items += 1
            storable = storable and signal.problem(item) is None
    except Exception as e:  # passed the CRC yet does not parse: keep the bytes, say why
        reason = f"record does not parse: {type(e).__name__}: {e}"
        return signal.table, [], [Quarantined(signal.table, reason, rec.kind, rec.received_at_ns, rec.payload)], 0
    if storable:
        mark = seen.mark()
        try:
            table = signal.to_table(msg, rec.received_at_ns, seen)
        except Exception:
            seen.roll_back(mark)
            log.exception("converting a %s record failed; retrying item by item", signal.table)
        else:
            return signal.table, [table], [], n_items - table.num_rows
    tables, bad, dups = [], [], 0
    for item, one in signal.split(msg):
        why = signal.problem(item)
        if why is None:
            mark = seen.mark()
            try:
                table = signal.to_table(one, rec.received_at_ns, seen)
            except Exception as e:
                seen.roll_back(mark)
                why = f"conversion failed: {type(e).__name__}: {e}"
            else:
                tables.append(table)
                dups += 1 - table.num_rows
                continue
        bad.append(Quarantined(signal.table, why, rec.kind, rec.received_at_ns, signal.encode(one)))
    return signal.table, tables, bad, dups


_TMP = re.compile(r"^\.part-(?P<writer>.+)-\d+\.parquet\.[0-9a-f]{32}\.tmp$")


def remove_stale_tmp(store: StoreLayout) -> int:
    """Delete temp files a killed compaction left (``.part-*.tmp``; ``.tmp`` in ``quarantine/``).

    A temp file is stale when no live process holds its writer's WAL lock: a live adopter of a dead
    writer's directory holds that lock while it compacts, so files still being written are spared."""
    removed = 0
    live: dict[str, bool] = {}
    for name in ("spans", "logs", "rewards"):
        root = store.table(name)
        for tmp in root.rglob(".part-*.tmp") if root.exists() else ():
            m = _TMP.match(tmp.name)
            if m is None:
                continue
            writer = m["writer"]
            if writer not in live:
                live[writer] = _writer_is_live(store.wal / writer)
            if not live[writer]:
                tmp.unlink(missing_ok=True)
                removed += 1
    qdir = quarantine_dir(store.root)
    for tmp in qdir.glob(".*.tmp") if qdir.exists() else ():
        writer = tmp.name[1:].rsplit("-", 1)[0]
        if not live.setdefault(writer, _writer_is_live(store.wal / writer)):
            tmp.unlink(missing_ok=True)
            removed += 1
    return removed


def _writer_is_live(wal_dir: Path) -> bool:
    if not wal_dir.is_dir():
        return False
    fd = try_lock(wal_dir)
    if fd is None:
        return True
    os.close(fd)
    return False


class Compactor:
    """Turns every sealed segment under ``store/wal`` into Parquet, oldest first."""

    def __init__(self, store: StoreLayout, *, dedupe_keys: int = 1_000_000):
        self.store = store
        self.stats = CompactorStats()
        self._windows = {name: DedupeWindow(dedupe_keys) for name in ("spans", "logs", "rewards")}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.stale_tmp_removed = remove_stale_tmp(store)
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
        for table, column in (("spans", ("trace_id", "span_id")), ("logs", ("log_id",)), ("rewards", ("reward_id",))):
            window = self._windows[table]
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
        """Parquet files (and a quarantine file) for one sealed segment, then delete it.

        An OSError (disk full, I/O error) propagates with the segment and the dedupe windows
        untouched, so the next attempt writes the same rows."""
        records, _ = read_records(segment)
        seg_id = segment.stem.split("-", 1)[1]
        staged = {name: _Staged(w) for name, w in self._windows.items()}
        tables: dict[tuple[str, str], list[pa.Table]] = {}
        quarantined: list[Quarantined] = []
        dups = 0
        for rec in records:
            name, parts, bad, n_dups = _convert(rec, staged)
            quarantined += bad
            dups += n_dups
            for t in parts:
                if t.num_rows:
                    tables.setdefault((name, _date_of(rec.received_at_ns)), []).append(t)
        rows = {}
        for (name, date), parts in sorted(tables.items()):
            table = pa.concat_tables(parts)
            write_table_atomic(table, self.store.partition(name, date) / f"part-{writer}-{seg_id}.parquet", name)
            rows[name] = rows.get(name, 0) + table.num_rows
        if quarantined:
            write_quarantine(self.store.root, writer, seg_id, quarantined)
            for q in quarantined:
                log.error("quarantined a %s item of %s/%s: %s", q.table, writer, segment.name, q.reason)
        for s in staged.values():  # the files are durably in place: only now may the windows learn the keys
            s.commit()
        size = segment.stat().st_size
        segment.unlink()
        st = self.stats
        st.files += len(tables)
        for name, n in rows.items():
            setattr(st, name, getattr(st, name) + n)
        st.duplicates += dups
        st.quarantined += len(quarantined)
        st.bytes += size
        st.segments += 1

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
                        (wal_dir / COMPACTION_ERROR).unlink(missing_ok=True)
                        (wal_dir / "LOCK").unlink(missing_ok=True)
                        os.rmdir(wal_dir)
                finally:
                    if lock_fd is not None:
                        os.close(lock_fd)
            if self.stats.last_error is not None:
                log.warning("compaction recovered after %d failed pass(es)", self.stats.failures)
                self._report(own, None, 0.0)
        return done

    def start(self, own: Path | None, interval_s: float = 0.2, max_backoff_s: float = 30.0) -> None:
        """Compact in the background every ``interval_s``; after a failure, back off (doubling up
        to ``max_backoff_s``) and retry the same segment, reporting the error until it clears."""

        def loop() -> None:
            delay = interval_s
            while not self._stop.is_set():
                try:
                    self.run_once(own)
                except Exception as e:  # keep serving; the segment stays and is retried
                    delay = min(max_backoff_s, delay * 2)
                    self._report(own, e, delay)
                else:
                    delay = interval_s
                self._wake.wait(delay)
                self._wake.clear()

        self._thread = threading.Thread(target=loop, name="tracerl-compactor", daemon=True)
        self._thread.start()

    def _report(self, own: Path | None, error: BaseException | None, retry_in_s: float) -> None:
        """Record the compaction error (or its end) in the stats, the log, and a small file in this
        writer's WAL directory that ``tracerl status`` reads (best effort: the disk may be full)."""
        st = self.stats
        if error is None:
            st.last_error = None
        else:
            st.failures += 1
            st.last_error = f"{type(error).__name__}: {error}"
            log.error("compaction failed (%s); the WAL segment is kept, retrying in %.1fs", st.last_error, retry_in_s,
                      exc_info=not isinstance(error, OSError))
        if own is None:
            return
        path = own / COMPACTION_ERROR
        with contextlib.suppress(OSError):
            if error is None:
                path.unlink(missing_ok=True)
            else:
                path.write_text(json.dumps({"error": st.last_error, "failures": st.failures, "at": time.time(),
                                            "retry_in_s": retry_in_s}))

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


def drain(wal: WriteAheadLog, compactor: Compactor, wal_dir: Path) -> list[str]:
    """Close the WAL (sealing it), stop the background compactor and compact everything left.

    The one shutdown sequence of every writer (collector, in-process exporter). Returns the
    problems that kept it from finishing; the WAL directory is removed only when it is empty."""
    problems = []
    try:
        wal.close()
    except WalError as e:
        problems.append(str(e))
    compactor.stop()
    try:
        compactor.run_once(own=wal_dir)
    except Exception as e:
        problems.append(f"final compaction failed ({type(e).__name__}: {e}); the WAL in {wal_dir} is kept "
                        "and compacted on the next start")
    if not any(wal_dir.glob("seg-*")):
        shutil.rmtree(wal_dir, ignore_errors=True)
    elif not problems:
        problems.append(f"{wal_dir} still holds segments after the final compaction; the next start compacts them")
    for p in problems:
        log.error("stop: %s", p)
    return problems
