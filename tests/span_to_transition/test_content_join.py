"""Exact token ids with no traceparent and no response id: the content join (``content_join.py``).

The gateway spans here carry the attributes the real gateway code writes (``serving.gateway.record.span_attributes`` of a
``record_from_response`` / ``StreamAccumulator`` record) for the request the recording server logged
(``<name>.wire.json``), streamed as chunks where the framework streamed; in a trace of their own, no response id.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from schemas.attributes import CONTENT_RECORDED, RESPONSE_MESSAGE
from serving.gateway.record import StreamAccumulator, record_from_response, span_attributes
from serving.protocol import CHAT
from span_to_transition.content_join import REQUEST_MESSAGES, content_key, match_by_content
from span_to_transition.convert import ConvertConfig
from span_to_transition.doctor import diagnose
from span_to_transition.records import LLMCall, Span
from span_to_transition.store import convert_store
from span_to_transition.survey import gather
from store.location import parse_store

from .factory import FIXTURES, TraceBuilder, fixture_tables, spans_table, user
from .test_store import LATER, put, transitions

IDS = {"prompt_token_ids": [5, 6]}


def _chunks(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A response as an OpenAI stream: content in two pieces, each tool call's arguments in two fragments."""
    msg = response["choices"][0]["message"]
    base = {"id": response["id"], "model": response["model"]}
    out = [{**base, "prompt_token_ids": IDS["prompt_token_ids"], "choices": []}]
    text = msg.get("content") or ""
    for piece in (text[: len(text) // 2], text[len(text) // 2 :]):
        out.append({**base, "choices": [{"index": 0, "delta": {"content": piece}, "token_ids": [7]}]})
    for i, c in enumerate(msg.get("tool_calls") or []):
        args = c["function"]["arguments"]
        out.append(
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "tool_calls": [
                                {
                                    "index": i,
                                    "id": c["id"],
                                    "type": "function",
                                    "function": {"name": c["function"]["name"], "arguments": args[:3]},
                                }
                            ]
                        },
                    }
                ],
            }
        )
        out.append(
            {
                **base,
                "choices": [
                    {"index": 0, "delta": {"tool_calls": [{"index": i, "function": {"arguments": args[3:]}}]}}
                ],
            }
        )
    out.append(
        {
            **base,
            "choices": [{"index": 0, "delta": {}, "finish_reason": response["choices"][0]["finish_reason"]}],
        }
    )
    return out


def gateway_attrs(
    request: dict[str, Any],
    response: dict[str, Any],
    stream: bool,
    keep_id: bool = False,
    record_content: bool = True,
) -> dict[str, str]:
    """What the gateway writes for this call (its own code), minus the response id (the join must not need it)."""
    if stream:
        acc = StreamAccumulator(request, CHAT)
        for chunk in _chunks(response):
            acc.add(chunk)
        rec = acc.finish()
    else:
        resp = {
            **response,
            "prompt_token_ids": IDS["prompt_token_ids"],
            "choices": [{**response["choices"][0], "token_ids": [7]}],
        }
        rec = record_from_response(request, resp, CHAT)
    rec.response_id = rec.response_id if keep_id else None
    attrs = span_attributes(rec, "http://up", record_content=record_content)
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in attrs.items()}


def _gateway_span(n: int, attrs: dict[str, str], start: int, end: int) -> Span:
    return Span(
        f"{n + 1:x}" * 32, f"{n + 1:016x}", None, "tracerl.gateway chat", start, end, attrs, {}, (), 100, None
    )


def _put_fixture(name: str, store: Path) -> None:
    traces, logs = fixture_tables(name)
    put(store, "spans", traces, "f")
    if logs is not None:
        put(store, "logs", logs, "f")


def _fixture_calls(name: str, store: Path) -> list[dict]:
    _put_fixture(name, store)
    convert_store(parse_store(store), ConvertConfig(missing_reward="fill"), now_ns=LATER)
    return sorted(transitions(store), key=lambda r: r["step"])


ALL = sorted(p.name.removesuffix(".traces.pb") for p in FIXTURES.glob("*.traces.pb"))


@pytest.mark.parametrize("name", ALL)
def test_every_framework_behind_the_gateway_gets_exact_ids_by_content(name: str, tmp_path: Path) -> None:
    """Streamed and not: each call joins the one gateway span that forwarded it, by content alone. Where the
    recording server logged the wire (``<name>.wire.json``) the gateway sees exactly that request; elsewhere the
    request is rebuilt from the recorded call."""
    calls = _fixture_calls(name, tmp_path / "plain")
    if any(r["response_message"] == "null" for r in calls):
        pytest.skip("token ids only: no messages to compare (the ids are on the span already)")
    wire_path = FIXTURES / f"{name}.wire.json"
    stream = "stream" in name
    if wire_path.exists():
        wire = [(w["request"], w["response"]) for w in json.loads(wire_path.read_text())]
    else:
        traces, _ = fixture_tables(name)
        ids = {
            row["span_id"]: dict(row["attributes"]).get("gen_ai.response.id")
            for row in traces.select(["span_id", "attributes"]).to_pylist()
        }
        wire = [
            (
                {"model": "policy@3", "messages": json.loads(r["prompt_messages"])},
                {
                    "id": ids.get(r["span_id"]) or "x",
                    "model": "policy@3",
                    "choices": [
                        {
                            "index": 0,
                            "message": json.loads(r["response_message"]),
                            "finish_reason": r["finish_reason"],
                        }
                    ],
                },
            )
            for r in calls
        ]
    assert len(wire) == len(calls)
    store = tmp_path / "gw"
    _put_fixture(name, store)
    # The contrib openai-v2 instrumentation keeps the messages in log records, which rollout assignment does not
    # read; it records the response id, which the gateway passes through, and that joins it (test_response_id_join)
    in_logs = (FIXTURES / f"{name}.logs.pb").exists()
    gws = [
        _gateway_span(
            i, gateway_attrs(req, resp, stream, keep_id=in_logs), r["started_at"] + 1, r["ended_at"] - 1
        )
        for i, ((req, resp), r) in enumerate(zip(wire, calls))
    ]
    put(store, "spans", spans_table(gws), "gw")
    stats = convert_store(parse_store(store), ConvertConfig(missing_reward="fill"), now_ns=LATER)
    rows = sorted(transitions(store), key=lambda r: r["step"])
    assert [r["token_source"] for r in rows] == ["gateway"] * len(calls), stats.problems
    assert stats.content_joined == (0 if in_logs else len(calls))
    assert stats.content_ties == stats.content_near_misses == 0
    assert {r["rollout_id"] for r in rows} == {
        r["rollout_id"] for r in calls
    }  # no gateway trace is a rollout


def _run(store: Path, trace: str, rollout: str, question: str, answer: str, at: int) -> TraceBuilder:
    t = TraceBuilder(trace * 32, rollout_id=rollout, received_at_ns=100)
    t.clock = at
    root = t.span("invoke_agent a", agent="a", duration_ns=10**9)
    t.chat(root, [user(question)], answer)
    t.reward(root, 1.0)
    put(store, "spans", spans_table(t.spans), rollout)
    return t


def _gateway_for(
    store: Path, n: int, t: TraceBuilder, question: str, answer: str, record_content: bool = True
) -> None:
    call = t.spans[1]
    request = {"model": "policy@1", "messages": [user(question)]}
    response = {
        "id": "r",
        "model": "policy@1",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}
        ],
    }
    attrs = gateway_attrs(request, response, False, record_content=record_content)
    g = _gateway_span(n, attrs, call.start_time_ns + 1, call.end_time_ns - 1)
    put(store, "spans", spans_table([g]), f"gw{n}")


def test_two_concurrent_rollouts_asking_the_same_question_never_cross_join(tmp_path: Path) -> None:
    a = _run(tmp_path, "a", "run-a", "2+2?", "4", 1_700_000_000_000_000_000)
    b = _run(
        tmp_path, "b", "run-b", "2+2?", "4", 1_700_000_000_000_000_000
    )  # the same moment, the same answer
    _gateway_for(tmp_path, 7, a, "2+2?", "4")
    _gateway_for(tmp_path, 8, b, "2+2?", "4")
    stats = convert_store(
        parse_store(tmp_path), ConvertConfig(quiet_s=0, missing_reward="fill"), now_ns=LATER
    )
    rows = [r for r in transitions(tmp_path) if r["rollout_id"] in ("run-a", "run-b")]
    assert sorted(r["token_source"] for r in rows) == ["retokenized", "retokenized"]
    assert stats.content_ties == 2 and stats.content_joined == 0
    assert any("a tie" in p for p in stats.problems)


def test_the_same_question_at_different_times_joins_each_its_own(tmp_path: Path) -> None:
    a = _run(tmp_path, "a", "run-a", "2+2?", "4", 1_700_000_000_000_000_000)
    b = _run(tmp_path, "b", "run-b", "2+2?", "4", 1_700_000_100_000_000_000)  # 100 s later
    _gateway_for(tmp_path, 7, a, "2+2?", "4")
    _gateway_for(tmp_path, 8, b, "2+2?", "4")
    stats = convert_store(
        parse_store(tmp_path), ConvertConfig(quiet_s=0, missing_reward="fill"), now_ns=LATER
    )
    rows = sorted(transitions(tmp_path), key=lambda r: r["rollout_id"])
    assert [(r["rollout_id"], r["token_source"]) for r in rows] == [
        ("run-a", "gateway"),
        ("run-b", "gateway"),
    ], stats.summary()
    assert stats.content_joined == 2 and stats.content_ties == 0


def test_a_near_miss_stays_retokenized_and_is_counted(tmp_path: Path) -> None:
    a = _run(tmp_path, "a", "run-a", "2+2?", "4", 1_700_000_000_000_000_000)
    _gateway_for(tmp_path, 7, a, "2+2?", "four")  # the same request, another answer: not this call
    stats = convert_store(
        parse_store(tmp_path), ConvertConfig(quiet_s=0, missing_reward="fill"), now_ns=LATER
    )
    [row] = [r for r in transitions(tmp_path) if r["rollout_id"] == "run-a"]
    assert row["token_source"] == "retokenized" and stats.content_near_misses == 1


def test_content_key_is_the_canonical_chat() -> None:
    one_part = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert content_key(one_part, {"content": "yo"}) == content_key(
        [user("hi")], {"role": "assistant", "content": "yo"}
    )
    args = {"tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}]}
    same = {"tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '{"a":2,"b":1}'}}]}
    assert content_key([user("hi")], args) == content_key([user("hi")], same)
    assert content_key([user("hi")], {"content": "yo"}) != content_key([user("hi ")], {"content": "yo"})
    assert content_key([], {"content": "yo"}) is None


def test_a_call_matched_by_two_gateway_spans_joins_neither() -> None:
    call = LLMCall(
        "c1",
        "t",
        "semconv",
        [user("q")],
        {"role": "assistant", "content": "a"},
        start_time_ns=0,
        end_time_ns=100,
    )
    request = {"model": "m", "messages": [user("q")]}
    response = {
        "id": "r",
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}}],
    }
    attrs = gateway_attrs(request, response, False)
    assert REQUEST_MESSAGES in attrs
    joined = match_by_content([call], [_gateway_span(1, attrs, 10, 20), _gateway_span(2, attrs, 30, 40)])
    assert joined.pairs == {} and sorted(joined.ties) == [f"{'2' * 32}/{2:016x}", f"{'3' * 32}/{3:016x}"]


def test_the_doctor_shows_the_ties(tmp_path: Path) -> None:
    a = _run(tmp_path, "a", "run-a", "2+2?", "4", 1_700_000_000_000_000_000)
    b = _run(tmp_path, "b", "run-b", "2+2?", "4", 1_700_000_000_000_000_000)
    _gateway_for(tmp_path, 7, a, "2+2?", "4")
    _gateway_for(tmp_path, 8, b, "2+2?", "4")
    convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0, missing_reward="fill"), now_ns=LATER)
    [finding] = [
        f for f in diagnose(gather(parse_store(tmp_path), now_ns=LATER)) if "by content" in f.problem
    ]
    assert "2 gateway spans in a trace of their own match several agent calls" in finding.saw
    assert "joined by content: 0" in finding.saw and "traceparent" in finding.fix


def test_a_gateway_that_records_no_content_joins_nothing_and_the_doctor_says_why(tmp_path: Path) -> None:
    """``tracerl gateway --no-record-content``: the span keeps its token ids but not the request and response, so
    a call with no traceparent and no response id stays retokenized; convert and the doctor name the switch."""
    request = {"model": "m", "messages": [user("q")]}
    response = {
        "id": "r",
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}}],
    }
    attrs = gateway_attrs(request, response, False, record_content=False)
    assert (
        attrs[CONTENT_RECORDED] == "false" and REQUEST_MESSAGES not in attrs and RESPONSE_MESSAGE not in attrs
    )
    assert attrs["tracerl.prompt_token_ids"] == "[5,6]"  # the token ids are still recorded
    a = _run(tmp_path, "a", "run-a", "2+2?", "4", 1_700_000_000_000_000_000)
    _gateway_for(tmp_path, 7, a, "2+2?", "4", record_content=False)
    stats = convert_store(
        parse_store(tmp_path), ConvertConfig(quiet_s=0, missing_reward="fill"), now_ns=LATER
    )
    [row] = [r for r in transitions(tmp_path) if r["rollout_id"] == "run-a"]
    assert row["token_source"] == "retokenized" and stats.content_joined == 0
    assert any("records no content (the gateway runs with --no-record-content)" in p for p in stats.problems)
    [finding] = [
        f for f in diagnose(gather(parse_store(tmp_path), now_ns=LATER)) if "records no content" in f.problem
    ]
    assert "1 of 1 transitions have no exact token ids" in finding.saw
    assert "without --no-record-content" in finding.fix
