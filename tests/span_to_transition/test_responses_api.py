"""The OpenAI Responses API shape (input items, output items, ``output_text``), streamed and not, read into chat.

The attribute shapes are those the instrumentations write: the request body and ``Response`` object as
OpenInference's JSON ``input.value`` / ``output.value`` (streamed: the ``response.completed`` event), the items in
``gen_ai.input.messages`` / ``gen_ai.output.messages``, and OpenLLMetry's ``responses_wrappers.py``, which puts a
message item's parts into ``gen_ai.prompt.{i}.content`` as JSON text.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from span_to_transition.chat_messages import chat_problem, tool_call
from span_to_transition.convert import ConvertConfig
from span_to_transition.dialects.registry import parse_call
from span_to_transition.doctor import diagnose
from span_to_transition.store import convert_store
from span_to_transition.survey import gather
from store.location import parse_store

from .factory import TraceBuilder, spans_table
from .test_store import LATER, put, transitions

INPUT = [
    {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
    {"type": "reasoning", "id": "rs_1", "summary": []},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
]
OUTPUT = [{"type": "message", "role": "assistant", "id": "msg_1",
           "content": [{"type": "output_text", "text": "It is sunny.", "annotations": []}]}]
RESPONSE = {"id": "resp_1", "object": "response", "model": "policy@2", "output": OUTPUT}
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [tool_call("call_1", "get_weather", '{"city":"Paris"}')]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]
ANSWER = {"role": "assistant", "content": "It is sunny."}


def _call(attrs: dict) -> tuple:
    t = TraceBuilder()
    span = t.span("response", None, attrs)
    call = parse_call(span)
    assert call is not None
    return call.messages, call.response


@pytest.mark.parametrize("output_value", [
    RESPONSE,  # not streamed: the Response
    {"type": "response.completed", "sequence_number": 9, "response": RESPONSE},  # streamed: the last event
    {"id": "resp_1", "output_text": "It is sunny."},  # only output_text
])
def test_openinference_request_body_and_response(output_value: dict) -> None:
    body = {"model": "policy@2", "instructions": "Be brief.", "input": INPUT, "stream": True}
    messages, response = _call({"openinference.span.kind": "LLM", "input.value": json.dumps(body),
                                "input.mime_type": "application/json", "output.value": json.dumps(output_value),
                                "output.mime_type": "application/json"})
    assert (messages, response) == (CHAT, ANSWER)
    assert chat_problem(messages, response) is None


def test_semconv_messages_holding_items() -> None:
    messages, response = _call({"gen_ai.operation.name": "chat", "gen_ai.input.messages": json.dumps(INPUT),
                                "gen_ai.output.messages": json.dumps(OUTPUT)})
    assert (messages, response) == (CHAT[1:], ANSWER)


def test_a_function_call_output_item_becomes_the_response_tool_call() -> None:
    out = [{"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Rome"}'}]
    _, response = _call({"gen_ai.input.messages": json.dumps(INPUT[:1]), "gen_ai.output.messages": json.dumps(out)})
    assert response == {"role": "assistant", "content": None,
                        "tool_calls": [tool_call("call_2", "get_weather", '{"city":"Rome"}')]}


def test_openllmetry_input_text_parts_are_text() -> None:
    messages, response = _call({"gen_ai.system": "openai", "gen_ai.prompt.0.role": "user",
                                "gen_ai.prompt.0.content": json.dumps(INPUT[0]["content"]),
                                "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "It is sunny."})
    assert (messages, response) == ([CHAT[1]], ANSWER)


def test_a_streamed_responses_call_converts_end_to_end(tmp_path: Path) -> None:
    t = TraceBuilder("f" * 32, rollout_id="resp-run", received_at_ns=100)
    root = t.span("invoke_agent a", agent="a")
    event = {"type": "response.completed", "response": RESPONSE}
    t.span("response", root, {"openinference.span.kind": "LLM", "input.mime_type": "application/json",
                              "input.value": json.dumps({"model": "policy@2", "input": INPUT, "stream": True}),
                              "output.mime_type": "application/json", "output.value": json.dumps(event)})
    t.reward(root, 1.0)
    put(tmp_path, "spans", spans_table(t.spans), "r")
    stats = convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0), now_ns=LATER)
    [row] = transitions(tmp_path)
    assert stats.problems == [] and row["trainable"] is True
    assert json.loads(row["prompt_messages"]) == CHAT[1:] and json.loads(row["response_message"]) == ANSWER


def test_the_doctor_names_the_shape_it_cannot_read(tmp_path: Path) -> None:
    """A Response kept as text (``output.mime_type`` text/plain) is not parsed: the doctor says which shape and where."""
    t = TraceBuilder("f" * 32, rollout_id="resp-run", received_at_ns=100)
    root = t.span("invoke_agent a", agent="a")
    t.span("response", root, {"openinference.span.kind": "LLM", "llm.input_messages.0.message.role": "user",
                              "llm.input_messages.0.message.content": "Weather in Paris?",
                              "output.mime_type": "text/plain", "output.value": json.dumps(RESPONSE)})
    t.reward(root, 1.0)
    put(tmp_path, "spans", spans_table(t.spans), "r")
    convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0), now_ns=LATER)
    [finding] = [f for f in diagnose(gather(parse_store(tmp_path), now_ns=LATER)) if "Responses API" in f.problem]
    assert "openinference" in finding.problem and "output.value" in finding.saw and "no response" in finding.saw
