"""Wire-format rules, tested as pure functions: what the gateway adds, strips and records."""

from __future__ import annotations

import json

import pytest

from serving.gateway.record import StreamAccumulator, record_from_response, span_attributes
from serving.protocol import (
    CHAT,
    TEXT_COMPLETION,
    error_message,
    iter_sse_data,
    latest_version_name,
    parse_hermes_tool_calls,
    parse_policy_version,
    pick_upstream,
    prepare_upstream_body,
    rollout_from_baggage,
    split_tool_stream,
    strip_chunk,
    strip_response,
    trace_id_from_traceparent,
)
from serving.vllm.publish import diagnose, version_name


@pytest.mark.parametrize(
    "model,version",
    [("policy@3", 3), ("org/qwen@12", 12), ("policy", None), ("policy@", None), ("a@b", None), (None, None)],
)
def test_policy_version_is_parsed_from_name_at_k(model, version):
    assert parse_policy_version(model) == version


def test_version_name_round_trips():
    assert parse_policy_version(version_name("policy", 7)) == 7
    with pytest.raises(ValueError):
        version_name("policy", -1)


def test_chat_request_asks_for_ids_and_logprobs_but_remembers_what_the_client_wanted():
    body = {"model": "m", "messages": [], "stream": True, "top_logprobs": 0}
    up, wants = prepare_upstream_body(body, CHAT)
    assert up["return_token_ids"] is True and up["logprobs"] is True
    assert up["stream_options"] == {"include_usage": True}
    assert not wants.token_ids and not wants.logprobs and not wants.usage_in_stream and wants.stream
    assert body == {
        "model": "m",
        "messages": [],
        "stream": True,
        "top_logprobs": 0,
    }  # caller's dict untouched


def test_completion_request_keeps_clients_logprobs_count():
    up, wants = prepare_upstream_body({"prompt": "x", "logprobs": 3}, TEXT_COMPLETION)
    assert up["logprobs"] == 3 and wants.logprobs
    up, wants = prepare_upstream_body({"prompt": "x"}, TEXT_COMPLETION)
    assert up["logprobs"] == 0 and not wants.logprobs and "stream_options" not in up


CHAT_RESPONSE = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "policy@2",
    "prompt_token_ids": [1, 2, 3],
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "finish_reason": "stop",
            "token_ids": [7, 8],
            "logprobs": {"content": [{"token": "h", "logprob": -0.1}, {"token": "i", "logprob": -0.2}]},
        },
        {
            "index": 1,
            "message": {"role": "assistant", "content": "yo"},
            "finish_reason": "length",
            "token_ids": [9],
            "logprobs": {"content": [{"token": "yo", "logprob": -1.5}]},
        },
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
}


def test_record_and_span_attributes_of_a_chat_response_with_two_choices():
    rec = record_from_response({"model": "policy@2"}, json.loads(json.dumps(CHAT_RESPONSE)), CHAT)
    attrs = span_attributes(rec, "http://u:8000")
    assert attrs == {
        "tracerl.gateway": True,
        "gen_ai.operation.name": "chat",
        "tracerl.upstream": "http://u:8000",
        "gen_ai.request.model": "policy@2",
        "gen_ai.response.model": "policy@2",
        "gen_ai.response.id": "chatcmpl-1",
        "tracerl.policy_version": 2,
        "gen_ai.response.finish_reasons": ["stop", "length"],
        "gen_ai.usage.input_tokens": 3,
        "gen_ai.usage.output_tokens": 3,
        "tracerl.prompt_token_ids": "[1,2,3]",
        "tracerl.response_token_ids": "[7,8]",
        "tracerl.response_logprobs": "[-0.1,-0.2]",
        "tracerl.choices.1.response_token_ids": "[9]",
        "tracerl.choices.1.response_logprobs": "[-1.5]",
    }


def test_token_ids_and_logprobs_are_the_text_the_store_keeps_for_an_array():
    """The gateway records ids and logprobs as one JSON string each (an array attribute costs the SDK and its
    OTLP encoder per element); the collector stores an int/double array attribute as text, and that text must
    be exactly this string, so spans from an older gateway (arrays) and this one read the same."""
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue

    from collector_exporter.otlp_arrow import any_to_text

    ids, logprobs = [0, 7, 151642, 2**31 - 1], [-0.1, -1e-07, 0.0, -12.5, float("-inf"), -3.0000001]
    response = {
        **CHAT_RESPONSE,
        "prompt_token_ids": ids,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x"},
                "token_ids": ids,
                "logprobs": {"content": [{"token": "t", "logprob": x} for x in logprobs]},
            }
        ],
    }
    attrs = span_attributes(record_from_response({"model": "policy"}, response, CHAT), "u")
    as_ints = AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=i) for i in ids]))
    as_doubles = AnyValue(array_value=ArrayValue(values=[AnyValue(double_value=x) for x in logprobs]))
    assert attrs["tracerl.prompt_token_ids"] == attrs["tracerl.response_token_ids"] == any_to_text(as_ints)
    assert attrs["tracerl.response_logprobs"] == any_to_text(as_doubles)
    assert json.loads(attrs["tracerl.response_logprobs"]) == logprobs


def test_unknown_version_has_no_policy_version_attribute():
    rec = record_from_response({"model": "policy"}, {"model": "policy", "choices": []}, CHAT)
    assert "tracerl.policy_version" not in span_attributes(rec, "u")
    assert "tracerl.policy_version" not in span_attributes(rec, "u", weight_version="sha-abc")
    assert span_attributes(rec, "u", weight_version="7")["tracerl.policy_version"] == 7
    named = record_from_response({"model": "policy"}, {"model": "policy@2", "choices": []}, CHAT)
    assert span_attributes(named, "u", weight_version="7")["tracerl.policy_version"] == 2  # the name wins


def test_strip_removes_only_what_the_gateway_added():
    resp = json.loads(json.dumps(CHAT_RESPONSE))
    _, wants = prepare_upstream_body({"messages": []}, CHAT)
    out = strip_response(resp, wants)
    assert "prompt_token_ids" not in out
    assert all("token_ids" not in c and c["logprobs"] is None for c in out["choices"])
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "hi"} and out["usage"]
    resp = json.loads(json.dumps(CHAT_RESPONSE))
    _, wants = prepare_upstream_body({"messages": [], "logprobs": True, "return_token_ids": True}, CHAT)
    assert strip_response(resp, wants) == CHAT_RESPONSE


def test_completion_ids_are_per_choice_and_stripped_there():
    resp = {
        "id": "cmpl-1",
        "model": "policy",
        "choices": [
            {
                "index": 0,
                "text": "ab",
                "prompt_token_ids": [5, 6],
                "token_ids": [1, 2],
                "finish_reason": "length",
                "logprobs": {
                    "tokens": ["a", "b"],
                    "token_logprobs": [-1.0, -2.0],
                    "top_logprobs": [None, None],
                    "text_offset": [0, 1],
                },
            }
        ],
    }
    rec = record_from_response({"model": "policy"}, resp, TEXT_COMPLETION)
    assert rec.prompt_token_ids == [5, 6] and rec.choices[0].logprobs == [-1.0, -2.0]
    _, wants = prepare_upstream_body({"prompt": "x"}, TEXT_COMPLETION)
    choice = strip_response(resp, wants)["choices"][0]
    assert "prompt_token_ids" not in choice and "token_ids" not in choice and choice["logprobs"] is None


def test_stream_accumulates_delta_ids_and_drops_the_usage_chunk_the_client_did_not_ask_for():
    _, wants = prepare_upstream_body({"messages": [], "stream": True}, CHAT)
    chunks = [
        {
            "id": "c",
            "model": "p@1",
            "prompt_token_ids": [1, 2],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        },
        {
            "id": "c",
            "model": "p@1",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "he"},
                    "token_ids": [5],
                    "logprobs": {"content": [{"logprob": -0.5}]},
                    "finish_reason": None,
                }
            ],
        },
        {
            "id": "c",
            "model": "p@1",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "y"},
                    "token_ids": [6, 7],
                    "logprobs": {"content": [{"logprob": -0.25}, {"logprob": -1.0}]},
                    "finish_reason": "stop",
                }
            ],
        },
        {"id": "c", "model": "p@1", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}},
    ]
    acc = StreamAccumulator({"model": "p@1"}, CHAT)
    sent = []
    for ch in chunks:
        acc.add(ch)
        out = strip_chunk(json.loads(json.dumps(ch)), wants)
        if out is not None:
            sent.append(out)
    rec = acc.finish()
    assert rec.prompt_token_ids == [1, 2] and rec.choices[0].token_ids == [5, 6, 7]
    assert rec.choices[0].logprobs == [-0.5, -0.25, -1.0] and rec.choices[0].text == "hey"
    assert rec.output_tokens == 3 and rec.choices[0].finish_reason == "stop"
    assert len(sent) == 3 and all(
        "token_ids" not in c["choices"][0] and "prompt_token_ids" not in c for c in sent
    )


def test_sse_parsing_handles_multiline_and_done():
    lines = ['data: {"a": 1}', "", ": comment", "data: [DONE]", ""]
    assert list(iter_sse_data(lines)) == ['{"a": 1}', "[DONE]"]


def test_hermes_tool_calls_are_parsed_like_vllm():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    p = parse_hermes_tool_calls(text)
    assert p.content == "Let me check.\n"
    assert [c["function"] for c in p.tool_calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ]
    assert p.tool_calls[0]["type"] == "function" and p.tool_calls[0]["id"].startswith("chatcmpl-tool-")
    two = parse_hermes_tool_calls(
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}</tool_call>'
    )
    assert two.content is None and [c["function"]["name"] for c in two.tool_calls] == ["a", "b"]
    assert two.tool_calls[1]["function"]["arguments"] == '{"x": 1}'
    bad = parse_hermes_tool_calls("<tool_call>{not json}</tool_call>")
    assert bad.tool_calls == [] and bad.content == "<tool_call>{not json}</tool_call>"


def test_streamed_tool_calls_hold_text_from_the_tag_and_parse_at_the_end():
    held, out = "", []
    for piece in ["Sure", ". <tool", '_call>\n{"name": "f", ', '"arguments": {}}\n</tool_call>']:
        emit, held, calls = split_tool_stream(held, piece, final=False)
        out.append(emit)
        assert calls is None
    emit, held, calls = split_tool_stream(held, "", final=True)
    assert "".join(out) == "Sure. " and emit == "" and held == ""
    assert [c["function"]["name"] for c in calls] == ["f"] and calls[0]["index"] == 0
    assert split_tool_stream("", "<to", final=False) == ("", "<to", None)
    assert split_tool_stream("<to", "ast>", final=True) == ("<toast>", "", None)


def test_upstream_choice_is_sticky_per_key_and_spreads_keys():
    ups = ["http://a", "http://b", "http://c"]
    picks = {pick_upstream(f"trace-{i}", ups) for i in range(60)}
    assert picks == {0, 1, 2}
    assert all(pick_upstream("trace-7", ups) == pick_upstream("trace-7", ups) for _ in range(5))
    # removing an upstream only moves keys that were on it
    moved = [
        k
        for k in (f"t{i}" for i in range(200))
        if pick_upstream(k, ups) != 2 and ups[pick_upstream(k, ups)] != ups[:2][pick_upstream(k, ups[:2])]
    ]
    assert moved == []
    assert pick_upstream(None, ups, fallback=4) == 1


def test_traceparent_trace_id():
    assert (
        trace_id_from_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        == "4bf92f3577b34da6a3ce929d0e0e4736"
    )
    assert trace_id_from_traceparent("garbage") is None and trace_id_from_traceparent(None) is None


def test_latest_version_alias_picks_the_newest_published_version():
    served = ["policy", "policy@2", "policy@10", "other@11", "policy@x"]
    assert latest_version_name("policy", served) == "policy@10"
    assert latest_version_name("policy@2", served) is None  # an explicit version is never rewritten
    assert latest_version_name("other", ["policy@1"]) is None and latest_version_name(None, served) is None


def test_rollout_id_from_baggage():
    assert rollout_from_baggage("userId=1, tracerl.rollout_id=r%2042;prop=1") == "r 42"
    assert rollout_from_baggage("other=1") is None and rollout_from_baggage(None) is None


def test_error_message_reads_every_error_shape():
    assert error_message({"error": {"message": "m1"}}) == "m1"
    assert error_message({"object": "error", "message": "m2"}) == "m2"
    assert error_message({"detail": "Not Found"}) == "Not Found"
    assert error_message({"error": "plain"}) == "plain"


@pytest.mark.parametrize(
    "endpoint,status,body,expect",
    [
        ("/v1/load_lora_adapter", 404, {"detail": "Not Found"}, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"),
        ("/v1/load_lora_adapter", 500, {"error": {"message": "LoRA is not enabled."}}, "--enable-lora"),
        (
            "/v1/load_lora_adapter",
            404,
            {"error": {"message": "Loading lora p@1 failed: No adapter found for /x"}},
            "must exist on the vLLM host",
        ),
        (
            "/v1/load_lora_adapter",
            400,
            {"error": {"message": "The lora adapter 'p@1' has already been loaded."}},
            "load_inplace=True",
        ),
        ("/collective_rpc", 404, {"detail": "Not Found"}, "VLLM_SERVER_DEV_MODE=1"),
        ("/reset_prefix_cache", 404, {"detail": "Not Found"}, "VLLM_SERVER_DEV_MODE=1"),
        ("/v1/models", 500, {"error": {"message": "boom"}}, "answered HTTP 500: boom"),
    ],
)
def test_diagnose_names_the_missing_flag(endpoint, status, body, expect):
    assert expect in diagnose(endpoint, status, body)
