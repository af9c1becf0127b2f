"""DuckDB views over the store.

Two entry points, one set of view definitions:
- ``view_sql(store)`` is plain SQL (``read_parquet(..., hive_partitioning=true)``) for users
  running their own DuckDB.
- ``connect_readonly(store)`` backs the same views with pyarrow datasets, then switches off
  DuckDB's file access and locks the configuration, so ``tracerl sql`` cannot write, attach
  or read anything outside the store, whatever the query says.
"""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds

from schemas.tables import PARTITION_SCHEMA, TABLES
from store.layout import StoreLayout

# Derived views, defined over the base table views; stages add theirs here so that the SQL
# users see in the README, `tracerl sql` and the trainer are the same text.
DERIVED_VIEWS: dict[str, str] = {
    # span_to_transition: one row per converted rollout (see span_to_transition/README.md).
    "rollouts": """
        SELECT rollout_id,
               any_value(task_id) AS task_id,
               max(rollout_reward) AS reward,
               any_value(reward_source) AS reward_source,
               count(*) AS n_calls,
               count(*) FILTER (WHERE trainable) AS n_trainable,
               list_sort(list_distinct(list(agent_name) FILTER (WHERE agent_name IS NOT NULL))) AS agents,
               min(policy_version) AS policy_version,
               max(policy_version) AS max_policy_version,
               avg(CASE WHEN token_source IN ('gateway', 'span') THEN 1.0 ELSE 0.0 END) AS token_coverage,
               min(started_at) AS started_at,
               max(ended_at) AS ended_at
        FROM transitions
        GROUP BY rollout_id
    """,
}


LATEST_ONLY: dict[str, str] = {
    # span_to_transition: a rollout converted again (a late reward, --rebuild) keeps its older rows in
    # older files until they are compacted; only its latest conversion is visible
    "transitions": "QUALIFY conversion IS NOT DISTINCT FROM max(conversion) OVER (PARTITION BY rollout_id)",
}
"""Base tables whose rows can be superseded, and the clause that hides the superseded ones."""


def _files(layout: StoreLayout, table: str) -> list[str]:
    root = layout.table(table)
    if not root.exists():
        return []
    return sorted(str(p) for p in root.rglob("*.parquet") if not p.name.startswith("."))


def view_sql(store: str) -> str:
    """The CREATE VIEW statements for an external DuckDB session over this store."""
    layout = StoreLayout.at(store)
    out = []
    for name in TABLES:
        glob = f"{layout.table(name)}/**/*.parquet"
        out.append(
            f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM read_parquet('{glob}', "
            f"hive_partitioning=true, union_by_name=true) {LATEST_ONLY.get(name, '')};"
        )
    out += [f"CREATE OR REPLACE VIEW {name} AS {sql};" for name, sql in DERIVED_VIEWS.items()]
    return "\n".join(out)


def connect_readonly(store: str) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with one view per table (empty when the table has no files yet)."""
    layout = StoreLayout.at(store)
    con = duckdb.connect(":memory:")
    for name, schema in TABLES.items():
        files = _files(layout, name)
        full = pa.unify_schemas([schema, PARTITION_SCHEMA])
        if files:
            data = ds.dataset(
                files,
                schema=full,
                format="parquet",
                partitioning=ds.partitioning(PARTITION_SCHEMA, flavor="hive"),
                partition_base_dir=str(layout.table(name)),
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
