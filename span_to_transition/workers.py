"""Convert a batch of complete rollouts: records per rollout through ``convert_rollout``, in-process
or in worker processes, each chunk handed to a sink (written to the store where it was converted)."""

from __future__ import annotations

import datetime
import gc
import hashlib
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from span_to_transition.columnar import SPAN_COLUMNS, materialize, transitions_table
from span_to_transition.convert import ConvertConfig, RolloutInput, RolloutOutput, convert_rollout
from span_to_transition.records import LogEvent, Reward, Transition
from store.location import StoreLocation
from store.parquet import write_table_atomic

PARALLEL_MIN_ROLLOUTS = 2000
"""Below this many ready rollouts, conversion stays in-process (worker start-up costs more)."""
BATCH_ROLLOUTS = 10_000
"""Rollouts converted per batch (in-process) or per chunk (workers), bounding memory and working set."""


def convert_table(
    sel: pa.Table,
    logs: list[LogEvent],
    rewards_by: dict[str, list[Reward]],
    config: ConvertConfig,
    timed_out: frozenset[str] = frozenset(),
) -> tuple[pa.Table, list[RolloutOutput]]:
    """Convert the spans of complete rollouts (``sel``, any row order) into a transitions table.

    ``timed_out``: the rollouts complete only because --max-wait-s passed without their root span.
    The returned outputs carry statuses and counts; their transitions are already in the table.
    """
    gc_was_enabled = gc.isenabled()
    gc.disable()  # millions of short-lived acyclic records: the cycle collector only costs time here
    try:
        return _convert_table(sel, logs, rewards_by, config, timed_out)
    finally:
        if gc_was_enabled:
            gc.enable()


def _convert_table(
    sel: pa.Table,
    logs: list[LogEvent],
    rewards_by: dict[str, list[Reward]],
    config: ConvertConfig,
    timed_out: frozenset[str],
) -> tuple[pa.Table, list[RolloutOutput]]:
    records, duplicates = materialize(sel, config.attribute_keys())
    logs_by_trace: dict[str, list[LogEvent]] = {}
    for e in logs:
        logs_by_trace.setdefault(e.trace_id or "", []).append(e)
    outputs: list[RolloutOutput] = []
    rows: list[Transition] = []
    start = 0
    for i in range(1, len(records) + 1):
        if i < len(records) and records[i].rollout_id == records[start].rollout_id:
            continue
        group = records[start:i]
        rid = group[0].rollout_id or group[0].trace_id
        traces = sorted({s.trace_id for s in group})
        rws = list(rewards_by.get(rid, []))
        for t_id in traces:
            rws += rewards_by.get(f"trace:{t_id}", [])
        lg = [e for t_id in traces for e in logs_by_trace.get(t_id, [])]
        out = convert_rollout(RolloutInput(rid, group, lg, rws, rid in timed_out), config)
        rows.extend(out.transitions)
        out.transitions = []
        outputs.append(out)
        start = i
    if outputs:
        outputs[0].duplicates += duplicates  # dropped before grouping; counted once per batch
    return transitions_table(rows), outputs


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


Sink = Callable[[pa.Table], object]
"""What happens to a converted chunk where it was converted (in the worker): written to the store
(``WriteTo``), so rows never travel back through a pipe; tests keep the table itself."""


@dataclass
class Written:
    files: list[str]
    rows: int
    trainable: int


@dataclass(frozen=True)
class WriteTo:
    """The store's sink: write a chunk's transitions (``write_transitions``), stamped with this pass's
    ``conversion`` number, and report what was written. It pickles into worker processes (so does a
    ``StoreLocation``: pyarrow file systems pickle with their options)."""

    store: StoreLocation
    conversion: int

    def __call__(self, table: pa.Table) -> Written:
        i = table.schema.get_field_index("conversion")
        table = table.set_column(
            i, table.schema.field(i), pa.array(np.full(len(table), self.conversion), pa.int64())
        )
        files = [str(p) for p in write_transitions(self.store, table)]
        trainable = (
            int(pc.sum(pc.cast(table.column("trainable"), pa.int64())).as_py() or 0) if len(table) else 0
        )
        return Written(files, len(table), trainable)


Packed = list[RolloutOutput | str]
"""Outputs as ``convert_parallel`` yields them: a rollout converted with nothing to report is its id alone
(``unpack`` gives the records)."""


def _pack(outputs: list[RolloutOutput]) -> Packed:
    """Outputs for the pipe and the ledger. Most rollouts convert with nothing to report, and loading a
    pickled ``RolloutOutput`` costs the parent ~6 us (0.6 s per 100k rollouts, serial beside the
    workers) where an id costs next to nothing; the store records an id without making a record of it."""
    return [o.rollout_id if o == RolloutOutput(o.rollout_id, "converted") else o for o in outputs]


def unpack(packed: Packed) -> list[RolloutOutput]:
    """The records ``_pack`` stood for (equal to the originals)."""
    return [RolloutOutput(o, "converted") if isinstance(o, str) else o for o in packed]


def _convert_chunk(
    args: tuple[bytes, list[LogEvent], dict[str, list[Reward]], ConvertConfig, frozenset[str], Sink],
) -> tuple[object, Packed]:
    data, logs, rewards_by, config, timed_out, sink = args
    table, outputs = convert_table(pa.ipc.open_stream(data).read_all(), logs, rewards_by, config, timed_out)
    return sink(table), _pack(outputs)


_INHERITED: dict[str, Any] = {}
"""The batch a ``fork``ed worker pool reads (copy-on-write): chunks never travel through a pipe."""


def _convert_inherited(k: int) -> tuple[object, Packed]:
    b = _INHERITED
    table, outputs = convert_table(
        b["sel"].filter(pa.array(b["slot"] == k)), b["logs"], b["rewards_by"], b["config"], b["timed_out"]
    )
    return b["sink"](table), _pack(outputs)


def _workers(config: ConvertConfig, n_rollouts: int) -> int:
    """Worker processes for this batch: auto (0) is one per CPU (at most 16) for large batches."""
    if config.workers == 1 or n_rollouts < PARALLEL_MIN_ROLLOUTS:
        return 1
    if config.workers > 1:
        return config.workers
    return max(1, min(os.cpu_count() or 1, 16))


def convert_parallel(
    sel: pa.Table,
    logs: list[LogEvent],
    rewards_by: dict[str, list[Reward]],
    config: ConvertConfig,
    n_rollouts: int,
    sink: Sink,
    timed_out: frozenset[str] = frozenset(),
) -> Iterable[tuple[object, Packed]]:
    """``convert_table`` + ``sink`` over rollout-aligned chunks, in worker processes for large batches;
    each chunk's outputs come packed (``Packed``: ``unpack`` gives the records).

    A single-threaded caller (``tracerl convert``) forks: workers inherit the batch copy-on-write
    and only the sink's small result travels back. A caller with threads (``collect --convert``
    runs beside gRPC threads) must not fork, so its workers start with ``forkserver`` and receive
    their chunks as Arrow IPC. Small batches (the streaming case) stay in-process.
    """
    n = _workers(config, n_rollouts)
    if n == 1 and n_rollouts <= BATCH_ROLLOUTS:
        table, outputs = convert_table(sel, logs, rewards_by, config, timed_out)
        yield sink(table), _pack(outputs)
        return
    sel = sel.select(SPAN_COLUMNS)
    # deal whole rollouts round-robin into chunks, vectorised: sequential filters, no sort or gather
    rollout_ids = pc.unique(sel.column("rollout_id"))
    n_chunks = min(max(n * 2, -(-len(rollout_ids) // BATCH_ROLLOUTS)), len(rollout_ids))
    slot = (
        pc.index_in(sel.column("rollout_id"), value_set=rollout_ids).to_numpy(zero_copy_only=False) % n_chunks
    )
    if n == 1:  # in-process, a bounded batch at a time: a small working set is faster than one huge one
        for k in range(n_chunks):
            table, outputs = convert_table(
                sel.filter(pa.array(slot == k)), logs, rewards_by, config, timed_out
            )
            yield sink(table), _pack(outputs)
        return
    if threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods():
        _INHERITED.update(
            sel=sel,
            slot=slot,
            logs=logs,
            rewards_by=rewards_by,
            config=config,
            timed_out=timed_out,
            sink=sink,
        )
        try:
            with ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context("fork")) as pool:
                yield from pool.map(_convert_inherited, range(n_chunks))
        finally:
            _INHERITED.clear()
        return
    jobs = _ipc_jobs(sel, slot, n_chunks, logs, rewards_by, (config, timed_out, sink))
    with ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context("forkserver")) as pool:
        yield from pool.map(_convert_chunk, jobs)


def _ipc_jobs(
    sel: pa.Table,
    slot: Any,
    n_chunks: int,
    logs: list[LogEvent],
    rewards_by: dict[str, list[Reward]],
    rest: tuple[ConvertConfig, frozenset[str], Sink],
) -> list[tuple]:
    """The chunks for ``forkserver`` workers, as Arrow IPC, each with only the logs and rewards of its own
    traces and rollouts (they travel through a pipe, so a worker is sent what it converts and no more)."""
    jobs = []
    for k in range(n_chunks):
        chunk = sel.filter(pa.array(slot == k))
        lg, rw = logs, rewards_by
        if logs or rewards_by:
            chunk_traces = set(pc.unique(chunk.column("trace_id")).to_pylist())
            chunk_rollouts = set(pc.unique(chunk.column("rollout_id")).to_pylist())
            lg = [e for e in logs if e.trace_id in chunk_traces]
            rw = {
                key: v
                for key, v in rewards_by.items()
                if key in chunk_rollouts or (key.startswith("trace:") and key[6:] in chunk_traces)
            }
        jobs.append((_ipc(chunk), lg, rw, *rest))
    return jobs


_EPOCH = datetime.date(1970, 1, 1)
ROW_GROUP_ROWS = 8192
"""Rows per row group of a transitions file. Rows are sorted by rollout, so a reader looking up one
rollout (``tracerl ui``'s rollout page) skips the groups whose rollout_id range excludes it: on a
1M-call store, 36 ms instead of 210 ms (one whole 78k-row file) per lookup (bench/ui.py, load 4-5)."""
_DAY_NS = 86_400 * 10**9


def write_transitions(loc: StoreLocation, table: pa.Table) -> list[Path | str]:
    """One atomic file per date partition (UTC date of the call's start), named by its content,
    so writing the same transitions again replaces a file with the same rows; returns their paths
    (``Path``s on local disk, ``bucket/key`` strings on object storage, as ``write_table_atomic``)."""
    if len(table) == 0:
        return []
    table = table.combine_chunks()
    # UTC date = whole days since the epoch (integer math, not a strftime per row); one gather puts
    # the rows in (date, rollout_id, step) order, so each partition is a slice in (rollout_id, step) order
    days = np.floor_divide(pc.cast(table.column("started_at"), pa.int64()).to_numpy(), _DAY_NS)
    order = pc.sort_indices(table, sort_keys=[("rollout_id", "ascending"), ("step", "ascending")]).to_numpy()
    order = order[np.argsort(days[order], kind="stable")]
    table, days = table.take(pa.array(order)), days[order]
    starts = [*np.flatnonzero(np.diff(days, prepend=days[0] - 1)).tolist(), len(days)]
    out = []
    for a, b in pairwise(starts):
        date = (_EPOCH + datetime.timedelta(days=int(days[a]))).isoformat()
        part = table.slice(a, b - a)
        digest = hashlib.sha256("\n".join(part.column("transition_id").to_pylist()).encode()).hexdigest()[:24]
        path = loc.path("transitions", f"date={date}", f"part-{digest}.parquet")
        out.append(write_table_atomic(part, path, "transitions", row_group_size=ROW_GROUP_ROWS, fs=loc.fs))
    return out
