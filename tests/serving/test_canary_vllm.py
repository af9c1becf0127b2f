"""A canary over two real vLLM processes on this CPU: `tracerl serve --engine vllm --second-listen`
starts both; the trainer's canary publisher reloads the candidate into the one not serving; the
gateway routes the share to it and labels every call with the weights that served it; after a
promote and the next round the two trade places and the gateway follows with no restart."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from tracerl_testing import free_port

from serving.gateway.canary import ARM_ATTRIBUTE, CANDIDATE, SERVING, arm_for
from serving.gateway.proxy import Gateway, GatewayConfig
from serving.models.tiny_model import build_tiny_model
from trainer.publish import canary_publisher
from trainer.rounds import PublishRequest

from .helpers import wait_for
from .test_canary_routing import trace_ids, traceparent

pytestmark = pytest.mark.slow  # two vLLM processes
PROMPT = [{"role": "user", "content": "Reply with the letter e"}]


def logprobs(answer: dict) -> list[float]:
    return [c["logprob"] for c in answer["choices"][0]["logprobs"]["content"]]


def same(x: list[float], y: list[float]) -> bool:
    return len(x) == len(y) and all(abs(p - q) < 1e-4 for p, q in zip(x, y))


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def greedy(url: str, tid: str | None = None) -> dict:
    headers = {"traceparent": traceparent(tid)} if tid else {}
    body = {"model": "policy", "messages": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_vllm_servers_carry_a_canary_round_after_round(model32: Path, tmp_path, spans):
    from .vllm_rig import running_vllm

    second = free_port()
    b = f"http://127.0.0.1:{second}"
    other = build_tiny_model(tmp_path / "other", seed=1, heads=2, kv_heads=1)  # the candidate's weights
    # without LoRA vLLM's CPU platform would torch.compile the model at start, both servers at once, on a
    # cold cache on a fresh machine (CI's); the test does not need the compile
    args = ("--dtype", "float32", "--max-model-len", "512", "--kv-cache-gb", "1", "--no-enable-lora",
            "--vllm-args=--enforce-eager")
    with running_vllm(
        model32, tmp_path / "vllm.log", *args, "--second-listen", f"127.0.0.1:{second}"
    ) as server:
        a = server.url
        wait_for(lambda: healthy(b), timeout=600, interval=1)
        base = logprobs(greedy(a))
        assert same(logprobs(greedy(b)), base)  # one model, twice
        publish = canary_publisher(f"{a},{b}", "full")
        t = time.monotonic()
        publish(PublishRequest("policy@1", 1, other, False, model32, serving_version=0))
        print(f"\nreload of the candidate into the second vLLM: {time.monotonic() - t:.1f}s")
        tags = [httpx.get(f"{u}/weight_info", timeout=10).json()["weight_version"] for u in (a, b)]
        assert tags == [
            "default",
            "1",
        ]  # only the server not serving was reloaded (vLLM's first tag: default)
        assert same(logprobs(greedy(a)), base) and not same(logprobs(greedy(b)), base)

        cfg = GatewayConfig(canary=0.5, upstream_for={"policy@0": a, "policy@1": b})
        gw = Gateway(("127.0.0.1", 0), cfg, spans.provider).start_background()
        tids, later = trace_ids(16, 11), trace_ids(16, 12)
        try:
            for tid in tids:
                greedy(gw.url, tid)
            # policy@1 promoted; the next round (from policy@1) goes into a, and the gateway follows
            assert httpx.post(gw.url + "/v1/canary", json={"fraction": 1.0}).status_code == 200
            publish(PublishRequest("policy@2", 2, model32, False, model32, serving_version=1))
            assert [httpx.get(f"{u}/weight_info").json()["weight_version"] for u in (a, b)] == ["2", "1"]
            # the gateway sends a call on a version read up to version_max_age_s old: one read before the
            # reload would label the call ambiguous (right, but not what this test checks), so let it age
            time.sleep(2 * cfg.version_max_age_s)
            r = httpx.post(gw.url + "/v1/canary", json={"serving": "policy@1", "candidate": "policy@2"})
            assert r.status_code == 200, r.text
            assert (r.json()["serving"]["upstream"], r.json()["candidate"]["upstream"]) == (b, a)
            for tid in later:
                greedy(gw.url, tid)
            got = wait_for(lambda: len(spans.get_finished_spans()) >= 32 and spans.get_finished_spans(), 30)
        finally:
            gw.stop()
    before = {SERVING: (a, 0), CANDIDATE: (b, 1)}  # policy@0 untouched on a, the candidate on b
    after = {SERVING: (b, 1), CANDIDATE: (a, 2)}  # promoted policy@1 on b, the next candidate on a
    assert len(got) == 32
    for s in got:
        at, tid = s.attributes, format(s.context.trace_id, "032x")
        arm = at[ARM_ATTRIBUTE]
        assert arm == arm_for(tid, 0.5)
        where = before if tid in tids else after
        assert (at["tracerl.upstream"], at["tracerl.policy_version"]) == where[arm]
