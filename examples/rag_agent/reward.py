"""Reward of the RAG task: how many of the expected answer's keywords the agent's answer contains.

``score(task, stdout)`` is the fraction of ``task["keywords"]`` found in the answer (0..1),
case-insensitive, with runs of whitespace read as one space. A keyword may list spellings that
count alike, separated by ``|`` (``"5-year|5 years"``). Keyword matching is crude on purpose: the
facts are numbers and names stated once in the corpus, so the reward is checkable by hand and
needs no judge model.
"""

from __future__ import annotations


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def keyword_hit(answer: str, keyword: str) -> bool:
    """Does the (normalised) answer contain any of the ``|``-separated spellings of ``keyword``?"""
    text = _norm(answer)
    return any(_norm(k) in text for k in keyword.split("|") if k.strip())


def score(task: dict, stdout: str) -> float:
    """``fn(task, stdout) -> float`` for ``tracerl rollout --reward examples/rag_agent/reward.py:score``.

    The whole stdout is the answer (the agent prints only its answer). No keywords: 0.
    """
    keywords = [str(k) for k in task.get("keywords") or []]
    if not keywords:
        return 0.0
    return sum(keyword_hit(stdout, k) for k in keywords) / len(keywords)
