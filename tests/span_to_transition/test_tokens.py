"""Exact tokens from the gateway (child span or same response id), from the span, or none."""

from __future__ import annotations

import json

from span_to_transition.convert import ConvertConfig, RolloutInput, convert_rollout
from span_to_transition.tokens import parse_policy_version

from .factory import TraceBuilder, parts, user


def gateway_attrs(response_id: str, prompt: list[int], response: list[int], version: int | None = 7) -> dict:
    attrs = {"tracerl.gateway": True, "gen_ai.operation.name": "chat", "gen_ai.response.id": response_id,
             "gen_ai.request.model": "policy@7", "gen_ai.response.model": "policy@7",
             "tracerl.prompt_token_ids": prompt, "tracerl.response_token_ids": response,
             "tracerl.response_logprobs": [-0.5] * len(response)}
    if version is not None:
        attrs["tracerl.policy_version"] = version
    return attrs


def convert(t: TraceBuilder):
    t.reward(None, 1.0)
    return convert_rollout(RolloutInput("r", t.spans), ConvertConfig())


def test_gateway_child_span_supplies_exact_tokens_and_is_not_a_call_itself() -> None:
    t = TraceBuilder()
    call = t.chat(None, [user("hi")], "hello", response_id="r1", model="policy@7")
    t.span("POST /v1/chat/completions", call, gateway_attrs("other-id", [1, 2, 3], [4, 5]))
    out = convert(t)
    [tr] = out.transitions
    assert (tr.token_source, tr.prompt_token_ids, tr.response_token_ids) == ("gateway", [1, 2, 3], [4, 5])
    assert tr.response_logprobs == [-0.5, -0.5] and tr.policy_version == 7


def test_gateway_span_elsewhere_in_the_trace_joins_by_response_id() -> None:
    t = TraceBuilder()
    call = t.chat(None, [user("hi")], "hello", response_id="r1")
    t.span("gateway", None, gateway_attrs("r1", [9], [8], version=None))
    [tr] = convert(t).transitions
    assert (tr.token_source, tr.prompt_token_ids, tr.span_id) == ("gateway", [9], call.span_id)
    assert tr.policy_version == 7  # parsed from the gateway's policy@7 model name


def test_token_ids_on_the_call_span_itself() -> None:
    t = TraceBuilder()
    t.chat(None, [user("hi")], "hello", extra={"tracerl.prompt_token_ids": [1], "tracerl.response_token_ids": [2]})
    [tr] = convert(t).transitions
    assert (tr.token_source, tr.prompt_token_ids, tr.response_token_ids) == ("span", [1], [2])


def test_no_tokens_means_retokenized_with_empty_ids() -> None:
    t = TraceBuilder()
    t.chat(None, [user("hi")], "hello")
    [tr] = convert(t).transitions
    assert (tr.token_source, tr.prompt_token_ids, tr.response_token_ids, tr.response_logprobs) == (
        "retokenized", [], [], None)


def test_malformed_token_ids_are_reported_not_guessed() -> None:
    t = TraceBuilder()
    call = t.chat(None, [user("hi")], "hello", response_id="r1")
    t.span("gw", call, {**gateway_attrs("r1", [1], [2]), "tracerl.prompt_token_ids": "[1, 'x']"})
    out = convert(t)
    assert out.transitions[0].token_source == "retokenized"
    assert any("tracerl.prompt_token_ids is not a JSON list of ints" in p for p in out.problems)


def test_gateway_without_an_agent_call_span_becomes_the_call() -> None:
    t = TraceBuilder()
    attrs = gateway_attrs("r5", [1, 2], [3])
    attrs["gen_ai.input.messages"] = parts([user("hi")])
    attrs["gen_ai.output.messages"] = json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": "yo"}]}])
    gw = t.span("gateway", None, attrs)
    [tr] = convert(t).transitions
    assert (tr.span_id, tr.token_source, tr.response_message) == (
        gw.span_id, "gateway", '{"role":"assistant","content":"yo"}')


def test_gateway_without_call_or_messages_is_reported() -> None:
    t = TraceBuilder()
    t.span("gateway", None, gateway_attrs("r5", [1], [2]))
    out = convert(t)
    assert out.transitions == [] and "matches no LLM call span" in out.problems[0]


def test_policy_version_from_model_name() -> None:
    assert parse_policy_version("policy@12") == 12
    assert parse_policy_version("gpt-4o") is None
    assert parse_policy_version(None) is None


def test_a_call_that_straddled_a_swap_gets_the_older_candidate_never_a_fresher_version() -> None:
    """The gateway labels a full-reload call whose version reads before and after differ as ambiguous
    (serving/gateway/versions.py); the transition takes the older one as a lower bound, not 0."""
    t = TraceBuilder()
    call = t.chat(None, [user("hi")], "hello", response_id="r1", model="policy")
    attrs = {**gateway_attrs("r1", [1, 2], [3], version=None), "gen_ai.request.model": "policy",
             "gen_ai.response.model": "policy", "tracerl.policy_version_ambiguous": True,
             "tracerl.policy_version_candidates": ["4", "5"]}
    t.span("POST /v1/chat/completions", call, attrs)
    [tr] = convert(t).transitions
    assert tr.token_source == "gateway" and tr.policy_version == 4
