"""The collector process: receivers → WAL → compactor → Parquet, started and stopped as one.

Stop order is what makes "nothing acknowledged is lost" hold on a graceful stop: stop
accepting (in-flight RPCs finish and are acked only after their fsync), close the WAL
(sealing the open segment), then compact everything that is left. A kill -9 skips all of
this and loses nothing either: every ack followed an fsync, and the next start replays.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from collector_exporter.compactor import Compactor, backlog_bytes, drain, wal_and_store
from collector_exporter.grpc_server import start_grpc
from collector_exporter.http_server import start_http
from collector_exporter.receive import Ingest, retry_hint_s
from collector_exporter.wal import WriteAheadLog
from store.layout import StoreLayout

log = logging.getLogger("tracerl.collector")


def split_hostport(value: str, default_port: int) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` or ``HOST``; IPv6 as ``[::1]:4317``."""
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port = rest.lstrip(":")
    elif value.count(":") == 1:
        host, port = value.split(":")
    else:
        host, port = value, ""
    try:
        return host or "127.0.0.1", int(port) if port else default_port
    except ValueError:
        raise ValueError(f"bad address {value!r}: expected HOST:PORT, e.g. 127.0.0.1:4317") from None


@dataclass
class CollectorSettings:
    store: str  # a directory, or s3://bucket/prefix (the tables go there; the WAL stays local)
    wal: str | None = None  # the WAL's local directory (default: STORE/wal, or ./tracerl-wal for a remote store)
    grpc: str | None = "127.0.0.1:4317"
    http: str | None = "127.0.0.1:4318"
    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_segment_bytes: int = 32 << 20
    max_segment_age_s: float = 1.0
    max_backlog_bytes: int = 2 << 30
    min_free_disk_bytes: int = 512 << 20
    dedupe_keys: int = 1_000_000


class OverloadGuard:
    """Answers "should we refuse new data now?" from WAL backlog and free disk, re-measured at
    most every ``every_s`` so the check costs nothing on the hot path; and how long a refused
    client should wait (``retry_after_s``), from the backlog and the drain rate seen while refusing."""

    def __init__(self, store: StoreLayout, max_backlog: int, min_free: int, every_s: float = 0.5):
        self.store, self.max_backlog, self.min_free, self.every_s = store, max_backlog, min_free, every_s
        self._at = 0.0
        self._reason: str | None = None
        self._lock = threading.Lock()
        self._backlog = 0
        self._drain_bytes_per_s = 0.0
        self._refusing_since: float | None = None

    def __call__(self) -> str | None:
        now = time.monotonic()
        if now - self._at < self.every_s:
            return self._reason
        with self._lock:
            if now - self._at >= self.every_s:
                self._reason = self._measure(now)
                self._at = now
        return self._reason

    def retry_after_s(self) -> int:
        since = self._refusing_since
        return retry_hint_s(self._backlog, int(self.max_backlog * 0.9), self._drain_bytes_per_s,
                            0.0 if since is None else time.monotonic() - since)

    def _measure(self, now: float) -> str | None:
        backlog = backlog_bytes(self.store)
        if self._reason is not None and self._at:  # refusing: what left the backlog was drained
            rate = max(0.0, self._backlog - backlog) / max(now - self._at, 1e-3)
            self._drain_bytes_per_s = rate if not self._drain_bytes_per_s else 0.5 * (self._drain_bytes_per_s + rate)
        self._backlog = backlog
        reason = self._why_refuse(backlog)
        if reason is None:
            self._refusing_since, self._drain_bytes_per_s = None, 0.0
        elif self._refusing_since is None:
            self._refusing_since = now
        return reason

    def _why_refuse(self, backlog: int) -> str | None:
        if backlog > self.max_backlog:
            return f"WAL backlog {backlog >> 20} MiB exceeds {self.max_backlog >> 20} MiB; compaction is behind, retry"
        st = os.statvfs(self.store.wal_root or self.store.root)  # the disk the WAL fills
        free = st.f_bavail * st.f_frsize
        if free < self.min_free:
            return f"only {free >> 20} MiB free on the store's disk (minimum {self.min_free >> 20} MiB); retry later"
        return None


class Collector:
    def __init__(self, settings: CollectorSettings):
        self.settings = settings
        self.store, out = wal_and_store(settings.store, settings.wal)
        writer = f"collector-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.wal_dir = self.store.wal / writer
        self.compactor = Compactor(self.store, dedupe_keys=settings.dedupe_keys, out=out)
        self.wal = WriteAheadLog(
            self.wal_dir, max_segment_bytes=settings.max_segment_bytes, max_segment_age_s=settings.max_segment_age_s
        )
        guard = OverloadGuard(self.store, settings.max_backlog_bytes, settings.min_free_disk_bytes)
        self.ingest = Ingest(self.wal, guard, guard.retry_after_s)
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self._grpc = None
        self._http = None
        self._stopped = False

    def start(self) -> Collector:
        s = self.settings
        if s.grpc:
            tls = None
            if s.tls_cert and s.tls_key:
                tls = (Path(s.tls_key).read_bytes(), Path(s.tls_cert).read_bytes())
            self._grpc, self.grpc_port = start_grpc(self.ingest, s.grpc, token=s.token, tls=tls)
            self._grpc_host = split_hostport(s.grpc, 4317)[0]
        if s.http:
            host, port = split_hostport(s.http, 4318)
            tls = (s.tls_cert, s.tls_key) if s.tls_cert and s.tls_key else None
            self._http = start_http(self.ingest, host, port, token=s.token, tls=tls)
            self.http_port = self._http.port
            self._http_host = host
        self.compactor.start(own=self.wal_dir)
        return self

    @property
    def grpc_endpoint(self) -> str:
        scheme = "https" if self.settings.tls_cert else "http"
        return f"{scheme}://{self._grpc_host}:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        scheme = "https" if self.settings.tls_cert else "http"
        return f"{scheme}://{self._http_host}:{self.http_port}"

    def flush(self) -> None:
        """Make everything acknowledged so far visible in Parquet (seal + compact now)."""
        self.wal.seal()
        self.compactor.run_once(own=self.wal_dir)

    def stop(self, grace_s: float = 10.0) -> list[str]:
        """Stop gracefully; returns what could not be finished (empty on a clean stop).

        A non-empty list means acknowledged data is still only in the WAL (a full disk, an I/O
        error): it is kept there and the next start on this store compacts it; the caller
        should exit non-zero."""
        if self._stopped:
            return []
        self._stopped = True
        if self._http is not None:
            self._http.stop(grace_s)
        if self._grpc is not None:
            self._grpc.stop(grace_s).wait()
        return drain(self.wal, self.compactor, self.wal_dir)

