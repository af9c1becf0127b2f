"""Where each table lives inside a store directory (DESIGN.md "The CLI")."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_STORE = "./tracerl-store"


def default_store() -> str:
    """``TRACERL_STORE`` when set, else ``./tracerl-store``: every command takes ``--store`` with this default."""
    return os.environ.get("TRACERL_STORE", DEFAULT_STORE)


@dataclass(frozen=True)
class StoreLayout:
    root: Path

    @classmethod
    def at(cls, root: str | os.PathLike[str]) -> StoreLayout:
        return cls(Path(root).expanduser().resolve())

    def table(self, name: str) -> Path:
        """Directory of a hive-partitioned table: spans, logs, rewards, transitions, rounds."""
        return self.root / name

    @property
    def wal(self) -> Path:
        return self.root / "wal"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def partition(self, table: str, date: str) -> Path:
        return self.table(table) / f"date={date}"
