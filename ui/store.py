"""The viewer's one way into the store: ``store.views.connect_readonly``, reopened when files change.

The store is a ``StoreLocation`` (``store.location``): a local directory or ``s3://bucket/prefix``,
both reached through ``pyarrow.fs``, so every page reads a bucket as it reads a directory. Tables go
through ``connect_readonly``; the trainer's JSON state files (selections, checkpoint manifests) and the
quarantine through the location's file system.

``connect_readonly`` is what ``tracerl sql`` uses: views over the Parquet files, DuckDB's file
access switched off and its configuration locked, so nothing the viewer runs can write (or read
outside the store). Its views are bound to the files present when it opens, so to show rounds and
rollouts as ``collect`` and ``train --watch`` add them, the reader lists the tables' files when a
page asks (``refresh``) and reopens when the list (names, sizes, mtimes) changed: one recursive listing
per table, which on a bucket is a few LIST requests, not a request per file.

Each connection also gets ``ui_rollouts``: one in-memory row per rollout (the ``rollouts`` view's
columns plus what the pages need: the reward the trainer uses, completeness, token sources, the
last answer), computed once per store version. Every list page reads it instead of aggregating the
``transitions`` view (whose latest-conversion window touches every row) on each request. It lives
in the connection's memory only; the store is never written. A new version is built in a background
thread while pages keep answering from the previous one (a page waits for it up to ``wait_s``).

A DuckDB connection is not safe to share between threads: queries take turns on one lock (the
server runs them off its event loop, in ``run_blocking``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.fs as pafs

from schemas.tables import TABLES
from store.location import StoreLocation
from store.views import connect_readonly

log = logging.getLogger("tracerl.ui")

ROLLOUT_INDEX_SQL = """
CREATE TEMP TABLE ui_rollouts AS
SELECT rollout_id,
       any_value(task_id) AS task_id,
       max(rollout_reward) AS reward,
       coalesce(max(rollout_reward), sum(reward)) AS reward_used,
       bool_or(coalesce(is_last, false)) AS complete,
       count(*) AS n_calls,
       count(*) FILTER (WHERE trainable) AS n_trainable,
       list_sort(list_distinct(list(agent_name) FILTER (WHERE agent_name IS NOT NULL))) AS agents,
       min(policy_version) AS policy_version,
       coalesce(min(policy_version), 0) AS version,
       avg(CASE WHEN token_source IN ('gateway', 'span') THEN 1.0 ELSE 0.0 END) AS token_coverage,
       list_sort(list_distinct(list(token_source) FILTER (WHERE token_source IS NOT NULL))) AS token_sources,
       min(started_at) AS started_at,
       max(ended_at) AS ended_at,
       left(arg_max(response_message, step), 2000) AS last_response
FROM transitions
GROUP BY rollout_id
"""
"""One row per rollout: the ``rollouts`` view (schemas/views.py) plus ``reward_used`` and ``complete`` as
the trainer's dataset computes them (trainer/dataset.py TRANSITIONS_SQL), ``version`` (unversioned calls
count as 0, the trainer's default ``--unversioned-as``), the token sources, and the last call's answer."""


def store_signature(loc: StoreLocation) -> tuple:
    """(path, size, mtime) of every committed table file: changes whenever a stage commits one. One
    recursive ``get_file_info`` per table: a directory walk locally, a paginated LIST on a bucket."""
    out = []
    for name in TABLES:
        selector = pafs.FileSelector(loc.table(name), recursive=True, allow_not_found=True)
        for info in loc.fs.get_file_info(selector):
            if info.type == pafs.FileType.File and info.base_name.endswith(".parquet") \
                    and not info.base_name.startswith("."):
                out.append((info.path, info.size, info.mtime_ns))
    return tuple(sorted(out))


class StoreReader:
    """Read-only queries over one store, against its files as of the last ``refresh``."""

    def __init__(self, loc: StoreLocation):
        self.loc = loc
        self.store = self.loc.root if self.loc.is_local else self.loc.uri
        """The store as pages name it: the directory, or the URI as given."""
        self._lock = threading.Lock()  # held while a query uses the connection
        self._state = threading.Lock()  # guards the build in progress
        self._con: duckdb.DuckDBPyConnection | None = None
        self._signature: tuple | None = None
        self._building: threading.Thread | None = None
        self._memo: dict[str, tuple[int, Any]] = {}
        self.generation = 0
        """Bumped each time a newer version of the store is in use: what live pages poll."""

    def _open(self) -> duckdb.DuckDBPyConnection:
        con = connect_readonly(self.loc)
        con.execute(ROLLOUT_INDEX_SQL)
        return con

    def _build(self, signature: tuple) -> None:
        try:
            con: duckdb.DuckDBPyConnection | None = self._open()
        except Exception as e:  # a file replaced while opening: keep the last version, retry next refresh
            log.warning("tracerl ui: could not open the store's new files (%s); showing the previous version", e)
            con = None
        old = None
        with self._lock:
            if con is not None:
                old, self._con = self._con, con
                self._signature = signature
                self.generation += 1
        if old is not None:
            old.close()
        with self._state:
            self._building = None

    def refresh(self, wait_s: float | None = 0.0) -> int:
        """Start opening the store's current files if they changed; wait up to ``wait_s`` (None: until
        done) for it. Returns the generation in use."""
        with self._state:
            if self._building is None:
                try:
                    signature = store_signature(self.loc)
                except OSError as e:  # a listing racing a compaction, a bucket's network blip: retry next time
                    log.warning("tracerl ui: could not list the store's files (%s); showing the previous version", e)
                    signature = self._signature
                if signature != self._signature:
                    self._building = threading.Thread(target=self._build, args=(signature,),
                                                      name="tracerl-ui-open", daemon=True)
                    self._building.start()
            building = self._building
        if building is not None and (wait_s is None or wait_s > 0):
            building.join(wait_s)
        return self.generation

    @contextlib.contextmanager
    def connection(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """The current connection, held exclusively for the ``with`` block (opened on first use)."""
        if self._con is None:
            self.refresh(wait_s=None)
        with self._lock:
            if self._con is None:
                raise RuntimeError(f"cannot open the store at {self.store}; see the log for why")
            yield self._con

    def rows(self, sql: str, params: Any = None) -> list[dict[str, Any]]:
        """Run ``sql`` with ``params`` (a list or a dict of named parameters) and return dict rows."""
        with self.connection() as con:
            cur = con.execute(sql, params) if params is not None else con.execute(sql)
            cols = [d[0] for d in cur.description or []]
            return [dict(zip(cols, r)) for r in cur.fetchall()]

    def memo(self, key: str, compute: Any) -> Any:
        """``compute()``, kept until the store changes: for what depends only on the store's files and is
        dear to recompute on every request (the rounds' staleness reads every selection file)."""
        generation = self.generation
        hit = self._memo.get(key)
        if hit is not None and hit[0] == generation:
            return hit[1]
        value = compute()
        self._memo[key] = (generation, value)
        return value

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None

    def read_json(self, *parts: str) -> dict[str, Any] | None:
        """A JSON file the trainer wrote below the store (``read_json("checkpoints", "round-000003.json")``),
        read through the store's file system; None if absent or unreadable."""
        try:
            data = json.loads(self.loc.read_bytes(self.loc.path(*parts)))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None


def read_local_json(path: str | Path) -> dict[str, Any] | None:
    """A JSON file on this host's disk (a checkpoint the trainer keeps outside the store), or None."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
