"""Credit assignment: how a rollout's reward is shared among its LLM calls.

Each strategy is a plain function ``(rollout) -> list[float]``, one reward per call in step
order, registered in ``CREDIT``. ``identical`` is the LightningRL default: every call of the
rollout is credited with the whole rollout reward, and the trainer's group-relative advantage
does the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from span_to_transition.records import Reward


class CallRef(NamedTuple):
    """What credit assignment needs to know about one call (a named tuple: one per call, made cheaply)."""

    span_id: str
    response_id: str | None
    ended_at_ns: int
    scope: object = None  # the call's nearest agent span (any hashable id); None: no agent


@dataclass(frozen=True)
class CreditRollout:
    calls: list[CallRef]  # in step order
    reward: float  # the rollout reward (after the missing-reward fill)
    rewards: list[Reward] = field(default_factory=list)  # the individual observations behind it
    gamma: float = 0.9
    reward_scopes: list[object] | None = None  # per reward: its nearest agent span (None: no agent / not in-band)


def identical(r: CreditRollout) -> list[float]:
    """Every call gets the rollout reward."""
    return [r.reward for _ in r.calls]


def last_call(r: CreditRollout) -> list[float]:
    """Only the final call is credited; earlier calls get 0."""
    n = len(r.calls)
    return [r.reward if t == n - 1 else 0.0 for t in range(n)]


def discounted(r: CreditRollout) -> list[float]:
    """The reward arrives after the last call and is discounted back: call t gets gamma^(n-1-t) * R."""
    n = len(r.calls)
    credit = [0.0] * n
    running = r.reward
    for t in reversed(range(n)):
        credit[t] = running
        running *= r.gamma
    return credit


def matched(r: CreditRollout) -> list[float]:
    """Each reward goes to the call it belongs to; what belongs to no call is shared as ``identical``.

    The rule, reward by reward in time order:

    1. A reward that names its call (``span_id`` of a call, e.g. an evaluation event on the call span,
       or its ``response_id``) goes to that call.
    2. An in-band reward with a time goes to the latest call (in step order) that ended at or before it
       under the same nearest agent span as the reward; a reward under no agent looks at every call of
       the rollout. Among those calls, the latest one no earlier reward went to is preferred (Agent
       Lightning's ``first_occurrence`` match: three rewards after three calls give one each, the later
       rewards backfilling older calls); when all already have one, the latest takes it too (summed).
       Never a call that ended after the reward: an action is not credited with what came before it.
    3. Anything else (no time: a side channel or offline score of the whole rollout; or no call of its
       agent had ended yet) is added to every call, as ``identical`` does.

    With no individual observations (e.g. a filled-in reward) this is ``identical``.
    """
    n = len(r.calls)
    if not r.rewards:
        return identical(r)
    credit = [0.0] * n
    by_span = {c.span_id: t for t, c in enumerate(r.calls)}
    by_response = {c.response_id: t for t, c in enumerate(r.calls) if c.response_id}
    scopes = r.reward_scopes if r.reward_scopes is not None else [None] * len(r.rewards)
    rewarded: set[int] = set()
    for rw, scope in sorted(zip(r.rewards, scopes), key=lambda p: p[0].at_ns or 0):
        target: int | None = None
        if rw.span_id in by_span:
            target = by_span[rw.span_id]
        elif rw.response_id in by_response:
            target = by_response[rw.response_id]
        elif rw.at_ns is not None:
            earlier = [t for t, c in enumerate(r.calls)
                       if c.ended_at_ns <= rw.at_ns and (scope is None or c.scope == scope)]
            fresh = [t for t in earlier if t not in rewarded]
            target = (fresh or earlier or [None])[-1]
        if target is None:
            for t in range(n):
                credit[t] += rw.value
        else:
            credit[target] += rw.value
            rewarded.add(target)
    return credit


CREDIT: dict[str, Callable[[CreditRollout], list[float]]] = {
    "identical": identical,
    "last_call": last_call,
    "discounted": discounted,
    "matched": matched,
}


def assign(strategy: str, rollout: CreditRollout) -> list[float]:
    """Run a registered strategy; an unknown name lists the valid ones."""
    try:
        fn = CREDIT[strategy]
    except KeyError:
        raise ValueError(f"unknown credit strategy {strategy!r}; choose one of {', '.join(CREDIT)}") from None
    return fn(rollout)
