"""Reading the store's tables for a conversion pass: which files a table holds, how the ledger names them,
their rows (with the file each came from), and every rollout's completion inputs.

Read-only and free of what a pass decides (``store.py`` decides; ``survey.py`` reads the same way to tell
what the next pass would do). Every read goes through ``StoreLocation``'s file system, so a local
directory and an ``s3://`` prefix read alike.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from span_to_transition.tree import END_MARKER, RolloutStatus
from store.location import StoreLocation


def table_files(loc: StoreLocation, table: str) -> list[str]:
    """The Parquet files of one table (files being written, named ``.*``, are not yet part of it)."""
    return loc.files(table)


def relative(layout: StoreLocation, table: str, path: str) -> str:
    """``path`` relative to its table's directory: how the ledger names span and reward files."""
    return path[len(layout.table(table)) + 1 :]


def read_files(
    layout: StoreLocation,
    files: list[str],
    schema: pa.Schema,
    columns: list[str] | None = None,
    filter: pc.Expression | None = None,
) -> pa.Table:
    if not files:
        return schema.empty_table() if columns is None else schema.empty_table().select(columns)
    dataset = ds.dataset(files, schema=schema, format="parquet", filesystem=layout.fs)
    return dataset.to_table(columns=columns, filter=filter)


def read_numbered(layout: StoreLocation, files: list[str], schema: pa.Schema) -> pa.Table:
    """Every row of ``files``, with ``_file``: the index in ``files`` of the file it came from."""
    parts = [schema.empty_table().append_column("_file", pa.array([], pa.int32()))]
    for i, f in enumerate(files):
        t = pq.read_table(f, schema=schema, filesystem=layout.fs)
        parts.append(t.append_column("_file", pa.array(np.full(len(t), i, dtype=np.int32))))
    return pa.concat_tables(parts)


def rollout_statuses(table: pa.Table) -> dict[str, RolloutStatus]:
    """Per-rollout completion inputs, computed with Arrow group-bys (no per-span Python)."""
    marker = pc.fill_null(
        pc.equal(pc.map_lookup(table.column("attributes"), END_MARKER, "first"), "true"), False
    )
    t = pa.table(
        {
            "rollout_id": pc.coalesce(table.column("rollout_id"), table.column("trace_id")),
            "trace_id": table.column("trace_id"),
            "is_root": pc.is_null(table.column("parent_span_id")),
            "rx": pc.cast(table.column("received_at"), pa.int64()),
            "marker": marker,
        }
    )
    per_trace = t.group_by(["rollout_id", "trace_id"]).aggregate(
        [("is_root", "any"), ("rx", "max"), ("marker", "any")]
    )
    per_rollout = per_trace.group_by("rollout_id").aggregate(
        [("trace_id", "count"), ("is_root_any", "sum"), ("rx_max", "max"), ("marker_any", "any")]
    )
    d = per_rollout.to_pydict()
    return {
        r: RolloutStatus(r, n, int(k or 0), rx, bool(m))
        for r, n, k, rx, m in zip(
            d["rollout_id"], d["trace_id_count"], d["is_root_any_sum"], d["rx_max_max"], d["marker_any_any"]
        )
    }
