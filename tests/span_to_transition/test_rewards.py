"""Rewards from every in-band spelling, and what happens to a rollout without one."""

from __future__ import annotations

from span_to_transition.convert import ConvertConfig, RolloutInput, convert_rollout
from span_to_transition.records import LogEvent, Reward, SpanEvent
from span_to_transition.rewards import in_band_rewards, rollout_reward

from .factory import TraceBuilder, user


def one_call(**reward_spans) -> TraceBuilder:
    t = TraceBuilder()
    root = t.span("invoke_agent solver", agent="solver")
    t.chat(root, [user("2+2?")], "4", response_id="r1")
    return t


def test_tracerl_reward_span_with_name() -> None:
    t = one_call()
    t.reward(None, 0.75, "exact_match")
    [r] = in_band_rewards(t.spans)
    assert (r.value, r.name, r.source) == (0.75, "exact_match", "span")


def test_agentlightning_reward_spans_indexed_primary_and_legacy() -> None:
    t = one_call()
    t.span("agentlightning.reward", None, {"agentlightning.reward.0.name": "task", "agentlightning.reward.0.value": 1.0,
                                           "agentlightning.reward.1.name": "cost", "agentlightning.reward.1.value": -0.2})
    t.span("agentlightning.reward", None, {"agentlightning.reward.primary": 0.5})
    t.span("agentlightning.reward", None, {"reward": 0.25})
    assert [(r.name, r.value) for r in in_band_rewards(t.spans)] == [
        ("task", 1.0), ("cost", -0.2), ("primary", 0.5), (None, 0.25)]


def test_evaluation_result_events_on_spans_and_in_logs_target_their_call() -> None:
    t = TraceBuilder()
    ev = SpanEvent("gen_ai.evaluation.result", 5, {"gen_ai.evaluation.name": "judge",
                                                     "gen_ai.evaluation.score.value": "0.9"})
    call = t.span("chat", None, {"gen_ai.operation.name": "chat"}, events=[ev])
    log = LogEvent(t.trace_id, call.span_id, 6, "gen_ai.evaluation.result",
                   attributes={"gen_ai.evaluation.score.value": "0.1", "gen_ai.response.id": "r9"})
    rewards = in_band_rewards(t.spans, [log])
    assert [(r.value, r.source, r.span_id, r.response_id) for r in rewards] == [
        (0.9, "event", call.span_id, None), (0.1, "event", call.span_id, "r9")]


def test_rollout_reward_sums_channels_and_counts_a_retried_row_once() -> None:
    rewards = [Reward(1.0, "span"), Reward(0.5, "side_channel", reward_id="x"), Reward(0.5, "side_channel", reward_id="x")]
    total = rollout_reward(rewards)
    assert (total.value, total.source) == (1.5, "side_channel,span")
    assert rollout_reward([]).value is None


def test_side_channel_and_offline_rows_reach_the_transition() -> None:
    t = one_call()
    rows = [Reward(0.25, "side_channel", reward_id="a"), Reward(0.5, "offline", reward_id="b")]
    [tr] = convert_rollout(RolloutInput("r", t.spans, rewards=rows), ConvertConfig()).transitions
    assert (tr.reward, tr.rollout_reward, tr.reward_source) == (0.75, 0.75, "offline,side_channel")


def test_rollout_without_reward_is_excluded_by_default_or_filled() -> None:
    t = one_call()
    out = convert_rollout(RolloutInput("r", t.spans), ConvertConfig())
    assert out.status == "excluded_no_reward" and out.transitions == []
    filled = convert_rollout(RolloutInput("r", t.spans), ConvertConfig(missing_reward="fill", fill_reward=-1.0))
    [tr] = filled.transitions
    assert filled.filled_reward and (tr.reward, tr.reward_source) == (-1.0, "fill")


def test_matched_credit_uses_in_band_positions() -> None:
    t = TraceBuilder()
    root = t.span("invoke_agent a", agent="a")
    t.chat(root, [user("q1")], "a1")
    t.reward(root, 1.0)  # after call 0
    t.chat(root, [user("q2")], "a2")
    t.reward(root, 3.0)  # after call 1
    out = convert_rollout(RolloutInput("r", t.spans), ConvertConfig(credit="matched"))
    assert [(tr.reward, tr.rollout_reward) for tr in out.transitions] == [(1.0, 4.0), (3.0, 4.0)]
