"""Atomic, self-describing Parquet files: the only way tracerl writes a table file.

A reader never sees a half-written file (temp file in the same directory, fsync, rename),
and every file carries ``tracerl.schema_version`` and its table name in the metadata.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.tables import SCHEMA_VERSION, TABLES


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in ``path`` durable (the directory entry itself is fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_table_atomic(table: pa.Table, path: str | os.PathLike[str], table_name: str,
                       row_group_size: int | None = None) -> Path:
    """Write ``table`` to ``path`` atomically; the file either exists whole or not at all.

    The table is cast to the contract schema first so a stage cannot drift from ``schemas/``.
    Writing the same path again replaces the file, which makes replays idempotent.
    ``row_group_size``: rows per row group (default: pyarrow's, 1M); smaller groups let a reader that
    filters on a sorted column skip most of a file by the groups' min/max statistics.
    """
    schema = TABLES[table_name]
    table = table.select(schema.names).cast(schema)
    meta = dict(schema.metadata or {})
    meta.update({b"tracerl.schema_version": SCHEMA_VERSION.encode(), b"tracerl.table": table_name.encode()})
    table = table.replace_schema_metadata(meta)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as f:
            pq.write_table(table, f, compression="zstd", row_group_size=row_group_size)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)
    return path


def read_table(directory: str | os.PathLike[str], table_name: str) -> pa.Table:
    """Read every committed file of a table (temp files start with '.' and are ignored)."""
    directory = Path(directory)
    schema = TABLES[table_name]
    files = sorted(p for p in directory.rglob("*.parquet") if not p.name.startswith("."))
    if not files:
        return schema.empty_table()
    return pa.concat_tables([pq.read_table(p, schema=schema) for p in files])
