"""The rounds manifest and the selections, on the store: what every trainer, `tracerl promote`, `report`
and `ui` read, and only the round protocol (``trainer/rounds.py``) writes.

- ``rounds/date=.../round-<k>.parquet``: one row per round (ROUNDS_SCHEMA), rewritten as its status
  advances (``started`` -> ``trained`` -> ``published`` or ``canary`` -> ``promoted``/``rolled_back``);
- ``checkpoints/round-<k>.json``: round k's selection (which rollouts and calls), written before it
  trains, so a rerun trains on exactly those and no later round trains on them again;
- the training lock (``store/lease.py``): one trainer at a time per store.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa

from schemas.tables import ROUNDS_SCHEMA
from store.lease import TRAINER_LOCK, Held, hold
from store.location import StoreLocation
from store.parquet import read_table, write_table_atomic

DONE = ("trained", "published", "canary", "promoted", "rolled_back")
"""Statuses of a round whose checkpoint exists."""


def now_utc() -> datetime:
    """The trainer's clock (the feedback window, the manifest's times)."""
    return datetime.now(timezone.utc)


def selection_path(loc: StoreLocation, k: int) -> str:
    """Round k's selection file, a path on the store's file system."""
    return loc.path("checkpoints", f"round-{k:06d}.json")


def read_selection(loc: StoreLocation, k: int) -> dict[str, Any] | None:
    """Round k's recorded selection, or None when no run of round k got that far."""
    path = selection_path(loc, k)
    return json.loads(loc.read_bytes(path)) if loc.is_file(path) else None


def read_rounds(loc: StoreLocation) -> dict[int, dict[str, Any]]:
    """The manifest: one row per round (each round's file is rewritten as its status advances); read
    through the store's file system, so ``tracerl report`` also reads a bucket."""
    rows = read_table(loc.table("rounds"), "rounds", loc.fs).to_pylist()
    return {r["round"]: r for r in sorted(rows, key=lambda r: r["round"])}


def start_version(rounds: dict[int, dict[str, Any]], k: int) -> int:
    """The version round k starts from and trains on: k, unless round k-1's policy@k was rolled back,
    then the version that kept serving (what round k-1 started from), never rolled-back weights."""
    prev = rounds.get(k - 1)
    if prev is None or prev["status"] != "rolled_back":
        return k
    p = prev.get("parent_version")
    return k - 1 if p is None else int(p)


def write_round(loc: StoreLocation, row: dict[str, Any]) -> Path | str:
    """Write (or replace) the manifest row of ``row['round']`` atomically, in its first date partition."""
    name = f"round-{row['round']:06d}.parquet"
    existing = [f for f in loc.files("rounds") if f.rsplit("/", 1)[-1] == name]
    path = existing[0] if existing else loc.path("rounds", f"date={now_utc().strftime('%Y-%m-%d')}", name)
    return write_table_atomic(pa.Table.from_pylist([row], schema=ROUNDS_SCHEMA), path, "rounds", fs=loc.fs)


@contextlib.contextmanager
def train_lock(loc: StoreLocation) -> Iterator[Held | None]:
    """The store's training lock, tried once (cron-safe): a ``Held`` (``confirm()`` before each state write),
    or None when another trainer holds it. ``flock`` locally, released by the OS if we die; a lease
    object on a bucket, taken over once a dead holder's expires (``store/lease.py``)."""
    stack = contextlib.ExitStack()
    try:
        held = stack.enter_context(hold(loc, TRAINER_LOCK, wait_s=0))
    except TimeoutError:
        yield None
        return
    with stack:
        yield held


def used_rollouts(loc: StoreLocation, before: int) -> set[str]:
    """Rollouts already consumed by rounds < ``before``."""
    used: set[str] = set()
    for k in range(before):
        sel = read_selection(loc, k)
        if sel is not None:
            used.update(sel["rollout_ids"])
    return used
