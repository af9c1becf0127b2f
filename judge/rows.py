"""Judge outcomes -> rows of the rewards table (REWARDS_SCHEMA, ``source = judge``). Pure.

``reward_id`` is a hash of (rollout, reward name, rubric hash): writing a judgment again yields the same
ids (the converter counts a reward id once), and a changed rubric or judge model yields new ones. A
group's token counts are split across its rollouts (the remainder to the first ones), so summing the
rows of a round gives exactly what the judge was paid.
"""

from __future__ import annotations

import hashlib
from typing import Any

from judge.client import Outcome

SOURCE = "judge"


def reward_id(rollout_id: str, name: str, rubric_hash: str) -> str:
    return hashlib.sha256(f"{rollout_id}\x1f{name}\x1f{rubric_hash}".encode()).hexdigest()[:32]


def split(total: int, n: int) -> list[int]:
    """``total`` in ``n`` integer shares that add up to it."""
    q, r = divmod(total, n)
    return [q + (1 if i < r else 0) for i in range(n)]


def reward_rows(
    outcome: Outcome, *, name: str, model: str, rubric_hash: str, at_ns: int
) -> list[dict[str, Any]]:
    """One row per rollout of a successful outcome; none for a failed or unavailable one."""
    if outcome.status != "ok" or outcome.parsed is None or outcome.parsed.scores is None:
        return []
    req = outcome.request
    n = len(req.rollout_ids)
    prompt, completion = split(outcome.prompt_tokens, n), split(outcome.completion_tokens, n)
    rows = []
    for i, (tid, rid) in enumerate(zip(req.ids, req.rollout_ids)):
        s = outcome.parsed.scores[tid]
        rows.append(
            {
                "reward_id": reward_id(rid, name, rubric_hash),
                "rollout_id": rid,
                "trace_id": None,
                "span_id": None,
                "response_id": None,
                "name": name,
                "value": s.score,
                "source": SOURCE,
                "at": at_ns,
                "judge_model": model,
                "rubric_hash": rubric_hash,
                "explanation": s.explanation,
                "judge_prompt_tokens": prompt[i],
                "judge_completion_tokens": completion[i],
            }
        )
    return rows
