"""Messages recorded as span events (Strands) and framework roles mapped to the wire: the pure rules."""

from __future__ import annotations

import json

from span_to_transition.dialects.registry import parse_call
from span_to_transition.records import Span, SpanEvent
from span_to_transition.span_events import block_text, blocks_to_bodies
from span_to_transition.wire_roles import openinference_response_id, to_wire_roles


def chat_span(*events: SpanEvent) -> Span:
    return Span("t" * 32, "s" * 16, None, "chat", 1, 2, {"gen_ai.operation.name": "chat"}, events=tuple(events))


def ev(name: str, at: int, **attrs: object) -> SpanEvent:
    return SpanEvent(name, at, {k: v if isinstance(v, str) else json.dumps(v) for k, v in attrs.items()})


def test_strands_default_events_become_openai_messages_with_one_tool_message_per_result() -> None:
    span = chat_span(
        ev("gen_ai.user.message", 1, content=[{"text": "two cities"}]),
        ev("gen_ai.assistant.message", 2, content=[{"text": "checking"}, {"toolUse": {
            "toolUseId": "a", "name": "w", "input": {"city": "Oslo"}}}, {"toolUse": {"toolUseId": "b", "name": "w",
                                                                               "input": {"city": "Rome"}}}]),
        ev("gen_ai.tool.message", 3, content=[
            {"toolResult": {"toolUseId": "a", "content": [{"text": "cold"}, {"json": {"c": -3}}]}},
            {"toolResult": {"toolUseId": "b", "content": [{"text": "warm"}]}}]),
        ev("gen_ai.choice", 4, message=[{"text": "Oslo is cold."}], finish_reason="end_turn"),
    )
    call = parse_call(span)
    assert call is not None and call.dialect == "semconv_events"
    assert call.messages == [
        {"role": "user", "content": "two cities"},
        {"role": "assistant", "content": "checking", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}},
            {"id": "b", "type": "function", "function": {"name": "w", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": 'cold\n{"c": -3}', "tool_call_id": "a"},
        {"role": "tool", "content": "warm", "tool_call_id": "b"},
    ]
    assert call.response == {"role": "assistant", "content": "Oslo is cold."}
    assert call.finish_reason == "stop"


def test_strands_latest_details_events_are_merged_and_tool_results_read_as_text() -> None:
    d = "gen_ai.client.inference.operation.details"
    span = chat_span(
        ev(d, 1, **{"gen_ai.system_instructions": [{"type": "text", "content": "be brief"}]}),
        ev(d, 1, **{"gen_ai.input.messages": [{"role": "user", "parts": [
            {"type": "tool_call_response", "id": "a", "response": [{"text": "18C"}]}]}]}),
        ev(d, 2, **{"gen_ai.output.messages": [{"role": "assistant", "parts": [
            {"type": "tool_call", "id": "b", "name": "w", "arguments": {"city": "Rome"}}], "finish_reason": "tool_use"}]}),
    )
    call = parse_call(span)
    assert call is not None
    assert call.messages == [{"role": "system", "content": "be brief"},
                             {"role": "tool", "content": "18C", "tool_call_id": "a"}]
    assert call.response["tool_calls"][0]["function"] == {"name": "w", "arguments": '{"city": "Rome"}'}
    assert call.finish_reason == "tool_calls"


def test_a_chat_span_with_no_message_events_is_a_call_without_content() -> None:
    call = parse_call(chat_span(ev("gen_ai.content.completion.chunk", 1, x="y")))
    assert call is not None and call.messages == [] and call.response is None


def test_content_blocks_helpers() -> None:
    assert block_text([{"text": "a"}, {"json": [1]}]) == "a\n[1]"
    assert block_text("plain") == "plain"
    assert blocks_to_bodies("user", [{"text": "a"}, {"text": "b"}]) == [
        ("user", {"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})]


def test_smolagents_roles_are_mapped_and_same_role_turns_merged_as_smolagents_sends_them() -> None:
    got = to_wire_roles([
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": None},  # an empty model output (streamed), unrecorded text
        {"role": "tool-call", "content": "Calling tools: x"},
        {"role": "tool-response", "content": "Observation: 1"},
        {"role": "user", "content": "and then?"},
    ])
    assert got == [{"role": "user", "content": "task"},
                   {"role": "assistant", "content": "\nCalling tools: x"},
                   {"role": "user", "content": "Observation: 1\nand then?"}]


def test_prompts_without_framework_roles_are_left_alone() -> None:
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert to_wire_roles(msgs) is msgs


def test_openinference_response_ids_inside_output_value() -> None:
    assert openinference_response_id({"id": "r1"}) == "r1"
    assert openinference_response_id({"raw": {"id": "r2"}}) == "r2"  # LlamaIndex
    assert openinference_response_id({"raw": "ChatCompletion(id='r3', choices=[])"}) == "r3"  # smolagents
    assert openinference_response_id({"raw": None}) is None
    assert openinference_response_id("assistant: hi") is None
