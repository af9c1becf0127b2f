"""The conversion pass: read spans, logs and rewards from the store, convert complete rollouts, write transitions.

One pass (``convert_store``) reads top to bottom:

1. open the ledger (``ledger.py``: what earlier passes did) and read the rewards;
2. pick the span files to read: those not yet fully converted, those of excluded rollouts whose
   reward has arrived, and those of converted rollouts a new reward row converts again;
3. read them, relabel each span to its rollout (``identity.py``), and compute every rollout's
   completion status with Arrow group-bys; sort rollouts into ready, pending and late;
4. convert the ready ones (``workers.py``: records from ``columnar.py``, ``convert_rollout`` per
   rollout, in-process or in worker processes, each chunk written where it was converted);
5. record what happened in the ledger and the stats (``stats.py``).

Re-running over the same spans writes nothing new. ``convert_loop.ConvertLoop`` runs passes inside the collector.
The store is a local directory or an ``s3://`` prefix: every read and write goes through ``store/``
(``StoreLocation``'s file system, the one atomic writer, and its lock: flock locally, a lease on S3).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from schemas.tables import LOGS_SCHEMA, REWARDS_SCHEMA, SPANS_SCHEMA, TRANSITIONS_SCHEMA
from span_to_transition.columnar import _ns, logs_from_table, spans_from_table
from span_to_transition.content_join import ContentJoin
from span_to_transition.convert import ConvertConfig
from span_to_transition.feedback import FeedbackRows, count_unjoined, join_feedback, reward_rows
from span_to_transition.identity import assign_rollouts, link_rollouts
from span_to_transition.ledger import Ledger, row_settings, settings_note
from span_to_transition.records import Reward
from span_to_transition.stats import MAX_PROBLEMS, ConvertStats
from span_to_transition.store_read import read_files, read_numbered, relative, rollout_statuses, table_files
from span_to_transition.tree import RolloutStatus, decide_completion
from span_to_transition.workers import Packed, WriteTo, Written, convert_parallel
from store.lease import CONVERTER_LOCK, hold
from store.location import StoreLocation

__all__ = [
    "ConvertStats",
    "convert_store",
    "link_rollouts",
    "logs_from_table",
    "spans_from_table",
]
"""The pass, and the names other packages and tests import from here (their homes are the modules above)."""


def convert_store(
    loc: StoreLocation, config: ConvertConfig, now_ns: int | None = None, *, rebuild: bool = False
) -> ConvertStats:
    """Convert every complete, not yet converted rollout in the store at ``loc``; safe to call repeatedly.

    A rollout is converted again when a reward row for it arrives after its conversion, and every
    rollout is with ``rebuild`` (to apply changed --agents/--credit/--missing-reward settings).
    New rows carry a higher ``conversion`` number; the ``transitions`` view shows each rollout's
    latest conversion only, so a crash between writing and cleaning up never shows a row twice.

    The collector calls this periodically (``collect --convert``) and ``tracerl convert`` calls it
    once; both give the same transitions because completion and conversion depend only on the
    spans and ``now_ns``. Returns what happened, including late spans and excluded rollouts.
    Concurrent callers on one store (the collector and a manual ``tracerl convert``, on one host or
    several sharing a bucket) take turns on the store's lock (``store/lease.py``), so no rollout is
    ever written twice; the lease is confirmed right before the ledger is saved (the commit point).
    """
    with hold(loc, CONVERTER_LOCK) as held:
        return _convert_store_locked(loc, config, now_ns, rebuild, held.confirm)


def _convert_store_locked(
    layout: StoreLocation,
    config: ConvertConfig,
    now_ns: int | None,
    rebuild: bool = False,
    confirm: Callable[[], None] = lambda: None,
) -> ConvertStats:
    t0 = time.perf_counter()
    config.validate()
    now_ns = time.time_ns() if now_ns is None else now_ns
    stats = ConvertStats()
    old_transition_files = table_files(layout, "transitions")
    ledger, converted, conversion = _open_ledger(layout, old_transition_files, config, rebuild, stats)
    span_files = table_files(layout, "spans")
    rel = {f: relative(layout, "spans", f) for f in span_files}
    rewards = _read_rewards(
        layout, ledger, converted, rebuild, span_files, rel, config.reward_rule().may_count
    )
    todo = _files_to_read(layout, span_files, rel, ledger, rewards)
    stats.span_files_read = len(todo)
    if not todo:
        _nothing_to_read(layout, ledger, converted, rewards, stats, confirm)
        return _finish(stats, ledger, t0)

    spans = read_numbered(layout, todo, SPANS_SCHEMA)
    lap = stats.lap("read", t0)
    spans = _assign(spans, ledger, config, stats)
    statuses = rollout_statuses(spans)
    stats.rollouts_seen = len(statuses)
    ready, timed_out, late_rollouts = _triage(statuses, converted, ledger, rewards, config, now_ns, stats)
    _count_late_spans(spans, late_rollouts, converted, ledger, stats)
    lap = stats.lap("status", lap)

    pairs = spans.select(["_file", "rollout_id"]).group_by(["_file", "rollout_id"]).aggregate([])
    _remember_waiting_files(pairs, ready, statuses, [rel[f] for f in todo], ledger)

    outputs = _convert_ready(
        layout, spans, ready, timed_out, len(statuses), rewards.rows, config, conversion, stats
    )
    lap = stats.lap("convert", lap)  # converting and writing the transitions
    excluded_now = [
        o.rollout_id for o in outputs if not isinstance(o, str) and o.status == "excluded_no_reward"
    ]
    watermark = {r: statuses[r].last_received_ns for r in ready}
    files_of_excluded = _files_of(pairs, excluded_now, [rel[f] for f in todo])
    _record(outputs, watermark, files_of_excluded, rewards.reconvert, ledger, stats)
    known = set(converted) | set(ledger.converted) | set(ledger.excluded) | set(statuses)
    stats.rewards_unjoined, stats.unjoined_samples = count_unjoined(rewards, known, ledger)

    _mark_files_done(pairs, statuses, todo, rel, ledger)
    ledger.reward_files = set(rewards.files)
    confirm()
    ledger.save(layout)
    if rebuild:  # every rollout has newer rows now: the older files only hold superseded ones
        _remove_superseded(layout, old_transition_files, stats)
    stats.lap("ledger", lap)
    return _finish(stats, ledger, t0)


def _nothing_to_read(
    layout: StoreLocation,
    ledger: Ledger,
    converted: dict[str, int],
    rewards: FeedbackRows,
    stats: ConvertStats,
    confirm: Callable[[], None],
) -> None:
    """A pass with no span file to read: count the unjoined rewards, and save the ledger if a rewards file is new."""
    stats.rewards_unjoined, stats.unjoined_samples = count_unjoined(
        rewards, set(converted) | set(ledger.excluded), ledger
    )
    if rewards.any_new:
        ledger.reward_files = set(rewards.files)
        confirm()
        ledger.save(layout)


def _remember_waiting_files(
    pairs: pa.Table,
    ready: list[str],
    statuses: dict[str, RolloutStatus],
    rel_files: list[str],
    ledger: Ledger,
) -> None:
    """Late spans of an excluded rollout must be read again if it is retried: add their files to its entry."""
    ready_set = set(ready)
    waiting = [r for r in ledger.excluded if r in statuses and r not in ready_set]
    files_of = _files_of(pairs, waiting, rel_files)
    for r in waiting:
        ledger.excluded[r] = sorted(set(ledger.excluded[r]) | files_of.get(r, set()))


def _assign(spans: pa.Table, ledger: Ledger, config: ConvertConfig, stats: ConvertStats) -> pa.Table:
    """Every span's rollout (``assign_rollouts``: its trace's, a linked or content-joined trace's), the
    ledger's trace map updated; content-join ties and near-misses counted and named."""
    joins = ContentJoin()
    spans, ledger.traces = assign_rollouts(
        spans, ledger.traces, config.follow_links, config.rollout_key, joins
    )
    stats.content_ties += len(joins.ties)
    stats.content_near_misses += len(joins.near_misses)
    stats.problems.extend(
        f"gateway span {g} matches no single agent call by content ({what}); its trace joins no rollout and the "
        "call stays retokenized"
        for what, ids in (
            ("a tie: several calls, or another gateway span", joins.ties),
            ("a near-miss: request or response only", joins.near_misses),
        )
        for g in ids
    )
    stats.spans_read = len(spans)
    return spans


def _mark_files_done(
    pairs: pa.Table, statuses: dict[str, RolloutStatus], todo: list[str], rel: dict[str, str], ledger: Ledger
) -> None:
    """A span file is done when none of its rollouts is still pending (neither converted nor excluded)."""
    pending = [r for r in statuses if r not in ledger.converted and r not in ledger.excluded]
    rollout_col = pairs.column("rollout_id")
    pending_mask = pc.or_(
        pc.is_in(rollout_col, value_set=pa.array(pending, pa.string())), pc.is_null(rollout_col)
    )
    pending_files = set(pairs.column("_file").filter(pending_mask).to_pylist())
    for i, f in enumerate(todo):
        if i not in pending_files:
            ledger.files_done.add(rel[f])


def _remove_superseded(layout: StoreLocation, old_transition_files: list[str], stats: ConvertStats) -> None:
    """``--rebuild``: the transition files this pass did not write hold only superseded rows."""
    stats.rollouts_reconverted = stats.rollouts_converted
    written = set(stats.files_written)
    for f in old_transition_files:
        if f not in written:
            with contextlib.suppress(FileNotFoundError):
                layout.fs.delete_file(f)
            stats.files_removed += 1


def _open_ledger(
    layout: StoreLocation,
    transition_files: list[str],
    config: ConvertConfig,
    rebuild: bool,
    stats: ConvertStats,
) -> tuple[Ledger, dict[str, int], int]:
    """The ledger (fresh for a rebuild, keeping the trace -> rollout pairs), the rollouts already
    converted (the ledger's, plus any with rows the ledger lost: never converted twice), and this
    pass's ``conversion`` number."""
    ledger = Ledger.load(layout)
    existing = read_files(layout, transition_files, TRANSITIONS_SCHEMA, ["rollout_id", "conversion"])
    conversion = int(pc.max(existing.column("conversion")).as_py() or 0) + 1
    settings = row_settings(config)
    if rebuild:  # every rollout again, from every span file; the trace -> rollout pairs stay known
        ledger = Ledger(traces=ledger.traces, responses=ledger.responses)
    stats.settings_changed = settings_note(ledger.settings, settings)
    if not ledger.settings:  # a new store, a rebuild, or a ledger from before settings were recorded
        ledger.settings = settings
    converted = dict(ledger.converted)
    if not rebuild:
        for r in pc.unique(existing.column("rollout_id")).to_pylist():
            converted.setdefault(r, 0)  # transitions exist but the ledger lost it: never convert twice
    return ledger, converted, conversion


def _read_rewards(
    layout: StoreLocation,
    ledger: Ledger,
    converted: dict[str, int],
    rebuild: bool,
    span_files: list[str],
    rel: dict[str, str],
    counts: Callable[[Reward], bool],
) -> FeedbackRows:
    """The rewards rows that count, joined to their rollouts (``feedback.join_feedback``); only those
    ``counts`` accepts (``--reward-from``) retry or reconvert a rollout."""
    reward_files = table_files(layout, "rewards")
    reward_rel = [relative(layout, "rewards", f) for f in reward_files]
    new_reward_file = [r not in ledger.reward_files for r in reward_rel]
    reward_table = read_numbered(layout, reward_files, REWARDS_SCHEMA)
    rows = reward_rows(reward_table, (i for i, new in enumerate(new_reward_file) if new))

    def scan(all_files: bool) -> list[pa.Table]:
        files = span_files if all_files else [f for f in span_files if rel[f] not in ledger.files_done]
        return [
            pq.read_table(f, columns=["trace_id", "rollout_id", "attributes"], filesystem=layout.fs)
            for f in files
        ]

    out = join_feedback(rows, ledger, converted, rebuild, scan, counts)
    out.files, out.any_new = reward_rel, any(new_reward_file)
    return out


def _files_to_read(
    layout: StoreLocation, span_files: list[str], rel: dict[str, str], ledger: Ledger, rewards: FeedbackRows
) -> list[str]:
    """Span files not yet fully converted, and the done ones holding a rollout to retry or reconvert."""
    extra: set[str] = set()
    if rewards.reconvert:
        traces = rewards.reconvert | {t for t, r in ledger.traces.items() if r in rewards.reconvert}
        done = [f for f in span_files if rel[f] in ledger.files_done]
        extra = _files_with(layout, done, rewards.reconvert, traces)
    return [
        f
        for f in span_files
        if rel[f] not in ledger.files_done or f in extra or any(rel[f] in v for v in rewards.retry.values())
    ]


def _files_with(layout: StoreLocation, files: list[str], rollouts: set[str], traces: set[str]) -> set[str]:
    """The span files holding any span of these rollouts (by rollout id, or by trace for spans that
    name no rollout, such as the gateway's)."""
    out = set()
    rollout_set, trace_set = pa.array(sorted(rollouts), pa.string()), pa.array(sorted(traces), pa.string())
    for f in files:
        ids = pq.read_table(f, columns=["rollout_id", "trace_id"], filesystem=layout.fs)
        if (
            pc.any(pc.is_in(ids.column("rollout_id"), value_set=rollout_set)).as_py()
            or pc.any(pc.is_in(ids.column("trace_id"), value_set=trace_set)).as_py()
        ):
            out.add(f)
    return out


def _triage(
    statuses: dict[str, RolloutStatus],
    converted: dict[str, int],
    ledger: Ledger,
    rewards: FeedbackRows,
    config: ConvertConfig,
    now_ns: int,
    stats: ConvertStats,
) -> tuple[list[str], frozenset[str], list[str]]:
    """(ready, timed out, late): rollouts to convert now, those of them complete only because
    --max-wait-s passed without their root span, and converted ones whose spans were read again.
    Excluded rollouts without a new reward are skipped; the rest are pending (counted by wait)."""
    quiet_ns, wait_ns = int(config.quiet_s * 1e9), int(config.max_wait_s * 1e9)
    ready: list[str] = []
    timed_out: set[str] = set()
    late: list[str] = []
    for r, st in statuses.items():
        if r in rewards.reconvert:
            ready.append(r)
        elif r in converted:
            late.append(r)
        elif r in ledger.excluded and r not in rewards.retry:
            continue
        elif (done := decide_completion(st, now_ns, quiet_ns, wait_ns)).complete:
            ready.append(r)
            if done.reason == "timeout_without_root":
                timed_out.add(r)
        else:
            stats.rollouts_pending += 1
            stats.pending_waits[done.reason] = stats.pending_waits.get(done.reason, 0) + 1
    return ready, frozenset(timed_out), late


def _count_late_spans(
    spans: pa.Table, late_rollouts: list[str], converted: dict[str, int], ledger: Ledger, stats: ConvertStats
) -> None:
    """Spans of converted rollouts received after their watermark: recorded in the ledger, counted."""
    if not late_rollouts:
        return
    lt = spans.filter(pc.is_in(spans.column("rollout_id"), value_set=pa.array(late_rollouts)))
    for r, s, rx in zip(
        lt.column("rollout_id").to_pylist(), lt.column("span_id").to_pylist(), _ns(lt.column("received_at"))
    ):
        if rx > converted[r] and converted[r] > 0:
            known = ledger.late.setdefault(r, [])
            if s not in known:
                known.append(s)
                stats.late_spans += 1


def _convert_ready(
    layout: StoreLocation,
    spans: pa.Table,
    ready: list[str],
    timed_out: frozenset[str],
    n_rollouts: int,
    reward_rows: list[tuple[str | None, str | None, Reward]],
    config: ConvertConfig,
    conversion: int,
    stats: ConvertStats,
) -> Packed:
    """Convert the ready rollouts with their log events and reward rows; the rows are written by the
    sink where they are converted, and only counts come back."""
    outputs: Packed = []
    if not ready:
        return outputs
    sel = (
        spans
        if len(ready) == n_rollouts
        else spans.filter(pc.is_in(spans.column("rollout_id"), value_set=pa.array(ready)))
    )
    sel = sel.drop_columns(["_file"])
    trace_ids = pc.unique(sel.column("trace_id"))
    logs = logs_from_table(
        read_files(
            layout,
            table_files(layout, "logs"),
            LOGS_SCHEMA,
            filter=(ds.field("trace_id").isin(trace_ids)) & pc.starts_with(ds.field("event_name"), "gen_ai."),
        )
    )
    rewards_by: dict[str, list[Reward]] = {}
    for r_id, t_id, rw in reward_rows:
        rewards_by.setdefault(r_id or f"trace:{t_id}", []).append(rw)
    for written, outs in convert_parallel(
        sel, logs, rewards_by, config, len(ready), WriteTo(layout, conversion), timed_out
    ):
        assert isinstance(written, Written)
        stats.files_written += written.files
        stats.transitions_written += written.rows
        stats.trainable_transitions += written.trainable
        outputs.extend(outs)
    return outputs


def _files_of(pairs: pa.Table, rollouts: list[str], rel_files: list[str]) -> dict[str, set[str]]:
    """The span files (relative to ``spans/``) holding each of ``rollouts``, from the pass's distinct
    (``_file``, ``rollout_id``) ``pairs``. Only the ledger's excluded rollouts need theirs (so a later
    reward can retry them), a few among many: they are picked on the Arrow columns, not by a Python pass
    over every pair (which cost more than a second of the pass's serial time per 100k rollouts)."""
    if not rollouts:
        return {}
    hit = pairs.filter(pc.is_in(pairs.column("rollout_id"), value_set=pa.array(rollouts, pa.string())))
    out: dict[str, set[str]] = {}
    for fi, r in zip(hit.column("_file").to_pylist(), hit.column("rollout_id").to_pylist()):
        out.setdefault(r, set()).add(rel_files[fi])
    return out


def _record(
    outputs: Packed,
    watermark: dict[str, int],
    files_of: dict[str, set[str]],
    reconvert: set[str],
    ledger: Ledger,
    stats: ConvertStats,
) -> None:
    """Each converted rollout's outcome into the ledger (converted with its watermark, or excluded
    with its span files so a later reward can retry it) and the stats. A rollout id alone
    (``workers.Packed``) converted with nothing to report."""
    for o in outputs:
        if isinstance(o, str):
            _record_converted(o, watermark, reconvert, ledger, stats)
            stats.rollouts_converted += 1
            continue
        stats.duplicate_spans += o.duplicates
        stats.orphan_spans += o.orphans
        stats.calls_without_content += o.calls_without_content
        stats.duplicate_calls += o.duplicate_calls
        stats.content_joined += o.content_joined
        stats.content_ties += o.content_ties
        stats.content_near_misses += o.content_near_misses
        for reason, n in o.untrainable_reasons.items():
            stats.untrainable_reasons[reason] = stats.untrainable_reasons.get(reason, 0) + n
        stats.problems.extend(o.problems[: MAX_PROBLEMS - len(stats.problems)])
        if o.reason:
            reasons = (
                stats.excluded_reasons if o.status == "excluded_no_reward" else stats.without_calls_reasons
            )
            reasons[o.reason] = reasons.get(o.reason, 0) + 1
        if o.status == "excluded_no_reward":
            stats.rollouts_excluded_no_reward += 1
            ledger.excluded[o.rollout_id] = sorted(
                set(ledger.excluded.get(o.rollout_id, [])) | files_of[o.rollout_id]
            )
            continue
        _record_converted(o.rollout_id, watermark, reconvert, ledger, stats)
        if o.status == "no_calls":
            stats.rollouts_without_calls += 1
            continue
        stats.rollouts_converted += 1
        stats.rollouts_filled_reward += int(o.filled_reward)


def _record_converted(
    rollout_id: str, watermark: dict[str, int], reconvert: set[str], ledger: Ledger, stats: ConvertStats
) -> None:
    ledger.excluded.pop(rollout_id, None)
    ledger.converted[rollout_id] = watermark[rollout_id]
    if rollout_id in reconvert:
        stats.rollouts_reconverted += 1
        ledger.late.pop(rollout_id, None)  # its late spans are converted now


def _finish(stats: ConvertStats, ledger: Ledger, t0: float) -> ConvertStats:
    stats.late_spans_total = sum(len(v) for v in ledger.late.values())
    stats.seconds = time.perf_counter() - t0
    return stats
