"""`tracerl serve` refuses what could hurt it or its other users: request chat templates, bad sampling
fields (for that request only), and cross-site calls to the endpoints that change the served model."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serving.embedded.sampling import UNTRUSTED_TEMPLATE, EngineError, SamplingParams, lone_surrogate_path
from serving.embedded.server import EmbeddedServer, ServeOptions, cross_site_refusal, host_allow_list

from .helpers import chat_prompt_ids, wait_for

MSGS = [{"role": "user", "content": "Hi"}]
JSON = {"Content-Type": "application/json"}


def post_raw(url: str, raw: str, **headers: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        content=raw.encode(),
        timeout=60,
        headers={"Content-Type": "application/json", **headers},
    )


def chat_body(**fields) -> dict:
    return {"model": "policy", "messages": MSGS, "max_tokens": 2, **fields}


# -- request chat templates (vLLM 0.11.1: --trust-request-chat-template) ---------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"chat_template": "{{ 'ab ' * 3000000 }}"},
        {"chat_template_kwargs": {"chat_template": "{{ 'ab ' * 3000000 }}"}},
    ],
)
@pytest.mark.slow
def test_a_request_chat_template_is_refused_without_the_trust_flag(embedded, fields):
    # the refusal's own message says the template was never rendered (rendering it would take seconds)
    r = httpx.post(embedded.url + "/v1/chat/completions", json=chat_body(**fields), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["message"] == UNTRUSTED_TEMPLATE


@pytest.mark.slow
def test_template_kwargs_reach_the_template_only_when_it_reads_them(embedded, tokenizer):
    r = httpx.post(
        embedded.url + "/v1/chat/completions",
        timeout=60,
        json=chat_body(return_token_ids=True, chat_template_kwargs={"not_a_template_var": 1}),
    )
    assert r.status_code == 200 and r.json()["prompt_token_ids"] == chat_prompt_ids(tokenizer, MSGS)
    r = httpx.post(
        embedded.url + "/v1/chat/completions", json=chat_body(chat_template_kwargs={"tokenize": True})
    )
    assert r.status_code == 400 and "unexpected chat template kwargs" in r.json()["error"]["message"]


@pytest.mark.slow
def test_with_the_trust_flag_a_request_template_renders_the_prompt(tiny_model_dir, tokenizer):
    server = EmbeddedServer.start(str(tiny_model_dir), options=ServeOptions(trust_request_chat_template=True))
    try:
        tmpl = "{% for m in messages %}<<{{ m['content'] }}{{ suffix }}>>{% endfor %}"
        r = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=60,
            json=chat_body(return_token_ids=True, chat_template=tmpl, chat_template_kwargs={"suffix": "!"}),
        )
        assert r.status_code == 200, r.text
        assert r.json()["prompt_token_ids"] == tokenizer.encode("<<Hi!>>", add_special_tokens=False)
    finally:
        server.stop()


# -- sampling fields: a bad one is a 400 for that request only -----------------------------------------

BAD_FIELDS = {
    "seed": ('"seed": 18446744073709551616', "seed"),
    "seed_negative": ('"seed": -9223372036854775809', "seed"),
    "temperature_nan": ('"temperature": NaN', "temperature"),
    "temperature_inf": ('"temperature": Infinity', "temperature"),
    "repetition_penalty_nan": ('"repetition_penalty": NaN', "repetition_penalty"),
    "top_p_nan": ('"top_p": NaN', "top_p"),
    "presence_penalty_nan": ('"presence_penalty": NaN', "presence_penalty"),
    "max_tokens_huge_float": ('"max_tokens": 1e400', "max_tokens"),
    "stop_token_ids": ('"stop_token_ids": ["x"]', "stop_token_ids"),
    "stop_token_ids_negative": ('"stop_token_ids": [-1]', "stop_token_ids"),
    "logit_bias_nan": ('"logit_bias": {"5": NaN}', "logit_bias"),
    "stream_not_bool": ('"stream": "yes"', "stream"),
    "stream_options": ('"stream_options": "x"', "stream_options"),
    "model_not_str": ('"model": ["policy"]', "model"),
    "tools_not_list": ('"tools": "x"', "tools"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_a_bad_sampling_field_is_a_400_naming_it(embedded, case):
    field, param = BAD_FIELDS[case]
    model = "" if '"model"' in field else ', "model": "policy"'
    raw = '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, ' + field + model + "}"
    r = post_raw(embedded.url, raw)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.slow
def test_a_lone_surrogate_in_a_message_is_a_400(embedded):
    r = post_raw(
        embedded.url,
        '{"model": "policy", "max_tokens": 2, "messages": [{"role": "user", "content": "ab\\ud800cd"}]}',
    )
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
    assert "messages[0].content" in r.json()["error"]["message"]
    ok = post_raw(
        embedded.url,
        '{"model": "policy", "max_tokens": 2, '
        '"messages": [{"role": "user", "content": "ab\\ud83d\\ude00cd"}]}',
    )
    assert ok.status_code == 200, "a complete surrogate pair is one character and fine"


def test_lone_surrogate_path_names_where_it_is():
    assert lone_surrogate_path({"a": ["ok", {"b": "x\ud800"}]}) == "a[1].b"
    assert lone_surrogate_path({"a": "\U0001f600"}) is None


@pytest.mark.slow
def test_one_bad_request_never_fails_the_others_batched_with_it(tiny_model_dir):
    server = EmbeddedServer.start(str(tiny_model_dir), options=ServeOptions(max_num_seqs=8))
    try:
        good = [
            json.dumps(chat_body(messages=[{"role": "user", "content": f"Count to {i}"}], temperature=0))
            for i in range(4)
        ]
        alone = [post_raw(server.url, raw).json()["choices"][0]["message"]["content"] for raw in good]
        bad = '{"model": "policy", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
        assert httpx.post(server.url + "/pause", params={"mode": "wait"}, json={}).status_code == 200
        with ThreadPoolExecutor(5) as pool:
            futs = [pool.submit(post_raw, server.url, raw) for raw in [*good[:2], bad, *good[2:]]]
            wait_for(lambda: len(server.worker._held) == 4, timeout=30)
            httpx.post(server.url + "/resume", json={})
            answers = [f.result(timeout=60) for f in futs]
        assert [a.status_code for a in answers] == [200, 200, 400, 200, 200]
        assert [
            a.json()["choices"][0]["message"]["content"] for a in answers if a.status_code == 200
        ] == alone
        assert list(server.worker.batches)[-1] == 4, "the four good requests ran as one batch"
    finally:
        server.stop()


@pytest.mark.slow
def test_a_job_that_fails_inside_a_batch_fails_alone(tiny_model_dir, tokenizer):
    """The second line of defence: what slips past validation still fails only its own request."""
    from serving.embedded.engine import GenerationJob, ModelEngine

    eng = ModelEngine(str(tiny_model_dir))
    prompt = chat_prompt_ids(tokenizer, MSGS)
    good = [
        GenerationJob(prompt, SamplingParams(max_tokens=4, temperature=0)),
        GenerationJob(prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=3)),
    ]
    bad = [
        GenerationJob(prompt, SamplingParams(max_tokens=4, temperature=float("nan"))),  # fails when sampling
        GenerationJob(prompt, SamplingParams(max_tokens=4, seed=2**64)),
    ]  # fails when seeding
    out = eng.generate_batch([good[0], bad[0], bad[1], good[1]])
    assert isinstance(out[1], EngineError) and isinstance(out[2], EngineError)
    for job, got in ((good[0], out[0]), (good[1], out[3])):
        assert [c.token_ids for c in got] == [c.token_ids for c in eng.generate(job.prompt_ids, job.params)]


# -- cross-site requests to state-changing endpoints ---------------------------------------------------


def test_host_allow_list_names_the_bound_address_and_the_extra_names():
    assert host_allow_list("127.0.0.1", 8000) == {"127.0.0.1:8000", "localhost:8000", "[::1]:8000"}
    assert host_allow_list("10.0.0.5", 8000, ("gpu-box", "lb.internal:443")) == {
        "10.0.0.5:8000",
        "gpu-box",
        "gpu-box:8000",
        "lb.internal:443",
    }
    allowed = host_allow_list("127.0.0.1", 8000)
    assert cross_site_refusal("application/json; charset=utf-8", "localhost:8000", allowed) is None
    assert "Content-Type" in cross_site_refusal("text/plain", "localhost:8000", allowed)
    assert "--allowed-hosts" in cross_site_refusal("application/json", "evil.example:8000", allowed)


@pytest.mark.slow
def test_state_changing_endpoints_refuse_cross_site_requests_and_take_the_api_key(tiny_model_dir):
    server = EmbeddedServer.start(
        str(tiny_model_dir), options=ServeOptions(api_key="k", allowed_hosts=("gpu-box",))
    )
    auth = {"Authorization": "bearer k"}
    port = server.server_address[1]
    try:

        def post(path: str, **kw) -> httpx.Response:
            return httpx.post(server.url + path, timeout=30, **kw)

        # what a web page can send without a preflight: text/plain, a form, no type at all
        for headers in (
            {"Content-Type": "text/plain"},
            {"Content-Type": "application/x-www-form-urlencoded"},
            {},
        ):
            for path in ("/pause", "/v1/load_lora_adapter", "/collective_rpc", "/update_weight_version"):
                r = post(path, content=b'{"new_version": "9"}', headers={**auth, **headers})
                assert r.status_code == 403 and "application/json" in r.json()["error"]["message"], (
                    path,
                    r.text,
                )
        # DNS rebinding: the right content type, but the Host is the attacker's name
        r = post("/pause", json={}, headers={**auth, "Host": f"evil.example:{port}"})
        assert r.status_code == 403 and "--allowed-hosts" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/is_paused", headers=auth).json() == {"is_paused": False}
        # the api key guards them like every other endpoint
        assert post("/pause", json={}).status_code == 401
        assert post("/pause", json={}, headers={"Authorization": "Bearer nope"}).status_code == 401
        # the bound address, a loopback name and an allowed name all work
        assert post("/pause", json={}, headers=auth).json() == {"status": "paused"}
        assert post("/resume", json={}, headers={**auth, "Host": f"localhost:{port}"}).json() == {
            "status": "resumed"
        }
        r = post("/update_weight_version", json={"new_version": "3"}, headers={**auth, "Host": "gpu-box"})
        assert r.status_code == 200 and server.engine.weight_version == "3"
    finally:
        server.stop()


@pytest.mark.slow
def test_a_body_nested_past_the_parser_is_a_400(embedded):
    r = post_raw(embedded.url, "[" * 100_000 + "]" * 100_000)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    assert post_raw(embedded.url, json.dumps(chat_body())).status_code == 200
