"""Transitions (Parquet) -> token sequences (``Sample``), which ``trainer.packing`` batches.

Two steps, each a function with its counts in ``DatasetStats`` so the round metrics say exactly
what was used, retokenized, truncated or dropped:

1. ``load_transitions``: one DuckDB query over the store picks the rollouts that started on the
   requested policy versions (a rollout's version is its first call's: one rollout never straddles
   the window), deduplicates replayed rows by ``transition_id``, marks whether each rollout is
   complete (one of its calls has ``is_last``) and derives the rollout reward, then keeps the
   selected calls (``trainable``, agent-name regex).
2. ``build_samples``: token ids come from the row when the gateway/span recorded them; otherwise
   the prompt and response are rendered with the model's chat template and tokenized (the row is
   marked ``retokenized`` and has no serving logprobs). Truncation is explicit: the prompt keeps
   its *last* ``max_prompt_tokens`` tokens (the most recent context), the response its *first*
   ``max_response_tokens``; both are counted. Each sample gets its rollout's advantage and a
   loss weight (see ``trainer.advantages``). With asynchronous rounds a call of an older version
   than the one trained on is *stale*; the loss corrects it with the engine's logprobs, so a stale
   call without them (retokenized) is dropped and counted, unless ``stale_without_logprobs`` says
   to train on it as if it were on-policy.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from trainer.advantages import (
    AUTO,
    RolloutReward,
    choose_estimator,
    per_rollout_token_weights,
    rollout_advantages,
)

TRANSITIONS_SQL = """
WITH latest AS (
    SELECT *, coalesce(policy_version, $unversioned) AS call_version FROM transitions
    QUALIFY row_number() OVER (PARTITION BY transition_id ORDER BY ended_at DESC NULLS LAST) = 1
),
started AS (  -- a rollout's version is the one it started on: the version of its first (oldest) call
    SELECT rollout_id, min(call_version) AS rollout_version FROM latest GROUP BY rollout_id
    HAVING min(call_version) BETWEEN $lo AND $hi
),
marked AS (
    SELECT latest.*, started.rollout_version,
        bool_or(coalesce(is_last, false)) OVER (PARTITION BY latest.rollout_id) AS rollout_complete,
        coalesce(max(rollout_reward) OVER (PARTITION BY latest.rollout_id),
                 sum(reward) OVER (PARTITION BY latest.rollout_id)) AS rollout_reward_used
    FROM latest JOIN started USING (rollout_id)
)
SELECT * FROM marked
WHERE ($all_calls OR coalesce(trainable, false))
  AND untrainable_reason IS NULL  -- malformed chat (span_to_transition): never trained, even with all calls
  AND ($agents IS NULL OR regexp_matches(coalesce(agent_name, ''), $agents))
  AND ($tasks IS NULL OR regexp_matches(coalesce(task_id, ''), $tasks))
ORDER BY rollout_id, step, transition_id
"""


@dataclass
class DatasetConfig:
    """How transitions become token sequences."""

    max_prompt_tokens: int = 1024
    max_response_tokens: int = 1024
    pack_tokens: int = 2048
    estimator: str = AUTO  # or a name of trainer.advantages.ESTIMATORS
    aggregation: str = "rollout"
    require_complete: bool = True
    stale_without_logprobs: str = "drop"  # or "train" (as if on-policy)


@dataclass
class DatasetStats:
    """What happened to the rows, reported in the round metrics."""

    n_transitions: int = 0
    n_rollouts: int = 0
    n_rollouts_incomplete: int = 0
    n_rollouts_no_reward: int = 0
    n_groups: int = 0
    n_groups_zero_variance: int = 0
    n_rollouts_zero_variance: int = 0
    n_retokenized: int = 0
    n_truncated_prompt: int = 0
    n_truncated_response: int = 0
    n_empty_response: int = 0
    n_samples: int = 0
    n_response_tokens: int = 0
    mean_reward: float = float("nan")
    n_stale_no_logprobs: int = (
        0  # stale calls without the engine's logprobs, dropped (or trained as on-policy)
    )
    n_rollouts_too_stale: int = 0  # unused rollouts older than the staleness window: never trained on
    staleness: dict[int, int] = field(default_factory=dict)  # samples by (trained version - call version)
    estimator: str = ""  # the estimator used (``--estimator auto`` resolved) and why
    estimator_reason: str = ""
    n_rollouts_feedback_waiting: int = (
        0  # --feedback-window still open: not trained yet, a later round takes them
    )
    n_rollouts_unrewarded_at_close: int = 0  # no feedback when the window closed: left out
    n_rollouts_over_cap: int = 0  # --max-rollouts: not the newest N, left for a later round (not consumed)


@dataclass
class Sample:
    """One model call ready to train on: prompt and response ids plus its advantage and weight."""

    transition_id: str
    rollout_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float] | None
    advantage: float = 0.0
    weight: float = 0.0  # loss weight of each response token
    retokenized: bool = False
    staleness: int = 0  # versions between the one this call was sampled from and the one trained on

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


class LazyTokenizer:
    """The base model's tokenizer, loaded on first use. Importing transformers and loading a tokenizer
    was most of a fresh process's dataset step (1.4-1.6 s of 1.7 s for 48 calls on 2 CPU cores), and
    rows whose token ids were recorded never need it. ``pad_token_id`` is read from the tokenizer
    files without loading it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._tokenizer: Any = None

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def get(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.path)
        return self._tokenizer

    @property
    def pad_token_id(self) -> int | None:
        if self._tokenizer is None:
            found = pad_token_id_from_files(self.path)
            if found is not None:
                return found
        return self.get().pad_token_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.get()(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.get())


def pad_token_id_from_files(model_dir: Path) -> int | None:
    """The pad token's id from ``tokenizer_config.json`` (its text) and ``tokenizer.json`` (its id), as
    transformers resolves it; None when either is missing (the caller then loads the tokenizer).

    ``tokenizer.json``'s answer is remembered while the file is unchanged (its size, mtime and inode):
    parsing its 2-3 MB took 1-2 s a round on the trainer's critical path (2 busy cores), for one number."""
    try:
        config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
        spec_file = Path(model_dir) / "tokenizer.json"
        st = spec_file.stat()
    except (OSError, ValueError):
        return None
    pad = config.get("pad_token")
    pad = pad.get("content") if isinstance(pad, dict) else pad
    if not isinstance(pad, str):
        return None
    return _token_id(str(spec_file), (st.st_size, st.st_mtime_ns, st.st_ino), pad)


@functools.lru_cache(maxsize=16)
def _token_id(spec_file: str, _stamp: tuple[int, int, int], token: str) -> int | None:
    """``token``'s id in a ``tokenizer.json``: an added token's, else the model vocabulary's."""
    try:
        spec = json.loads(Path(spec_file).read_text())
    except (OSError, ValueError):
        return None
    for added in spec.get("added_tokens") or []:
        if added.get("content") == token:
            return int(added["id"])
    vocab = (spec.get("model") or {}).get("vocab")
    return int(vocab[token]) if isinstance(vocab, dict) and token in vocab else None


def load_transitions(
    con: Any,
    versions: tuple[int, int],
    *,
    agents: str | None = None,
    tasks: str | None = None,
    trainable_only: bool = True,
    unversioned: int = 0,
) -> pa.Table:
    """Selected calls of policy versions ``versions[0]..versions[1]`` with rollout completeness and reward.

    ``con`` is a DuckDB connection with the store's views (``store.views.connect_readonly``).
    Calls recorded without a version (the base model served as plain ``policy`` before anything
    was published has no ``@k``) count as version ``unversioned`` (0, the base; -1 skips them).
    """
    params = {
        "lo": versions[0],
        "hi": versions[1],
        "agents": agents,
        "tasks": tasks,
        "all_calls": not trainable_only,
        "unversioned": unversioned,
    }
    return con.sql(TRANSITIONS_SQL, params=params).to_arrow_table()


def _json(text: str | None, default: Any) -> Any:
    if text is None or text == "":
        return default
    return json.loads(text)


def retokenize(
    tokenizer: Any, prompt_messages: list[dict], response_message: dict, tools: list[dict] | None
) -> tuple[list[int], list[int]]:
    """Prompt and response ids from the chat template, for rows recorded without token ids.

    The response is the text the template adds after the generation prompt when the assistant
    message is appended, up to and including the end-of-turn token (the trailing newline some
    templates add after it is not something the model generated).
    """
    kw = {"tools": tools} if tools else {}
    prompt_text = tokenizer.apply_chat_template(
        prompt_messages, add_generation_prompt=True, tokenize=False, **kw
    )
    full_text = tokenizer.apply_chat_template(
        [*prompt_messages, response_message], add_generation_prompt=False, tokenize=False, **kw
    )
    if full_text.startswith(prompt_text):
        response_text = full_text[len(prompt_text) :].rstrip("\n")
    else:  # a template that rewrites earlier turns: fall back to the content plus end of turn
        response_text = (response_message.get("content") or "") + (tokenizer.eos_token or "")
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response_text, add_special_tokens=False)["input_ids"]
    return list(prompt_ids), list(response_ids)


def _timestamps_as_ns(rows: pa.Table) -> pa.Table:
    """Timestamp columns as int64 nanoseconds: pyarrow cannot turn a nanosecond timestamp that is not a
    whole microsecond into a ``datetime`` without pandas, and real spans carry such times."""
    for i, f in enumerate(rows.schema):
        if pa.types.is_timestamp(f.type):
            rows = rows.set_column(i, f.name, rows.column(i).cast(pa.int64()))
    return rows


def build_samples(
    rows: pa.Table,
    tokenizer: Any,
    config: DatasetConfig,
    *,
    exclude_rollouts: Iterable[str] = (),
    trained_version: int | None = None,
) -> tuple[list[Sample], DatasetStats]:
    """Turn selected transition rows into weighted samples; see the module docstring for the rules.

    ``trained_version``: the policy version the round trains (``k``); calls of older versions are
    stale. None: every call counts as on-policy.
    """
    excluded = set(exclude_rollouts)
    stats = DatasetStats()
    records = [r for r in _timestamps_as_ns(rows).to_pylist() if r["rollout_id"] not in excluded]
    usable = _rewarded_rollouts(records, config, stats)
    choice = choose_estimator(usable, config.estimator)
    stats.estimator, stats.estimator_reason = choice.estimator, choice.reason
    adv = rollout_advantages(usable, choice.estimator)
    stats.n_groups = adv.n_groups
    stats.n_groups_zero_variance = adv.n_groups_dropped_zero_variance
    stats.n_rollouts_zero_variance = adv.n_rollouts_dropped
    samples: list[Sample] = []
    for r in records:
        if r["rollout_id"] in adv.advantages:
            sample = _call_sample(
                r, adv.advantages[r["rollout_id"]], tokenizer, config, stats, trained_version
            )
            if sample is not None:
                samples.append(sample)
    assign_weights(samples, config.aggregation)
    stats.n_samples = len(samples)
    stats.n_response_tokens = sum(len(s.response_ids) for s in samples)
    return samples, stats


def _rewarded_rollouts(
    records: list[dict], config: DatasetConfig, stats: DatasetStats
) -> list[RolloutReward]:
    """One entry per rollout that may train (complete if required, rewarded), in first-seen order; the
    others are counted in ``stats``, with the rollouts seen and the mean reward of the usable ones."""
    rollouts: dict[str, dict] = {}
    for r in records:
        rollouts.setdefault(r["rollout_id"], r)
    stats.n_rollouts = len(rollouts)
    usable: list[RolloutReward] = []
    for rid, r in rollouts.items():
        if config.require_complete and not r["rollout_complete"]:
            stats.n_rollouts_incomplete += 1
        elif r["rollout_reward_used"] is None:
            stats.n_rollouts_no_reward += 1
        else:
            usable.append(
                RolloutReward(
                    rid, r["task_id"] or rid, float(r["rollout_reward_used"]), r.get("agent_name") or ""
                )
            )
    if usable:
        stats.mean_reward = sum(u.reward for u in usable) / len(usable)
    return usable


def _call_sample(
    r: dict,
    advantage: float,
    tokenizer: Any,
    config: DatasetConfig,
    stats: DatasetStats,
    trained_version: int | None,
) -> Sample | None:
    """One call of a training rollout as a sample: its exact ids (retokenized when the gateway did not record
    them), truncated to the limits; None for a call that cannot train (empty, or stale without logprobs under
    ``drop``). Counts what happened in ``stats``."""
    stats.n_transitions += 1
    prompt_ids, response_ids = r["prompt_token_ids"] or [], r["response_token_ids"] or []
    logprobs = r["response_logprobs"]
    retok = r["token_source"] == "retokenized" or not prompt_ids or not response_ids
    if retok:
        prompt_ids, response_ids = retokenize(
            tokenizer,
            _json(r["prompt_messages"], []),
            _json(r["response_message"], {}),
            _json(r["tools"], None),
        )
        logprobs = None
        stats.n_retokenized += 1
    if logprobs is not None and len(logprobs) != len(response_ids):
        logprobs = None
    stale = 0 if trained_version is None else max(0, trained_version - int(r.get("call_version") or 0))
    if stale and logprobs is None:
        stats.n_stale_no_logprobs += 1
        if config.stale_without_logprobs == "drop":
            return None
    if len(prompt_ids) > config.max_prompt_tokens:
        prompt_ids = prompt_ids[-config.max_prompt_tokens :]
        stats.n_truncated_prompt += 1
    if len(response_ids) > config.max_response_tokens:
        response_ids = response_ids[: config.max_response_tokens]
        logprobs = logprobs[: config.max_response_tokens] if logprobs is not None else None
        stats.n_truncated_response += 1
    if not response_ids or not prompt_ids:
        stats.n_empty_response += 1
        return None
    stats.staleness[stale] = stats.staleness.get(stale, 0) + 1
    return Sample(
        transition_id=r["transition_id"],
        rollout_id=r["rollout_id"],
        prompt_ids=list(prompt_ids),
        response_ids=list(response_ids),
        rollout_logprobs=list(logprobs) if logprobs is not None else None,
        advantage=advantage,
        retokenized=retok,
        staleness=stale,
    )


def assign_weights(samples: Sequence[Sample], aggregation: str) -> None:
    """Set each sample's per-token loss weight so the weights of the whole round sum to 1.

    ``rollout``: every rollout counts equally (default); ``token``: every response token counts
    equally (OpenRLHF token-level); ``sequence``: every call counts equally (OpenRLHF sample-level).
    """
    lengths = [len(s.response_ids) for s in samples]
    if aggregation == "rollout":
        ws = per_rollout_token_weights([s.rollout_id for s in samples], lengths)
    elif aggregation == "token":
        total = sum(lengths)
        ws = [1.0 / total if total else 0.0 for _ in samples]
    elif aggregation == "sequence":
        ws = [1.0 / (n * len(samples)) if n else 0.0 for n in lengths]
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}; must be one of rollout, token, sequence")
    for s, w in zip(samples, ws, strict=True):
        s.weight = w
