"""A round's dataset step: which transitions round k trains on, read from the store and turned into
samples (``trainer/dataset.py``), with the counts the manifest and the doctor report.

New round: the not-yet-used rollouts of versions v-K..v (``--max-staleness K``) whose feedback window
has closed (``--feedback-window``); a resumed round: exactly its recorded selection. The tokenizer is
loaded only if a row needs retokenizing (``LazyTokenizer``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from store.location import StoreLocation
from store.views import connect_readonly
from trainer.config import TrainSettings
from trainer.dataset import (
    DatasetConfig,
    DatasetStats,
    LazyTokenizer,
    Sample,
    build_samples,
    load_transitions,
)
from trainer.feedback_window import WindowSplit, feedback_split
from trainer.manifest import now_utc, read_selection, used_rollouts
from trainer.round_cap import over_cap


def dataset_config(s: TrainSettings) -> DatasetConfig:
    return DatasetConfig(max_prompt_tokens=s.max_prompt_tokens, max_response_tokens=s.max_response_tokens,
                         pack_tokens=s.pack_tokens, estimator=s.estimator, aggregation=s.aggregation,
                         stale_without_logprobs=s.stale_without_logprobs)


@dataclass
class DatasetStep:
    """What a round's dataset step found: the selection it resumes (None: a new round), the rows read,
    the samples built from them and their counts."""

    selection: dict[str, Any] | None
    lo: int
    rows: pa.Table
    tokenizer: LazyTokenizer
    window: WindowSplit
    exclude: set[str]
    samples: list[Sample]
    stats: DatasetStats


def dataset_step(settings: TrainSettings, loc: StoreLocation, k: int, v: int, base_model: Path) -> DatasetStep:
    """Round k's rows and samples, trained on version v (k, or the serving version after a rollback:
    ``start_version``): the selection of an interrupted run of k (redone on the same rollouts), else the
    not-yet-used rollouts of versions v-K..v whose feedback window has closed.
    The tokenizer is loaded only if a row needs retokenizing (``LazyTokenizer``): recorded token ids
    need none, and importing transformers was most of a fresh process's dataset step
    (``bench/dataset_step.py``)."""
    selection = read_selection(loc, k)
    lo = selection["versions"][0] if selection is not None else max(0, v - settings.max_staleness)
    con = connect_readonly(loc)
    rows = load_transitions(con, (lo, v), agents=settings.agents, tasks=settings.tasks,
                            unversioned=settings.unversioned_as)
    con.close()
    if selection is not None:
        rows = rows.filter(pc.is_in(rows["rollout_id"], pa.array(selection["rollout_ids"], pa.string())))
    tokenizer = LazyTokenizer(base_model)
    used = used_rollouts(loc, k) if selection is None else set()
    window = (feedback_split(settings.feedback_window, rows, used, int(now_utc().timestamp() * 1e9))
              if selection is None else WindowSplit())
    exclude = used | set(window.waiting) | window.unrewarded
    capped = over_cap(rows, exclude, settings.max_rollouts) if selection is None else set()
    exclude |= capped
    samples, stats = build_samples(rows, tokenizer, dataset_config(settings), exclude_rollouts=exclude,
                                   trained_version=v)
    stats.n_rollouts_feedback_waiting = len(window.waiting)
    stats.n_rollouts_unrewarded_at_close = len(window.unrewarded)
    stats.n_rollouts_over_cap = len(capped)
    if lo > 0 and selection is None:
        stats.n_rollouts_too_stale = _too_stale(settings, loc, lo, used)
    return DatasetStep(selection, lo, rows, tokenizer, window, exclude, samples, stats)


def usable_rollouts(rows: pa.Table, exclude: set[str]) -> set[str]:
    """Complete, rewarded rollouts in ``rows`` (consumed by this round even if their group had no signal)."""
    out = set()
    for r in rows.select(["rollout_id", "rollout_complete", "rollout_reward_used"]).to_pylist():
        if r["rollout_complete"] and r["rollout_reward_used"] is not None and r["rollout_id"] not in exclude:
            out.add(r["rollout_id"])
    return out


def _too_stale(settings: TrainSettings, loc: StoreLocation, lo: int, used: set[str]) -> int:
    """Complete, rewarded rollouts that started before version ``lo`` and no round used: out of the
    window for good (a level, not a flow: each such rollout is counted by every later round)."""
    con = connect_readonly(loc)
    try:
        rows = load_transitions(con, (0, lo - 1), agents=settings.agents, tasks=settings.tasks,
                                unversioned=settings.unversioned_as)
    finally:
        con.close()
    return len(usable_rollouts(rows, used))
