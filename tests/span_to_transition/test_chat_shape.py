"""Transitions must be well-formed chat: a malformed call is untrainable with its reason, counted, never trained.

The check is one pure function (``chat_messages.chat_problem``) applied to every dialect's output; it must pass
every recorded framework fixture and catch what Haystack's OpenInference instrumentor records (message text
only: an assistant turn with no tool call, a tool result with no content and no ``tool_call_id``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from schemas.tables import TRANSITIONS_SCHEMA
from span_to_transition.chat_messages import (
    ASSISTANT_EMPTY,
    CALL_NO_NAME,
    RESPONSE_EMPTY,
    TOOL_NO_CONTENT,
    TOOL_NO_ID,
    TOOL_UNKNOWN_ID,
    chat_problem,
    tool_call,
)
from span_to_transition.convert import ConvertConfig
from span_to_transition.doctor import diagnose
from span_to_transition.records import Span
from span_to_transition.store import convert_store
from span_to_transition.survey import gather
from store.layout import StoreLayout
from store.location import parse_store
from store.parquet import read_table
from store.views import connect_readonly
from trainer.dataset import load_transitions

from .factory import FIXTURES, TraceBuilder, fixture_tables, spans_table
from .test_store import LATER, put, transitions

SYS, USER = {"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Paris?"}
CALL = {"role": "assistant", "content": None, "tool_calls": [tool_call("c1", "weather", '{"city":"Paris"}')]}
RESULT = {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
ANSWER = {"role": "assistant", "content": "It is sunny."}


@pytest.mark.parametrize(
    ("messages", "response", "problem", "where"),
    [
        ([SYS, USER], ANSWER, None, None),
        ([SYS, USER, CALL, RESULT], ANSWER, None, None),
        ([], None, None, None),  # token ids only: nothing to check
        ([SYS, USER], {"role": "assistant", "content": None, "tool_calls": CALL["tool_calls"]}, None, None),
        (
            [SYS, USER, {"role": "assistant", "content": None}, RESULT],
            ANSWER,
            ASSISTANT_EMPTY,
            "prompt_messages[2]",
        ),
        ([SYS, USER, {"role": "assistant", "content": ""}], ANSWER, ASSISTANT_EMPTY, "prompt_messages[2]"),
        (
            [SYS, USER, CALL, {"role": "tool", "content": None, "tool_call_id": "c1"}],
            ANSWER,
            TOOL_NO_CONTENT,
            "prompt_messages[3]",
        ),
        ([SYS, USER, CALL, {"role": "tool", "content": "sunny"}], ANSWER, TOOL_NO_ID, "prompt_messages[3]"),
        ([SYS, USER, CALL, {**RESULT, "tool_call_id": "c9"}], ANSWER, TOOL_UNKNOWN_ID, "prompt_messages[3]"),
        (
            [SYS, USER, RESULT, CALL],
            ANSWER,
            TOOL_UNKNOWN_ID,
            "prompt_messages[2]",
        ),  # answered before it was asked
        (
            [SYS, USER, {**CALL, "tool_calls": [tool_call("c1", None, "{}")]}, RESULT],
            ANSWER,
            CALL_NO_NAME,
            "prompt_messages[2]",
        ),
        ([SYS, USER], {"role": "assistant", "content": None}, RESPONSE_EMPTY, "response_message"),
    ],
)
def test_chat_problem_names_the_first_malformed_message(messages, response, problem, where) -> None:
    found = chat_problem(messages, response)
    assert (found.problem if found else None, found.where if found else None) == (problem, where)


def _convert_fixture(name: str, store: Path) -> list[dict]:
    traces, logs = fixture_tables(name)
    put(store, "spans", traces, "f")
    if logs is not None:
        put(store, "logs", logs, "f")
    stats = convert_store(parse_store(store), ConvertConfig(missing_reward="fill"), now_ns=LATER)
    assert stats.untrainable_reasons == {}
    return transitions(store)


@pytest.mark.parametrize(
    "name", sorted(p.name.removesuffix(".traces.pb") for p in FIXTURES.glob("*.traces.pb"))
)
def test_every_recorded_fixture_is_well_formed_chat(name: str, tmp_path: Path) -> None:
    rows = _convert_fixture(name, tmp_path)
    assert rows
    for r in rows:
        assert r["untrainable_reason"] is None and r["trainable"] is True, r["untrainable_reason"]
        assert chat_problem(json.loads(r["prompt_messages"]), json.loads(r["response_message"])) is None


def _oi_message(i: int, role: str, content: str | None = None, prefix: str = "llm.input_messages") -> dict:
    out = {f"{prefix}.{i}.message.role": role}
    if content is not None:
        out[f"{prefix}.{i}.message.content"] = content
    return out


def haystack_run(store: Path, input_value: str, mime: str) -> None:
    """What openinference-instrumentation-haystack 0.1.46 records for a tool-using agent's second call: message
    text only (the assistant turn that called the tool has no content and no tool call; the tool result has no
    content and no tool_call_id); the tool call lives only in ``input.value``."""
    t = TraceBuilder("d" * 32, rollout_id="hay-1", received_at_ns=100)
    root = t.span("Agent.run", None, {"openinference.span.kind": "AGENT"}, agent="weather")
    first = {
        "openinference.span.kind": "LLM",
        "llm.model_name": "policy@3",
        **_oi_message(0, "system", "be brief"),
        **_oi_message(1, "user", "weather in Paris?"),
        **_oi_message(0, "assistant", None, "llm.output_messages"),
        "llm.output_messages.0.message.tool_calls.0.tool_call.id": "c1",
        "llm.output_messages.0.message.tool_calls.0.tool_call.function.name": "weather",
        "llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments": '{"city":"Paris"}',
    }
    t.span("OpenAIChatGenerator.run", root, first)
    second = {
        "openinference.span.kind": "LLM",
        "llm.model_name": "policy@3",
        **_oi_message(0, "system", "be brief"),
        **_oi_message(1, "user", "weather in Paris?"),
        **_oi_message(2, "assistant"),
        **_oi_message(3, "tool"),
        **_oi_message(0, "assistant", "It is sunny.", "llm.output_messages"),
        "input.value": input_value,
        "input.mime_type": mime,
    }
    t.span("OpenAIChatGenerator.run", root, second)
    t.reward(root, 1.0)
    put(store, "spans", spans_table(t.spans), "hay")


HAYSTACK_REPR = (
    "{'messages': [ChatMessage(_role=<ChatRole.ASSISTANT: 'assistant'>, _content=[ToolCall(tool_name="
    "'weather', arguments={'city': 'Paris'}, id='c1')]), ChatMessage(_role=<ChatRole.TOOL: 'tool'>, "
    "_content=[ToolCallResult(result='sunny', origin=ToolCall(tool_name='weather', id='c1'))])]}"
)


def test_a_haystack_call_with_text_only_messages_is_untrainable_counted_and_never_trained(
    tmp_path: Path,
) -> None:
    haystack_run(tmp_path, HAYSTACK_REPR, "text/plain")
    stats = convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0), now_ns=LATER)
    reason = f"malformed chat (openinference): {ASSISTANT_EMPTY}"
    assert stats.untrainable_reasons == {reason: 1}
    assert "untrainable (malformed chat" in stats.summary() and "prompt_messages[2]" in " ".join(
        stats.problems
    )
    rows = sorted(transitions(tmp_path), key=lambda r: r["step"])
    assert [(r["trainable"], r["untrainable_reason"]) for r in rows] == [(True, None), (False, reason)]
    assert stats.trainable_transitions == 1
    # never from the Python repr: the prompt stays as recorded
    assert json.loads(rows[1]["prompt_messages"])[2] == {"role": "assistant", "content": None}
    con = connect_readonly(parse_store(tmp_path))
    for trainable_only in (True, False):  # not even when every call is asked for
        got = load_transitions(con, (0, 10), trainable_only=trainable_only).column("step").to_pylist()
        assert got == [0]
    con.close()


def test_the_doctor_names_the_dialect_the_field_and_the_fix(tmp_path: Path) -> None:
    haystack_run(tmp_path, HAYSTACK_REPR, "text/plain")
    convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0), now_ns=LATER)
    [finding] = [
        f
        for f in diagnose(gather(parse_store(tmp_path), now_ns=LATER))
        if f.problem.startswith("malformed chat")
    ]
    assert finding.problem == f"malformed chat (openinference): {ASSISTANT_EMPTY}"
    assert (
        "1 transition (e.g. span" in finding.saw
        and "llm.input_messages.{i}.message.tool_calls" in finding.saw
    )
    assert "opentelemetry-instrumentation-openai" in finding.fix and "never from a Python repr" in finding.fix


def test_the_request_held_as_json_is_recovered(tmp_path: Path) -> None:
    """Where the span holds the request the client sent as JSON (OpenInference's ``input.value``), it is the truth."""
    body = {
        "model": "policy@3",
        "messages": [SYS, USER, {"role": "assistant", "tool_calls": CALL["tool_calls"]}, RESULT],
    }
    haystack_run(tmp_path, json.dumps(body), "application/json")
    stats = convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert stats.untrainable_reasons == {} and stats.trainable_transitions == 2
    second = max(transitions(tmp_path), key=lambda r: r["step"])
    assert json.loads(second["prompt_messages"]) == [SYS, USER, CALL, RESULT]


def test_a_tool_call_id_recorded_as_null_is_untrainable(tmp_path: Path) -> None:
    """One framework's native telemetry records the tool result's id as null (semconv parts)."""
    t = TraceBuilder("e" * 32, rollout_id="null-id", received_at_ns=100)
    root = t.span("invoke_agent a", agent="a")
    prompt = [
        {"role": "user", "parts": [{"type": "text", "content": "weather?"}]},
        {
            "role": "assistant",
            "parts": [{"type": "tool_call", "id": None, "name": "weather", "arguments": {}}],
        },
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": None, "response": "sunny"}]},
    ]
    t.chat(root, [], "It is sunny.", extra={"gen_ai.input.messages": json.dumps(prompt)})
    t.reward(root, 1.0)
    put(tmp_path, "spans", spans_table(t.spans), "n")
    stats = convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert stats.untrainable_reasons == {f"malformed chat (semconv): {TOOL_NO_ID}": 1}
    [row] = transitions(tmp_path)
    assert row["trainable"] is False


def test_transitions_written_before_the_column_read_as_well_formed(tmp_path: Path) -> None:
    haystack_run(tmp_path, HAYSTACK_REPR, "text/plain")
    convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0), now_ns=LATER)
    layout = StoreLayout.at(tmp_path)
    for path in Path(layout.table("transitions")).rglob("*.parquet"):
        pq.write_table(
            pq.read_table(path).drop_columns(["untrainable_reason"]), path
        )  # an older writer's file
    old = read_table(layout.table("transitions"), "transitions")
    assert old.schema.names == TRANSITIONS_SCHEMA.names and old.column(
        "untrainable_reason"
    ).null_count == len(old)
    assert {r["untrainable_reason"] for r in transitions(tmp_path)} == {None}


def test_behind_the_gateway_the_wire_replaces_a_malformed_record(tmp_path: Path) -> None:
    """The gateway span under the call (traceparent) recorded the request as it went over the wire."""
    from serving.gateway.record import record_from_response, span_attributes
    from serving.protocol import CHAT

    haystack_run(tmp_path / "x", HAYSTACK_REPR, "text/plain")
    spans = [s for s in spans_table_rows(tmp_path / "x")]
    wire = [SYS, USER, CALL, RESULT]
    rec = record_from_response(
        {"model": "policy@3", "messages": wire},
        {
            "id": "r2",
            "model": "policy@3",
            "prompt_token_ids": [1, 2],
            "choices": [{"index": 0, "message": ANSWER, "token_ids": [3], "finish_reason": "stop"}],
        },
        CHAT,
    )
    attrs = {
        k: v if isinstance(v, str) else json.dumps(v) for k, v in span_attributes(rec, "http://up").items()
    }
    second = max((s for s in spans if s.name == "OpenAIChatGenerator.run"), key=lambda s: s.start_time_ns)
    gw = Span(
        second.trace_id,
        "f" * 16,
        second.span_id,
        "gateway",
        second.start_time_ns + 1,
        second.end_time_ns - 1,
        attrs,
        {},
        (),
        100,
        second.rollout_id,
    )
    put(tmp_path, "spans", spans_table([*spans, gw]), "hay")
    stats = convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0), now_ns=LATER)
    assert stats.untrainable_reasons == {} and stats.trainable_transitions == 2
    row = max(transitions(tmp_path), key=lambda r: r["step"])
    assert json.loads(row["prompt_messages"]) == wire and row["token_source"] == "gateway"


def spans_table_rows(store: Path) -> list[Span]:
    from span_to_transition.columnar import spans_from_table

    return spans_from_table(read_table(StoreLayout.at(store).table("spans"), "spans"), all_attributes=True)


@pytest.mark.parametrize("exact", [True, False])
def test_an_empty_response_is_trainable_only_with_the_engines_own_ids(tmp_path: Path, exact: bool) -> None:
    """An immediate end of text is a real sample when the engine's response ids say so (the ids are what the
    trainer trains on); without them an empty recorded response may be an instrumentation that lost it."""
    t = TraceBuilder("f" * 32, rollout_id="empty", received_at_ns=100)
    root = t.span("invoke_agent a", agent="a")
    ids = {"tracerl.prompt_token_ids": "[1, 2, 3]", "tracerl.response_token_ids": "[0]"} if exact else {}
    t.chat(root, [SYS, USER], "", extra=ids)
    t.reward(root, 1.0)
    put(tmp_path, "spans", spans_table(t.spans), "e")
    stats = convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0), now_ns=LATER)
    [row] = transitions(tmp_path)
    assert row["token_source"] == ("span" if exact else "retokenized")
    assert row["trainable"] is exact
    assert stats.untrainable_reasons == ({} if exact else {f"malformed chat (semconv): {RESPONSE_EMPTY}": 1})
