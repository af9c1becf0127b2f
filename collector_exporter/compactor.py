"""Sealed WAL segments → Parquet tables (spans, logs, rewards), then delete the segment.

Idempotent by construction: the files a segment produces are named after it
(``part-<writer>-<segment>.parquet`` in the date partition of the record's receive time), so a
crash between writing them and deleting the segment only means the same files are written
again on replay. Exporter retries (an ack lost on the wire) are dropped by a dedupe window
keyed on (trace_id, span_id) for spans, ``log_id`` for logs and ``reward_id`` plus content for rewards
(a correction keeps its ``reward_id`` and changes the value: ``rewards.dedupe_keys``).

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
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from collector_exporter.quarantine import Quarantined, quarantine_dir, write_quarantine
from collector_exporter.records import DedupeWindow, StagedKeys, convert_record, convert_traces_at_once
from collector_exporter.rewards import DEDUPE_COLUMNS, dedupe_keys
from collector_exporter.wal import (
    Kind,
    WalError,
    WriteAheadLog,
    iter_wal_dirs,
    read_records,
    recover,
    sealed_segments,
    try_lock,
)
from store.layout import StoreLayout
from store.location import StoreLocation, parse_store
from store.parquet import write_table_atomic

log = logging.getLogger("tracerl.collector")

COMPACTION_ERROR = "compaction-error.json"
"""Written into a live writer's WAL directory while its compaction is failing; read by ``tracerl status``."""


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

    def __init__(self, store: StoreLayout, *, dedupe_keys: int = 1_000_000, out: StoreLocation | None = None):
        """``store``: the local directories (the WAL); ``out``: where the tables go (default: the same
        store's root; an ``s3://`` location for a collector whose WAL is local and store is a bucket)."""
        self.store = store
        self.out = out or parse_store(store.root)
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
        for table, column in (
            ("spans", ("trace_id", "span_id")),
            ("logs", ("log_id",)),
            ("rewards", DEDUPE_COLUMNS),
        ):
            window = self._windows[table]
            selector = pafs.FileSelector(self.out.table(table), recursive=True, allow_not_found=True)
            files = sorted(
                (
                    i
                    for i in self.out.fs.get_file_info(selector)
                    if i.is_file
                    and i.base_name.startswith("part-")
                    and i.base_name.endswith(".parquet")
                    and i.base_name not in pending
                ),
                key=lambda i: i.mtime,
                reverse=True,
            )
            loaded = 0
            for info in files:
                if loaded >= window.max_keys:
                    break
                t = pq.read_table(info.path, columns=list(column), filesystem=self.out.fs)
                if table == "spans":
                    keys = [
                        (bytes.fromhex(a), bytes.fromhex(b))
                        for a, b in zip(t.column(0).to_pylist(), t.column(1).to_pylist())
                    ]
                elif table == "rewards":
                    keys = dedupe_keys(t)
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
        staged = {name: StagedKeys(w) for name, w in self._windows.items()}
        tables: dict[tuple[str, str], list[pa.Table]] = {}
        quarantined: list[Quarantined] = []
        dups = 0
        traces = [r for r in records if r.kind == Kind.TRACES]
        at_once = None
        if len(traces) > 1 and len({_date_of(r.received_at_ns) for r in traces}) == 1:
            at_once = convert_traces_at_once(traces, staged["spans"])
        if at_once is not None:
            table, n_spans = at_once
            if table.num_rows:
                tables[("spans", _date_of(traces[0].received_at_ns))] = [table]
            dups += n_spans - table.num_rows
            records = [r for r in records if r.kind != Kind.TRACES]
        for rec in records:
            name, parts, bad, n_dups = convert_record(rec, staged)
            quarantined += bad
            dups += n_dups
            for t in parts:
                if t.num_rows:
                    tables.setdefault((name, _date_of(rec.received_at_ns)), []).append(t)
        rows = {}
        for (name, date), parts in sorted(tables.items()):
            table = pa.concat_tables(parts)
            write_table_atomic(
                table,
                self.out.path(name, f"date={date}", f"part-{writer}-{seg_id}.parquet"),
                name,
                fs=self.out.fs,
            )
            rows[name] = rows.get(name, 0) + table.num_rows
        if quarantined:
            write_quarantine(self.out, writer, seg_id, quarantined)
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
            log.error(
                "compaction failed (%s); the WAL segment is kept, retrying in %.1fs",
                st.last_error,
                retry_in_s,
                exc_info=not isinstance(error, OSError),
            )
        if own is None:
            return
        path = own / COMPACTION_ERROR
        with contextlib.suppress(OSError):
            if error is None:
                path.unlink(missing_ok=True)
            else:
                path.write_text(
                    json.dumps(
                        {
                            "error": st.last_error,
                            "failures": st.failures,
                            "at": time.time(),
                            "retry_in_s": retry_in_s,
                        }
                    )
                )

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
        problems.append(
            f"final compaction failed ({type(e).__name__}: {e}); the WAL in {wal_dir} is kept "
            "and compacted on the next start"
        )
    if not any(wal_dir.glob("seg-*")):
        shutil.rmtree(wal_dir, ignore_errors=True)
    elif not problems:
        problems.append(
            f"{wal_dir} still holds segments after the final compaction; the next start compacts them"
        )
    for p in problems:
        log.error("stop: %s", p)
    return problems


DEFAULT_REMOTE_WAL = "./tracerl-wal"
"""Where a collector (or the in-process exporter) keeps its write-ahead log when the store is a bucket and ``--wal`` is not given."""


def wal_and_store(store: str, wal: str | None = None) -> tuple[StoreLayout, StoreLocation]:
    """Where a writer's WAL lives (always this host's disk) and where compaction writes the tables.

    A local store keeps its WAL inside (``STORE/wal``, or ``wal``); for a bucket the tables go there
    and this host keeps only its WAL (``wal``, default ``./tracerl-wal``). Shared by the collector and
    the in-process exporter, so both write a bucket the same way."""
    out = parse_store(store)
    if out.is_local:
        layout = StoreLayout.at(store, wal=wal)
    else:
        local = Path(wal or DEFAULT_REMOTE_WAL).expanduser().resolve()
        layout = StoreLayout(local, wal_root=local)
    layout.root.mkdir(parents=True, exist_ok=True)
    return layout, out
