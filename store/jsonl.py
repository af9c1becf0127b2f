"""Append-only JSON-lines records (the rollout driver's ``STORE/rollouts/``), on local disk or a bucket.

A writer that appends a line per finished unit of work wants each line kept the moment it is
written, so a writer killed midway leaves the finished lines behind. Local disk gets exactly that:
one file opened for appending, flushed after each line. Object storage has no append, so there
each ``append`` rewrites the current object whole through the one atomic writer
(``store/atomic.py``): a reader sees the lines up to some append, never a torn one. To bound what
each rewrite uploads, a file of ``part_lines`` lines is closed and the next lines go to the next
part, ``<stem>.<n>.jsonl``; readers list ``*.jsonl`` and read them all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from store.atomic import write_atomic
from store.location import StoreLocation

PART_LINES = 256
"""Lines per object on object storage: each append uploads at most this many lines."""


class JsonLines:
    """``append(record)`` writes one JSON line to ``STORE/<table>/<stem>.jsonl``; ``close()`` when done."""

    def __init__(self, loc: StoreLocation, table: str, stem: str, *, part_lines: int = PART_LINES):
        self.loc, self.table, self.stem, self.part_lines = loc, table, stem, part_lines
        self.path = loc.path(table, f"{stem}.jsonl")
        """The first (locally: the only) file: what a summary names."""
        self._file: IO[str] | None = None
        self._lines: list[str] = []
        self._part = 0
        if loc.is_local:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        else:
            write_atomic(self.path, b"", loc.fs)  # the run's file exists from its start, as on disk

    def _part_path(self) -> str:
        return self.path if self._part == 0 else self.loc.path(self.table, f"{self.stem}.{self._part}.jsonl")

    def append(self, record: dict[str, Any]) -> None:
        """Keep ``record`` as one line now (flushed locally; the object re-uploaded on a bucket)."""
        line = json.dumps(record, ensure_ascii=False) + "\n"
        if self._file is not None:
            self._file.write(line)
            self._file.flush()
            return
        if len(self._lines) == self.part_lines:
            self._part, self._lines = self._part + 1, []
        self._lines.append(line)
        write_atomic(self._part_path(), "".join(self._lines).encode(), self.loc.fs)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> JsonLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
