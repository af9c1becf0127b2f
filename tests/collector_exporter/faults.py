"""Fault injection at the OS-call boundary, for the capture path's failure tests.

Replaces ``os.write``, ``os.fsync``, ``os.fdatasync``, ``os.replace`` and
``pyarrow.parquet.write_table`` with wrappers that fail (ENOSPC, EIO, or a short write followed
by ENOSPC, as a filling disk does) only for files whose path contains a given fragment
(``/wal/``, ``/spans/``), so the rest of the process (sockets, pytest's own output) is untouched.
The calls are the real ones in every other case; clearing a fault restores normal service
without restarting anything, which is what the tests check the collector survives.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass

import pyarrow.parquet as pq
import pytest


@dataclass
class Rule:
    op: str  # write | fsync | replace | parquet
    where: str  # path fragment the call must touch
    err: int = errno.ENOSPC
    short: bool = False  # write: write half and return, then fail the continuation
    hits: int = 0


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


class Faults:
    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.rules: list[Rule] = []
        self._lock = threading.Lock()
        self._short_pending: set[int] = set()
        real_write, real_fsync, real_fdatasync = os.write, os.fsync, os.fdatasync
        real_replace, real_write_table = os.replace, pq.write_table

        def write(fd, data):
            rule = self._match("write", _fd_path(fd))
            if rule is None:
                return real_write(fd, data)
            if rule.short:
                with self._lock:
                    if fd not in self._short_pending and len(data) > 1:
                        self._short_pending.add(fd)
                        return real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(rule.err, os.strerror(rule.err))

        def fsync_like(real):
            def call(fd):
                rule = self._match("fsync", _fd_path(fd))
                if rule is not None:
                    raise OSError(rule.err, os.strerror(rule.err))
                return real(fd)

            return call

        def replace(src, dst, *a, **kw):
            rule = self._match("replace", os.fspath(src))
            if rule is not None:
                raise OSError(rule.err, os.strerror(rule.err))
            return real_replace(src, dst, *a, **kw)

        def write_table(table, where, *a, **kw):
            rule = self._match("parquet", getattr(where, "name", str(where)))
            if rule is not None:
                raise OSError(rule.err, os.strerror(rule.err))
            return real_write_table(table, where, *a, **kw)

        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "fsync", fsync_like(real_fsync))
        monkeypatch.setattr(os, "fdatasync", fsync_like(real_fdatasync))
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(pq, "write_table", write_table)

    def _match(self, op: str, path: str) -> Rule | None:
        with self._lock:
            for rule in self.rules:
                if rule.op == op and rule.where in path:
                    rule.hits += 1
                    return rule
        return None

    def inject(self, op: str, where: str, err: int = errno.ENOSPC, *, short: bool = False) -> Rule:
        rule = Rule(op, where, err, short)
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()
            self._short_pending.clear()
