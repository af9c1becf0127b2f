"""Every dialect, recorded by its real instrumentation package, converts to the same transitions."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from span_to_transition.chat_messages import messages_from_parts
from span_to_transition.convert import ConvertConfig, RolloutInput, convert_rollout
from span_to_transition.dialects.registry import classify, parse_call
from span_to_transition.flat_attributes import unflatten
from span_to_transition.records import Span
from span_to_transition.store import convert_store, logs_from_table, spans_from_table
from store.layout import StoreLayout
from store.location import parse_store
from store.parquet import write_table_atomic
from store.views import connect_readonly

from .factory import (
    AGENTOPS_FIXTURES,
    DIALECT_FIXTURES,
    STREAM_FIXTURES,
    VERCEL_FIXTURES,
    TraceBuilder,
    fixture_tables,
    user,
)

WEATHER_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_CALL = {"id": "call_w1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
EXPECTED = [
    {
        "prompt": [{"role": "system", "content": "You are a weather assistant. Use the tools."},
                   {"role": "user", "content": "What is the weather in Paris?"}],
        "response": {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
        "finish_reason": "tool_calls", "usage": (42, 9),
    },
    {
        "prompt": [{"role": "system", "content": "You are a weather assistant. Use the tools."},
                   {"role": "user", "content": "What is the weather in Paris?"},
                   {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                   {"role": "tool", "content": "18C and sunny", "tool_call_id": "call_w1"}],
        "response": {"role": "assistant", "content": "It is 18C and sunny in Paris."},
        "finish_reason": "stop", "usage": (61, 11),
    },
]
CHART = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8/5+hHgAHggJ/PchI7wAAAABJRU5E"
         "rkJggg==")
VERCEL_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                   "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}]
# Which recordings carry tool definitions at all (the contrib instrumentation does not record them).
RECORDS_TOOLS = {"openllmetry": True, "openllmetry-legacy": True, "openinference": True, "openai-v2": False,
                 "openai-v2-events": False, "openai-v2-details": False}
# The LLM-call span attributes a streamed recording has that differ from the non-streamed one (the
# loopback port in ``gen_ai.openai.api_base`` aside). Usage is recorded alike by all: the agent asks
# for ``stream_options.include_usage``.
STREAM_CHANGES = {
    # is_streaming true; the tool-call output gains an empty text part (content "" accumulated from
    # the deltas), which reads as content None like the non-streamed reply.
    "openllmetry": {"gen_ai.is_streaming", "gen_ai.output.messages"},
    # llm.is_streaming true; gen_ai.usage.reasoning_tokens (0 when not streamed) is not written.
    "openllmetry-legacy": {"llm.is_streaming", "gen_ai.usage.reasoning_tokens"},
    # The stream wrapper never fills gen_ai.response.finish_reasons (on the span and on the details
    # log event alike); the finish reason comes from the output messages / gen_ai.choice event.
    "openai-v2": {"gen_ai.response.finish_reasons"},
    "openai-v2-events": {"gen_ai.response.finish_reasons"},
    "openai-v2-details": {"gen_ai.response.finish_reasons"},
    # The request with stream/stream_options; output.value is the chunks merged into one
    # chat.completion.chunk object (no logprobs).
    "openinference": {"input.value", "llm.invocation_parameters", "output.value"},
}


def convert_fixture(name: str):
    traces, logs = fixture_tables(name)
    spans = spans_from_table(traces)
    out = convert_rollout(
        RolloutInput(spans[0].rollout_id, spans, logs_from_table(logs) if logs is not None else []), ConvertConfig())
    assert out.status == "converted", out.problems
    assert out.problems == []
    return out.transitions


@pytest.mark.parametrize("name", DIALECT_FIXTURES + STREAM_FIXTURES + VERCEL_FIXTURES + AGENTOPS_FIXTURES)
def test_each_recorded_dialect_yields_the_weather_agents_two_calls(name: str) -> None:
    transitions = convert_fixture(name)
    assert len(transitions) == 2
    for t, want in zip(transitions, EXPECTED):
        assert json.loads(t.prompt_messages) == want["prompt"]
        assert json.loads(t.response_message) == want["response"]
        assert t.finish_reason == want["finish_reason"]
        assert (t.input_tokens, t.output_tokens) == want["usage"]
        assert t.agent_name == ("Weather" if name.startswith("agentops") else "weather")
        assert t.model == "policy@3" and t.policy_version == 3
        assert t.token_source == "retokenized" and t.prompt_token_ids == [] and t.response_token_ids == []
        assert t.reward == 1.0 and t.reward_source == "span"
        if name.startswith("vercel-ai"):  # the SDK's zod schema, as JSON Schema
            assert json.loads(t.tools) == VERCEL_TOOL
        elif name.startswith("agentops") or RECORDS_TOOLS[name.removesuffix("-stream")]:
            assert json.loads(t.tools) == WEATHER_TOOL
        else:
            assert t.tools is None
    assert [t.step for t in transitions] == [0, 1]
    assert [t.is_last for t in transitions] == [False, True]


def test_all_dialects_agree_row_for_row() -> None:
    def comparable(name: str) -> list[tuple]:
        return [(t.step, t.prompt_messages, t.response_message, t.finish_reason, t.input_tokens, t.output_tokens,
                 t.agent_name.lower(), t.model, t.task_id, t.reward) for t in convert_fixture(name)]

    reference = comparable(DIALECT_FIXTURES[0])
    for name in DIALECT_FIXTURES[1:] + STREAM_FIXTURES + VERCEL_FIXTURES + AGENTOPS_FIXTURES:
        assert comparable(name) == reference, name


def _call_attributes(name: str) -> list[dict[str, str]]:
    return [s.attributes for s in spans_from_table(fixture_tables(name)[0]) if classify(s.attributes)]


@pytest.mark.parametrize("name", DIALECT_FIXTURES)
def test_a_streamed_recording_converts_field_for_field_like_the_non_streamed_one(name: str) -> None:
    pairs = zip(_call_attributes(name), _call_attributes(f"{name}-stream"), strict=True)
    changed = {k for plain, streamed in pairs for k in plain.keys() | streamed.keys()
               if plain.get(k) != streamed.get(k)}
    assert changed - {"gen_ai.openai.api_base"} == STREAM_CHANGES[name]

    recording = {"transition_id", "rollout_id", "trace_id", "span_id", "started_at", "ended_at"}
    plain, streamed = ([{k: v for k, v in asdict(t).items() if k not in recording} for t in convert_fixture(f)]
                       for f in (name, f"{name}-stream"))
    assert streamed == plain


def _span(attrs: dict[str, str], name: str = "x") -> Span:
    return Span("t" * 32, "s" * 16, None, name, 1, 2, attrs)


def test_calls_are_recognised_by_attributes_not_span_names() -> None:
    assert classify({}) is None
    assert parse_call(_span({}, name="openai.chat")) is None
    assert classify({"gen_ai.input.messages": "[]"}) == "semconv"
    assert classify({"openinference.span.kind": "LLM"}) == "openinference"
    assert classify({"openinference.span.kind": "TOOL"}) is None
    assert classify({"gen_ai.prompt.0.role": "user"}) == "openllmetry"
    assert classify({"gen_ai.operation.name": "execute_tool"}) is None


def test_semconv_system_instructions_tool_results_and_structured_arguments() -> None:
    attrs = {
        "gen_ai.system_instructions": json.dumps([{"type": "text", "content": "Be brief."}]),
        "gen_ai.input.messages": json.dumps([
            {"role": "user", "parts": [{"type": "text", "content": "add 2 and 3"}]},
            {"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "add",
                                             "arguments": {"a": 2, "b": 3}}]},
            {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1", "response": 5}]},
        ]),
        "gen_ai.output.messages": json.dumps([{"role": "assistant", "finish_reason": "stop",
                                               "parts": [{"type": "reasoning", "content": "easy"},
                                                         {"type": "text", "content": "5"}]}]),
        "gen_ai.tool.definitions": json.dumps([{"type": "function", "name": "add", "parameters": {"type": "object"}}]),
        "gen_ai.usage.prompt_tokens": "7",  # the older usage spelling
    }
    call = parse_call(_span(attrs))
    assert call is not None
    assert call.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "content": "5", "tool_call_id": "c1"},
    ]
    assert call.response == {"role": "assistant", "content": "5"}
    assert call.tools == [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    assert call.input_tokens == 7


def test_flattened_openllmetry_usage_spellings_and_multiple_tool_calls() -> None:
    attrs = {
        "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "two things",
        "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.finish_reason": "tool_calls",
        "gen_ai.completion.0.tool_calls.1.id": "b", "gen_ai.completion.0.tool_calls.1.name": "g",
        "gen_ai.completion.0.tool_calls.1.arguments": "{}",
        "gen_ai.completion.0.tool_calls.0.id": "a", "gen_ai.completion.0.tool_calls.0.name": "f",
        "gen_ai.completion.0.tool_calls.0.arguments": '{"x": 1}',
        "gen_ai.usage.input_tokens": "3", "gen_ai.usage.output_tokens": "4",
    }
    call = parse_call(_span(attrs))
    assert [c["id"] for c in call.response["tool_calls"]] == ["a", "b"]
    assert (call.input_tokens, call.output_tokens) == (3, 4)


def test_unflatten_orders_by_integer_index_not_text() -> None:
    attrs = {f"p.{i}.role": str(i) for i in (10, 2, 1)}
    assert [m["role"] for m in unflatten(attrs, "p.")] == ["1", "2", "10"]


def test_semconv_message_in_plain_openai_shape_is_accepted() -> None:
    assert messages_from_parts([{"role": "user", "content": "hi"}]) == [{"role": "user", "content": "hi"}]


def test_two_instrumentations_on_one_call_count_once_by_response_id() -> None:
    t = TraceBuilder()
    root = t.span("invoke_agent a", agent="a")
    outer = t.chat(root, [user("q")], "answer", response_id="chatcmpl-9")
    # a second instrumentation (flattened attributes, no content for the response) inside the first
    t.span("openai.chat", outer, {"gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "q",
                                  "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "answer",
                                  "gen_ai.response.id": "chatcmpl-9"})
    t.reward(root, 1.0)
    out = convert_rollout(RolloutInput("r", t.spans), ConvertConfig())
    assert out.duplicate_calls == 1
    [tr] = out.transitions
    assert tr.span_id == outer.span_id  # equally complete: the outer (shallower) record is kept


def test_a_framework_llm_span_over_the_client_span_counts_once_as_the_inner_request() -> None:
    """OpenInference's Agents SDK ``generation`` span (no response id) over OpenLLMetry's ``openai.chat``."""
    t = TraceBuilder()
    root = t.span("researcher", None, {"openinference.span.kind": "AGENT", "agent.name": "researcher"})
    outer = t.span("generation", root, {
        "openinference.span.kind": "LLM", "llm.model_name": "policy",
        "llm.input_messages.0.message.role": "user", "llm.input_messages.0.message.content": "q",
        "llm.output_messages.0.message.role": "assistant", "llm.output_messages.0.message.content": "answer"})
    inner = t.chat(outer, [user("q")], "answer", response_id="chatcmpl-1")
    lone = t.span("generation", root, {  # a framework span with no client span below: a call of its own
        "openinference.span.kind": "LLM", "llm.model_name": "policy",
        "llm.input_messages.0.message.role": "user", "llm.input_messages.0.message.content": "q2",
        "llm.output_messages.0.message.role": "assistant", "llm.output_messages.0.message.content": "a2"})
    t.reward(root, 1.0)
    out = convert_rollout(RolloutInput("r", t.spans), ConvertConfig())
    assert out.duplicate_calls == 1 and out.problems == []
    assert [tr.span_id for tr in out.transitions] == [inner.span_id, lone.span_id]
    assert all(tr.agent_name == "researcher" for tr in out.transitions)
    assert outer.span_id not in {tr.span_id for tr in out.transitions}


def test_call_without_captured_content_is_reported_with_the_fix() -> None:
    t = TraceBuilder()
    t.span("chat policy", None, {"gen_ai.operation.name": "chat", "gen_ai.request.model": "policy"})
    t.reward(None, 1.0)
    out = convert_rollout(RolloutInput("r", t.spans), ConvertConfig())
    assert out.transitions == [] and out.calls_without_content == 1
    assert "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT" in out.problems[0]


TEAM_AGENTS = {"agentops-team": ["Weather", "Weather", "Checker"], "vercel-ai-team": ["weather", "weather", "checker"]}


@pytest.mark.parametrize("name", ["agentops-team", "agentops-team-stream", "vercel-ai-team", "vercel-ai-team-stream"])
def test_a_team_run_keeps_agents_multimodal_parts_and_scoped_rewards(name: str) -> None:
    """Two agents in one trace (AgentOps: ``@agent`` classes under ``agentops.start_trace``; the Vercel AI SDK:
    two ``generateText`` runs under agent spans), the second asking about an image: three calls, each with its
    agent; the image part survives (AgentOps' ``json.dumps`` of the content, the SDK's ``file`` part);
    ``matched`` credit gives each agent's reward to that agent's latest call."""
    traces, _ = fixture_tables(name)
    spans = spans_from_table(traces)
    convert = lambda credit: convert_rollout(  # noqa: E731
        RolloutInput(spans[0].rollout_id, spans), ConvertConfig(credit=credit)).transitions
    rows = convert("identical")
    assert [t.agent_name for t in rows] == TEAM_AGENTS[name.removesuffix("-stream")]
    assert [json.loads(t.response_message) for t in rows[:2]] == [e["response"] for e in EXPECTED]
    assert json.loads(rows[2].prompt_messages) == [{"role": "user", "content": [
        {"type": "text", "text": "Does this chart agree with the forecast?"},
        {"type": "image_url", "image_url": {"url": CHART}}]}]
    assert json.loads(rows[2].response_message) == {"role": "assistant", "content": "Yes, it agrees."}
    assert [t.reward for t in rows] == [1.5, 1.5, 1.5]
    assert [t.reward for t in convert("matched")] == [0.0, 1.0, 0.5]


@pytest.mark.parametrize("name", ["litellm", "litellm-stream", "litellm-proxy", "litellm-proxy-stream"])
def test_litellm_otel_callback_records_the_weather_agents_two_calls(name: str) -> None:
    """LiteLLM 1.106.2's own OTel callback, as an SDK and as Agent Lightning's proxy: semconv messages in a
    hybrid form (OpenAI ``tool_calls`` / ``tool_call_id`` beside the parts), the response's tool call only as
    flattened ``gen_ai.completion.0.function_call.*`` (LiteLLM records no id for it), tools as
    ``llm.request.functions``; through the proxy, vLLM's token ids on the ``raw_gen_ai_request`` span."""
    transitions = convert_fixture(name)
    first_response = {**EXPECTED[0]["response"], "tool_calls": [{**TOOL_CALL, "id": None}]}
    for t, want, response in zip(transitions, EXPECTED, [first_response, EXPECTED[1]["response"]], strict=True):
        assert json.loads(t.prompt_messages) == want["prompt"]
        assert json.loads(t.response_message) == response
        assert (t.finish_reason, (t.input_tokens, t.output_tokens)) == (want["finish_reason"], want["usage"])
        assert json.loads(t.tools) == WEATHER_TOOL and t.model == "policy@3" and t.reward == 1.0
        # Streamed, the SDK logs from a worker thread outside the caller's context: its spans start traces of
        # their own (kept in the rollout by tracerl.rollout_id) with no agent span above them. The proxy
        # continues the agent's trace from traceparent.
        assert t.agent_name == (None if name == "litellm-stream" else "weather")
        if name == "litellm-proxy":  # the scripted server returns vLLM's ids: as many as the usage says
            prompt_n, response_n = want["usage"]
            assert (t.prompt_token_ids, t.response_token_ids, t.token_source) == (
                list(range(100, 100 + prompt_n)), list(range(500, 500 + response_n)), "span")
        else:  # streamed, the proxy's raw span records only "first stream response received"
            assert (t.prompt_token_ids, t.response_token_ids, t.token_source) == ([], [], "retokenized")


NEW_FIXTURES = VERCEL_FIXTURES + AGENTOPS_FIXTURES + [
    "vercel-ai-team", "vercel-ai-team-stream", "agentops-team", "agentops-team-stream",
    "litellm", "litellm-stream", "litellm-proxy", "litellm-proxy-stream"]


@pytest.mark.parametrize("name", NEW_FIXTURES)
def test_the_store_pass_keeps_what_the_new_dialects_need(name: str, tmp_path) -> None:
    """Through ``convert_store`` (column pruning, skeleton spans, the Parquet round trip) a recording converts
    to the rows ``convert_rollout`` gives it: tool-call child spans, agent spans, reward spans and token-id
    twins all survive the pruning."""
    traces, _ = fixture_tables(name)
    write_table_atomic(traces, StoreLayout.at(tmp_path).partition("spans", "2026-11-21") / "f.parquet", "spans")
    stats = convert_store(parse_store(tmp_path), ConvertConfig(), now_ns=2_000_000_000 * 10**9)
    assert stats.problems == []
    con = connect_readonly(parse_store(tmp_path))
    got = con.sql("SELECT step, agent_name, prompt_messages, response_message, tools, prompt_token_ids, "
                  "response_token_ids, token_source, reward FROM transitions ORDER BY step").fetchall()
    con.close()
    want = [(t.step, t.agent_name, t.prompt_messages, t.response_message, t.tools, t.prompt_token_ids,
             t.response_token_ids, t.token_source, t.reward) for t in convert_fixture(name)]
    assert got == want
