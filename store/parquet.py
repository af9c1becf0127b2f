"""Self-describing Parquet files, written through the one atomic writer (store/atomic.py).

Every file carries ``tracerl.schema_version`` and its table name in the metadata, and is cast to the
contract schema of ``schemas/`` first, so a stage cannot drift from it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from schemas.tables import SCHEMA_VERSION, TABLES
from store.atomic import write_atomic


def contract_table(table: pa.Table, table_name: str) -> pa.Table:
    """``table`` cast to its contract schema, with the schema version and table name in its metadata."""
    schema = TABLES[table_name]
    table = table.select(schema.names).cast(schema)
    meta = dict(schema.metadata or {})
    meta.update({b"tracerl.schema_version": SCHEMA_VERSION.encode(), b"tracerl.table": table_name.encode()})
    return table.replace_schema_metadata(meta)


def write_table_atomic(table: pa.Table, path: str | os.PathLike[str], table_name: str,
                       row_group_size: int | None = None, fs: pafs.FileSystem | None = None) -> Path | str:
    """Write ``table`` to ``path`` (on ``fs``; local disk when None) atomically; returns the path.

    Writing the same path again replaces the file, which makes replays idempotent.
    ``row_group_size``: rows per row group (default: pyarrow's, 1M); smaller groups let a reader that
    filters on a sorted column skip most of a file by the groups' min/max statistics.
    """
    table = contract_table(table, table_name)
    write_atomic(path, lambda f: pq.write_table(table, f, compression="zstd", row_group_size=row_group_size), fs)
    return Path(path) if fs is None or isinstance(fs, pafs.LocalFileSystem) else os.fspath(path)


def read_table(directory: str | os.PathLike[str], table_name: str, fs: pafs.FileSystem | None = None) -> pa.Table:
    """Read every committed file of a table (temp files start with '.' and are ignored); ``fs``: the
    store's file system when it is not local disk (``StoreLocation.fs``, with ``directory`` a path on it)."""
    schema = TABLES[table_name]
    if fs is None or isinstance(fs, pafs.LocalFileSystem):
        local = Path(directory)
        files = [str(p) for p in sorted(local.rglob("*.parquet")) if not p.name.startswith(".")]
        fs = None
    else:
        selector = pafs.FileSelector(os.fspath(directory), recursive=True, allow_not_found=True)
        files = sorted(i.path for i in fs.get_file_info(selector) if i.type == pafs.FileType.File
                       and i.path.endswith(".parquet") and not i.base_name.startswith("."))
    if not files:
        return schema.empty_table()
    return pa.concat_tables([pq.read_table(p, schema=schema, filesystem=fs) for p in files])
