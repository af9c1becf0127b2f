"""``store/quarantine/``: acknowledged records the compactor could not turn into rows.

Nothing acknowledged is dropped silently: a record that cannot be converted (a bug, a field a
future version understands) is kept here with its reason and its original bytes, and counted by
``tracerl status``, while compaction moves on. One file per WAL segment
(``<writer>-<segment>.jsonl``, one JSON object per item), written atomically and named after the
segment, so a replay of the same segment rewrites the same file instead of counting twice.
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from schemas.parquet import fsync_dir


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


def write_quarantine(store_root: Path, writer: str, segment: str, items: list[Quarantined]) -> Path:
    """Write (or rewrite) the segment's quarantine file durably: temp file, fsync, rename, fsync dir."""
    d = quarantine_dir(store_root)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{writer}-{segment}.jsonl"
    tmp = d / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(item.to_json(writer, segment) + "\n" for item in items)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(d)
    return path


def quarantine_counts(store_root: Path) -> dict[str, int]:
    """Quarantined items per table (what ``tracerl status`` shows)."""
    counts: Counter[str] = Counter()
    d = quarantine_dir(store_root)
    if d.exists():
        for path in d.glob("*.jsonl"):
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    counts[json.loads(line).get("table", "unknown")] += 1
    return dict(counts)
