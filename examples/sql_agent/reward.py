"""Reward of the SQL task: does the agent's final query return what the gold query returns? 1.0 or 0.0.

Execution match, not string match: any query with the same result is right. The reward runs
the final SQL itself (from the agent's last stdout line) on a read-only connection, so the score
does not trust rows the agent printed, and a query that writes cannot change the database.
Rows compare as a multiset, in order only when the gold query has an ORDER BY; floats are
rounded to 6 places so ``SUM`` in a different order still matches.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter

MAX_ROWS = 10_000


def run_readonly(db: str, sql: str) -> list[tuple]:
    """The rows of ``sql`` on ``db`` opened read-only (``mode=ro``); raises ``sqlite3.Error``."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute(sql).fetchmany(MAX_ROWS)
    finally:
        con.close()
    return [tuple(round(v, 6) if isinstance(v, float) else v for v in row) for row in rows]


def results_match(got: list[tuple], gold: list[tuple], ordered: bool) -> bool:
    """Same rows (and, when ``ordered``, in the same order)."""
    return got == gold if ordered else Counter(got) == Counter(gold)


def final_sql(stdout: str) -> str | None:
    """The ``sql`` of the agent's last stdout line (JSON), or None."""
    lines = stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    sql = out.get("sql") if isinstance(out, dict) else None
    return sql if isinstance(sql, str) and sql.strip() else None


def score(task: dict, stdout: str) -> float:
    """``fn(task, stdout) -> float`` for ``tracerl rollout --reward examples/sql_agent/reward.py:score``."""
    sql = final_sql(stdout)
    if sql is None:
        return 0.0
    gold = run_readonly(task["db"], task["gold_sql"])  # a broken gold query is the task's bug: raise
    try:
        got = run_readonly(task["db"], sql)
    except (sqlite3.Error, sqlite3.Warning):
        return 0.0
    return 1.0 if results_match(got, gold, "order by" in task["gold_sql"].lower()) else 0.0
