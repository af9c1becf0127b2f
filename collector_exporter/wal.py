"""Write-ahead log: what the receiver acknowledges is on disk (fsync) before the ack.

Layout: one directory per writer (a collector, or one SDK-exporter process), holding
``LOCK`` (flock held while the writer lives), ``seg-<n>.open`` (being appended) and
``seg-<n>.wal`` (sealed, waiting for compaction). A segment is sealed when it passes
``max_segment_bytes`` or ``max_segment_age_s``; the compactor turns sealed segments into
Parquet and deletes them. A writer that died leaves its directory unlocked; the next
compactor adopts it, truncates a torn tail, and replays it.

Record: ``<u32 len><u32 crc32><u8 kind><u64 received_at_ns><payload>``; ``len`` counts
kind + timestamp + payload, the CRC covers the same bytes.

Group commit: callers enqueue and block; one writer thread writes everything queued with a
single ``write`` + ``fdatasync`` and wakes them all, so fsync cost is shared by concurrent
requests (measured here: ~2 ms p50 per fdatasync).
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from schemas.parquet import fsync_dir

HEADER = struct.Struct("<IIBQ")
_CRC_OFFSET = 8  # crc covers bytes from kind onwards


class Kind(IntEnum):
    TRACES = 1  # serialized ExportTraceServiceRequest (only valid spans)
    LOGS = 2  # serialized ExportLogsServiceRequest
    REWARDS = 3  # JSON list of reward rows


@dataclass(frozen=True)
class Record:
    kind: Kind
    received_at_ns: int
    payload: bytes


class WalClosed(Exception):
    """Appending after close: the collector is shutting down; the client should retry elsewhere."""


def encode_record(kind: Kind, received_at_ns: int, payload: bytes) -> bytes:
    body = struct.pack("<BQ", kind, received_at_ns) + payload
    return struct.pack("<II", len(body), zlib.crc32(body)) + body


def read_records(path: Path) -> tuple[list[Record], int]:
    """All intact records of a segment, and the byte offset where intact data ends.

    A torn or corrupt tail (a crash mid-write) ends the segment: nothing after it was ever
    acknowledged, because the ack waits for the fsync that covers the whole record.
    """
    data = path.read_bytes()
    out: list[Record] = []
    pos = 0
    while pos + 8 <= len(data):
        length, crc = struct.unpack_from("<II", data, pos)
        end = pos + 8 + length
        if length < 9 or end > len(data):
            break
        body = data[pos + 8 : end]
        if zlib.crc32(body) != crc:
            break
        kind, ts = struct.unpack_from("<BQ", body, 0)
        out.append(Record(Kind(kind), ts, body[9:]))
        pos = end
    return out, pos


def segment_number(path: Path) -> int:
    return int(path.name.split("-", 1)[1].split(".", 1)[0])


def sealed_segments(wal_dir: Path) -> list[Path]:
    return sorted(wal_dir.glob("seg-*.wal"), key=segment_number)


def try_lock(wal_dir: Path) -> int | None:
    """Take the directory's writer lock; None when a live process holds it."""
    wal_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(wal_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def recover(wal_dir: Path) -> None:
    """Seal what a dead writer left open, cutting any torn tail. Caller holds the lock."""
    for path in sorted(wal_dir.glob("seg-*.open"), key=segment_number):
        _, good = read_records(path)
        if good == 0:
            path.unlink()
            continue
        if good != path.stat().st_size:
            with open(path, "r+b") as f:
                f.truncate(good)
                f.flush()
                os.fsync(f.fileno())
        os.replace(path, path.with_suffix(".wal"))
    fsync_dir(wal_dir)


class WriteAheadLog:
    """The durable append path. ``append`` returns only once the record is fsynced."""

    def __init__(self, wal_dir: Path, *, max_segment_bytes: int = 32 << 20, max_segment_age_s: float = 1.0):
        self.dir = Path(wal_dir)
        self.max_segment_bytes = max_segment_bytes
        self.max_segment_age_s = max_segment_age_s
        self._lock_fd = try_lock(self.dir)
        if self._lock_fd is None:
            raise RuntimeError(f"WAL directory {self.dir} is in use by another process")
        recover(self.dir)
        existing = [segment_number(p) for p in self.dir.glob("seg-*.*") if p.suffix in (".wal", ".open")]
        self._next_segment = max(existing, default=0) + 1
        self._cv = threading.Condition()
        self._queue: list[bytes] = []
        self._queued_seq = 0  # sequence number of the last queued record
        self._durable_seq = 0  # every record up to this one is fsynced
        self._error: BaseException | None = None
        self._closed = False
        self._seal_requested = False
        self._fd: int | None = None
        self._seg_path: Path | None = None
        self._seg_bytes = 0
        self._seg_opened = 0.0
        self.bytes_written = 0
        self._thread = threading.Thread(target=self._run, name="tracerl-wal", daemon=True)
        self._thread.start()

    # -- producer side -------------------------------------------------------------------
    def append(self, kind: Kind, payload: bytes, received_at_ns: int | None = None) -> None:
        rec = encode_record(kind, received_at_ns or time.time_ns(), payload)
        with self._cv:
            if self._closed:
                raise WalClosed("the collector is shutting down")
            self._queue.append(rec)
            self._queued_seq += 1
            seq = self._queued_seq
            self._cv.notify_all()
            while self._durable_seq < seq and self._error is None:
                self._cv.wait()
            if self._error is not None and self._durable_seq < seq:
                raise OSError(f"write-ahead log failed: {self._error}") from self._error

    def seal(self) -> None:
        """Seal the open segment now (e.g. before a compaction pass on shutdown)."""
        with self._cv:
            self._seal_requested = True
            self._cv.notify_all()
            while self._seal_requested and self._error is None and self._thread.is_alive():
                self._cv.wait(0.05)

    def close(self) -> None:
        """Drain the queue, seal the open segment, release the lock."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- the writer thread ---------------------------------------------------------------
    def _open_segment(self) -> None:
        self._seg_path = self.dir / f"seg-{self._next_segment:012d}.open"
        self._next_segment += 1
        self._fd = os.open(self._seg_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        fsync_dir(self.dir)
        self._seg_bytes = 0
        self._seg_opened = time.monotonic()

    def _seal_segment(self) -> None:
        if self._fd is None or self._seg_path is None:
            return
        os.close(self._fd)
        self._fd = None
        if self._seg_bytes:
            os.replace(self._seg_path, self._seg_path.with_suffix(".wal"))
        else:
            self._seg_path.unlink()
        fsync_dir(self.dir)
        self._seg_path = None

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._queue and not self._closed and not self._seal_requested:
                        timeout = None
                        if self._fd is not None and self._seg_bytes:
                            timeout = max(0.0, self._seg_opened + self.max_segment_age_s - time.monotonic())
                            if timeout == 0.0:
                                break
                        self._cv.wait(timeout)
                    batch, self._queue = self._queue, []
                    last_seq = self._queued_seq
                    closing = self._closed
                    seal_now = self._seal_requested
                if batch:
                    if self._fd is None:
                        self._open_segment()
                    data = b"".join(batch)
                    os.write(self._fd, data)
                    os.fdatasync(self._fd)
                    self._seg_bytes += len(data)
                    self.bytes_written += len(data)
                    with self._cv:
                        self._durable_seq = last_seq
                        self._cv.notify_all()
                age = time.monotonic() - self._seg_opened
                if self._fd is not None and (
                    closing or seal_now or self._seg_bytes >= self.max_segment_bytes
                    or (self._seg_bytes and age >= self.max_segment_age_s)
                ):
                    self._seal_segment()
                if seal_now:
                    with self._cv:
                        self._seal_requested = False
                        self._cv.notify_all()
                if closing and not batch:
                    self._seal_segment()
                    return
        except BaseException as e:  # disk full, I/O error: fail every waiter loudly, never ack
            with self._cv:
                self._error = e
                self._cv.notify_all()


def iter_wal_dirs(root: Path) -> Iterator[Path]:
    """Every writer directory under the store's ``wal/``."""
    if root.exists():
        yield from sorted(p for p in root.iterdir() if p.is_dir())
