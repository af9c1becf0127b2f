"""Judge one batch of rollouts and say how it went: what ``tracerl demo --reward judge`` does each round.

The batch's rollouts (and no others: never a held-out evaluation's) are judged in one pass of the
stage (``run_once(only=...)``), then the judge's rows and the grader's rows of the same rollouts are
read back from the store, so the agreement printed is the store's, never a number kept on the side.
A group whose judging failed has no judge row: its rollouts train nothing (their transitions keep a
null reward under ``--reward-from judge``), and the summary says how many.
"""

from __future__ import annotations

from dataclasses import dataclass

from judge.agreement import Agreement, agreement
from judge.config import JudgeSettings
from judge.stage import JudgeStats, run_once
from store.location import StoreLocation, parse_store
from store.views import connect_readonly

PAIRS_SQL = """
WITH ids AS (SELECT unnest($ids::VARCHAR[]) AS rollout_id),
     latest AS (  -- one row per reward id: a correction or retry counts once (no time: oldest)
         SELECT rollout_id, reward_id, source, name, arg_max(value, coalesce(epoch_ns("at"), -1)) AS value
         FROM rewards JOIN ids USING (rollout_id) GROUP BY ALL),
     judged AS (SELECT rollout_id, avg(value) AS judge FROM latest
                WHERE source = 'judge' AND name = $name GROUP BY 1),
     graded AS (SELECT rollout_id, sum(value) AS grader FROM latest
                WHERE coalesce(source, '') <> 'judge' GROUP BY 1)
SELECT rollout_id, judged.judge, graded.grader
FROM judged FULL JOIN graded USING (rollout_id) ORDER BY rollout_id
"""
"""Per rollout of the batch: the judge's score (null: not judged) and the grader's reward (null: none)."""


@dataclass(frozen=True)
class BatchJudgment:
    """One batch's judging: the pass's counts and the judge's agreement with the grader on it."""

    rollouts: int  # in the batch
    judged: int  # rollouts with a judge score
    groups_scored: int
    groups_failed: int  # answered but unusable or refused: their rollouts train nothing
    groups_unavailable: int  # no answer (down, timeout): their rollouts train nothing this round
    prompt_tokens: int
    completion_tokens: int
    agreement: Agreement | None  # None: no rollout has both a judge score and a grader reward

    @property
    def untrained(self) -> int:
        """Rollouts of the batch without a judge score: under ``--reward-from judge`` they train nothing."""
        return self.rollouts - self.judged


def summarize(
    stats: JudgeStats, pairs: list[tuple[str, float | None, float | None]], rollouts: int, threshold: float
) -> BatchJudgment:
    """The pass's stats and the store's (rollout, judge, grader) rows -> the batch's judgment (pure)."""
    both = [(j, g) for _, j, g in pairs if j is not None and g is not None]
    return BatchJudgment(
        rollouts=rollouts,
        judged=sum(j is not None for _, j, _ in pairs),
        groups_scored=stats.groups_scored,
        groups_failed=sum(stats.failures.values()),
        groups_unavailable=sum(stats.unavailable.values()),
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.completion_tokens,
        agreement=agreement([j for j, _ in both], [g for _, g in both], threshold) if both else None,
    )


def combine(
    done: list[BatchJudgment], pairs: list[tuple[str, float | None, float | None]], threshold: float
) -> BatchJudgment:
    """Several batches' judgments as one: counts and tokens summed, agreement over all their rollouts'
    ``pairs`` (read again from the store: agreement does not add up batch by batch)."""
    both = [(j, g) for _, j, g in pairs if j is not None and g is not None]
    return BatchJudgment(
        rollouts=sum(j.rollouts for j in done),
        judged=sum(j is not None for _, j, _ in pairs),
        groups_scored=sum(j.groups_scored for j in done),
        groups_failed=sum(j.groups_failed for j in done),
        groups_unavailable=sum(j.groups_unavailable for j in done),
        prompt_tokens=sum(j.prompt_tokens for j in done),
        completion_tokens=sum(j.completion_tokens for j in done),
        agreement=agreement([j for j, _ in both], [g for _, g in both], threshold) if both else None,
    )


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_judgment(j: BatchJudgment) -> str:
    """One line: groups scored/failed, rollouts left untrained, tokens, agreement (undefined shown as -)."""
    a = j.agreement
    agree = (
        f"agreement with the grader over {a.n} rollouts ({a.n_pass} pass): AUC {_num(a.auc)}, Spearman "
        f"{_num(a.spearman)}"
        if a
        else "no rollout has both a judge score and a grader reward"
    )
    failed = f", {j.groups_failed} failed" if j.groups_failed else ""
    down = f", {j.groups_unavailable} unanswered" if j.groups_unavailable else ""
    return (
        f"judge: {j.groups_scored} groups scored{failed}{down}; {j.judged}/{j.rollouts} rollouts judged, "
        f"{j.untrained} train nothing; {j.prompt_tokens} + {j.completion_tokens} judge tokens; {agree}"
    )


def judge_pairs(
    loc: StoreLocation, ids: list[str], name: str
) -> list[tuple[str, float | None, float | None]]:
    """(rollout, judge score, grader reward) of these rollouts, from the store (``PAIRS_SQL``)."""
    con = connect_readonly(loc)
    try:
        return con.execute(PAIRS_SQL, {"ids": ids, "name": name}).fetchall()
    finally:
        con.close()


def judge_batch(settings: JudgeSettings, ids: list[str], threshold: float = 1.0) -> BatchJudgment:
    """Judge these rollouts (one pass of the stage, only them), then read back how it went."""
    stats = run_once(settings, only=ids)
    if stats.locked:
        raise RuntimeError(f"another `tracerl judge` holds the judge lock of {settings.store}; stop it first")
    return summarize(stats, judge_pairs(parse_store(settings.store), ids, settings.name), len(ids), threshold)
