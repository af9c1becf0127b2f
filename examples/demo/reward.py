"""Reward of the demo task: did the writer and the rewriter both reply with the task's letter?

A known function of the output, so a learning curve can be checked against it. Each agent's
reply scores the mean of two parts:

- first: 1 if its first visible character is the letter (either case), else 0;
- share: of the characters in it that are one of the task's letters (``letters``, e.g. "aeot"),
  the fraction that is the right one (0 when it has none of them).

The rollout reward is the mean over the writer's and the rewriter's replies. A random policy
scores about 0.1 (a few task letters turn up in six random tokens); the optimum, both replies
starting with the letter and holding no other task letter, scores 1.0. No reply that ignores the
task can beat 1/len(letters) on average, because the shares of one reply over the letters sum
to at most 1: the policy must read the letter from the prompt (a copy a 2-layer model can learn).
"""

from __future__ import annotations

import json


def letter_score(reply: str, letter: str, letters: str) -> float:
    """Score one reply in [0, 1]: mean of "starts with ``letter``" and its share among ``letters``."""
    text, target = reply.strip().lower(), letter.lower()
    alphabet = set(letters.lower()) | {target}
    if not target:
        return 0.0
    first = 1.0 if text.startswith(target) else 0.0
    hits = [c for c in text if c in alphabet]
    share = hits.count(target) / len(hits) if hits else 0.0
    return (first + share) / 2


def score(task: dict, stdout: str) -> float:
    """``fn(task, stdout) -> float`` for ``tracerl rollout --reward examples/demo/reward.py:score``.

    Reads the agent's last stdout line (JSON with ``writer`` and ``final``); anything else is 0.
    """
    lines = stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return 0.0
    if not isinstance(out, dict):
        return 0.0
    letter, letters = str(task["letter"]), str(task.get("letters", task["letter"]))
    return (letter_score(str(out.get("writer", "")), letter, letters)
            + letter_score(str(out.get("final", "")), letter, letters)) / 2
