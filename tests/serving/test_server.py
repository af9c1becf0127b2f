"""The embedded server answers like vLLM: token ids, logprobs, sampling, streaming, errors."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from serving.embedded.server import EmbeddedServer, ServeOptions

from .helpers import WEATHER_TOOL, chat_prompt_ids, recompute_logprobs

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client(embedded) -> openai.OpenAI:
    return openai.OpenAI(base_url=embedded.url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    kw.setdefault("model", "policy")
    kw.setdefault("messages", MSGS)
    kw.setdefault("max_tokens", 12)
    return client.chat.completions.create(**kw)


def test_return_token_ids_gives_the_rendered_prompt_and_ids_that_decode_to_the_text(client, tokenizer):
    r = chat(client, temperature=0, extra_body={"return_token_ids": True})
    prompt_ids = r.model_extra["prompt_token_ids"]
    ids = r.choices[0].model_extra["token_ids"]
    assert prompt_ids == chat_prompt_ids(tokenizer, MSGS)
    assert len(ids) == 12 and r.choices[0].finish_reason == "length"
    assert tokenizer.decode(ids, skip_special_tokens=True) == r.choices[0].message.content
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), 12)
    plain = chat(client, temperature=0)
    assert plain.model_extra.get("prompt_token_ids") is None and plain.choices[0].model_extra.get("token_ids") is None
    assert plain.choices[0].message.content == r.choices[0].message.content


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_logprobs_are_the_raw_model_logprobs_of_the_sampled_tokens(client, reference_model, temperature):
    r = chat(client, temperature=temperature, seed=3, logprobs=True, top_logprobs=3,
             extra_body={"return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    got = [e.logprob for e in r.choices[0].logprobs.content]
    want = recompute_logprobs(reference_model, r.model_extra["prompt_token_ids"], ids)
    assert got == pytest.approx(want, abs=1e-4)
    for e in r.choices[0].logprobs.content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-6
        assert e.bytes == list(e.token.encode())


def test_greedy_is_deterministic_seed_reproduces_and_n_samples_differ(client):
    greedy = {chat(client, temperature=0).choices[0].message.content for _ in range(2)}
    assert len(greedy) == 1
    a = chat(client, temperature=1.0, seed=11, n=3, extra_body={"return_token_ids": True})
    b = chat(client, temperature=1.0, seed=11, n=3, extra_body={"return_token_ids": True})
    ids_a = [c.model_extra["token_ids"] for c in a.choices]
    assert ids_a == [c.model_extra["token_ids"] for c in b.choices]
    assert len({tuple(x) for x in ids_a}) == 3, "three samples of a ~4.7-nat distribution should differ"
    c = chat(client, temperature=1.0, seed=12, extra_body={"return_token_ids": True})
    assert c.choices[0].model_extra["token_ids"] != ids_a[0]


def test_top_p_tiny_makes_sampling_greedy(client):
    greedy = chat(client, temperature=0).choices[0].message.content
    assert chat(client, temperature=1.0, top_p=1e-6, seed=5).choices[0].message.content == greedy


def test_stream_carries_the_same_text_ids_and_usage_as_the_plain_call(client):
    plain = chat(client, temperature=0, logprobs=True, extra_body={"return_token_ids": True})
    stream = chat(client, temperature=0, logprobs=True, stream=True, stream_options={"include_usage": True},
                  extra_body={"return_token_ids": True})
    text, ids, lps, prompt_ids, usage, finish = "", [], [], None, None, None
    for ch in stream:
        if not ch.choices:
            usage = ch.usage
            continue
        prompt_ids = prompt_ids or ch.model_extra.get("prompt_token_ids")
        text += ch.choices[0].delta.content or ""
        ids += ch.choices[0].model_extra.get("token_ids") or []
        lps += [e.logprob for e in (ch.choices[0].logprobs.content if ch.choices[0].logprobs else [])]
        finish = ch.choices[0].finish_reason or finish
    assert text == plain.choices[0].message.content
    assert ids == plain.choices[0].model_extra["token_ids"]
    assert lps == pytest.approx([e.logprob for e in plain.choices[0].logprobs.content])
    assert prompt_ids == plain.model_extra["prompt_token_ids"]
    assert usage.completion_tokens == 12 and finish == "length"


def test_stop_string_truncates_the_text_and_is_reported(client):
    full = chat(client, temperature=0, max_tokens=20).choices[0].message.content
    stop = full[5:7]
    r = chat(client, temperature=0, max_tokens=20, stop=[stop])
    assert r.choices[0].message.content == full[: full.find(stop)]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop


def test_completions_put_ids_on_the_choice_and_default_to_16_tokens(client, tokenizer, reference_model):
    r = client.completions.create(model="policy", prompt="The weather in Paris", temperature=0, logprobs=2,
                                  extra_body={"return_token_ids": True})
    ch = r.choices[0]
    assert ch.model_extra["prompt_token_ids"] == tokenizer.encode("The weather in Paris", add_special_tokens=False)
    assert len(ch.model_extra["token_ids"]) == 16 and ch.finish_reason == "length"
    assert ch.logprobs.token_logprobs == pytest.approx(
        recompute_logprobs(reference_model, ch.model_extra["prompt_token_ids"], ch.model_extra["token_ids"]), abs=1e-4)
    assert "".join(ch.logprobs.tokens) == ch.text and ch.logprobs.text_offset[0] == 0
    by_ids = client.completions.create(model="policy", prompt=ch.model_extra["prompt_token_ids"], temperature=0)
    assert by_ids.choices[0].text == ch.text


def test_tools_are_rendered_through_the_chat_template(client, tokenizer):
    r = chat(client, tools=[WEATHER_TOOL], temperature=0, max_tokens=2, extra_body={"return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == chat_prompt_ids(tokenizer, MSGS, tools=[WEATHER_TOOL])
    assert "<tools>" in tokenizer.decode(r.model_extra["prompt_token_ids"])


def test_models_lists_the_served_name(embedded):
    data = httpx.get(embedded.url + "/v1/models").json()["data"]
    assert [(m["id"], m["object"], m["parent"]) for m in data] == [("policy", "model", None)]


def test_bad_requests_get_openai_errors(client, embedded):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        chat(client, model="policy@99")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        chat(client, temperature=7)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        chat(client, max_tokens=10**6)
    r = httpx.post(embedded.url + "/v1/chat/completions", content=b"{nope")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(embedded.url + "/v1/nothing", json={})
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}


def test_request_body_limit_and_bearer_token(tiny_model_dir):
    server = EmbeddedServer.start(str(tiny_model_dir), options=ServeOptions(api_key="s3cret", max_body_bytes=2048))
    try:
        body = {"model": "policy", "messages": [{"role": "user", "content": "x" * 4096}]}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
        with pytest.raises(openai.AuthenticationError):
            chat(openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0), max_tokens=1)
        ok = chat(openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0), max_tokens=1)
        assert ok.choices[0].finish_reason == "length"
        assert httpx.get(server.url + "/health").status_code == 200
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.stop()


def test_concurrent_requests_match_sequential_results(client):
    prompts = [f"Count to {i}" for i in range(8)]

    def one(p: str) -> str:
        return chat(client, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=6).choices[0].message.content

    sequential = [one(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, prompts)) == sequential


def test_a_client_that_disconnects_mid_stream_does_not_hurt_the_server(embedded, client):
    body = json.dumps({"model": "policy", "messages": MSGS, "max_tokens": 200, "stream": True}).encode()
    with socket.create_connection(embedded.server_address[:2]) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert s.recv(64).startswith(b"HTTP/1.1 200")
    assert chat(client, max_tokens=2).choices[0].finish_reason == "length"


def test_pause_holds_new_requests_until_resume_and_abort_fails_them(tiny_model_dir):
    server = EmbeddedServer.start(str(tiny_model_dir))
    try:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        assert httpx.post(server.url + "/pause", params={"mode": "wait"}, json={}).json() == {"status": "paused"}
        assert httpx.get(server.url + "/is_paused").json() == {"is_paused": True}
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(chat, c, max_tokens=2)
            with pytest.raises(TimeoutError):
                held.result(timeout=0.5)
            assert httpx.post(server.url + "/resume", json={}).json() == {"status": "resumed"}
            assert held.result(timeout=30).choices[0].finish_reason == "length"
            httpx.post(server.url + "/pause", params={"mode": "wait"}, json={})
            queued = pool.submit(chat, c, max_tokens=2)
            time.sleep(0.3)
            httpx.post(server.url + "/pause", params={"mode": "abort"}, json={})
            with pytest.raises(openai.APIStatusError, match="aborted") as e:
                queued.result(timeout=30)
            assert e.value.status_code == 503
        httpx.post(server.url + "/resume", json={})
        assert httpx.get(server.url + "/is_paused").json() == {"is_paused": False}
        assert chat(c, max_tokens=1).choices[0].finish_reason == "length"
        r = httpx.post(server.url + "/pause", params={"mode": "bogus"}, json={})
        assert r.status_code == 400 and "mode must be one of" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_a_batch_samples_what_each_request_would_sample_alone(tiny_model_dir, reference_model, tokenizer):
    from serving.embedded.engine import GenerationJob, ModelEngine, SamplingParams

    eng = ModelEngine(str(tiny_model_dir))
    jobs = [
        GenerationJob(chat_prompt_ids(tokenizer, MSGS), SamplingParams(max_tokens=9, temperature=0)),
        GenerationJob(tokenizer.encode("Hi", add_special_tokens=False),
                      SamplingParams(max_tokens=5, temperature=1.0, seed=7, n=2, top_k=50)),
        GenerationJob(tokenizer.encode("The quick brown fox jumps", add_special_tokens=False),
                      SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=1, stop=["e"])),
    ]
    batched = eng.generate_batch(jobs)
    for job, outs in zip(jobs, batched, strict=True):
        alone = eng.generate(job.prompt_ids, job.params)
        assert [c.token_ids for c in outs] == [c.token_ids for c in alone]
        assert [(c.text, c.finish_reason, c.stop_reason) for c in outs] == \
            [(c.text, c.finish_reason, c.stop_reason) for c in alone]
        for c in outs:  # left padding must not leak into the logprobs
            assert c.logprobs == pytest.approx(recompute_logprobs(reference_model, job.prompt_ids, c.token_ids),
                                               abs=1e-4)


def test_requests_waiting_together_run_as_one_batch(tiny_model_dir):
    server = EmbeddedServer.start(str(tiny_model_dir), options=ServeOptions(max_num_seqs=4))
    try:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        prompts = [f"Count to {i}" for i in range(6)]
        alone = [chat(c, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=5).choices[0].message.content
                 for p in prompts]
        httpx.post(server.url + "/pause", params={"mode": "wait"}, json={})
        with ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(chat, c, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=5)
                    for p in prompts]
            deadline = time.monotonic() + 10
            while len(server.worker._held) < 6 and time.monotonic() < deadline:
                time.sleep(0.02)
            httpx.post(server.url + "/resume", json={})
            together = [f.result(timeout=30).choices[0].message.content for f in futs]
        assert together == alone
        assert list(server.worker.batches)[-2:] == [4, 2], server.worker.batches
    finally:
        server.stop()


def test_processed_logprobs_mode_reports_the_tempered_distribution(tiny_model_dir, reference_model, tokenizer):
    from serving.embedded.engine import ModelEngine, SamplingParams

    prompt = chat_prompt_ids(tokenizer, MSGS)
    raw = ModelEngine(str(tiny_model_dir)).generate(prompt, SamplingParams(max_tokens=6, temperature=0.5, seed=2))[0]
    proc = ModelEngine(str(tiny_model_dir), logprobs_mode="processed_logprobs").generate(
        prompt, SamplingParams(max_tokens=6, temperature=0.5, seed=2))[0]
    assert proc.token_ids == raw.token_ids  # the mode changes what is reported, not what is sampled
    ids = torch.tensor([prompt + raw.token_ids])
    with torch.no_grad():
        logits = reference_model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    tempered = torch.log_softmax(logits / 0.5, dim=-1).gather(-1, torch.tensor(raw.token_ids).view(-1, 1)).view(-1)
    assert proc.logprobs == pytest.approx(tempered.tolist(), abs=1e-4)
    assert raw.logprobs == pytest.approx(recompute_logprobs(reference_model, prompt, raw.token_ids), abs=1e-4)
    assert max(abs(a - b) for a, b in zip(proc.logprobs, raw.logprobs, strict=True)) > 0.1


def test_logit_bias_min_tokens_and_penalties_shape_sampling_but_not_raw_logprobs(client, tokenizer, reference_model):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    forced = chat(client, temperature=0, max_tokens=6, logit_bias={"42": 100},
                  logprobs=True, extra_body={"return_token_ids": True})
    assert forced.choices[0].model_extra["token_ids"] == [42] * 6
    assert all(e.logprob < -0.5 for e in forced.choices[0].logprobs.content), "raw logprobs ignore the bias"
    early = chat(client, temperature=0, max_tokens=10, logit_bias={str(eos): 100}, extra_body={
        "return_token_ids": True, "min_tokens": 3})
    ids = early.choices[0].model_extra["token_ids"]
    assert len(ids) == 4 and ids[-1] == eos and eos not in ids[:3] and early.choices[0].finish_reason == "stop"

    # presence/frequency penalties on top of a bias: greedy choice under OpenAI's formulas,
    # recomputed independently; without the penalties the bias alone repeats token 42
    bias = {"42": 6}
    r = chat(client, temperature=0, max_tokens=8, presence_penalty=1.5, frequency_penalty=2.0, logit_bias=bias,
             extra_body={"return_token_ids": True})
    prompt = r.model_extra["prompt_token_ids"]
    want: list[int] = []
    for _ in range(8):
        with torch.no_grad():
            logits = reference_model(input_ids=torch.tensor([prompt + want])).logits[0, -1].float()
        logits[42] += 6
        counts = torch.bincount(torch.tensor(want, dtype=torch.long), minlength=logits.shape[0]).float()
        want.append(int((logits - 2.0 * counts - 1.5 * (counts > 0).float()).argmax()))
        if want[-1] == eos:
            break
    assert r.choices[0].model_extra["token_ids"] == want
    biased = chat(client, temperature=0, max_tokens=8, logit_bias=bias, extra_body={"return_token_ids": True})
    assert biased.choices[0].model_extra["token_ids"] == [42] * 8 and want[0] == 42 and want.count(42) < 8


def test_a_batch_waits_briefly_for_requests_right_behind_its_first(tiny_model_dir, tokenizer):
    """Agents of a round send their calls milliseconds apart: with the gather window they share one
    batch instead of a lone first call followed by a batch of the rest (batches are static)."""
    from serving.embedded.engine import GenerationJob, ModelEngine, SamplingParams
    from serving.embedded.worker import EngineWorker

    worker = EngineWorker(ModelEngine(str(tiny_model_dir)), max_batch=4, batch_wait_s=2.0)
    try:
        prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}])
        futs = []
        for i in range(3):
            futs.append(worker.generate(GenerationJob(prompt, SamplingParams(max_tokens=3, seed=i))))
            time.sleep(0.05)
        for f in futs:
            assert len(f.result(timeout=60)) == 1
        assert list(worker.batches) == [3], worker.batches
    finally:
        worker.close()
