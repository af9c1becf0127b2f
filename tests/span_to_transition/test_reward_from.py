"""``--reward-from``: which of a rollout's rewards make its reward. A judge scoring graded rollouts (to
measure agreement) must not add to the grader's reward; a rollout nobody graded trains on the judge; a
name list trains on exactly those names. Pure: the rule, then ``convert_rollout`` on built spans."""

from __future__ import annotations

import pytest

from span_to_transition.convert import (
    NO_REWARD,
    NO_SELECTED_REWARD,
    ConvertConfig,
    RolloutInput,
    convert_rollout,
)
from span_to_transition.records import Reward
from span_to_transition.rewards import RewardFrom, parse_reward_from, rollout_reward, select_rewards

from .factory import TraceBuilder, user

GRADE = Reward(1.0, "side_channel", "grade", reward_id="g")
STYLE = Reward(0.25, "offline", "style", reward_id="s")
JUDGE = Reward(0.4, "judge", "judge", reward_id="j")
UNNAMED = Reward(0.5, "span")


def test_auto_is_every_reward_but_the_judges_where_the_rollout_has_any() -> None:
    auto = parse_reward_from("auto")
    assert auto == RewardFrom() and str(auto) == "auto"
    assert select_rewards([GRADE, JUDGE, STYLE], auto) == [GRADE, STYLE]
    assert select_rewards([JUDGE], auto) == [JUDGE]  # nobody graded it: the judge's score is all there is
    assert select_rewards([], auto) == []


def test_a_judge_row_under_another_name_is_still_the_judges() -> None:
    """``tracerl judge --name ruler`` writes source=judge rows: auto knows them by source, not name."""
    ruler = Reward(0.9, "judge", "ruler", reward_id="r")
    assert select_rewards([ruler, GRADE], RewardFrom()) == [GRADE]


def test_a_name_list_keeps_exactly_those_names_whatever_their_source() -> None:
    assert select_rewards([GRADE, JUDGE, STYLE], parse_reward_from("judge")) == [JUDGE]
    assert select_rewards([GRADE, JUDGE, STYLE], parse_reward_from("style,grade")) == [GRADE, STYLE]
    assert select_rewards([GRADE, STYLE], parse_reward_from("judge")) == []
    # an unnamed reward (a bare tracerl.reward span) goes by "reward", the side channel's default name
    assert select_rewards([UNNAMED, GRADE], parse_reward_from("reward")) == [UNNAMED]
    assert str(parse_reward_from("style, grade")) == "grade,style"


@pytest.mark.parametrize("bad", ["", ",", "grade,,style", "my grade", "auto,judge"])
def test_a_bad_list_names_the_flag_and_the_fix(bad: str) -> None:
    with pytest.raises(ValueError, match=r"--reward-from .*give auto, or reward names separated by commas"):
        parse_reward_from(bad)
    with pytest.raises(ValueError, match="--reward-from"):
        ConvertConfig(reward_from=bad).validate()


def test_may_count_says_which_rows_can_ever_change_a_rollouts_reward() -> None:
    assert RewardFrom().may_count(JUDGE) and RewardFrom().may_count(GRADE)
    judge_only = parse_reward_from("judge")
    assert judge_only.may_count(JUDGE) and not judge_only.may_count(GRADE)


def test_the_rollout_reward_names_what_was_summed() -> None:
    total = rollout_reward([GRADE, STYLE, UNNAMED])
    assert (total.value, total.source, total.names) == (
        1.75,
        "offline,side_channel,span",
        "grade,reward,style",
    )
    assert rollout_reward([]).names is None


def one_call() -> TraceBuilder:
    t = TraceBuilder()
    root = t.span("invoke_agent solver", agent="solver")
    t.chat(root, [user("2+2?")], "4", response_id="r1")
    return t


def convert(rows: list[Reward], **config: object):
    return convert_rollout(RolloutInput("r", one_call().spans, rewards=rows), ConvertConfig(**config))


def test_a_graded_rollout_trains_on_its_grader_and_the_judge_adds_nothing() -> None:
    [tr] = convert([GRADE, JUDGE]).transitions
    assert (tr.reward, tr.rollout_reward, tr.reward_source, tr.reward_names) == (
        1.0,
        1.0,
        "side_channel",
        "grade",
    )


def test_an_ungraded_rollout_trains_on_the_judge() -> None:
    [tr] = convert([JUDGE]).transitions
    assert (tr.rollout_reward, tr.reward_source, tr.reward_names) == (0.4, "judge", "judge")


def test_reward_from_judge_trains_on_the_judge_alone() -> None:
    [tr] = convert([GRADE, JUDGE], reward_from="judge").transitions
    assert (tr.rollout_reward, tr.reward_names) == (0.4, "judge")


def test_a_rollout_with_only_unselected_rewards_is_reward_less_and_says_why() -> None:
    out = convert([GRADE], reward_from="judge")
    assert (out.status, out.reason) == ("excluded_no_reward", NO_SELECTED_REWARD)
    assert convert([], reward_from="judge").reason == NO_REWARD  # nothing at all: the old reason
    [kept] = convert([GRADE], reward_from="judge", missing_reward="keep").transitions
    assert (kept.rollout_reward, kept.reward_names) == (None, None)  # what `tracerl judge` waits on
    [filled] = convert([GRADE], reward_from="judge", missing_reward="fill").transitions
    assert (filled.rollout_reward, filled.reward_source, filled.reward_names) == (0.0, "fill", None)
