"""The gateway returns exactly what the client asked for and records the exact tokens as a span."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from opentelemetry.trace import SpanKind, StatusCode
from scripted_server import Server

from serving.gateway.proxy import Gateway, GatewayConfig

from .helpers import chat_answer, chat_prompt_ids, recompute_logprobs, scripted_upstream, wait_for

MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@contextmanager
def gateway(spans, *upstreams: str, **cfg) -> Iterator[Gateway]:
    gw = Gateway(("127.0.0.1", 0), GatewayConfig(upstreams=list(upstreams), **cfg), spans.provider).start_background()
    try:
        yield gw
    finally:
        gw.stop()


def client_for(gw: Gateway, **kw) -> openai.OpenAI:
    kw.setdefault("api_key", "agent-key")
    return openai.OpenAI(base_url=gw.url + "/v1", max_retries=0, **kw)


def one_span(spans, n: int = 1):
    got = wait_for(lambda: len(spans.get_finished_spans()) >= n and spans.get_finished_spans())
    return got[n - 1]


@pytest.mark.slow
def test_chat_through_the_gateway_records_exact_ids_and_returns_only_what_was_asked(
        spans, embedded, tokenizer, reference_model):
    with gateway(spans, embedded.url) as gw:
        r = client_for(gw).chat.completions.create(model="policy", messages=MSGS, max_tokens=10, temperature=0.8,
                                                   seed=1)
    assert r.choices[0].logprobs is None
    assert "prompt_token_ids" not in r.model_extra and "token_ids" not in r.choices[0].model_extra
    span = one_span(spans)
    a = span.attributes
    assert span.name == "tracerl.gateway policy" and span.kind == SpanKind.CLIENT
    assert a["tracerl.gateway"] is True and a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "policy"
    assert a["gen_ai.response.id"] == r.id and a["tracerl.upstream"] == embedded.url
    assert list(a["gen_ai.response.finish_reasons"]) == [r.choices[0].finish_reason]
    assert json.loads(a["tracerl.prompt_token_ids"]) == chat_prompt_ids(tokenizer, MSGS)
    ids = json.loads(a["tracerl.response_token_ids"])
    assert tokenizer.decode(ids, skip_special_tokens=True) == r.choices[0].message.content
    assert a["gen_ai.usage.input_tokens"] == r.usage.prompt_tokens and a["gen_ai.usage.output_tokens"] == len(ids)
    assert json.loads(a["tracerl.response_logprobs"]) == pytest.approx(
        recompute_logprobs(reference_model, json.loads(a["tracerl.prompt_token_ids"]), ids), abs=1e-4)
    assert "tracerl.policy_version" not in a and span.status.status_code != StatusCode.ERROR


@pytest.mark.slow
def test_fields_the_client_asked_for_are_kept(spans, embedded):
    with gateway(spans, embedded.url) as gw:
        r = client_for(gw).chat.completions.create(model="policy", messages=MSGS, max_tokens=4, logprobs=True,
                                                   extra_body={"return_token_ids": True})
    assert len(r.choices[0].logprobs.content) == 4 and len(r.choices[0].model_extra["token_ids"]) == 4
    assert json.loads(one_span(spans).attributes["tracerl.response_token_ids"]) == r.choices[0].model_extra["token_ids"]


@pytest.mark.slow
def test_streaming_client_gets_a_clean_stream_and_the_span_gets_the_ids(spans, embedded, tokenizer):
    with gateway(spans, embedded.url) as gw:
        c = client_for(gw)
        plain = c.chat.completions.create(model="policy", messages=MSGS, max_tokens=10, temperature=0)
        chunks = list(c.chat.completions.create(model="policy", messages=MSGS, max_tokens=10, temperature=0,
                                                stream=True))
    assert all(ch.choices for ch in chunks), "the usage chunk the gateway asked for must not reach the client"
    assert all("token_ids" not in ch.choices[0].model_extra and ch.choices[0].logprobs is None for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == plain.choices[0].message.content
    s_plain, s_stream = one_span(spans, 1), one_span(spans, 2)
    for key in ("tracerl.prompt_token_ids", "tracerl.response_token_ids", "gen_ai.usage.output_tokens",
                "gen_ai.response.finish_reasons"):
        assert s_stream.attributes[key] == s_plain.attributes[key], key
    assert s_stream.attributes["gen_ai.response.id"] == chunks[0].id
    assert tokenizer.decode(json.loads(s_stream.attributes["tracerl.response_token_ids"]), skip_special_tokens=True) == text


@pytest.mark.slow
def test_completions_and_n_choices(spans, embedded, tokenizer):
    with gateway(spans, embedded.url) as gw:
        r = client_for(gw).completions.create(model="policy", prompt="Hello", max_tokens=5, n=2, temperature=1.0,
                                              seed=4)
    a = one_span(spans).attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert json.loads(a["tracerl.prompt_token_ids"]) == tokenizer.encode("Hello", add_special_tokens=False)
    for i, key in ((0, "tracerl.response_token_ids"), (1, "tracerl.choices.1.response_token_ids")):
        assert tokenizer.decode(json.loads(a[key]), skip_special_tokens=True) == r.choices[i].text
    assert len(json.loads(a["tracerl.choices.1.response_logprobs"])) == 5 and r.choices[0].logprobs is None


@pytest.mark.slow
def test_streamed_completions_and_concurrent_clients(spans, embedded, tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    with gateway(spans, embedded.url) as gw:
        c = client_for(gw)

        def one(i: int) -> str:
            chunks = list(c.completions.create(model="policy", prompt=f"Count {i}", max_tokens=6, temperature=0,
                                               stream=True))
            assert all("prompt_token_ids" not in ch.choices[0].model_extra for ch in chunks if ch.choices)
            return "".join(ch.choices[0].text for ch in chunks if ch.choices)

        with ThreadPoolExecutor(6) as pool:
            texts = list(pool.map(one, range(6)))
    got = wait_for(lambda: len(spans.get_finished_spans()) == 6 and spans.get_finished_spans())
    by_prompt = {tokenizer.decode(json.loads(s.attributes["tracerl.prompt_token_ids"])): s for s in got}
    for i, text in enumerate(texts):
        s = by_prompt[f"Count {i}"]
        assert tokenizer.decode(json.loads(s.attributes["tracerl.response_token_ids"]), skip_special_tokens=True) == text
        assert s.attributes["gen_ai.operation.name"] == "text_completion"
        assert len(json.loads(s.attributes["tracerl.response_logprobs"])) == len(json.loads(s.attributes["tracerl.response_token_ids"]))


def test_span_is_a_child_of_the_incoming_traceparent_and_propagates_it_upstream(spans):
    seen: list[dict] = []

    def answer(h, body):
        seen.append(dict(h.headers))
        h.send_json(200, chat_answer(body["model"]))

    up = scripted_upstream(answer)
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    try:
        with gateway(spans, up.url) as gw:
            r = httpx.post(gw.url + "/v1/chat/completions", json={"model": "policy@3", "messages": MSGS},
                           headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
    finally:
        up.stop()
    assert r.status_code == 200
    span = one_span(spans)
    assert format(span.context.trace_id, "032x") == trace_id and format(span.parent.span_id, "016x") == parent_id
    assert span.attributes["tracerl.policy_version"] == 3
    assert seen[0]["traceparent"].split("-")[1:3] == [trace_id, format(span.context.span_id, "016x")]


@pytest.mark.slow
def test_unreachable_upstream_is_a_clear_502_and_the_gateway_stays_up(spans, embedded):
    dead = Server(("127.0.0.1", 0), type("H", (), {}))  # bind a port, then free it: nothing listens
    dead_url = dead.url
    dead.server_close()
    with gateway(spans, dead_url) as gw:
        with pytest.raises(openai.InternalServerError, match="no upstream reachable") as e:
            client_for(gw).chat.completions.create(model="policy", messages=MSGS, max_tokens=2)
        assert e.value.status_code == 502
        assert httpx.get(gw.url + "/health").status_code == 200
    span = one_span(spans)
    assert span.status.status_code == StatusCode.ERROR and span.attributes["error.type"] == "ConnectError"
    with gateway(spans, dead_url, embedded.url) as gw:  # failover: the call goes to the live upstream
        ok = client_for(gw).chat.completions.create(model="policy", messages=MSGS, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
    assert one_span(spans, 2).attributes["tracerl.upstream"] == embedded.url


def test_a_call_on_a_connection_the_upstream_closes_as_it_arrives_is_sent_again_on_a_new_one(spans):
    """The keep-alive race (RFC 9112 sec. 9.3.1), made certain: this upstream answers the first request of a
    connection and closes the connection when the next one arrives on it, as uvicorn (vLLM) does when its
    keep-alive timer fires as a call comes in. Seen in CI as a 502 for a call held through a weight reload."""
    from scripted_server import Handler

    closed: list[int] = []

    class ClosesKeptAlive(Handler):
        served = 0  # requests answered on this connection (one handler per connection)

        def do_GET(self) -> None:
            self.served += 1
            self.send_json(200, {"object": "list", "data": [{"id": "policy", "object": "model"}]})

        def do_POST(self) -> None:
            body = self.read_json()
            if self.served:
                closed.append(1)
                self.close_connection = True  # no answer: the connection just ends
                return
            self.served += 1
            self.send_json(200, chat_answer(body["model"]))

    up = Server(("127.0.0.1", 0), ClosesKeptAlive).start_background()
    try:
        with gateway(spans, up.url) as gw:
            for _ in range(4):
                r = httpx.post(gw.url + "/v1/chat/completions", timeout=30,
                               json={"model": "policy", "messages": MSGS, "max_tokens": 2})
                assert r.status_code == 200, r.text
    finally:
        up.shutdown()
        up.server_close()
    assert closed, "no call met a kept-alive connection: the race was not exercised"


def test_slow_upstream_times_out_as_504(spans):
    up = scripted_upstream(lambda h, body: (time.sleep(1.0), h.send_json(200, chat_answer(body["model"]))))
    try:
        with gateway(spans, up.url, timeout_s=0.2) as gw:
            with pytest.raises(openai.APIStatusError, match="did not answer within") as e:
                client_for(gw).chat.completions.create(model="policy", messages=MSGS)
            assert e.value.status_code == 504
            assert httpx.get(gw.url + "/health").status_code == 200
    finally:
        up.stop()
    assert one_span(spans).attributes["error.type"] == "ReadTimeout"


@pytest.mark.slow
def test_upstream_errors_pass_through_with_status_and_message(spans, embedded):
    up = scripted_upstream(lambda h, body: h.send_json(500, {"error": {"message": "CUDA out of memory",
                                                                       "type": "InternalServerError", "code": 500}}))
    try:
        with gateway(spans, up.url, embedded.url) as gw:
            c = client_for(gw)
            with pytest.raises(openai.InternalServerError, match="CUDA out of memory"):
                c.chat.completions.create(model="policy", messages=MSGS,
                                          extra_headers={"X-Tracerl-Rollout-Id": _key_for(gw, 0)})
            with pytest.raises(openai.NotFoundError, match="does not exist"):
                c.chat.completions.create(model="nope", messages=MSGS,
                                          extra_headers={"X-Tracerl-Rollout-Id": _key_for(gw, 1)})
    finally:
        up.stop()
    assert one_span(spans, 1).attributes["error.type"] == "500"
    assert one_span(spans, 2).attributes["error.type"] == "404"


def _key_for(gw: Gateway, index: int) -> str:
    """A rollout id that rendezvous hashing sends to upstream ``index``."""
    return next(k for k in (f"rollout-{i}" for i in range(1000)) if gw.upstream_order(k)[0] == index)


def test_calls_of_one_rollout_stick_to_one_upstream(spans):
    ups = [scripted_upstream(lambda h, body, n=n: h.send_json(200, chat_answer(body["model"], content=f"u{n}")))
           for n in range(3)]
    try:
        with gateway(spans, *(u.url for u in ups)) as gw:
            c = client_for(gw)
            seen = {}
            for rollout in ("a", "b", "c", "d", "e", "f"):
                got = {c.chat.completions.create(model="policy", messages=MSGS,
                                                 extra_headers={"X-Tracerl-Rollout-Id": rollout}).choices[0].message.content
                       for _ in range(4)}
                assert len(got) == 1, f"rollout {rollout} moved between upstreams: {got}"
                seen[rollout] = got.pop()
            assert len(set(seen.values())) > 1, "six rollouts should spread over three upstreams"
    finally:
        for u in ups:
            u.stop()


def test_client_auth_passes_through_and_the_gateway_token_protects_it(spans):
    up = scripted_upstream(lambda h, body: h.send_json(200, chat_answer(body["model"])))
    try:
        with gateway(spans, up.url, token="gw-secret", upstream_api_key="vllm-key") as gw:
            with pytest.raises(openai.AuthenticationError):
                client_for(gw, api_key="wrong").chat.completions.create(model="policy", messages=MSGS)
            client_for(gw, api_key="agent-key", default_headers={"X-Tracerl-Gateway-Token": "gw-secret"}) \
                .chat.completions.create(model="policy", messages=MSGS)
            client_for(gw, api_key="gw-secret").chat.completions.create(model="policy", messages=MSGS)
            models = httpx.get(gw.url + "/v1/models", headers={"Authorization": "Bearer gw-secret"}).json()
    finally:
        up.stop()
    auths = [h.get("Authorization") for h in up.handler_class.seen_headers]
    assert auths == ["Bearer agent-key", "Bearer vllm-key"]
    assert models["data"][0]["id"] == "scripted"


@pytest.mark.slow
def test_oversized_bodies_are_refused(spans, embedded):
    with gateway(spans, embedded.url, max_body_bytes=1024) as gw:
        r = httpx.post(gw.url + "/v1/chat/completions",
                       json={"model": "policy", "messages": [{"role": "user", "content": "x" * 2000}]})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        assert httpx.get(gw.url + "/health").status_code == 200


def test_upstream_failing_mid_stream_reaches_the_client_as_an_error_event(spans):
    def broken_stream(h, body):
        h.start_stream()
        first = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "model": "policy", "prompt_token_ids": [1],
                 "choices": [{"index": 0, "delta": {"content": "par"}, "token_ids": [9], "finish_reason": None}]}
        h.write_chunk(f"data: {json.dumps(first)}\n\n".encode())
        h.write_chunk(b'data: {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}\n\n')
        h.end_stream()

    up = scripted_upstream(broken_stream)
    try:
        with gateway(spans, up.url) as gw:
            with pytest.raises(openai.APIError, match="engine died"):
                list(client_for(gw).chat.completions.create(model="policy", messages=MSGS, stream=True))
    finally:
        up.stop()
    span = one_span(spans)
    assert span.attributes["error.type"] == "stream_error" and json.loads(span.attributes["tracerl.response_token_ids"]) == [9]


def random_lora(tiny_model_dir, out, seed: int):
    """A LoRA adapter with random (non-zero) weights: it changes the model's outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(out)
    return out


@pytest.mark.slow
def test_agents_asking_for_policy_get_the_newest_published_version(spans, tiny_model_dir, tmp_path):
    from serving.embedded.server import EmbeddedServer
    from serving.vllm.publish import publish_policy

    server = EmbeddedServer.start(str(tiny_model_dir))
    try:
        with gateway(spans, server.url, models_ttl_s=60) as gw:
            c = client_for(gw)
            first = c.chat.completions.create(model="policy", messages=MSGS, max_tokens=3)
            assert first.model == "policy"
            publish_policy(server.url, "policy@1", str(random_lora(tiny_model_dir, tmp_path / "a1", 1)), adapter=True)
            # the gateway's model list is cached for 60 s; the alias appears after a refresh
            gw.states.cached.clear()
            assert c.chat.completions.create(model="policy", messages=MSGS, max_tokens=3).model == "policy@1"
            # policy@2 with keep=1 unloads policy@1 while the gateway still believes in it
            publish_policy(server.url, "policy@2", str(random_lora(tiny_model_dir, tmp_path / "a2", 2)), adapter=True,
                           keep=1)
            third = c.chat.completions.create(model="policy", messages=MSGS, max_tokens=3)
            assert third.model == "policy@2", "a 404 on a stale alias must refresh the list and retry"
    finally:
        server.stop()
    got = wait_for(lambda: len(spans.get_finished_spans()) == 3 and spans.get_finished_spans())
    assert [s.attributes.get("tracerl.policy_version") for s in got] == [None, 1, 2]
    assert {s.attributes["gen_ai.request.model"] for s in got} == {"policy"}


def test_upstream_answering_garbage_is_a_502(spans):
    up = scripted_upstream(lambda h, body: h.send_bytes(200, b"<html>proxy login</html>", "text/html"))
    try:
        with gateway(spans, up.url) as gw:
            with pytest.raises(openai.APIStatusError, match="not JSON") as e:
                client_for(gw).chat.completions.create(model="policy", messages=MSGS)
            assert e.value.status_code == 502
    finally:
        up.stop()
    assert one_span(spans).attributes["error.type"] == "invalid_response"


@pytest.mark.slow
def test_full_weight_reloads_are_tagged_with_the_published_version(spans, tiny_model_dir):
    from serving.embedded.server import EmbeddedServer
    from serving.vllm.publish import publish_policy

    server = EmbeddedServer.start(str(tiny_model_dir))
    try:
        with gateway(spans, server.url, models_ttl_s=0) as gw:
            c = client_for(gw)
            c.chat.completions.create(model="policy", messages=MSGS, max_tokens=2)
            publish_policy(server.url, "policy@7", str(tiny_model_dir), adapter=False)
            after = c.chat.completions.create(model="policy", messages=MSGS, max_tokens=2)
    finally:
        server.stop()
    assert after.model == "policy" and server.engine.weight_version == "7"
    got = wait_for(lambda: len(spans.get_finished_spans()) == 2 and spans.get_finished_spans())
    assert [s.attributes.get("tracerl.policy_version") for s in got] == [None, 7]


def test_an_upstream_that_refuses_return_token_ids_still_serves_the_agent(spans, caplog):
    def strict(h, body):  # the OpenAI API's answer to fields it does not know
        if "return_token_ids" in body:
            h.send_json(400, {"error": {"message": "Unrecognized request argument supplied: return_token_ids",
                                        "type": "invalid_request_error", "param": None, "code": None}})
        else:
            h.send_json(200, {**chat_answer(body["model"]), "prompt_token_ids": None})

    up = scripted_upstream(strict)
    try:
        with gateway(spans, up.url) as gw:
            c = client_for(gw)
            for _ in range(2):
                assert c.chat.completions.create(model="gpt-x", messages=MSGS).choices[0].message.content == "ok"
    finally:
        up.stop()
    assert [("return_token_ids" in b) for b in up.handler_class.bodies] == [True, False, False]
    assert "refuses return_token_ids" in caplog.text
    got = wait_for(lambda: len(spans.get_finished_spans()) == 2 and spans.get_finished_spans())
    assert all("tracerl.prompt_token_ids" not in s.attributes and s.status.status_code != StatusCode.ERROR for s in got)
