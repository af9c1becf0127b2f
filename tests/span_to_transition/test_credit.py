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
        Reward(0.5, "span", at_ns=50),  # before any call ended: the first call
        Reward(2.0, "event", span_id="s2"),  # attached to call 2
        Reward(3.0, "side_channel", response_id="r0"),  # targets call 0 by response id
        Reward(10.0, "side_channel"),  # whole-rollout score: shared as identical
    ]
    assert CREDIT["matched"](rollout(16.5, rewards)) == [10.0 + 0.5 + 3.0, 10.0 + 1.0, 10.0 + 2.0]


def test_matched_without_observations_is_identical() -> None:
    assert CREDIT["matched"](rollout(0.0)) == [0.0, 0.0, 0.0]


def test_unknown_strategy_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="identical, last_call, discounted, matched"):
        assign("best", rollout(1.0))


@pytest.mark.parametrize("name", sorted(CREDIT))
def test_every_strategy_returns_one_reward_per_call(name: str) -> None:
    assert len(CREDIT[name](rollout(1.0))) == len(CALLS)
    assert CREDIT[name](CreditRollout([], 1.0)) == []
