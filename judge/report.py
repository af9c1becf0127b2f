"""``tracerl report``'s judge section: token cost per round, and agreement with a grader where there is one.

A round is the policy version a rollout started on (its first call's version, as the trainer counts
it). The grader is every reward row of another source on the same rollout (summed), e.g. what
``tracerl rollout --reward`` posted; in-band span rewards live in the spans, not the rewards table, and
are not compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from judge.agreement import Agreement, agreement
from store.location import StoreLocation
from store.views import connect_readonly

PER_ROUND_SQL = """
WITH version AS (SELECT rollout_id, min(policy_version) AS v FROM transitions GROUP BY 1),
     judged AS (SELECT rollout_id, avg(value) AS judge, sum(judge_prompt_tokens) AS p,
                       sum(judge_completion_tokens) AS c
                FROM rewards WHERE source = 'judge' AND name = $name GROUP BY 1),
     graded AS (SELECT rollout_id, sum(value) AS grader FROM rewards
                WHERE coalesce(source, '') <> 'judge' AND rollout_id IS NOT NULL GROUP BY 1)
SELECT version.v AS round, judged.judge, judged.p, judged.c, graded.grader
FROM judged LEFT JOIN version USING (rollout_id) LEFT JOIN graded USING (rollout_id)
ORDER BY round NULLS LAST
"""


@dataclass
class JudgeRound:
    round: int | None  # None: rollouts whose transitions carry no policy version
    rollouts: int
    prompt_tokens: int
    completion_tokens: int
    agreement: Agreement | None  # None: no grader reward on these rollouts


def judge_rounds(rows: list[dict[str, Any]], threshold: float = 0.5) -> list[JudgeRound]:
    """Rows of ``PER_ROUND_SQL`` -> one summary per round (pure)."""
    by: dict[int | None, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["round"], []).append(r)
    out = []
    for k, rs in by.items():
        both = [(r["judge"], r["grader"]) for r in rs if r["grader"] is not None]
        agree = agreement([j for j, _ in both], [g for _, g in both], threshold) if both else None
        out.append(JudgeRound(k, len(rs), sum(r["p"] or 0 for r in rs), sum(r["c"] or 0 for r in rs), agree))
    return out


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_judge(rounds: list[JudgeRound]) -> str:
    """The judge section as a text table (empty when nothing was judged)."""
    if not rounds:
        return ""
    lines = [
        "judge (source=judge rewards, by the policy version the rollout started on):",
        f"{'round':>6} {'rollouts':>8} {'prompt tok':>10} {'compl tok':>9} {'tok/rollout':>11} "
        f"{'graded':>6} {'spearman':>8} {'auc':>5}",
    ]
    for r in rounds:
        a = r.agreement
        lines.append(
            f"{'-' if r.round is None else r.round:>6} {r.rollouts:>8} {r.prompt_tokens:>10} {r.completion_tokens:>9} "
            f"{(r.prompt_tokens + r.completion_tokens) / r.rollouts:>11.0f} {a.n if a else 0:>6} "
            f"{_num(a.spearman if a else None):>8} {_num(a.auc if a else None):>5}"
        )
    return "\n".join(lines)


def judge_report(loc: StoreLocation, name: str = "judge", threshold: float = 0.5) -> list[JudgeRound]:
    """Read the store's judge rows (and any grader rows on the same rollouts) by round."""
    con = connect_readonly(loc)
    try:
        rows = con.sql(PER_ROUND_SQL, params={"name": name}).to_arrow_table().to_pylist()
    finally:
        con.close()
    return judge_rounds(rows, threshold)
