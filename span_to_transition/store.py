"""The I/O shell: read spans/logs/rewards from the store, convert complete rollouts, write transitions.

Heavy lifting is vectorised (Arrow): reading only files not yet fully converted, per-rollout
completion status, selecting the rows of complete rollouts, and deciding which rows need their
attributes at all. Python objects are built only for spans that matter (calls, agents, rewards,
gateways, task ids); every other span becomes a skeleton (ids, parent, name, times) that still
links the tree. The pure ``convert_rollout`` then runs once per rollout.

State lives next to the table it describes, ``transitions/_state.json`` (not a Parquet file,
so table globs never read it): which rollouts are converted or excluded, the span files that
are fully converted, and late spans. Re-running over the same spans writes nothing new.
"""

from __future__ import annotations

import datetime
import fcntl
import gc
import hashlib
import json
import logging
import multiprocessing
import operator
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import islice, pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from schemas.parquet import write_table_atomic
from schemas.store import StoreLayout
from schemas.tables import LOGS_SCHEMA, REWARDS_SCHEMA, SPANS_SCHEMA, TRANSITIONS_SCHEMA
from span_to_transition.agents import AGENT_KEYS
from span_to_transition.convert import ConvertConfig, RolloutInput, RolloutOutput, convert_rollout
from span_to_transition.dialects import CALL_KEYS, CALL_OPERATIONS
from span_to_transition.records import LogEvent, Reward, Span, SpanEvent, Transition
from span_to_transition.tokens import GATEWAY_FLAG
from span_to_transition.tree import END_MARKER, RolloutStatus, decide_completion

RELEVANT_OPERATIONS = sorted(CALL_OPERATIONS | {"invoke_agent"})
RELEVANT_KEYS = sorted(
    (CALL_KEYS - {"gen_ai.operation.name", "llm.request.type"}) | AGENT_KEYS
    | {"tracerl.reward", "tracerl.task_id", "traceloop.span.kind", GATEWAY_FLAG, END_MARKER, "reward",
       "agentlightning.reward.primary", "agentlightning.reward.0.value"}
)
"""A span with any of these attribute keys is materialised with its attributes (see module docstring)."""

SPAN_COLUMNS = ["trace_id", "span_id", "parent_span_id", "name", "rollout_id", "start_time_ns", "end_time_ns",
                "received_at", "attributes", "resource_attributes", "events"]
"""The span columns conversion reads; batches are cut from these alone (a filter of every column costs 2x)."""

RELEVANT_NAME_PREFIXES = ("invoke_agent", "agentlightning.reward")
MAX_PROBLEMS = 50
logger = logging.getLogger("tracerl.convert")
_EMPTY: dict[str, str] = {}  # shared by attribute-less spans; records are never mutated
PARALLEL_MIN_ROLLOUTS = 2000
BATCH_ROLLOUTS = 10_000
"""Rollouts converted per batch (in-process) or per chunk (workers), bounding memory and working set."""
"""Below this many ready rollouts, conversion stays in-process (worker start-up costs more)."""


@dataclass
class ConvertStats:
    """What one conversion pass did; printed by ``tracerl convert`` and logged by ``collect --convert``."""

    span_files_read: int = 0
    spans_read: int = 0
    rollouts_seen: int = 0
    rollouts_pending: int = 0
    rollouts_converted: int = 0
    rollouts_excluded_no_reward: int = 0
    rollouts_filled_reward: int = 0
    rollouts_without_calls: int = 0
    transitions_written: int = 0
    trainable_transitions: int = 0
    duplicate_spans: int = 0
    duplicate_calls: int = 0
    orphan_spans: int = 0
    calls_without_content: int = 0
    late_spans: int = 0  # spans that arrived after their rollout was converted (this pass)
    late_spans_total: int = 0
    rollouts_reconverted: int = 0  # converted again: a reward arrived after their conversion, or --rebuild
    files_removed: int = 0  # superseded transitions files deleted by --rebuild
    settings_changed: str | None = None  # these settings differ from those of the rows already converted
    files_written: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)  # read, status, convert (+ write), ledger

    def lap(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.phase_seconds[phase] = round(self.phase_seconds.get(phase, 0.0) + now - since, 4)
        return now

    def summary(self) -> str:
        lines = [
            f"converted {self.rollouts_converted} rollouts -> {self.transitions_written} transitions "
            f"({self.trainable_transitions} trainable) from {self.spans_read} spans in {self.span_files_read} "
            f"files, {self.seconds:.2f}s",
            f"pending (not complete yet): {self.rollouts_pending}; without LLM calls: {self.rollouts_without_calls}; "
            f"duplicate spans dropped: {self.duplicate_spans}; duplicate calls (same response id): "
            f"{self.duplicate_calls}; orphan spans repaired: {self.orphan_spans}",
        ]
        if self.rollouts_excluded_no_reward:
            lines.append(f"excluded (no reward on any channel): {self.rollouts_excluded_no_reward}; they are "
                         "reconsidered when a reward row arrives, or pass --missing-reward fill --fill-reward V")
        if self.rollouts_filled_reward:
            lines.append(f"rollouts given the fill reward: {self.rollouts_filled_reward}")
        if self.calls_without_content:
            lines.append(f"LLM calls without message content (not converted): {self.calls_without_content}")
        if self.rollouts_reconverted:
            lines.append(f"converted again (a reward arrived after their conversion, or --rebuild): "
                         f"{self.rollouts_reconverted} rollouts; their earlier rows are superseded")
        if self.settings_changed:
            lines.append(f"note: {self.settings_changed}")
        if self.late_spans or self.late_spans_total:
            lines.append(f"late spans (arrived after their rollout was converted; kept in spans, not converted): "
                         f"{self.late_spans} new, {self.late_spans_total} total; raise --quiet-s if this grows")
        lines += [f"  problem: {p}" for p in self.problems[:10]]
        if len(self.problems) > 10:
            lines.append(f"  ... and {len(self.problems) - 10} more problems")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Ledger


@dataclass
class Ledger:
    converted: dict[str, int] = field(default_factory=dict)  # rollout -> received-at watermark (ns)
    excluded: dict[str, list[str]] = field(default_factory=dict)  # rollout -> span files holding it
    files_done: set[str] = field(default_factory=set)  # span files (relative) fully converted
    late: dict[str, list[str]] = field(default_factory=dict)  # rollout -> late span ids
    traces: dict[str, str] = field(default_factory=dict)  # trace -> explicit rollout id (tracerl.rollout_id)
    reward_files: set[str] = field(default_factory=set)  # rewards files (relative) already applied
    settings: dict[str, object] = field(default_factory=dict)  # the row settings of the converted rows

    @staticmethod
    def path(layout: StoreLayout) -> Path:
        return layout.table("transitions") / "_state.json"

    @classmethod
    def load(cls, layout: StoreLayout) -> Ledger:
        p = cls.path(layout)
        if not p.exists():
            return cls()
        d = json.loads(p.read_text())
        return cls(d["converted"], d["excluded"], set(d["files_done"]), d["late"], d.get("traces", {}),
                   set(d.get("reward_files", [])), d.get("settings", {}))

    def save(self, layout: StoreLayout) -> None:
        p = self.path(layout)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.parent / f".{p.name}.{uuid.uuid4().hex}.tmp"
        data = {"converted": self.converted, "excluded": self.excluded, "files_done": sorted(self.files_done),
                "late": self.late, "traces": self.traces, "reward_files": sorted(self.reward_files),
                "settings": self.settings}
        with open(tmp, "w") as f:
            json.dump(data, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)


# ---------------------------------------------------------------------------------------------
# Arrow -> records


def _maps_to_dicts(arr: pa.Array) -> list[dict[str, str]]:
    """A map<string,string> array to dicts, through flat key/value lists (much faster than to_pylist)."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    if len(arr) == 0:
        return []
    offsets = arr.offsets.to_numpy(zero_copy_only=False)
    start, stop = int(offsets[0]), int(offsets[-1])
    # keys repeat (a few dozen distinct names): decode each name once and share the str objects
    encoded = pc.dictionary_encode(arr.keys[start:stop])
    names = np.array(encoded.dictionary.to_pylist(), dtype=object)
    keys = names[encoded.indices.to_numpy(zero_copy_only=False)].tolist()
    pairs = zip(keys, arr.items[start:stop].to_pylist())
    counts = np.diff(offsets).tolist()  # a null map has no entries, so it becomes {}
    return [dict(islice(pairs, c)) for c in counts]


def _ns(col: pa.ChunkedArray | pa.Array) -> list[int]:
    return pc.cast(col, pa.int64()).to_pylist()


def relevant_mask(table: pa.Table) -> pa.Array:
    """Rows that need their attributes: any relevant key, a relevant name, events, or flattened content."""
    attrs = table.column("attributes").combine_chunks()
    n = len(table)
    if n == 0:
        return pa.array([], pa.bool_())
    keys, items = attrs.keys, attrs.items
    hit = pc.or_(
        pc.is_in(keys, value_set=pa.array(RELEVANT_KEYS)),
        pc.or_(pc.starts_with(keys, "agentlightning.reward."), pc.starts_with(keys, "llm.input_messages.")),
    )
    # gen_ai.operation.name / llm.request.type matter only for calls and agents (not tool spans)
    by_value = pc.or_(
        pc.and_(pc.equal(keys, "gen_ai.operation.name"), pc.is_in(items, value_set=pa.array(RELEVANT_OPERATIONS))),
        pc.and_(pc.equal(keys, "llm.request.type"), pc.is_in(items, value_set=pa.array(["chat", "completion"]))),
    )
    hit = pc.or_(hit, pc.fill_null(by_value, False)).to_numpy(zero_copy_only=False)
    lengths = np.diff(attrs.offsets.to_numpy(zero_copy_only=False))
    row_of_key = np.repeat(np.arange(n), lengths)
    rows = np.zeros(n, dtype=bool)
    rows[row_of_key[hit]] = True
    rows &= attrs.is_valid().to_numpy(zero_copy_only=False)
    mask = pa.array(rows)
    names = table.column("name")
    for prefix in RELEVANT_NAME_PREFIXES:
        mask = pc.or_(mask, pc.fill_null(pc.starts_with(names, prefix), False))
    has_events = pc.fill_null(pc.greater(pc.list_value_length(table.column("events")), 0), False)
    out = pc.or_(mask, has_events)
    return out.combine_chunks() if isinstance(out, pa.ChunkedArray) else out


def spans_from_table(table: pa.Table, *, all_attributes: bool = False) -> list[Span]:
    """Rows of SPANS_SCHEMA to ``Span`` records; irrelevant rows get no attributes unless asked."""
    n = len(table)
    if n == 0:
        return []
    cols = {name: table.column(name) for name in ("trace_id", "span_id", "parent_span_id", "name", "rollout_id")}
    py = {k: v.to_pylist() for k, v in cols.items()}
    start, end = _ns(table.column("start_time_ns")), _ns(table.column("end_time_ns"))
    received = _ns(table.column("received_at"))
    mask = pa.array([True] * n) if all_attributes else relevant_mask(table)
    idx = pc.indices_nonzero(mask)
    rel = idx.to_pylist()
    attrs = _maps_to_dicts(pc.take(table.column("attributes"), idx))
    res_all = pc.take(table.column("resource_attributes"), idx)
    task = pc.map_lookup(res_all, "tracerl.task_id", "first").to_pylist()
    events = pc.take(table.column("events"), idx).to_pylist()
    a_of: dict[int, tuple[dict[str, str], dict[str, str], tuple[SpanEvent, ...]]] = {}
    for j, i in enumerate(rel):
        ev = tuple(SpanEvent(e["name"], e["time_ns"] or 0, dict(e["attributes"] or [])) for e in events[j] or [])
        a_of[i] = (attrs[j], {"tracerl.task_id": task[j]} if task[j] else {}, ev)
    empty: tuple[dict[str, str], dict[str, str], tuple[SpanEvent, ...]] = ({}, {}, ())
    out = []
    tid, sid, par, nm, rid = py["trace_id"], py["span_id"], py["parent_span_id"], py["name"], py["rollout_id"]
    for i in range(n):
        a, r, ev = a_of.get(i, empty)
        out.append(Span(tid[i], sid[i], par[i] or None, nm[i] or "", start[i] or 0, end[i] or 0, a, r, ev,
                        received[i] or 0, rid[i] or tid[i]))
    return out


def materialize(table: pa.Table) -> tuple[list[Span], int]:
    """Spans of complete rollouts as records, grouped by rollout: (records, duplicates dropped).

    Vectorised before any Python object exists: duplicates are dropped (earliest received kept),
    parents are resolved with a hash join, and spans that matter to no rule (tool internals,
    HTTP clients, ...) are pruned: every kept span is re-parented to its nearest kept ancestor
    (numpy pointer jumping). Kept: spans with relevant attributes, roots, and orphans (whose
    parent is missing, so the pure tree code still reports them). Agent attribution, gateway
    joins and rewards only ever look at kept spans, so the result equals the unpruned tree's.
    """
    n0 = len(table)
    if n0 == 0:
        return [], 0
    # sort and dedupe on the id columns only; the wide columns are gathered once, at the end
    ids = table.select(["rollout_id", "trace_id", "span_id", "received_at"])
    order = pc.sort_indices(ids, sort_keys=[("rollout_id", "ascending"), ("trace_id", "ascending"),
                                            ("span_id", "ascending"), ("received_at", "ascending")])
    ids = ids.take(order)
    tid_a, sid_a = ids.column("trace_id"), ids.column("span_id")
    if n0 > 1:
        same = pc.and_(pc.equal(tid_a.slice(1), tid_a.slice(0, n0 - 1)), pc.equal(sid_a.slice(1), sid_a.slice(0, n0 - 1)))
        first = np.concatenate([[True], ~same.to_numpy(zero_copy_only=False)])
        order = pc.filter(order, pa.array(first))
    table = table.select(SPAN_COLUMNS)
    narrow = table.select(["trace_id", "span_id", "parent_span_id"]).take(order)
    order_np = order.to_numpy(zero_copy_only=False)
    m = len(narrow)
    rows = pa.array(np.arange(m))
    left = pa.table({"trace_id": narrow.column("trace_id"), "parent_span_id": narrow.column("parent_span_id"),
                     "row": rows})
    right = pa.table({"trace_id": narrow.column("trace_id"), "span_id": narrow.column("span_id"), "prow": rows})
    joined = left.join(right, keys=["trace_id", "parent_span_id"], right_keys=["trace_id", "span_id"],
                       join_type="left outer", use_threads=False)
    parent = np.full(m, -1, dtype=np.int64)
    parent[joined.column("row").to_numpy()] = pc.fill_null(joined.column("prow"), -1).to_numpy()
    has_parent_id = pc.is_valid(narrow.column("parent_span_id")).to_numpy(zero_copy_only=False)
    orphan = has_parent_id & (parent < 0)
    relevant = relevant_mask(table).to_numpy(zero_copy_only=False)[order_np]
    keep = relevant | ~has_parent_id | orphan
    anc = parent.copy()
    for _ in range(m):  # pointer jumping through pruned spans; bounded by the tree depth
        hop = (anc >= 0) & ~keep[np.maximum(anc, 0)]
        if not hop.any():
            break
        anc[hop] = parent[anc[hop]]

    kept_idx = np.nonzero(keep)[0]
    rel_in_kept = relevant[kept_idx]
    kept = table.select(["trace_id", "span_id", "parent_span_id", "name", "rollout_id", "start_time_ns",
                         "end_time_ns", "received_at"]).take(pc.take(order, pa.array(kept_idx)))
    py = {k: kept.column(k).to_pylist() for k in ("trace_id", "span_id", "parent_span_id", "name", "rollout_id")}
    anc_kept = anc[kept_idx]
    new_parent = pc.take(narrow.column("span_id"), pa.array(np.maximum(anc_kept, 0))).to_pylist()
    start, end = _ns(kept.column("start_time_ns")), _ns(kept.column("end_time_ns"))
    received = _ns(kept.column("received_at"))
    rel_rows = pc.take(order, pa.array(kept_idx[rel_in_kept]))  # rows of ``table`` that get attributes
    # gather the wide map columns in ascending row order with a row mask (the rows are unique, so a
    # filter selects exactly them, 10x faster than a gather), then put the Python objects back in
    # rollout order
    rel_np = rel_rows.to_numpy(zero_copy_only=False)
    asc = np.argsort(rel_np, kind="stable")
    back = np.empty_like(asc)
    back[asc] = np.arange(len(asc))
    row_mask = np.zeros(len(table), dtype=bool)
    row_mask[rel_np] = True
    row_mask_a = pa.array(row_mask)
    attrs_asc = _maps_to_dicts(pc.filter(table.column("attributes"), row_mask_a))
    attrs = [attrs_asc[k] for k in back.tolist()]
    task = pc.take(pc.map_lookup(pc.filter(table.column("resource_attributes"), row_mask_a), "tracerl.task_id",
                                 "first"), pa.array(back)).to_pylist()
    n_events = pc.take(pc.fill_null(pc.list_value_length(table.column("events")), 0), rel_rows)
    events_rows = pc.indices_nonzero(pc.greater(n_events, 0))
    events_py = pc.take(table.column("events"), pc.take(rel_rows, events_rows)).to_pylist()
    events_of = dict(zip(events_rows.to_pylist(), events_py))
    has_anc = (anc_kept >= 0).tolist()
    is_orphan = orphan[kept_idx].tolist()
    is_rel = rel_in_kept.tolist()
    tid, sid, par, nm, rid = py["trace_id"], py["span_id"], py["parent_span_id"], py["name"], py["rollout_id"]
    out = []
    j = 0
    for i in range(len(kept_idx)):
        if is_rel[i]:
            a = attrs[j]
            r = {"tracerl.task_id": task[j]} if task[j] else _EMPTY
            ev = events_of.get(j)
            evs = tuple(SpanEvent(e["name"], e["time_ns"] or 0, dict(e["attributes"] or [])) for e in ev) if ev else ()
            j += 1
        else:
            a, r, evs = _EMPTY, _EMPTY, ()
        p = new_parent[i] if has_anc[i] else (par[i] if is_orphan[i] else None)
        out.append(Span(tid[i], sid[i], p, nm[i] or "", start[i] or 0, end[i] or 0, a, r, evs,
                        received[i] or 0, rid[i] or tid[i]))
    return out, n0 - m


def logs_from_table(table: pa.Table) -> list[LogEvent]:
    if len(table) == 0:
        return []
    attrs = _maps_to_dicts(table.column("attributes"))
    cols = {k: table.column(k).to_pylist() for k in ("trace_id", "span_id", "event_name", "body")}
    times = _ns(table.column("time_ns"))
    observed = _ns(table.column("observed_time_ns"))
    return [
        LogEvent(cols["trace_id"][i], cols["span_id"][i], times[i] or observed[i] or 0,
                 cols["event_name"][i] or attrs[i].get("event.name", ""), cols["body"][i], attrs[i])
        for i in range(len(table))
    ]


def rewards_from_table(table: pa.Table) -> list[tuple[str | None, str | None, Reward]]:
    """(rollout_id, trace_id, Reward) for each rewards row. A row that targets no call carries no
    time (``at_ns=None``): its time is when it was posted, not where in the rollout it belongs."""
    out = []
    for row in table.select(["reward_id", "rollout_id", "trace_id", "span_id", "response_id", "name", "value",
                             "source"]).to_pylist():
        out.append((row["rollout_id"], row["trace_id"],
                    Reward(float(row["value"]), row["source"] or "side_channel", row["name"], row["span_id"],
                           row["response_id"], None, row["reward_id"])))
    return out


def transitions_table(rows: list[Transition]) -> pa.Table:
    """Transition records to a TRANSITIONS_SCHEMA table, built column by column (no per-row tuples)."""
    if not rows:
        return TRANSITIONS_SCHEMA.empty_table()
    arrays = []
    for f in TRANSITIONS_SCHEMA:
        if f.name == "conversion":  # the store's pass number, set where the rows are written (WriteTo)
            arrays.append(pa.nulls(len(rows), f.type))
            continue
        values = list(map(operator.attrgetter(f.name), rows))
        if pa.types.is_timestamp(f.type):
            arrays.append(pa.array(values, pa.int64()).cast(f.type))
        else:
            arrays.append(pa.array(values, f.type))
    return pa.Table.from_arrays(arrays, schema=TRANSITIONS_SCHEMA)


# ---------------------------------------------------------------------------------------------


def _table_files(layout: StoreLayout, table: str) -> list[Path]:
    root = layout.table(table)
    if not root.exists():
        return []
    return sorted(p for p in root.rglob("*.parquet") if not p.name.startswith("."))


def _read(files: list[Path], schema: pa.Schema, columns: list[str] | None = None,
          filter: pc.Expression | None = None) -> pa.Table:
    if not files:
        return schema.empty_table() if columns is None else schema.empty_table().select(columns)
    dataset = ds.dataset([str(f) for f in files], schema=schema, format="parquet")
    return dataset.to_table(columns=columns, filter=filter)


def _read_numbered(files: list[Path], schema: pa.Schema) -> pa.Table:
    """Every row of ``files``, with ``_file``: the index in ``files`` of the file it came from."""
    parts = [schema.empty_table().append_column("_file", pa.array([], pa.int32()))]
    for i, f in enumerate(files):
        t = pq.read_table(f, schema=schema)
        parts.append(t.append_column("_file", pa.array(np.full(len(t), i, dtype=np.int32))))
    return pa.concat_tables(parts)


def _statuses(table: pa.Table) -> dict[str, RolloutStatus]:
    """Per-rollout completion inputs, computed with Arrow group-bys (no per-span Python)."""
    marker = pc.fill_null(pc.equal(pc.map_lookup(table.column("attributes"), END_MARKER, "first"), "true"), False)
    t = pa.table({
        "rollout_id": pc.coalesce(table.column("rollout_id"), table.column("trace_id")),
        "trace_id": table.column("trace_id"),
        "is_root": pc.is_null(table.column("parent_span_id")),
        "rx": pc.cast(table.column("received_at"), pa.int64()),
        "marker": marker,
    })
    per_trace = t.group_by(["rollout_id", "trace_id"]).aggregate(
        [("is_root", "any"), ("rx", "max"), ("marker", "any")])
    per_rollout = per_trace.group_by("rollout_id").aggregate(
        [("trace_id", "count"), ("is_root_any", "sum"), ("rx_max", "max"), ("marker_any", "any")])
    d = per_rollout.to_pydict()
    return {
        r: RolloutStatus(r, n, int(k or 0), rx, bool(m))
        for r, n, k, rx, m in zip(d["rollout_id"], d["trace_id_count"], d["is_root_any_sum"], d["rx_max_max"],
                                  d["marker_any_any"])
    }


def unify_rollouts(spans: pa.Table, known: dict[str, str], *, follow_links: bool = True
                   ) -> tuple[pa.Table, dict[str, str]]:
    """A trace belongs wholly to the rollout any of its spans names (``tracerl.rollout_id``).

    The collector derives ``rollout_id`` per span (span attribute, resource attribute, else trace
    id), so spans from a process that does not set the id (the serving gateway, a downstream
    service) would form a rollout of their own, keyed by the trace id. They join the rollout
    their trace belongs to. With ``follow_links``, a trace that names no rollout and links to a
    span of another trace joins that trace's rollout (``link_rollouts``). ``known`` holds the
    trace -> rollout pairs of earlier passes, so late spans still find their rollout. Returns the
    relabelled table and the updated pairs.
    """
    rid, tid = spans.column("rollout_id"), spans.column("trace_id")
    explicit = pc.not_equal(rid, tid)
    pairs = spans.filter(explicit).select(["trace_id", "rollout_id"]).group_by("trace_id").aggregate(
        [("rollout_id", "min")])
    mapping = dict(known)
    mapping.update(zip(pairs.column("trace_id").to_pylist(), pairs.column("rollout_id_min").to_pylist()))
    if follow_links:
        mapping.update(link_rollouts(_link_edges(spans, explicit), mapping))
    if not mapping:
        return spans, mapping
    keys, values = pa.array(list(mapping), pa.string()), pa.array(list(mapping.values()), pa.string())
    mapped = pc.take(values, pc.index_in(tid, value_set=keys))
    relabelled = pc.if_else(explicit, rid, pc.coalesce(mapped, rid))
    return spans.set_column(spans.schema.get_field_index("rollout_id"), "rollout_id", relabelled), mapping


def _link_edges(spans: pa.Table, explicit: pa.ChunkedArray) -> list[tuple[str, str]]:
    """(trace, linked trace) for every span link from a trace that names no rollout to another trace."""
    links = spans.column("links").combine_chunks()
    if pc.sum(pc.list_value_length(links)).as_py() in (None, 0):
        return []
    parents = pc.list_parent_indices(links)
    src = pc.take(spans.column("trace_id"), parents)
    dst = pc.struct_field(pc.list_flatten(links), "trace_id")
    keep = pc.and_(pc.invert(pc.take(explicit, parents)), pc.not_equal(src, dst))
    edges = pa.table({"src": src, "dst": dst}).filter(pc.fill_null(keep, False)).group_by(["src", "dst"]).aggregate([])
    return list(zip(edges.column("src").to_pylist(), edges.column("dst").to_pylist()))


def link_rollouts(edges: Iterable[tuple[str, str]], known: dict[str, str]) -> dict[str, str]:
    """trace -> rollout for traces joined by span links (AutoGen starts a trace per message and links
    it to the sender's span), for the traces ``known`` has no rollout for yet.

    Traces connected by links form one rollout: the one a member already belongs to (``known``: an
    explicit ``tracerl.rollout_id`` or an earlier pass; the smallest if several), else the trace id
    of the origin, the trace that links to no other (the smallest if several). Link targets count
    even before their spans arrive, so the origin, and with it the rollout id, never changes as
    the component grows.
    """
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        root = x
        while parent.setdefault(root, root) != root:
            root = parent[root]
        while parent[x] != root:  # path compression
            parent[x], x = root, parent[x]
        return root

    linking = set()
    for a, b in edges:
        linking.add(a)
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    members: dict[str, list[str]] = {}
    for t in list(parent):
        members.setdefault(find(t), []).append(t)
    out = {}
    for group in members.values():
        named = [known[t] for t in group if t in known]
        rollout = min(named) if named else min((t for t in group if t not in linking), default=min(group))
        out.update({t: rollout for t in group if t not in known and t != rollout})
    return out


def convert_table(sel: pa.Table, logs: list[LogEvent], rewards_by: dict[str, list[Reward]],
                  config: ConvertConfig) -> tuple[pa.Table, list[RolloutOutput]]:
    """Convert the spans of complete rollouts (``sel``, any row order) into a transitions table.

    The returned outputs carry statuses and counts; their transitions are already in the table.
    """
    gc_was_enabled = gc.isenabled()
    gc.disable()  # millions of short-lived acyclic records: the cycle collector only costs time here
    try:
        return _convert_table(sel, logs, rewards_by, config)
    finally:
        if gc_was_enabled:
            gc.enable()


def _convert_table(sel: pa.Table, logs: list[LogEvent], rewards_by: dict[str, list[Reward]],
                   config: ConvertConfig) -> tuple[pa.Table, list[RolloutOutput]]:
    records, duplicates = materialize(sel)
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
        out = convert_rollout(RolloutInput(rid, group, lg, rws), config)
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
    ``conversion`` number, and report what was written."""

    root: str
    conversion: int

    def __call__(self, table: pa.Table) -> Written:
        i = table.schema.get_field_index("conversion")
        table = table.set_column(i, table.schema.field(i), pa.array(np.full(len(table), self.conversion), pa.int64()))
        files = [str(p) for p in write_transitions(StoreLayout.at(self.root), table)]
        trainable = int(pc.sum(pc.cast(table.column("trainable"), pa.int64())).as_py() or 0) if len(table) else 0
        return Written(files, len(table), trainable)


def _convert_chunk(args: tuple[bytes, list[LogEvent], dict[str, list[Reward]], ConvertConfig, Sink]
                   ) -> tuple[object, list[RolloutOutput]]:
    data, logs, rewards_by, config, sink = args
    table, outputs = convert_table(pa.ipc.open_stream(data).read_all(), logs, rewards_by, config)
    return sink(table), outputs


_INHERITED: dict[str, Any] = {}
"""The batch a ``fork``ed worker pool reads (copy-on-write): chunks never travel through a pipe."""


def _convert_inherited(k: int) -> tuple[object, list[RolloutOutput]]:
    b = _INHERITED
    table, outputs = convert_table(b["sel"].filter(pa.array(b["slot"] == k)), b["logs"], b["rewards_by"], b["config"])
    return b["sink"](table), outputs


def _workers(config: ConvertConfig, n_rollouts: int) -> int:
    """Worker processes for this batch: auto (0) is one per CPU (at most 16) for large batches."""
    if config.workers == 1 or n_rollouts < PARALLEL_MIN_ROLLOUTS:
        return 1
    if config.workers > 1:
        return config.workers
    return max(1, min(os.cpu_count() or 1, 16))


def _convert_parallel(sel: pa.Table, logs: list[LogEvent], rewards_by: dict[str, list[Reward]],
                      config: ConvertConfig, n_rollouts: int, sink: Sink) -> Iterable[tuple[object, list[RolloutOutput]]]:
    """``convert_table`` + ``sink`` over rollout-aligned chunks, in worker processes for large batches.

    A single-threaded caller (``tracerl convert``) forks: workers inherit the batch copy-on-write
    and only the sink's small result travels back. A caller with threads (``collect --convert``
    runs beside gRPC threads) must not fork, so its workers start with ``forkserver`` and receive
    their chunks as Arrow IPC. Small batches (the streaming case) stay in-process.
    """
    n = _workers(config, n_rollouts)
    if n == 1 and n_rollouts <= BATCH_ROLLOUTS:
        table, outputs = convert_table(sel, logs, rewards_by, config)
        yield sink(table), outputs
        return
    sel = sel.select(SPAN_COLUMNS)
    # deal whole rollouts round-robin into chunks, vectorised: sequential filters, no sort or gather
    rollout_ids = pc.unique(sel.column("rollout_id"))
    n_chunks = min(max(n * 2, -(-len(rollout_ids) // BATCH_ROLLOUTS)), len(rollout_ids))
    slot = pc.index_in(sel.column("rollout_id"), value_set=rollout_ids).to_numpy(zero_copy_only=False) % n_chunks
    if n == 1:  # in-process, a bounded batch at a time: a small working set is faster than one huge one
        for k in range(n_chunks):
            table, outputs = convert_table(sel.filter(pa.array(slot == k)), logs, rewards_by, config)
            yield sink(table), outputs
        return
    if threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods():
        _INHERITED.update(sel=sel, slot=slot, logs=logs, rewards_by=rewards_by, config=config, sink=sink)
        try:
            with ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context("fork")) as pool:
                yield from pool.map(_convert_inherited, range(n_chunks))
        finally:
            _INHERITED.clear()
        return
    jobs = []
    for k in range(n_chunks):
        chunk = sel.filter(pa.array(slot == k))
        lg, rw = logs, rewards_by
        if logs or rewards_by:
            chunk_traces = set(pc.unique(chunk.column("trace_id")).to_pylist())
            chunk_rollouts = set(pc.unique(chunk.column("rollout_id")).to_pylist())
            lg = [e for e in logs if e.trace_id in chunk_traces]
            rw = {key: v for key, v in rewards_by.items()
                  if key in chunk_rollouts or (key.startswith("trace:") and key[6:] in chunk_traces)}
        jobs.append((_ipc(chunk), lg, rw, config, sink))
    with ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context("forkserver")) as pool:
        yield from pool.map(_convert_chunk, jobs)


def convert_store(store: str | os.PathLike[str], config: ConvertConfig, now_ns: int | None = None, *,
                  rebuild: bool = False) -> ConvertStats:
    """Convert every complete, not yet converted rollout in ``store``; safe to call repeatedly.

    A rollout is converted again when a reward row for it arrives after its conversion, and every
    rollout is with ``rebuild`` (to apply changed --agents/--credit/--missing-reward settings).
    New rows carry a higher ``conversion`` number; the ``transitions`` view shows each rollout's
    latest conversion only, so a crash between writing and cleaning up never shows a row twice.

    The collector calls this periodically (``collect --convert``) and ``tracerl convert`` calls it
    once; both give the same transitions because completion and conversion depend only on the
    spans and ``now_ns``. Returns what happened, including late spans and excluded rollouts.
    Concurrent callers on one store (the collector and a manual ``tracerl convert``) take turns
    on an exclusive lock, so no rollout is ever written twice.
    """
    layout = StoreLayout.at(store)
    lock_path = layout.table("transitions") / "_state.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _convert_store_locked(layout, config, now_ns, rebuild)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def row_settings(config: ConvertConfig) -> dict[str, object]:
    """The settings a converted row depends on (not completion timing or worker count)."""
    return {"agents": config.agents, "credit": config.credit, "gamma": config.gamma,
            "missing_reward": config.missing_reward, "fill_reward": config.fill_reward,
            "follow_links": config.follow_links}


def _settings_note(old: dict[str, object], new: dict[str, object]) -> str | None:
    changed = [k for k in new if k in old and old[k] != new[k]]
    if not changed:
        return None
    what = ", ".join(f"--{k.replace('_', '-')} {old[k]!r} -> {new[k]!r}" for k in changed)
    return (f"rows already converted used other settings ({what}); they are kept as they are and only newly "
            "complete rollouts use the new ones; run 'tracerl convert --rebuild' with the new settings to rewrite all")


def _files_with(files: list[Path], rollouts: set[str], traces: set[str]) -> set[Path]:
    """The span files holding any span of these rollouts (by rollout id, or by trace for spans that
    name no rollout, such as the gateway's)."""
    out = set()
    rollout_set, trace_set = pa.array(sorted(rollouts), pa.string()), pa.array(sorted(traces), pa.string())
    for f in files:
        ids = pq.read_table(f, columns=["rollout_id", "trace_id"])
        if pc.any(pc.is_in(ids.column("rollout_id"), value_set=rollout_set)).as_py() or \
                pc.any(pc.is_in(ids.column("trace_id"), value_set=trace_set)).as_py():
            out.add(f)
    return out


def _convert_store_locked(layout: StoreLayout, config: ConvertConfig, now_ns: int | None,
                          rebuild: bool = False) -> ConvertStats:
    t0 = time.perf_counter()
    config.validate()
    now_ns = time.time_ns() if now_ns is None else now_ns
    stats = ConvertStats()
    ledger = Ledger.load(layout)
    old_transition_files = _table_files(layout, "transitions")
    existing = _read(old_transition_files, TRANSITIONS_SCHEMA, ["rollout_id", "conversion"])
    conversion = int(pc.max(existing.column("conversion")).as_py() or 0) + 1
    settings = row_settings(config)
    if rebuild:  # every rollout again, from every span file; the trace -> rollout pairs stay known
        ledger = Ledger(traces=ledger.traces)
    stats.settings_changed = _settings_note(ledger.settings, settings)
    if not ledger.settings:  # a new store, a rebuild, or a ledger from before settings were recorded
        ledger.settings = settings
    converted = dict(ledger.converted)
    if not rebuild:
        for r in pc.unique(existing.column("rollout_id")).to_pylist():
            converted.setdefault(r, 0)  # transitions exist but the ledger lost it: never convert twice

    all_files = _table_files(layout, "spans")
    rel = {f: str(f.relative_to(layout.table("spans"))) for f in all_files}
    reward_files = _table_files(layout, "rewards")
    reward_rel = [str(f.relative_to(layout.table("rewards"))) for f in reward_files]
    new_reward_file = [r not in ledger.reward_files for r in reward_rel]
    reward_table = _read_numbered(reward_files, REWARDS_SCHEMA)
    reward_rows = rewards_from_table(reward_table)
    rewarded = {x for r_id, t_id, _ in reward_rows for x in (r_id, t_id) if x}
    # excluded rollouts whose reward has since arrived are read again from their files
    retry = {r: files for r, files in ledger.excluded.items() if r in rewarded}
    # converted rollouts with a reward row that arrived after their conversion are converted again
    reconvert = set()
    if any(new_reward_file) and not rebuild:
        is_new = pc.is_in(reward_table.column("_file"), value_set=pa.array(np.flatnonzero(new_reward_file), pa.int32()))
        for (r_id, t_id, _), new in zip(reward_rows, is_new.to_pylist()):
            rid = r_id or ledger.traces.get(t_id or "") or t_id
            if new and rid in converted:
                reconvert.add(rid)
    extra: set[Path] = set()
    if reconvert:
        traces = reconvert | {t for t, r in ledger.traces.items() if r in reconvert}
        extra = _files_with([f for f in all_files if rel[f] in ledger.files_done], reconvert, traces)
    todo = [f for f in all_files if rel[f] not in ledger.files_done or f in extra
            or any(rel[f] in v for v in retry.values())]
    stats.span_files_read = len(todo)
    if not todo:
        if any(new_reward_file):
            ledger.reward_files = set(reward_rel)
            ledger.save(layout)
        stats.late_spans_total = sum(len(v) for v in ledger.late.values())
        stats.seconds = time.perf_counter() - t0
        return stats

    spans = _read_numbered(todo, SPANS_SCHEMA)
    lap = stats.lap("read", t0)
    spans = spans.set_column(spans.schema.get_field_index("rollout_id"), "rollout_id",
                             pc.coalesce(spans.column("rollout_id"), spans.column("trace_id")))
    spans, ledger.traces = unify_rollouts(spans, ledger.traces, follow_links=config.follow_links)
    stats.spans_read = len(spans)
    statuses = _statuses(spans)
    stats.rollouts_seen = len(statuses)

    quiet_ns, wait_ns = int(config.quiet_s * 1e9), int(config.max_wait_s * 1e9)
    ready: list[str] = []
    late_rollouts: list[str] = []
    for r, st in statuses.items():
        if r in reconvert:
            ready.append(r)
        elif r in converted:
            late_rollouts.append(r)
        elif r in ledger.excluded and r not in retry:
            continue
        elif decide_completion(st, now_ns, quiet_ns, wait_ns).complete:
            ready.append(r)
        else:
            stats.rollouts_pending += 1

    if late_rollouts:  # spans of converted rollouts received after their watermark
        lt = spans.filter(pc.is_in(spans.column("rollout_id"), value_set=pa.array(late_rollouts)))
        for r, s, rx in zip(lt.column("rollout_id").to_pylist(), lt.column("span_id").to_pylist(),
                            _ns(lt.column("received_at"))):
            if rx > converted[r] and converted[r] > 0:
                known = ledger.late.setdefault(r, [])
                if s not in known:
                    known.append(s)
                    stats.late_spans += 1

    lap = stats.lap("status", lap)
    pairs = spans.select(["_file", "rollout_id"]).group_by(["_file", "rollout_id"]).aggregate([])
    files_of: dict[str, set[str]] = {}
    for fi, r in zip(pairs.column("_file").to_pylist(), pairs.column("rollout_id").to_pylist()):
        files_of.setdefault(r, set()).add(rel[todo[fi]])
    for r in statuses:  # late spans of an excluded rollout must be read again if it is retried
        if r in ledger.excluded and r not in ready:
            ledger.excluded[r] = sorted(set(ledger.excluded[r]) | files_of.get(r, set()))

    outputs: list[RolloutOutput] = []
    if ready:
        sel = spans if len(ready) == len(statuses) else spans.filter(
            pc.is_in(spans.column("rollout_id"), value_set=pa.array(ready)))
        sel = sel.drop_columns(["_file"])
        trace_ids = pc.unique(sel.column("trace_id"))
        logs = logs_from_table(_read(
            _table_files(layout, "logs"), LOGS_SCHEMA,
            filter=(ds.field("trace_id").isin(trace_ids)) & pc.starts_with(ds.field("event_name"), "gen_ai."),
        ))
        rewards_by: dict[str, list[Reward]] = {}
        for r_id, t_id, rw in reward_rows:
            rewards_by.setdefault(r_id or f"trace:{t_id}", []).append(rw)
        for written, outs in _convert_parallel(sel, logs, rewards_by, config, len(ready), WriteTo(str(layout.root), conversion)):
            assert isinstance(written, Written)
            stats.files_written += written.files
            stats.transitions_written += written.rows
            stats.trainable_transitions += written.trainable
            outputs.extend(outs)

    lap = stats.lap("convert", lap)  # converting and writing the transitions
    watermark = {r: statuses[r].last_received_ns for r in ready}
    for o in outputs:
        stats.duplicate_spans += o.duplicates
        stats.orphan_spans += o.orphans
        stats.calls_without_content += o.calls_without_content
        stats.duplicate_calls += o.duplicate_calls
        stats.problems.extend(o.problems[: MAX_PROBLEMS - len(stats.problems)])
        if o.status == "excluded_no_reward":
            stats.rollouts_excluded_no_reward += 1
            ledger.excluded[o.rollout_id] = sorted(set(ledger.excluded.get(o.rollout_id, [])) | files_of[o.rollout_id])
            continue
        ledger.excluded.pop(o.rollout_id, None)
        ledger.converted[o.rollout_id] = watermark[o.rollout_id]
        if o.rollout_id in reconvert:
            stats.rollouts_reconverted += 1
            ledger.late.pop(o.rollout_id, None)  # its late spans are converted now
        if o.status == "no_calls":
            stats.rollouts_without_calls += 1
            continue
        stats.rollouts_converted += 1
        stats.rollouts_filled_reward += int(o.filled_reward)

    # a span file is done when none of its rollouts is still pending
    done_states = set(ledger.converted) | set(ledger.excluded)
    pending_files = {f for f, r in zip(pairs.column("_file").to_pylist(), pairs.column("rollout_id").to_pylist())
                     if r not in done_states}
    for i, f in enumerate(todo):
        if i not in pending_files:
            ledger.files_done.add(rel[f])
    ledger.reward_files = set(reward_rel)
    ledger.save(layout)
    if rebuild:  # every rollout has newer rows now: the older files only hold superseded ones
        stats.rollouts_reconverted = stats.rollouts_converted
        written = {Path(f).resolve() for f in stats.files_written}
        for f in old_transition_files:
            if f.resolve() not in written:
                f.unlink(missing_ok=True)
                stats.files_removed += 1
    stats.lap("ledger", lap)
    stats.late_spans_total = sum(len(v) for v in ledger.late.values())
    stats.seconds = time.perf_counter() - t0
    return stats


_EPOCH = datetime.date(1970, 1, 1)
_DAY_NS = 86_400 * 10**9


def write_transitions(layout: StoreLayout, table: pa.Table) -> list[Path]:
    """One atomic file per date partition (UTC date of the call's start), named by its content,
    so writing the same transitions again replaces a file with the same rows."""
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
        path = layout.partition("transitions", date) / f"part-{digest}.parquet"
        out.append(write_table_atomic(part, path, "transitions"))
    return out


class ConvertLoop:
    """``collect --convert``: run ``convert_store`` every ``every_s`` seconds in a background thread.

    ``poke()`` (e.g. from the collector's after-compaction hook) runs a pass now instead of at the
    next tick. A failing pass is logged and retried on the next tick, never raised into the
    collector. ``stop()`` runs one final pass so nothing complete is left behind, then joins.
    """

    def __init__(self, store: str | os.PathLike[str], config: ConvertConfig, every_s: float = 5.0,
                 on_stats: Callable[[ConvertStats], None] | None = None):
        config.validate()
        self.store, self.config, self.every_s = store, config, every_s
        self.on_stats = on_stats or _log_stats
        self.passes = 0
        self.last: ConvertStats | None = None
        self.last_error: str | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tracerl-convert", daemon=True)

    def start(self) -> ConvertLoop:
        self._thread.start()
        return self

    def poke(self) -> None:
        self._wake.set()

    def stop(self, final_pass: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=300)
        if final_pass:
            self._pass()

    def _pass(self) -> None:
        try:
            self.last = convert_store(self.store, self.config)
            self.last_error = None
            self.passes += 1
            self.on_stats(self.last)
        except Exception as e:  # keep the collector alive; the next tick retries
            self.last_error = f"{type(e).__name__}: {e}"
            logger.exception("conversion pass failed (will retry in %.0fs)", self.every_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.every_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            self._pass()


def _log_stats(stats: ConvertStats) -> None:
    if stats.transitions_written or stats.late_spans or stats.rollouts_excluded_no_reward or stats.problems:
        logger.info("convert: %s", stats.summary().replace("\n", "; "))
