"""Where each table lives inside a store directory (DESIGN.md "The CLI")."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from store.location import StoreLocation, is_uri, parse_store

DEFAULT_STORE = "./tracerl-store"


def default_store() -> str:
    """``TRACERL_STORE`` when set, else ``./tracerl-store``: every command takes ``--store`` with this default."""
    return os.environ.get("TRACERL_STORE", DEFAULT_STORE)


@dataclass(frozen=True)
class StoreLayout:
    """The local directories of a store; with ``wal_root``, the WAL lives there instead of ``root/wal``."""

    root: Path
    wal_root: Path | None = None

    @classmethod
    def at(cls, root: str | os.PathLike[str], wal: str | os.PathLike[str] | None = None) -> StoreLayout:
        """A local store; ``s3://…`` is refused here, since a stage that walks ``Path``s cannot use it."""
        if is_uri(root) and not os.fspath(root).startswith("file://"):
            raise ValueError(f"{os.fspath(root)} is not a local directory; this command needs a local --store "
                             "(collect, convert, train, sql, status, doctor, report, ui and rollout take s3://bucket/prefix)")
        return cls(Path(root).expanduser().resolve(), Path(wal).expanduser().resolve() if wal else None)

    def table(self, name: str) -> Path:
        """Directory of a hive-partitioned table: spans, logs, rewards, transitions, rounds."""
        return self.root / name

    @property
    def wal(self) -> Path:
        """Where each writer's write-ahead log directory lives: always local disk."""
        return self.wal_root or self.root / "wal"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def partition(self, table: str, date: str) -> Path:
        return self.table(table) / f"date={date}"

    @property
    def location(self) -> StoreLocation:
        """The same store as a ``pyarrow.fs`` location (what code that also runs on a bucket takes)."""
        return parse_store(self.root)
