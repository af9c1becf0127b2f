"""``store/quarantine/``: acknowledged records the compactor could not turn into rows.

Nothing acknowledged is dropped silently: a record that cannot be converted (a bug, a field a
future version understands) is kept here with its reason and its original bytes, and counted by
``tracerl status``, while compaction moves on. One file per WAL segment
(``<writer>-<segment>.jsonl``, one JSON object per item), written atomically and named after the
segment, so a replay of the same segment rewrites the same file instead of counting twice.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from store.atomic import write_atomic
from store.location import StoreLocation


@dataclass(frozen=True)
class Quarantined:
    table: str  # spans | logs | rewards | unknown
    reason: str
    kind: int  # the WAL record kind
    received_at_ns: int
    payload: bytes  # a request holding just this item, in the WAL's encoding for its kind

    def to_json(self, writer: str, segment: str) -> str:
        return json.dumps(
            {
                "table": self.table,
                "reason": self.reason,
                "kind": self.kind,
                "received_at_ns": self.received_at_ns,
                "writer": writer,
                "segment": segment,
                "payload_b64": base64.b64encode(self.payload).decode(),
            }
        )


def quarantine_dir(store_root: Path) -> Path:
    return store_root / "quarantine"


def write_quarantine(store: StoreLocation, writer: str, segment: str, items: list[Quarantined]) -> str:
    """Write (or rewrite) the segment's quarantine file durably: temp file, fsync, rename, fsync dir."""
    path = store.path("quarantine", f"{writer}-{segment}.jsonl")
    write_atomic(path, "".join(item.to_json(writer, segment) + "\n" for item in items).encode("utf-8"), store.fs)
    return path


def quarantine_records(store: StoreLocation) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each quarantined item as (its file's name, its JSON object), newest file first, on local disk or
    in a bucket: what ``tracerl status`` counts and the viewer lists. A line that is not JSON (a file
    cut short by hand) is skipped; a file replaced or removed after the listing is skipped too."""
    selector = pafs.FileSelector(store.path("quarantine"), recursive=True, allow_not_found=True)
    infos = [i for i in store.fs.get_file_info(selector) if i.type == pafs.FileType.File
             and i.base_name.endswith(".jsonl") and not i.base_name.startswith(".")]
    for info in sorted(infos, key=lambda i: (i.mtime_ns or 0, i.path), reverse=True):
        data = b""
        with contextlib.suppress(FileNotFoundError):
            data = store.read_bytes(info.path)
        for line in data.decode("utf-8", errors="replace").splitlines():
            try:
                item = json.loads(line)
            except ValueError:
                continue
            if isinstance(item, dict):
                yield info.base_name, item


def quarantine_counts(store: StoreLocation) -> dict[str, int]:
    """Quarantined items per table (what ``tracerl status`` shows), on local disk or in a bucket."""
    return dict(Counter(item.get("table", "unknown") for _name, item in quarantine_records(store)))
