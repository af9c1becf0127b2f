"""Reward of the real-model demo's SQL task, graded so that only the question's own query pays.

* 1.0: the final SQL returns the gold rows (execution match, as in ../sql_agent/reward.py, whose
  read-only runner and row comparison this reuses): any query with the gold rows is right.
* ON_TOPIC (0.2): it runs, reads a table, and names the question's value (``'Paris'``, ``40``,
  month ``3`` as ``03``): the step a 135M model most often misses is carrying the question's
  entity into the ``WHERE`` clause.
* RUNS (0.05): it runs but ignores the question.
* 0: no SQL, or SQL that fails.

Why not "0.2 for any SQL that runs": under RL the policy collapsed onto one trivially valid query
(``SELECT name FROM products WHERE id = 3``, the worked example's shape) for every question; it
collected the partial credit and never the answer (measured in the second real-model run: held-out
success 0.067 -> 0.000 while valid SQL went 0.34 -> 0.81). A constant query cannot name every
question's value, so here it earns RUNS, a quarter of what an on-topic query earns.
"""

from __future__ import annotations

import importlib.util
import re
import sqlite3
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "sql_agent_reward", Path(__file__).resolve().parents[1] / "sql_agent" / "reward.py"
)
_sql = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sql)
run_readonly, results_match, final_sql = _sql.run_readonly, _sql.results_match, _sql.final_sql

ON_TOPIC = 0.2  # runs, reads a table, names the question's value
RUNS = 0.05  # runs, but ignores the question
_TABLE = re.compile(r"\bFROM\s+(customers|products|orders)\b", re.I)


def names_value(sql: str, value: object) -> bool:
    """Does ``sql`` carry the question's value? Text case-insensitively, numbers as whole numbers
    (``3`` matches ``'2024-03-%'`` and ``= 3``, not ``30``)."""
    if isinstance(value, str):
        return value.lower() in sql.lower()
    return re.search(rf"(?<![\d.])0*{re.escape(str(value))}(?![\d])", sql) is not None


def grade(task: dict, sql: str | None) -> float:
    """1.0 for the gold rows, ON_TOPIC or RUNS for SQL that runs (see the module docstring), else 0.0."""
    if not sql:
        return 0.0
    gold = run_readonly(task["db"], task["gold_sql"])  # a broken gold query is the task's bug: raise
    try:
        got = run_readonly(task["db"], sql)
    except (sqlite3.Error, sqlite3.Warning, ValueError):
        return 0.0
    if results_match(got, gold, "order by" in task["gold_sql"].lower()):
        return 1.0
    on_topic = "value" in task and _TABLE.search(sql) is not None and names_value(sql, task["value"])
    return ON_TOPIC if on_topic else RUNS


def score(task: dict, stdout: str) -> float:
    """``fn(task, stdout) -> float`` for ``tracerl rollout --reward examples/demo/sql_reward.py:score``."""
    return grade(task, final_sql(stdout))
