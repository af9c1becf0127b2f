"""Rollouts shaped like the demo's SQL agent (a writer, then a rewriter with a fresh prompt), for the judge's tests."""

from __future__ import annotations

import json

from judge.trajectories import Call, Rollout

SYSTEM = {"role": "system", "content": "You write SQLite queries. Reply with one SQL query and nothing else."}
SHOTS = [
    {"role": "user", "content": "Tables: customers(id, name, city)\nQuestion: Which customers live in Oslo?"},
    {"role": "assistant", "content": "SELECT name FROM customers WHERE city = 'Oslo'"},
]
QUESTION = "How many customers live in Madrid?"
DRAFTS = [
    "SELECT COUNT(*) FROM customers WHERE city = 'Madrid'",
    "SELECT name FROM customers WHERE city = 'Oslo'",
    "SELECT COUNT(*) FROM customer WHERE city = 'Madrid'",
    "SELECT * FROM customers",
    "SELECT COUNT(*) FROM customers WHERE city = 'Madrid'",
    "I don't know",
    "SELECT COUNT(id) FROM customers WHERE city='Madrid'",
    "SELECT city FROM customers",
]


def writer_prompt(question: str = QUESTION) -> list[dict]:
    return [SYSTEM, *SHOTS, {"role": "user", "content": f"Question: {question}"}]


def rewriter_prompt(draft: str, question: str = QUESTION) -> list[dict]:
    return [
        SYSTEM,
        {"role": "user", "content": f"Question: {question}\nSQL: {draft}\nResult: [(3,)]\nFix it if needed."},
    ]


def sql_rollout(i: int, task: str = "madrid", draft: str | None = None, ended_ns: int = 10**18) -> Rollout:
    draft = DRAFTS[i % len(DRAFTS)] if draft is None else draft
    calls = [
        Call(0, writer_prompt(), {"role": "assistant", "content": draft}, "writer"),
        Call(1, rewriter_prompt(draft), {"role": "assistant", "content": draft}, "rewriter"),
    ]
    return Rollout(f"r{i}-{task}", task, calls, ended_ns)


def rows_of(rollout: Rollout) -> list[dict]:
    """The rollout as transition rows (what the stage reads from the store)."""
    return [
        {
            "rollout_id": rollout.rollout_id,
            "task_id": rollout.task_id,
            "step": c.step,
            "prompt_messages": json.dumps(c.prompt),
            "response_message": json.dumps(c.response),
            "tools": json.dumps(c.tools) if c.tools else None,
            "agent_name": c.agent,
            "ended_at": rollout.ended_ns,
        }
        for c in rollout.calls
    ]
