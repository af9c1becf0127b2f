"""Reward of the real-model demo's SQL task, graded: 1.0 for the gold result, 0.2 for SQL that runs, else 0.

The grading gives an untrained 135M model a signal before it gets any answer right: a query
that runs beats one that does not. Execution match as in the SQL example (../sql_agent/reward.py,
whose read-only runner and row comparison this reuses): any query with the gold rows is right.
"""

from __future__ import annotations

import importlib.util
import sqlite3
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "sql_agent_reward", Path(__file__).resolve().parents[1] / "sql_agent" / "reward.py"
)
_sql = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sql)
run_readonly, results_match, final_sql = _sql.run_readonly, _sql.results_match, _sql.final_sql

RUNS = 0.2  # SQL that runs but returns other rows


def grade(task: dict, sql: str | None) -> float:
    """1.0 if ``sql`` returns the gold rows on the task's database, RUNS if it only runs, 0.0 otherwise."""
    if not sql:
        return 0.0
    gold = run_readonly(task["db"], task["gold_sql"])  # a broken gold query is the task's bug: raise
    try:
        got = run_readonly(task["db"], sql)
    except (sqlite3.Error, sqlite3.Warning, ValueError):
        return 0.0
    return 1.0 if results_match(got, gold, "order by" in task["gold_sql"].lower()) else RUNS


def score(task: dict, stdout: str) -> float:
    """``fn(task, stdout) -> float`` for ``tracerl rollout --reward examples/demo/sql_reward.py:score``."""
    return grade(task, final_sql(stdout))
