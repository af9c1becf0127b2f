"""Credit assignment strategies on hand-computed examples."""

from __future__ import annotations

import pytest

from span_to_transition.credit import CREDIT, CallRef, CreditRollout, assign
from span_to_transition.records import Reward

CALLS = [CallRef("s0", "r0", 100), CallRef("s1", "r1", 200), CallRef("s2", "r2", 300)]


def rollout(reward: float, rewards: list[Reward] | None = None, gamma: float = 0.9) -> CreditRollout:
    return CreditRollout(CALLS, reward, rewards or [], gamma)


def test_identical_gives_every_call_the_rollout_reward() -> None:
    assert CREDIT["identical"](rollout(2.0)) == [2.0, 2.0, 2.0]


def test_last_call_credits_only_the_final_call() -> None:
    assert CREDIT["last_call"](rollout(2.0)) == [0.0, 0.0, 2.0]


def test_discounted_backs_up_the_reward_with_gamma() -> None:
    # gamma = 0.5: R * 0.25, R * 0.5, R
    assert CREDIT["discounted"](rollout(4.0, gamma=0.5)) == [1.0, 2.0, 4.0]


def test_matched_gives_in_band_rewards_to_the_nearest_preceding_call() -> None:
    rewards = [
        Reward(1.0, "span", at_ns=250),  # after call 1 ended (200), before call 2 ended (300)
        Reward(0.5, "span", at_ns=50),  # before any call ended: no call earned it, shared as identical
        Reward(2.0, "event", span_id="s2"),  # attached to call 2
        Reward(3.0, "side_channel", response_id="r0"),  # targets call 0 by response id
        Reward(10.0, "side_channel"),  # whole-rollout score: shared as identical
    ]
    assert CREDIT["matched"](rollout(16.5, rewards)) == [10.5 + 3.0, 10.5 + 1.0, 10.5 + 2.0]


# Two agents interleaved in time: A's calls s0 (ends 100) and s2 (ends 300), B's call s1 (ends 200).
SCOPED = [CallRef("s0", None, 100, "A"), CallRef("s1", None, 200, "B"), CallRef("s2", None, 300, "A")]


def scoped(rewards: list[tuple[float, int, str | None]]) -> list[float]:
    rs = [Reward(v, "span", at_ns=at) for v, at, _ in rewards]
    return CREDIT["matched"](CreditRollout(SCOPED, sum(v for v, _, _ in rewards), rs, 0.9, [a for _, _, a in rewards]))


def test_matched_never_crosses_an_agent_boundary() -> None:
    # A reward under agent A at 250: B's call ended just before it, but A's latest earlier call is s0.
    assert scoped([(1.0, 250, "A")]) == [1.0, 0.0, 0.0]
    assert scoped([(1.0, 250, "B")]) == [0.0, 1.0, 0.0]
    # A reward under no agent looks at every call of the rollout: the latest that ended before it.
    assert scoped([(1.0, 250, None)]) == [0.0, 1.0, 0.0]


def test_matched_never_credits_a_later_call_and_spreads_what_no_call_earned() -> None:
    # Under A before any A call ended (B's had not either): no call earned it, every call gets it.
    assert scoped([(0.3, 50, "A")]) == [0.3, 0.3, 0.3]
    # Under B at 150: B's only call ends at 200, after the reward: shared as identical too.
    assert scoped([(0.6, 150, "B")]) == [0.6, 0.6, 0.6]


def test_matched_backfills_older_calls_like_agent_lightnings_first_occurrence() -> None:
    # Three rewards after three calls (same agent): one each, latest call first, later rewards backfill.
    calls = [CallRef("s0", None, 100, "A"), CallRef("s1", None, 200, "A"), CallRef("s2", None, 300, "A")]
    rs = [Reward(0.1, "span", at_ns=400), Reward(0.2, "span", at_ns=500), Reward(0.3, "span", at_ns=600)]
    assert CREDIT["matched"](CreditRollout(calls, 0.6, rs, 0.9, ["A"] * 3)) == [0.3, 0.2, 0.1]
    # More rewards than earlier calls: the extra one adds to the latest earlier call (nothing is lost).
    rs = [Reward(1.0, "span", at_ns=150), Reward(2.0, "span", at_ns=160)]
    assert CREDIT["matched"](CreditRollout(calls, 3.0, rs, 0.9, ["A"] * 2)) == [3.0, 0.0, 0.0]


def test_matched_without_observations_is_identical() -> None:
    assert CREDIT["matched"](rollout(0.0)) == [0.0, 0.0, 0.0]


def test_unknown_strategy_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="identical, last_call, discounted, matched"):
        assign("best", rollout(1.0))


@pytest.mark.parametrize("name", sorted(CREDIT))
def test_every_strategy_returns_one_reward_per_call(name: str) -> None:
    assert len(CREDIT[name](rollout(1.0))) == len(CALLS)
    assert CREDIT[name](CreditRollout([], 1.0)) == []
