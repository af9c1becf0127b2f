"""The judge's messages, and the hash that names a judge configuration.

Group mode (RULER-style): one prompt per task group. Every trajectory is rendered as the agent saw it
(``trajectories.trajectory_lines``); the lines all of them start with (the system prompt, few-shot
turns, the task itself) are sent once, and each trajectory shows only what follows. The judge scores
each trajectory from 0 to 1 *relative to the others*: a group-relative advantage needs only the order
and spacing within the group, and ranking is easier for a judge than absolute grading.

Pointwise mode: one rollout against the rubric, scored on its own (live traffic, where no task repeats).

Trajectories are named ``"1"``..``"n"`` in the prompt, not by rollout id: short ids cost fewer tokens
and a small judge copies them reliably; ``JudgeRequest.rollout_ids`` maps them back. Pure functions.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

from judge.trajectories import Rollout, shared_prefix, trajectory_lines

PROMPT_VERSION = "1"
"""Part of the rubric hash: a change to the wording below judges every rollout again under a new hash."""

ANSWER_FORMAT = (
    'Answer with only a JSON object: {"scores": {"<id>": {"explanation": "<one short sentence>", '
    '"score": <number from 0 to 1>}, ...}} with one entry for each trajectory id.'
)

GROUP_SYSTEM = """You are a strict judge of an AI agent's work. You will see {n} trajectories: attempts \
by the same agent at the same task. Score each from 0 to 1 relative to the others: the best gets the \
highest score, a failed attempt gets near 0, and equally good attempts get equal scores.

Rubric:
{rubric}

{answer}"""

POINTWISE_SYSTEM = """You are a strict judge of an AI agent's work. You will see one trajectory: the \
agent's attempt at a task. Score it from 0 (failed) to 1 (fully achieved) against the rubric.

Rubric:
{rubric}

{answer}"""


def default_rubric() -> str:
    """The packaged rubric (``judge/default_rubric.md``)."""
    return files("judge").joinpath("default_rubric.md").read_text(encoding="utf-8")


def rubric_hash(rubric: str, mode: str, model: str) -> str:
    """Stable name of a judge configuration: the same rubric text, mode, judge model and prompt version give
    the same hash on every machine and run (leading/trailing whitespace and line endings ignored)."""
    text = "\n".join(line.rstrip() for line in rubric.strip().splitlines())
    key = json.dumps({"rubric": text, "mode": mode, "model": model, "prompt": PROMPT_VERSION}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class JudgeRequest:
    """One judge call: its messages, and which rollout each trajectory id ("1".."n") stands for."""

    key: str  # the group's name in counts and the failure record: task id (+ chunk) or rollout id
    messages: list[dict[str, str]]
    rollout_ids: list[str]

    @property
    def ids(self) -> list[str]:
        return [str(i + 1) for i in range(len(self.rollout_ids))]


def _block(tag: str, lines: list[str], attrs: str = "") -> str:
    return f"<{tag}{attrs}>\n" + "\n".join(lines) + f"\n</{tag}>"


def group_request(key: str, rollouts: list[Rollout], rubric: str) -> JudgeRequest:
    """One prompt ranking ``rollouts`` (one task's), their shared leading messages sent once."""
    rendered = [trajectory_lines(r.calls) for r in rollouts]
    k = shared_prefix(rendered)
    parts = []
    if k:
        parts.append(
            f"All {len(rollouts)} trajectories begin with these messages (shown once):\n"
            + _block("shared", rendered[0][:k])
        )
        parts.append("What each trajectory did after them:")
    for i, lines in enumerate(rendered):
        parts.append(_block("trajectory", lines[k:], f' id="{i + 1}"'))
    ids = ", ".join(f'"{i + 1}"' for i in range(len(rollouts)))
    parts.append(f"Score trajectories {ids}. {ANSWER_FORMAT}")
    system = GROUP_SYSTEM.format(n=len(rollouts), rubric=rubric.strip(), answer=ANSWER_FORMAT)
    return JudgeRequest(
        key,
        [{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(parts)}],
        [r.rollout_id for r in rollouts],
    )


def pointwise_request(rollout: Rollout, rubric: str) -> JudgeRequest:
    """One prompt scoring one rollout against the rubric, the whole trajectory shown."""
    body = _block("trajectory", trajectory_lines(rollout.calls), ' id="1"')
    system = POINTWISE_SYSTEM.format(rubric=rubric.strip(), answer=ANSWER_FORMAT)
    user = f'{body}\n\nScore trajectory "1". {ANSWER_FORMAT}'
    return JudgeRequest(
        rollout.rollout_id,
        [{"role": "system", "content": system}, {"role": "user", "content": user}],
        [rollout.rollout_id],
    )


def retry_messages(request: JudgeRequest, answer: str, error: str) -> list[dict[str, Any]]:
    """The one retry: the same conversation, the judge's unusable answer, and the parse error quoted."""
    return [
        *request.messages,
        {"role": "assistant", "content": answer[:4000]},
        {
            "role": "user",
            "content": f"That answer could not be used: {error}. {ANSWER_FORMAT} "
            f"The ids are {', '.join(request.ids)}.",
        },
    ]
