"""Whether the next training round would train, and if not why, with the fix: the training half of
``tracerl doctor`` (pure: ``TrainingFacts`` in, ``Finding`` s out).

A store can hold perfect transitions and still never train: a deployed service's requests never
repeat a task, so a group estimator sees only groups of one; a few-shot preamble makes every request
one "task"; the feedback names keys no rollout has; every rollout still waits on its feedback
window; or every reward is the same. "Healthy" means the next round has at least one rollout with a
learning signal under the estimator it would use.

The estimator rule is the trainer's own (``trainer.advantages.choose_estimator``): a group estimator when
at least half of the round's rollouts share their task with another, the group-free REINFORCE++ otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from span_to_transition.doctor_finding import Finding, plural
from span_to_transition.survey_training import RolloutFact, TrainingFacts
from trainer.advantages import GROUP_FREE, RolloutReward, choose_estimator

ACCIDENTAL_MIN = 4
"""A task this large whose rollouts were all asked different things is one group by accident."""
ACCIDENTAL_DISTINCT = 0.9
"""... 'all different': at least this share of its rollouts have a first prompt of their own."""

TASK_KEY_FIX = (
    "give each request the task it belongs to: convert --task-key ATTR (a span or resource attribute that names "
    "what was asked, e.g. an app's request attribute or http.route), or set the span attribute tracerl.task_id; "
    "then tracerl convert --rebuild"
)


@dataclass(frozen=True)
class Round:
    """The rollouts the next round would take, as ``tracerl train`` selects them."""

    version: int
    candidates: list[RolloutFact]  # complete, rewarded, trainable, unused, window closed
    waiting: list[tuple[RolloutFact, float]]  # window still open: (rollout, seconds left)
    of_version: int  # unused rollouts of the version at all


def next_round(t: TrainingFacts) -> Round:
    window_ns = int(t.feedback_window_s * 1e9)
    cands, waiting, n = [], [], 0
    for r in t.rollouts:
        if r.version != t.next_version or r.used or not r.trainable:
            continue
        n += 1
        left = 0 if r.ended_ns is None else r.ended_ns + window_ns - t.now_ns
        if window_ns and left > 0:
            waiting.append((r, left / 1e9))
        elif r.complete and r.reward is not None and (r.rewarded or not window_ns):
            cands.append(r)
    return Round(t.next_version, cands, waiting, n)


def resolve_estimator(requested: str, rollouts: list[RolloutFact]) -> tuple[str, str]:
    """(estimator, why) the round would use: the trainer's own rule (``choose_estimator``)."""
    choice = choose_estimator([RolloutReward(r.rollout_id, r.task_id, r.reward or 0.0) for r in rollouts], requested)
    return choice.estimator, choice.reason


def has_signal(estimator: str, rollouts: list[RolloutFact]) -> bool:
    """Whether some rollout gets a non-zero advantage: a task group of two or more with different rewards
    (group estimators), or a batch with different rewards (group-free)."""
    if estimator in GROUP_FREE:
        return len({r.reward for r in rollouts}) > 1
    groups: dict[str, set[float | None]] = {}
    for r in rollouts:
        groups.setdefault(r.task_id, set()).add(r.reward)
    return any(len(rewards) > 1 for rewards in groups.values())


def training_findings(t: TrainingFacts) -> list[Finding]:
    """The reasons the next round would not train (or would train by accident), most fundamental first."""
    out: list[Finding] = []
    if t.unjoined:
        out.append(_unjoined(t))
    out += _accidental_groups(t.rollouts)
    if not t.rollouts:
        return out
    rnd = next_round(t)
    estimator, why = resolve_estimator(t.estimator, rnd.candidates)
    if rnd.candidates and has_signal(estimator, rnd.candidates):
        return out
    if rnd.waiting:
        out.append(_waiting(t, rnd))
    elif not rnd.candidates:
        out.append(_nothing_new(t, rnd))
    elif (
        len(rnd.candidates) > 1
        and estimator not in GROUP_FREE
        and all(c == 1 for c in _task_sizes(rnd.candidates))
    ):
        out.append(_singletons(rnd, estimator, why))
    else:
        out.append(_no_variance(rnd, estimator, why))
    return out


def coverage(t: TrainingFacts) -> dict[int, tuple[int, int]]:
    """version -> (rollouts with feedback, rollouts): the converted ones plus those excluded for want of it."""
    out: dict[int, tuple[int, int]] = {v: (0, n) for v, n in t.excluded_by_version.items()}
    for r in t.rollouts:
        fed, n = out.get(r.version, (0, 0))
        out[r.version] = (fed + int(r.rewarded), n + 1)
    return dict(sorted(out.items()))


def coverage_text(t: TrainingFacts) -> str:
    return "; ".join(
        f"policy@{v}: {fed} of {plural(n, 'rollout')} ({fed / n:.0%})"
        for v, (fed, n) in coverage(t).items()
        if n
    )


def _task_sizes(rollouts: Iterable[RolloutFact]) -> list[int]:
    sizes: dict[str, int] = {}
    for r in rollouts:
        sizes[r.task_id] = sizes.get(r.task_id, 0) + 1
    return list(sizes.values())


def _unjoined(t: TrainingFacts) -> Finding:
    return Finding(
        "feedback that matches no rollout",
        f"{plural(t.unjoined, 'feedback row')} (the latest per reward_id) name keys no rollout in this store has, "
        f"as of the last convert pass; e.g. {', '.join(t.unjoined_samples[:3])}",
        "they reward nothing yet; they are kept in rewards/ and joined when a rollout with those keys arrives",
        "check what the client sends: trace_id must be the trace the request's spans were exported in (the "
        "service's server span: format(span.get_span_context().trace_id, '032x')); response_id the 'id' of the "
        "OpenAI response the app got back (a call span or the gateway must record it as gen_ai.response.id); "
        "rollout_id the tracerl.rollout_id the agent set. Check the spans reach this store (tracerl status: last "
        "span received) and that convert ran since",
    )


def _accidental_groups(rollouts: list[RolloutFact]) -> list[Finding]:
    by_task: dict[str, list[RolloutFact]] = {}
    for r in rollouts:
        by_task.setdefault(r.task_id, []).append(r)
    hits = [
        (task, rs)
        for task, rs in by_task.items()
        if len(rs) >= ACCIDENTAL_MIN and len({r.prompt_key for r in rs}) >= ACCIDENTAL_DISTINCT * len(rs)
    ]
    if not hits:
        return []
    task, rs = max(hits, key=lambda h: len(h[1]))
    return [
        Finding(
            "different requests grouped as one task",
            f"{plural(len(rs), 'rollout')} share task {task!r} but {len({r.prompt_key for r in rs})} of them were "
            f"asked something different (their first calls' prompts differ)"
            + (f"; {len(hits) - 1} more such tasks" if len(hits) > 1 else ""),
            "a group estimator compares each rollout with rollouts of other questions: the advantage measures "
            "which question was easier, not which answer was better (a shared system prompt or few-shot turns "
            "decided the task)",
            TASK_KEY_FIX + "; or train group-free: tracerl train --estimator reinforce_plus_plus",
        )
    ]


def _waiting(t: TrainingFacts, rnd: Round) -> Finding:
    soonest = min(left for _, left in rnd.waiting)
    return Finding(
        "rollouts waiting on their feedback window",
        f"{plural(len(rnd.waiting), 'rollout')} of policy@{rnd.version} ended less than --feedback-window "
        f"{t.feedback_window_s:g}s ago (the first closes in {soonest:.0f}s); the "
        f"{plural(len(rnd.candidates), 'rollout')} whose window has closed give no learning signal alone",
        "the next round trains none of them yet: their feedback may still come",
        "wait for the window to close; or pass a shorter --feedback-window to tracerl train (and doctor)",
    )


def _nothing_new(t: TrainingFacts, rnd: Round) -> Finding:
    if rnd.of_version:
        saw = (
            f"{plural(rnd.of_version, 'unused rollout')} of policy@{rnd.version}, none complete with a reward"
            + (" closed without feedback" if t.feedback_window_s else "")
        )
        fix = (
            "send feedback for them (POST /v1/rewards with their trace_id, response_id or rollout_id) or emit "
            "tracerl.reward; check that the agent ends its rollouts (tracerl doctor names pending ones)"
        )
    else:
        versions = sorted({r.version for r in t.rollouts if not r.used})
        saw = f"no unused rollout of policy@{rnd.version}, the version the next round trains" + (
            f"; unused rollouts exist of {', '.join(f'policy@{v}' for v in versions)}"
            if versions
            else "; every rollout was used by an earlier round"
        )
        fix = (
            f"send traffic to policy@{rnd.version}: this store's rounds number the versions (the base model is "
            "policy@0, round k publishes policy@k+1 with tracerl train --server URL) and a call's version is read "
            "from its served model name; older versions train with --max-staleness K; calls recorded without a "
            "version count as --unversioned-as (0)"
        )
    return Finding("nothing for the next round to train", saw, "tracerl train waits and writes nothing", fix)


def _singletons(rnd: Round, estimator: str, why: str) -> Finding:
    return Finding(
        "every task seen once under a group estimator",
        f"{plural(len(rnd.candidates), 'rollout')} of policy@{rnd.version} in "
        f"{plural(len(rnd.candidates), 'task')}: each task has one rollout; {estimator} ({why}) compares a rollout "
        "only with rollouts of its own task",
        "every group has one rollout and zero variance, so the round drops them all and never trains (live traffic: "
        "requests never repeat)",
        "train group-free: tracerl train --estimator auto (picks REINFORCE++ where tasks do not repeat) or "
        "--estimator reinforce_plus_plus; if requests do repeat a task that the key misses: " + TASK_KEY_FIX,
    )


def _no_variance(rnd: Round, estimator: str, why: str) -> Finding:
    rewards = sorted({r.reward for r in rnd.candidates if r.reward is not None})
    scope = "the batch" if estimator in GROUP_FREE else "every task group"
    return Finding(
        "no reward variance",
        f"{plural(len(rnd.candidates), 'rollout')} of policy@{rnd.version}, rewards {rewards[:5]}: {scope} got one "
        f"reward under {estimator} ({why})",
        "every advantage is zero, so the next round drops them all and trains nothing",
        "make the reward tell answers apart (a graded score, not a constant), sample more rollouts per task "
        "(tracerl rollout --samples N), or use tasks the policy sometimes fails",
    )
