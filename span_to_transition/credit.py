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


@dataclass(frozen=True)
class CreditRollout:
    calls: list[CallRef]  # in step order
    reward: float  # the rollout reward (after the missing-reward fill)
    rewards: list[Reward] = field(default_factory=list)  # the individual observations behind it
    gamma: float = 0.9


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
    """Each reward goes to the call it belongs to; the rest is shared as ``identical``.

    A reward that names its call (``span_id`` or ``response_id``) goes to that call. An in-band
    reward with a time goes to the nearest preceding call (the last call that ended at or
    before it; the first call if it came before every call). A reward with neither (a side
    channel or offline score of the whole rollout) is added to every call. With no individual
    observations (e.g. a filled-in reward) this is ``identical``.
    """
    n = len(r.calls)
    if not r.rewards:
        return identical(r)
    credit = [0.0] * n
    by_span = {c.span_id: t for t, c in enumerate(r.calls)}
    by_response = {c.response_id: t for t, c in enumerate(r.calls) if c.response_id}
    for rw in r.rewards:
        if rw.span_id in by_span:
            credit[by_span[rw.span_id]] += rw.value
        elif rw.response_id in by_response:
            credit[by_response[rw.response_id]] += rw.value
        elif rw.at_ns is not None and n:
            target = 0
            for t, c in enumerate(r.calls):
                if c.ended_at_ns <= rw.at_ns:
                    target = t
            credit[target] += rw.value
        else:
            for t in range(n):
                credit[t] += rw.value
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
