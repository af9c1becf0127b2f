"""DuckDB views over a store, local or in object storage.

Two entry points, one set of view definitions (``schemas/views.py``):
- ``view_sql(store)`` is plain SQL (``read_parquet(..., hive_partitioning=true)``) for users
  running their own DuckDB (on an ``s3://`` store, with DuckDB's own httpfs and credentials).
- ``connect_readonly(store)`` lists each table's Parquet files through ``pyarrow.fs`` and backs the
  views with pyarrow datasets on that file system, so DuckDB reads a bucket with no extension to
  download at run time; then it switches off DuckDB's file access and locks the configuration, so
  ``tracerl sql`` cannot write, attach or read anything outside the store, whatever the query says.
"""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds

from schemas.tables import PARTITION_SCHEMA, TABLES
from schemas.views import DERIVED_VIEWS, LATEST_ONLY
from store.location import StoreLocation


def view_sql(loc: StoreLocation) -> str:
    """The CREATE VIEW statements for an external DuckDB session over this store."""
    scheme = "" if loc.is_local else loc.uri.split("://", 1)[0] + "://"
    out = []
    for name in TABLES:
        glob = f"{scheme}{loc.table(name)}/**/*.parquet"
        out.append(
            f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM read_parquet('{glob}', "
            f"hive_partitioning=true, union_by_name=true) {LATEST_ONLY.get(name, '')};"
        )
    out += [f"CREATE OR REPLACE VIEW {name} AS {sql};" for name, sql in DERIVED_VIEWS.items()]
    return "\n".join(out)


def connect_readonly(loc: StoreLocation, since: float | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with one view per table (empty when the table has no files yet).

    ``since`` (epoch seconds): the views read only the files written then or later, for a question about
    rows stored since (the loop's look at a batch still arriving: over every file of a store 14 rounds
    old each look took seconds, over the batch's own files a fraction of one)."""
    con = duckdb.connect(":memory:")
    for name, schema in TABLES.items():
        files = loc.files(name, since=since)
        full = pa.unify_schemas([schema, PARTITION_SCHEMA])
        if files:
            data = ds.dataset(
                files,
                schema=full,
                format="parquet",
                filesystem=loc.fs,
                partitioning=ds.partitioning(PARTITION_SCHEMA, flavor="hive"),
                partition_base_dir=loc.table(name),
            )
        else:
            data = full.empty_table()
        con.register(f"_{name}_data", data)
        con.execute(f"CREATE VIEW {name} AS SELECT * FROM _{name}_data {LATEST_ONLY.get(name, '')}")
    for name, sql in DERIVED_VIEWS.items():
        con.execute(f"CREATE VIEW {name} AS {sql}")
    # DuckDB keeps its spill directory (temp_directory, default '<cwd>/.tmp') readable and writable
    # even with external access off, so a query could COPY into or read from it: no spill directory.
    con.execute("SET temp_directory = ''")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con
