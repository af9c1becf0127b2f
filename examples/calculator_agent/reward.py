"""Reward of the calculator task: 1.0 when the agent's final number equals the task's answer, else 0.0.

Used as ``tracerl rollout --reward examples/calculator_agent/reward.py:score``. The agent prints one
JSON line ``{"answer": "23", ...}``; a plain-text last line is read too (its last number), so an
agent that prints "The answer is 23." still scores.
"""

from __future__ import annotations

import json
import math
import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(stdout: str) -> float | None:
    """The number the agent answered: ``answer`` of its last JSON line, else the last number on that line."""
    lines = stdout.strip().splitlines()
    if not lines:
        return None
    last = lines[-1]
    try:
        out = json.loads(last)
    except json.JSONDecodeError:
        out = None
    if isinstance(out, dict):
        value = out.get("answer")
        last = "" if value is None else str(value)
    found = NUMBER.findall(last)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def score(task: dict, stdout: str) -> float:
    """``fn(task, stdout) -> float``: 1.0 if the final number matches ``task["answer"]`` (to 1e-6), else 0.0."""
    got = final_number(stdout)
    if got is None:
        return 0.0
    return 1.0 if math.isclose(got, float(task["answer"]), rel_tol=1e-9, abs_tol=1e-6) else 0.0
