"""The viewer's one way into the store: ``schemas.views.connect_readonly``, reopened when files change.

``connect_readonly`` is what ``tracerl sql`` uses: views over the Parquet files, DuckDB's file
access switched off and its configuration locked, so nothing the viewer runs can write (or read
outside the store). Its views are bound to the files present when it opens, so to show rounds and
rollouts as ``collect`` and ``train --watch`` add them, the reader lists the tables' files at most
every ``refresh_s`` and reopens when the list (names, sizes, mtimes) changed. A DuckDB connection is
not safe to share between threads: queries take turns on one lock (the server runs them off its
event loop, in ``run_blocking``).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb

from schemas.store import StoreLayout
from schemas.tables import TABLES
from schemas.views import connect_readonly


def store_signature(layout: StoreLayout) -> tuple:
    """(path, size, mtime) of every committed table file: changes whenever a stage commits one."""
    out = []
    for name in TABLES:
        root = layout.table(name)
        if not root.exists():
            continue
        for dirpath, _dirs, files in os.walk(root):
            for f in files:
                if f.endswith(".parquet") and not f.startswith("."):
                    with contextlib.suppress(FileNotFoundError):  # replaced or compacted meanwhile
                        st = os.stat(os.path.join(dirpath, f))
                        out.append((dirpath, f, st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))


class StoreReader:
    """Read-only queries over one store, always against its current files (within ``refresh_s``)."""

    def __init__(self, store: str | os.PathLike[str], refresh_s: float = 1.0):
        self.layout = StoreLayout.at(store)
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._con: duckdb.DuckDBPyConnection | None = None
        self._signature: tuple | None = None
        self._checked = 0.0
        self.generation = 0
        """Bumped each time the store's files change: a cheap "is there anything new" for pollers."""

    def _current(self) -> duckdb.DuckDBPyConnection:
        now = time.monotonic()
        if self._con is not None and now - self._checked < self.refresh_s:
            return self._con
        self._checked = now
        sig = store_signature(self.layout)
        if self._con is None or sig != self._signature:
            if self._con is not None:
                self._con.close()
            self._con = connect_readonly(str(self.layout.root))
            self._signature = sig
            self.generation += 1
        return self._con

    @contextlib.contextmanager
    def connection(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """The current connection, held exclusively for the ``with`` block."""
        with self._lock:
            yield self._current()

    def rows(self, sql: str, params: Any = None) -> list[dict[str, Any]]:
        """Run ``sql`` with ``params`` (a list or a dict of named parameters) and return dict rows."""
        with self.connection() as con:
            cur = con.execute(sql, params) if params is not None else con.execute(sql)
            cols = [d[0] for d in cur.description or []]
            return [dict(zip(cols, r)) for r in cur.fetchall()]

    def refresh(self) -> int:
        """Look for new files now (not waiting for ``refresh_s``); returns the generation."""
        with self._lock:
            self._checked = 0.0
            self._current()
            return self.generation

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None

    def read_json(self, path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """A JSON file the trainer wrote (checkpoint manifest, round selection), or None if absent or
        unreadable. Only files inside the store, or a checkpoint the manifest names, are read."""
        try:
            return json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return None
