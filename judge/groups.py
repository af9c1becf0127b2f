"""Which rollouts are judged together, and which wait. Pure.

Group mode judges a task's unjudged rollouts in one call once the newest of them ended
``group_wait_s`` ago, so siblings still being converted are not judged apart from it; a task with more
than ``max_group`` rollouts is cut into near-equal chunks (17 with a limit of 16: 9 and 8), each ranked on
its own; a task with a single rollout is scored pointwise (there is nothing to rank it against).
Pointwise mode judges every rollout alone, at once. Rollouts whose earlier group failed are
skipped (they were paid for once) unless the caller asks to retry them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from judge.prompts import JudgeRequest, group_request, pointwise_request
from judge.trajectories import Rollout


@dataclass
class Plan:
    requests: list[JudgeRequest] = field(default_factory=list)
    waiting: int = 0  # rollouts whose task may still grow (group mode)
    skipped_failed: int = 0  # rollouts of a group that failed before, under this rubric hash


def chunks(items: list[Rollout], size: int) -> list[list[Rollout]]:
    """``items`` in ceil(n / size) near-equal consecutive chunks."""
    n = -(-len(items) // size)
    q, r = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + q + (1 if i < r else 0)
        out.append(items[start:end])
        start = end
    return out


def plan(
    rollouts: list[Rollout],
    *,
    mode: str,
    rubric: str,
    now_ns: int,
    group_wait_s: float = 30.0,
    max_group: int = 16,
    failed: frozenset[str] = frozenset(),
) -> Plan:
    """The judge calls of one pass over ``rollouts`` (none of which has a reward of the judge's name yet)."""
    out = Plan()
    todo = [r for r in rollouts if r.rollout_id not in failed]
    out.skipped_failed = len(rollouts) - len(todo)
    if mode == "pointwise":
        out.requests = [pointwise_request(r, rubric) for r in todo]
        return out
    by_task: dict[str, list[Rollout]] = defaultdict(list)
    for r in todo:
        by_task[r.task_id].append(r)
    wait_ns = int(group_wait_s * 1e9)
    for task in sorted(by_task):
        group = sorted(by_task[task], key=lambda r: r.rollout_id)
        if now_ns - max(r.ended_ns for r in group) < wait_ns:
            out.waiting += len(group)
            continue
        if len(group) == 1:  # nothing to rank it against: scored on its own against the rubric
            out.requests.append(pointwise_request(group[0], rubric))
            continue
        parts = chunks(group, max_group)
        for i, part in enumerate(parts):
            key = task if len(parts) == 1 else f"{task}#{i + 1}"
            out.requests.append(group_request(key, part, rubric))
    return out
