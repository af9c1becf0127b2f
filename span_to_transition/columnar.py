"""Arrow tables of the store -> the records the pure converter reads, and transitions -> an Arrow table.

Heavy lifting is vectorised: deduplication, parent resolution and deciding which rows need their
attributes at all happen on Arrow columns before any Python object exists. Python objects are
built only for spans that matter (calls, agents, rewards, gateways, task ids); every other span
becomes a skeleton (ids, parent, name, times) that still links the tree, or is pruned.
"""

from __future__ import annotations

import operator
from itertools import islice

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.attributes import TASK_ID
from schemas.tables import TRANSITIONS_SCHEMA
from span_to_transition.agents import AGENT_KEYS
from span_to_transition.dialects.registry import KEPT_KEYS, KEPT_PREFIXES, KEPT_VALUES
from span_to_transition.records import LogEvent, Reward, Span, SpanEvent, Transition
from span_to_transition.rewards import AGL_LEGACY_NAMES, REWARD_KEYS
from span_to_transition.tokens import GATEWAY_FLAG
from span_to_transition.tree import END_MARKER

RELEVANT_KEYS = sorted(
    KEPT_KEYS
    | AGENT_KEYS
    | REWARD_KEYS
    | {
        TASK_ID,
        "traceloop.span.kind",
        GATEWAY_FLAG,
        END_MARKER,
        "reward",
    }
)
"""A span with any of these attribute keys is materialised with its attributes (see module docstring); the
dialects' keys come from their registry, so a dialect cannot be recognised by a key pruned here."""
RELEVANT_PREFIXES = ("agentlightning.reward.", *KEPT_PREFIXES)
RELEVANT_VALUES = {
    **KEPT_VALUES,
    "gen_ai.operation.name": KEPT_VALUES.get("gen_ai.operation.name", frozenset()) | {"invoke_agent"},
}
"""Keys that matter only with some values: calls (the dialects') and agents, not tool spans."""

SKELETON_COLUMNS = [
    "trace_id",
    "span_id",
    "parent_span_id",
    "name",
    "rollout_id",
    "start_time_ns",
    "end_time_ns",
    "received_at",
]
"""What every span keeps, even one pruned to a skeleton: ids, parent, name, times."""
SPAN_COLUMNS = [*SKELETON_COLUMNS, "attributes", "resource_attributes", "events"]
"""The span columns conversion reads; batches are cut from these alone (a filter of every column costs 2x)."""

RELEVANT_NAME_PREFIXES = ("invoke_agent", *sorted(AGL_LEGACY_NAMES))
_EMPTY: dict[str, str] = {}  # shared by attribute-less spans; records are never mutated


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


def _ns_or_0(col: pa.ChunkedArray | pa.Array) -> list[int]:
    return pc.fill_null(pc.cast(col, pa.int64()), 0).to_pylist()


def _placed(values: list[dict[str, str]], at: np.ndarray, n: int) -> list[dict[str, str]]:
    """``values[q]`` at place ``at[q]`` of a list of ``n``, every other place the shared ``_EMPTY``: numpy's
    object scatter instead of a Python pass over every kept span."""
    out = np.empty(n, dtype=object)
    out[:] = [_EMPTY] * n
    placed = np.empty(len(values), dtype=object)
    placed[:] = values
    out[at] = placed
    return out.tolist()


def _events_placed(
    events: pa.ChunkedArray, rel_rows: pa.Array, rel_at: np.ndarray, n: int
) -> list[tuple[SpanEvent, ...]]:
    """The span events of the relevant rows (``rel_rows`` of the table, placed at ``rel_at``), ``()`` elsewhere."""
    n_events = pc.take(pc.fill_null(pc.list_value_length(events), 0), rel_rows)
    with_events = pc.indices_nonzero(pc.greater(n_events, 0))
    out: list[tuple[SpanEvent, ...]] = [()] * n
    for j, ev in zip(with_events.to_pylist(), pc.take(events, pc.take(rel_rows, with_events)).to_pylist()):
        out[rel_at[j]] = tuple(
            SpanEvent(e["name"], e["time_ns"] or 0, dict(e["attributes"] or [])) for e in ev
        )
    return out


def relevant_mask(table: pa.Table, extra_keys: tuple[str, ...] = ()) -> pa.Array:
    """Rows that need their attributes: any relevant key (``extra_keys`` too: ``--task-key``), a relevant
    name, events, or flattened content."""
    attrs = table.column("attributes").combine_chunks()
    n = len(table)
    if n == 0:
        return pa.array([], pa.bool_())
    keys, items = attrs.keys, attrs.items
    hit = pc.is_in(keys, value_set=pa.array(sorted(set(RELEVANT_KEYS) | set(extra_keys))))
    for prefix in RELEVANT_PREFIXES:
        hit = pc.or_(hit, pc.starts_with(keys, prefix))
    for key, values in RELEVANT_VALUES.items():
        by_value = pc.and_(pc.equal(keys, key), pc.is_in(items, value_set=pa.array(sorted(values))))
        hit = pc.or_(hit, pc.fill_null(by_value, False))
    hit = hit.to_numpy(zero_copy_only=False)
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


def _resource_dicts(resource: pa.Array | pa.ChunkedArray, keys: tuple[str, ...]) -> list[dict[str, str]]:
    """Each row's resource attributes that conversion reads (``keys``: ``ConvertConfig.attribute_keys``).

    Most processes set none of them, so the rows holding any are found on the Arrow columns first and
    only those get a dict of their own (a Python pass over every row cost a quarter of ``materialize``)."""
    n = len(resource)
    looked = [(k, pc.map_lookup(resource, k, "first")) for k in keys]
    holds = np.zeros(n, dtype=bool)
    for _, vals in looked:  # a value counts when it is non-empty (null and "" do not)
        holds |= pc.fill_null(pc.greater(pc.utf8_length(vals), 0), False).to_numpy(zero_copy_only=False)
    rows = np.flatnonzero(holds)
    out: list[dict[str, str]] = [_EMPTY] * n
    if len(rows) == 0:
        return out
    taken = [(k, pc.take(vals, pa.array(rows)).to_pylist()) for k, vals in looked]
    for j, row in enumerate(rows.tolist()):
        out[row] = {k: vals[j] for k, vals in taken if vals[j]}
    return out


def spans_from_table(
    table: pa.Table, *, all_attributes: bool = False, keys: tuple[str, ...] = (TASK_ID,)
) -> list[Span]:
    """Rows of SPANS_SCHEMA to ``Span`` records; irrelevant rows get no attributes unless asked. ``keys``:
    the resource attributes kept (and span attribute keys that make a row relevant besides the dialects')."""
    n = len(table)
    if n == 0:
        return []
    cols = {
        name: table.column(name) for name in ("trace_id", "span_id", "parent_span_id", "name", "rollout_id")
    }
    py = {k: v.to_pylist() for k, v in cols.items()}
    start, end = _ns(table.column("start_time_ns")), _ns(table.column("end_time_ns"))
    received = _ns(table.column("received_at"))
    mask = pa.array([True] * n) if all_attributes else relevant_mask(table, keys)
    idx = pc.indices_nonzero(mask)
    rel = idx.to_pylist()
    attrs = _maps_to_dicts(pc.take(table.column("attributes"), idx))
    resource = _resource_dicts(pc.take(table.column("resource_attributes"), idx), keys)
    events = pc.take(table.column("events"), idx).to_pylist()
    a_of: dict[int, tuple[dict[str, str], dict[str, str], tuple[SpanEvent, ...]]] = {}
    for j, i in enumerate(rel):
        ev = tuple(
            SpanEvent(e["name"], e["time_ns"] or 0, dict(e["attributes"] or [])) for e in events[j] or []
        )
        a_of[i] = (attrs[j], resource[j], ev)
    empty: tuple[dict[str, str], dict[str, str], tuple[SpanEvent, ...]] = ({}, {}, ())
    out = []
    tid, sid, par, nm, rid = py["trace_id"], py["span_id"], py["parent_span_id"], py["name"], py["rollout_id"]
    for i in range(n):
        a, r, ev = a_of.get(i, empty)
        out.append(
            Span(
                tid[i],
                sid[i],
                par[i] or None,
                nm[i] or "",
                start[i] or 0,
                end[i] or 0,
                a,
                r,
                ev,
                received[i] or 0,
                rid[i] or tid[i],
            )
        )
    return out


def materialize(table: pa.Table, keys: tuple[str, ...] = (TASK_ID,)) -> tuple[list[Span], int]:
    """Spans of complete rollouts as records, grouped by rollout: (records, duplicates dropped).

    Vectorised before any Python object exists: duplicates are dropped (earliest received kept),
    parents are resolved with a hash join, and spans that matter to no rule (tool internals,
    HTTP clients, ...) are pruned: every kept span is re-parented to its nearest kept ancestor
    (numpy pointer jumping). Kept: spans with relevant attributes, roots, and orphans (whose
    parent is missing, so the pure tree code still reports them). Agent attribution, gateway
    joins and rewards only ever look at kept spans, so the result equals the unpruned tree's.
    ``keys``: the attributes conversion reads besides the dialects' (``ConvertConfig.attribute_keys``:
    ``tracerl.task_id``, ``--task-key``): a span carrying one is kept with its attributes, and the
    resource attributes of the kept spans are kept for these keys alone.
    """
    n0 = len(table)
    if n0 == 0:
        return [], 0
    order = _first_received_order(table)
    table = table.select(SPAN_COLUMNS)
    narrow = table.select(["trace_id", "span_id", "parent_span_id"]).take(order)
    parent = _parent_rows(narrow)
    has_parent_id = pc.is_valid(narrow.column("parent_span_id")).to_numpy(zero_copy_only=False)
    orphan = has_parent_id & (parent < 0)
    relevant = relevant_mask(table, keys).to_numpy(zero_copy_only=False)[order.to_numpy(zero_copy_only=False)]
    keep = relevant | ~has_parent_id | orphan
    anc = _nearest_kept(parent, keep)
    kept_idx = np.nonzero(keep)[0]
    kept = table.select(SKELETON_COLUMNS).take(pc.take(order, pa.array(kept_idx))).combine_chunks()
    attrs, resource, events = _wide_columns(table, order, kept_idx, relevant[kept_idx], keys)
    # parent: the nearest kept ancestor, else the recorded parent of an orphan, else none (a root)
    anc_kept = anc[kept_idx]
    parents = pc.if_else(
        pa.array(anc_kept >= 0),
        pc.take(narrow.column("span_id"), pa.array(np.maximum(anc_kept, 0))),
        pc.if_else(
            pa.array(orphan[kept_idx]), kept.column("parent_span_id"), pa.nulls(len(kept), pa.string())
        ),
    )
    trace_ids, rollout_ids = kept.column("trace_id"), kept.column("rollout_id")
    rollouts = pc.if_else(pc.fill_null(pc.not_equal(rollout_ids, ""), False), rollout_ids, trace_ids)
    out = list(
        map(
            Span,
            trace_ids.to_pylist(),
            kept.column("span_id").to_pylist(),
            parents.to_pylist(),
            pc.fill_null(kept.column("name"), "").to_pylist(),
            _ns_or_0(kept.column("start_time_ns")),
            _ns_or_0(kept.column("end_time_ns")),
            attrs,
            resource,
            events,
            _ns_or_0(kept.column("received_at")),
            rollouts.to_pylist(),
        )
    )
    return out, n0 - len(narrow)


def _first_received_order(table: pa.Table) -> pa.Array:
    """Row indices sorted by (rollout, trace, span, received_at), each span's earliest copy only: sorted
    and deduplicated on the id columns alone (the wide columns are gathered once, at the end)."""
    n0 = len(table)
    ids = table.select(["rollout_id", "trace_id", "span_id", "received_at"])
    order = pc.sort_indices(
        ids,
        sort_keys=[
            ("rollout_id", "ascending"),
            ("trace_id", "ascending"),
            ("span_id", "ascending"),
            ("received_at", "ascending"),
        ],
    )
    ids = ids.take(order)
    tid_a, sid_a = ids.column("trace_id"), ids.column("span_id")
    if n0 > 1:
        same = pc.and_(
            pc.equal(tid_a.slice(1), tid_a.slice(0, n0 - 1)), pc.equal(sid_a.slice(1), sid_a.slice(0, n0 - 1))
        )
        first = np.concatenate([[True], ~same.to_numpy(zero_copy_only=False)])
        order = pc.filter(order, pa.array(first))
    return order


def _parent_rows(narrow: pa.Table) -> np.ndarray:
    """Each span's parent as a row of ``narrow`` (-1: none recorded, or not present): a hash join on
    (trace_id, parent_span_id) = (trace_id, span_id)."""
    m = len(narrow)
    rows = pa.array(np.arange(m))
    left = pa.table(
        {
            "trace_id": narrow.column("trace_id"),
            "parent_span_id": narrow.column("parent_span_id"),
            "row": rows,
        }
    )
    right = pa.table(
        {"trace_id": narrow.column("trace_id"), "span_id": narrow.column("span_id"), "prow": rows}
    )
    joined = left.join(
        right,
        keys=["trace_id", "parent_span_id"],
        right_keys=["trace_id", "span_id"],
        join_type="left outer",
        use_threads=False,
    )
    parent = np.full(m, -1, dtype=np.int64)
    parent[joined.column("row").to_numpy()] = pc.fill_null(joined.column("prow"), -1).to_numpy()
    return parent


def _nearest_kept(parent: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Each span's nearest kept ancestor (-1: none), by pointer jumping through pruned spans; the loop is
    bounded by the tree depth."""
    anc = parent.copy()
    for _ in range(len(parent)):
        hop = (anc >= 0) & ~keep[np.maximum(anc, 0)]
        if not hop.any():
            break
        anc[hop] = parent[anc[hop]]
    return anc


def _wide_columns(
    table: pa.Table, order: pa.Array, kept_idx: np.ndarray, rel_in_kept: np.ndarray, keys: tuple[str, ...]
) -> tuple[list, list, list]:
    """(attributes, resource attributes, events) of the kept spans, in kept order: Python objects for the
    relevant ones only (the rest get empties). The wide map columns are gathered in ascending row order
    with a row mask (the rows are unique, so a filter selects exactly them, 10x faster than a gather),
    then the objects are put in kept order."""
    n_kept = len(kept_idx)
    rel_rows = pc.take(order, pa.array(kept_idx[rel_in_kept]))  # rows of ``table`` that get attributes
    rel_np = rel_rows.to_numpy(zero_copy_only=False)
    asc = np.argsort(rel_np, kind="stable")
    row_mask = np.zeros(len(table), dtype=bool)
    row_mask[rel_np] = True
    row_mask_a = pa.array(row_mask)
    at = np.flatnonzero(rel_in_kept)[asc]  # where each relevant row (ascending) goes among the kept spans
    attrs = _placed(_maps_to_dicts(pc.filter(table.column("attributes"), row_mask_a)), at, n_kept)
    resource = _placed(
        _resource_dicts(pc.filter(table.column("resource_attributes"), row_mask_a), keys), at, n_kept
    )
    events = _events_placed(table.column("events"), rel_rows, np.flatnonzero(rel_in_kept), n_kept)
    return attrs, resource, events


def logs_from_table(table: pa.Table) -> list[LogEvent]:
    if len(table) == 0:
        return []
    attrs = _maps_to_dicts(table.column("attributes"))
    cols = {k: table.column(k).to_pylist() for k in ("trace_id", "span_id", "event_name", "body")}
    times = _ns(table.column("time_ns"))
    observed = _ns(table.column("observed_time_ns"))
    return [
        LogEvent(
            cols["trace_id"][i],
            cols["span_id"][i],
            times[i] or observed[i] or 0,
            cols["event_name"][i] or attrs[i].get("event.name", ""),
            cols["body"][i],
            attrs[i],
        )
        for i in range(len(table))
    ]


def rewards_from_table(table: pa.Table) -> list[tuple[str | None, str | None, Reward]]:
    """(rollout_id, trace_id, Reward) for each rewards row. A row that targets no call carries no
    time (``at_ns=None``): its time is when it was posted, not where in the rollout it belongs."""
    out = []
    for row in table.select(
        ["reward_id", "rollout_id", "trace_id", "span_id", "response_id", "name", "value", "source"]
    ).to_pylist():
        out.append(
            (
                row["rollout_id"],
                row["trace_id"],
                Reward(
                    float(row["value"]),
                    row["source"] or "side_channel",
                    row["name"],
                    row["span_id"],
                    row["response_id"],
                    None,
                    row["reward_id"],
                ),
            )
        )
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
