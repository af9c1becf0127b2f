"""Feedback rows (the rewards table) joined to rollouts by what a client holds.

A row names its rollout by ``rollout_id`` (``tracerl.rollout_id``), by ``trace_id`` (the trace the
request ran in, or a trace joined to a rollout: ``Ledger.traces``), or only by ``response_id``: the
OpenAI id the app got back (``chatcmpl-...``), which joins the rollout whose call span or gateway
span recorded that ``gen_ai.response.id`` (or, for OpenInference, kept it in ``output.value``: the
same places ``identity.gateway_rollouts`` looks).

Two rows with the same ``reward_id`` are one reward: a retried POST (same value) or a correction
(a later value); the latest by received ``at`` wins (``latest_rows``), so a rollout's reward sums
over distinct reward ids only. A row whose keys match no rollout is kept and counted as unjoined
(``unjoined``): feedback may name a trace that was never exported, or arrive before its spans.

Pure functions over records, ``response_rollouts`` (an Arrow scan of span rows) and
``join_feedback``, what a conversion pass does with the rows (its span reads are passed in).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

import pyarrow as pa
import pyarrow.compute as pc

from span_to_transition.identity import _OUTPUT_ID, GATEWAY_FLAG
from span_to_transition.ledger import Ledger
from span_to_transition.records import Reward

MAX_UNJOINED_SAMPLES = 5
"""Sample keys of unjoined rows kept for ``tracerl doctor`` and ``tracerl status``."""


@dataclass(frozen=True)
class RewardRow:
    """One rewards-table row as the join sees it: its keys, its reward, when it was received and where it
    was read (``order``: file, then row; it breaks ties between rows received in the same nanosecond)."""

    rollout_id: str | None
    trace_id: str | None
    reward: Reward
    at_ns: int | None = None
    order: tuple[int, int] = (0, 0)
    new: bool = False  # read from a rewards file no earlier pass applied

    @property
    def response_only(self) -> bool:
        return self.rollout_id is None and self.trace_id is None and bool(self.reward.response_id)

    def key(self) -> str:
        """The key a person would look for, for samples of unjoined rows."""
        if self.rollout_id is not None:
            return f"rollout_id={self.rollout_id}"
        if self.trace_id is not None:
            return f"trace_id={self.trace_id}"
        return f"response_id={self.reward.response_id}"


def reward_rows(table: pa.Table, new_files: Iterable[int] = ()) -> list[RewardRow]:
    """The rows of a rewards table read with a ``_file`` column (``store_read.read_numbered``)."""
    new = set(new_files)
    cols = [
        "reward_id",
        "rollout_id",
        "trace_id",
        "span_id",
        "response_id",
        "name",
        "value",
        "source",
        "_file",
    ]
    at = pc.cast(table.column("at"), pa.int64()).to_pylist() if len(table) else []
    out = []
    for i, (row, at_ns) in enumerate(zip(table.select(cols).to_pylist(), at)):
        reward = Reward(
            float(row["value"]),
            row["source"] or "side_channel",
            row["name"],
            row["span_id"],
            row["response_id"],
            None,
            row["reward_id"],
        )  # a posted row carries no place in time
        out.append(
            RewardRow(
                row["rollout_id"], row["trace_id"], reward, at_ns, (row["_file"], i), row["_file"] in new
            )
        )
    return out


def latest_rows(rows: Iterable[RewardRow]) -> list[RewardRow]:
    """One row per ``reward_id``: the latest received (a correction replaces the earlier value; a retry is
    the same row twice). Rows without a ``reward_id`` are all kept. Keeps the input order of the winners."""
    rows = list(rows)
    best: dict[str, RewardRow] = {}
    touched: set[str] = set()  # reward ids with a row in a new file: their winner is news to this pass
    for r in rows:
        rid = r.reward.reward_id
        if rid is None:
            continue
        if r.new:
            touched.add(rid)
        cur = best.get(rid)
        if cur is None or (_at(r), r.order) > (_at(cur), cur.order):
            best[rid] = r
    out = [r for r in rows if r.reward.reward_id is None or best[r.reward.reward_id] is r]
    return [replace(r, new=True) if r.reward.reward_id in touched else r for r in out]


def _at(r: RewardRow) -> int:
    return -1 if r.at_ns is None else r.at_ns  # an offline row without a time is older than any posted one


def target(row: RewardRow, traces: Mapping[str, str], responses: Mapping[str, str]) -> str | None:
    """The rollout a row rewards, or None when its only key is a response id not (yet) seen on a span."""
    if row.rollout_id is not None:
        return row.rollout_id
    if row.trace_id is not None:
        return traces.get(row.trace_id) or row.trace_id
    return responses.get(row.reward.response_id or "")


@dataclass
class Unjoined:
    """Feedback whose keys match no rollout the store has seen: kept, counted, sampled."""

    count: int = 0
    samples: list[str] = field(default_factory=list)


def unjoined(
    rows: Iterable[RewardRow],
    known: set[str] | Mapping[str, object],
    traces: Mapping[str, str],
    responses: Mapping[str, str],
) -> Unjoined:
    """The rows (winners of ``latest_rows``) whose target is no known rollout (converted, excluded or pending)."""
    out = Unjoined()
    for r in rows:
        t = target(r, traces, responses)
        if t is None or t not in known:
            out.count += 1
            if len(out.samples) < MAX_UNJOINED_SAMPLES:
                out.samples.append(r.key())
    return out


def response_ids(attributes: pa.ChunkedArray | pa.Array) -> pa.Array:
    """Each span's provider response id: ``gen_ai.response.id``, or the id inside OpenInference's ``output.value``."""
    return pc.coalesce(
        pc.map_lookup(attributes, "gen_ai.response.id", "first"),
        pc.struct_field(
            pc.extract_regex(pc.map_lookup(attributes, "output.value", "first"), _OUTPUT_ID), "id"
        ),
    )


def response_rollouts(spans: pa.Table, wanted: set[str], traces: Mapping[str, str]) -> dict[str, str]:
    """response id -> rollout, for the ``wanted`` ids recorded on these span rows (``trace_id``,
    ``rollout_id`` and ``attributes`` columns, as stored). A span's rollout is its trace's (``traces``),
    else its own ``rollout_id``, else its trace id. The agent's call span wins over a gateway span with
    the same id: a gateway trace the agent did not propagate into is its own trace until joined."""
    if not wanted or not len(spans):
        return {}
    ids = response_ids(spans.column("attributes"))
    hit = pc.fill_null(pc.is_in(ids, value_set=pa.array(sorted(wanted), pa.string())), False)
    if not pc.any(hit).as_py():
        return {}
    sel = spans.filter(hit)
    gateway = pc.fill_null(
        pc.equal(pc.map_lookup(sel.column("attributes"), GATEWAY_FLAG, "first"), "true"), False
    )
    out: dict[str, tuple[bool, str]] = {}
    for rid, trace, rollout, gw in zip(
        pc.filter(ids, hit).to_pylist(),
        sel.column("trace_id").to_pylist(),
        sel.column("rollout_id").to_pylist(),
        gateway.to_pylist(),
    ):
        found = (gw, traces.get(trace) or rollout or trace)
        if rid not in out or found < out[rid]:  # a call span (gw False) before a gateway span
            out[rid] = found
    return {rid: rollout for rid, (_, rollout) in out.items()}


@dataclass
class FeedbackRows:
    """The rewards table as a conversion pass sees it (the latest row per ``reward_id``), and what it changes."""

    rows: list[tuple[str | None, str | None, Reward]]  # (rollout_id, trace_id, reward) per joinable row
    winners: list[RewardRow]  # every row that counts, joined or not
    files: list[str] = field(default_factory=list)  # every rewards file, relative to rewards/
    any_new: bool = False  # a rewards file the ledger has not applied yet
    retry: dict[str, list[str]] = field(
        default_factory=dict
    )  # excluded rollout now rewarded -> its span files
    reconvert: set[str] = field(default_factory=set)  # converted rollouts with a reward row newer than that


SpanScan = Callable[[bool], list[pa.Table]]
"""``scan(all_files)``: span rows (``trace_id``, ``rollout_id``, ``attributes``) of every span file, or
(False) of those not fully converted yet."""


def join_feedback(
    rows: list[RewardRow],
    ledger: Ledger,
    converted: Mapping[str, int],
    rebuild: bool,
    scan: SpanScan,
    counts: Callable[[Reward], bool] = lambda _r: True,
) -> FeedbackRows:
    """The rows that count (a correction replaces the row with its ``reward_id``), each joined to its
    rollout, and the rollouts they retry (excluded for want of a reward) or convert again (a reward newer
    than their conversion, or a response id joined only now). Only a row ``counts`` accepts (the
    converter's ``--reward-from`` may select it) retries or reconverts: a reward of a name that is never
    summed would convert its rollout again to the same rows on every pass."""
    winners = latest_rows(rows)
    joined_now = _join_responses(winners, ledger, scan)
    out = FeedbackRows([], winners)
    for w in winners:
        if not w.response_only:
            out.rows.append((w.rollout_id, w.trace_id, w.reward))
        elif (rid := ledger.responses.get(w.reward.response_id or "")) is not None:
            out.rows.append((rid, None, w.reward))
    rewarded = {x for r_id, t_id, rw in out.rows if counts(rw) for x in (r_id, t_id) if x}
    out.retry = {r: files for r, files in ledger.excluded.items() if r in rewarded}
    if not rebuild:
        for w in winners:
            if counts(w.reward) and (w.new or (w.response_only and w.reward.response_id in joined_now)):
                rid = target(w, ledger.traces, ledger.responses)
                if rid in converted:
                    out.reconvert.add(rid)
    return out


def _join_responses(winners: list[RewardRow], ledger: Ledger, scan: SpanScan) -> set[str]:
    """Join feedback keyed only by a response id to the rollout whose span recorded it, into
    ``ledger.responses`` (looked up until found, then never again). A new row is looked up in every
    span file; an older one only in the files not fully converted (spans that arrived since).
    Returns the response ids joined now."""
    wanted = {
        w.reward.response_id: w.new
        for w in winners
        if w.response_only and w.reward.response_id and w.reward.response_id not in ledger.responses
    }
    if not wanted:
        return set()
    value_set = pa.array(sorted(wanted), pa.string())
    hits = []
    for t in scan(any(wanted.values())):
        hit = pc.fill_null(pc.is_in(response_ids(t.column("attributes")), value_set=value_set), False)
        if pc.any(hit).as_py():
            hits.append(t.filter(hit))
    if not hits:
        return set()
    found = response_rollouts(pa.concat_tables(hits), set(wanted), ledger.traces)
    ledger.responses.update(found)
    return set(found)


def count_unjoined(rewards: FeedbackRows, known: set[str], ledger: Ledger) -> tuple[int, list[str]]:
    """Feedback whose keys match no rollout seen (converted, excluded or pending): recorded in the ledger
    (for ``tracerl status`` and ``doctor``) and returned as (count, sample keys); never dropped."""
    u = unjoined(rewards.winners, known, ledger.traces, ledger.responses)
    ledger.unjoined = {"count": u.count, "samples": u.samples}
    return u.count, u.samples
