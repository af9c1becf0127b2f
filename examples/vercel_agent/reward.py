"""Reward of the unit-conversion task: 1.0 when the agent's answer is within 0.5% of the task's, else 0.0.

Used as ``tracerl rollout --reward examples/vercel_agent/reward.py:score``. agent.mjs prints one JSON
line ``{"answer": 26.22, "final": "...", "steps": 2}`` (``answer``: the last number of its final text);
0.5% leaves room for a model that rounds the tool's result to two decimals.
"""

from __future__ import annotations

import json
import math

REL_TOL = 0.005


def score(task: dict, stdout: str) -> float:
    """``fn(task, stdout) -> float``: 1.0 if the agent's ``answer`` is within 0.5% of ``task["answer"]``."""
    lines = stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return 0.0
    got = out.get("answer") if isinstance(out, dict) else None
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return 0.0
    return 1.0 if math.isclose(got, float(task["answer"]), rel_tol=REL_TOL) else 0.0
