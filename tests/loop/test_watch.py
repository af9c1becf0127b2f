"""``loop.watch.round_complete``: when a round's spans, rewards and gateway spans are all stored."""

from __future__ import annotations

from loop.watch import round_complete


def _status(roots: int = 4, rewards: int = 4, calls: int = 8, gateway_spans: int = 8) -> dict[str, int]:
    return {
        "roots": roots,
        "traces": roots,
        "calls": calls,
        "gateway_spans": gateway_spans,
        "rewards": rewards,
        "converted": 0,
    }


def test_a_round_is_complete_with_every_root_reward_and_a_gateway_span_per_call():
    assert round_complete(_status(), rollouts=4, rewarded=4)


def test_a_missing_root_reward_or_gateway_span_keeps_the_loop_waiting():
    assert not round_complete(_status(roots=3), rollouts=4, rewarded=4)
    assert not round_complete(_status(rewards=3), rollouts=4, rewarded=4)
    assert not round_complete(_status(gateway_spans=7), rollouts=4, rewarded=4)


def test_a_round_with_no_llm_call_stored_yet_is_not_complete():
    # the agents' own spans may arrive before their LLM-call spans: zero calls is not "all calls"
    assert not round_complete(_status(calls=0, gateway_spans=0), rollouts=4, rewarded=4)


def test_rewards_are_counted_against_those_posted_not_the_rollouts():
    assert round_complete(_status(rewards=3), rollouts=4, rewarded=3)  # one reward could not be computed
