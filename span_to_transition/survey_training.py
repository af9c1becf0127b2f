"""What a store holds for its next training round, for ``tracerl doctor``: read-only queries whose
results ``doctor_training.training_findings`` judges.

Per rollout of ``transitions`` (each rollout's latest conversion): its task, the version it started
on, its reward and whether real feedback (not the fill placeholder) gave it, when its last call
ended, whether it is complete, and a key of its first call's whole prompt (two rollouts asked the
same thing have the same key). Beside them: the rollouts earlier rounds used (their selection files),
the version the next round trains (the rounds manifest), the rollouts excluded for want of a reward
by version, and the feedback rows that match no rollout (the converter's ledger).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import duckdb

from span_to_transition.ledger import Ledger
from store.location import StoreLocation


@dataclass(frozen=True)
class RolloutFact:
    rollout_id: str
    task_id: str
    version: int  # the version its first call was served by (unversioned: 0, as the trainer counts it)
    reward: float | None
    rewarded: bool  # a reward other than convert --missing-reward fill's placeholder
    ended_ns: int | None
    complete: bool
    trainable: bool  # has a call the trainer selects (the agents regex of convert)
    prompt_key: str | None  # hash of its first call's prompt messages
    used: bool = False  # an earlier round trained on it (or consumed it)


@dataclass
class TrainingFacts:
    """Everything ``training_findings`` needs to say whether the next round would train."""

    rollouts: list[RolloutFact] = field(default_factory=list)
    next_version: int = 0  # the version the next round trains (0 before any round)
    excluded_by_version: dict[int, int] = field(default_factory=dict)  # excluded for want of a reward
    unjoined: int = 0  # feedback rows matching no rollout, as the last convert pass counted them
    unjoined_samples: list[str] = field(default_factory=list)
    estimator: str = "auto"  # the trainer's --estimator to judge by
    feedback_window_s: float = 0.0
    now_ns: int = 0


_ROLLOUTS_SQL = """
SELECT rollout_id,
       arg_min(coalesce(task_id, rollout_id), step) AS task_id,
       min(coalesce(policy_version, 0)) AS version,
       coalesce(max(rollout_reward), sum(reward)) AS reward,
       bool_or(rollout_reward IS NOT NULL AND coalesce(reward_source, '') <> 'fill') AS rewarded,
       max(epoch_ns(ended_at)) AS ended_ns,
       bool_or(coalesce(is_last, false)) AS complete,
       bool_or(coalesce(trainable, false)) AS trainable,
       arg_min(md5(coalesce(prompt_messages, '')), step) AS prompt_key
FROM transitions GROUP BY rollout_id ORDER BY rollout_id
"""

_EXCLUDED_SQL = """
SELECT r, coalesce(min(v), 0) FROM (
    SELECT coalesce(rollout_id, trace_id) AS r,
           try_cast(regexp_extract(coalesce(attributes['gen_ai.response.model'], attributes['gen_ai.request.model']),
                                   '@([0-9]+)$', 1) AS BIGINT) AS v
    FROM spans WHERE coalesce(rollout_id, trace_id) IN (SELECT unnest(?))
) GROUP BY r
"""
"""The version each excluded rollout was served by, from its calls' model names (``policy@3``)."""


def gather_training(
    con: duckdb.DuckDBPyConnection,
    layout: StoreLocation,
    ledger: Ledger,
    *,
    estimator: str,
    feedback_window_s: float,
    now_ns: int,
) -> TrainingFacts:
    """The facts of the next round, from the store's views (``con``), its selection files and the ledger."""
    used = used_rollouts(layout)
    t = TrainingFacts(estimator=estimator, feedback_window_s=feedback_window_s, now_ns=now_ns)
    for row in con.execute(_ROLLOUTS_SQL).fetchall():
        rid, task, version, reward, rewarded, ended, complete, trainable, key = row
        t.rollouts.append(
            RolloutFact(
                rid,
                task,
                int(version),
                reward,
                bool(rewarded),
                ended,
                bool(complete),
                bool(trainable),
                key,
                rid in used,
            )
        )
    done = con.execute(
        "SELECT max(round) FROM rounds WHERE status IN ('trained', 'published', 'canary', 'promoted', 'rolled_back')"
    ).fetchall()[0][0]
    t.next_version = 0 if done is None else int(done) + 1
    if ledger.excluded:
        for _, v in con.execute(_EXCLUDED_SQL, [sorted(ledger.excluded)]).fetchall():
            t.excluded_by_version[int(v)] = t.excluded_by_version.get(int(v), 0) + 1
    t.unjoined = int(ledger.unjoined.get("count", 0) or 0)  # type: ignore[call-overload]
    t.unjoined_samples = list(ledger.unjoined.get("samples", []) or [])  # type: ignore[call-overload]
    return t


def used_rollouts(layout: StoreLocation) -> set[str]:
    """Rollouts earlier rounds consumed, from their selection files (``checkpoints/round-*.json``, the
    trainer's record of which rollouts each round took)."""
    used: set[str] = set()
    for path in layout.files("checkpoints", suffix=".json"):
        if not path.rsplit("/", 1)[-1].startswith("round-"):
            continue
        try:
            used.update(json.loads(layout.read_bytes(path)).get("rollout_ids", []))
        except (ValueError, OSError):  # a selection being written: its round has not trained yet
            continue
    return used
