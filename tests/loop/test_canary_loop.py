"""The canary loop with real parts: `tracerl serve --second-listen` (two embedded servers of the tiny
model: vLLM's CPU attention refuses its head size), `tracerl gateway --canary`, a real collector, an
agent in this process on the real `openai` client instrumented by OpenLLMetry, rewards posted to
the collector's side channel, the real converter, and `tracerl promote --once` as a process.

The task is the demo's letter task (``examples/demo/reward.py``: reply with the letter the prompt names).
From one random tiny model, three checkpoints are trained for a few steps toward replies of known reward:
the serving ``policy@0`` on two of the four letters (it scores about 0.5), round 0's candidate on
inverted rewards (every letter answered with another: it scores 0) and round 1's on all four (it scores
about 1). The harmed one is rolled back; the better one is promoted, with the higher measured reward,
across a `kill -9` of `tracerl promote` after it recorded the decision and before the gateway heard it.
Each candidate reaches its server through the trainer's real canary publisher (a full-weight reload into
the server not serving). The rounds are written to the manifest as `tracerl train --canary` leaves them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np
import pytest
from tracerl_testing import BIN, free_port, start_tracerl, stop_tracerl

from loop.canary import decide
from loop.promote import arm_sequence, newest_canary
from store.location import parse_store
from store.views import connect_readonly
from trainer.manifest import read_rounds, write_round
from trainer.publish import canary_publisher
from trainer.rounds import PublishRequest

pytestmark = pytest.mark.slow  # starts servers, a gateway, a collector and promote processes

LETTERS = "aeot"  # the demo's task letters (examples/demo/make_tasks.py)
SHARE = 0.5  # half the rollouts to the candidate: 20 per arm (promote's minimum) in about 40


def writer_prompt(letter: str) -> str:
    """The demo writer's prompt (examples/demo/agent.py)."""
    return f"Reply with the letter {letter}: " + " ".join([letter] * 8)


def letter_score(reply: str, letter: str) -> float:
    """The demo's reward for one reply (``letter_score`` of examples/demo/reward.py, loaded from its file)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "examples" / "demo" / "reward.py"
    spec = importlib.util.spec_from_file_location("demo_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.letter_score(reply, letter, LETTERS)


def train_toward(src: Path, dst: Path, replies: dict[str, str], steps: int = 30) -> Path:
    """``src`` trained for a few Adam steps toward ``replies`` (prompt -> reply): a checkpoint whose
    greedy answers, and so whose reward, are known (the same full-weight layout as ``src``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest on shared cores
    try:
        tok, model = AutoTokenizer.from_pretrained(src), AutoModelForCausalLM.from_pretrained(src)
        batch = []
        for prompt, reply in replies.items():
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            ids = ids if isinstance(ids, list) else ids["input_ids"]
            batch.append((torch.tensor([ids + tok(reply + "<|im_end|>")["input_ids"]]), len(ids)))
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        model.train()
        for _ in range(steps):
            opt.zero_grad()
            for seq, n in batch:
                torch.nn.functional.cross_entropy(model(seq).logits[0, n - 1 : -1], seq[0, n:]).backward()
            opt.step()
        shutil.copytree(src, dst)
        model.save_pretrained(dst)
    finally:
        torch.set_num_threads(threads)
    return dst


def answer(client, prompt: str) -> str:
    """One greedy call, with the W3C traceparent of the current span (what an instrumented HTTP
    client sends: the gateway keeps a rollout's calls on one arm by it)."""
    from opentelemetry.propagate import inject

    headers: dict[str, str] = {}
    inject(headers)
    r = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=4,
        temperature=0.0,
        extra_headers=headers,
    )
    return r.choices[0].message.content or ""


def run_rollouts(n: int, client, tracer, rng: np.random.Generator, rewards_url: str) -> None:
    """n rollouts of the letter task, a random letter each, two calls each (a writer and a second
    writer, as the demo's writer and rewriter); reward: the demo's, the mean of the replies' scores."""
    for _ in range(n):
        letter = LETTERS[int(rng.integers(len(LETTERS)))]
        with tracer.start_as_current_span("rollout") as root:
            scores = [letter_score(answer(client, writer_prompt(letter)), letter) for _ in range(2)]
            tid = format(root.get_span_context().trace_id, "032x")
        r = httpx.post(rewards_url, json={"trace_id": tid, "value": sum(scores) / 2})
        assert r.status_code == 200, r.text


def converted(store: Path, collector, want: int) -> int:
    """Flush the collector and convert until ``want`` rollouts since the start are transitions."""
    from span_to_transition.convert import ConvertConfig
    from span_to_transition.store import convert_store

    deadline = time.monotonic() + 60
    while True:
        collector.flush()
        # a rollout is complete once quiet for 2 s: the gateway's spans (exported every 0.5 s) are in
        convert_store(parse_store(store), ConvertConfig(quiet_s=2.0))
        con = connect_readonly(parse_store(store))
        try:
            n = con.execute(
                "SELECT count(DISTINCT rollout_id) FROM transitions WHERE rollout_reward IS NOT NULL"
            ).fetchone()[0]
        finally:
            con.close()
        if n >= want or time.monotonic() > deadline:
            return n
        time.sleep(0.5)


def promote(store: Path, gateway: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "tracerl"), "promote", "--once", "--store", str(store), "--gateway", gateway],
        capture_output=True,
        text=True,
        timeout=120,
    )


def canary_round(store: Path, k: int, parent: int) -> None:
    """The manifest row `tracerl train --canary` writes once policy@k+1 is published."""
    row = {"round": k, "policy_version": parent, "parent_version": parent, "status": "canary"}
    write_round(parse_store(store), {**row, "published_at": datetime.now(timezone.utc), "timings": "{}"})


def test_a_harmed_candidate_is_rolled_back_a_sound_one_promoted_across_a_kill_9(tmp_path):
    from openai import OpenAI
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.openai import OpenAIInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from collector_exporter.testing import running_collector
    from serving.models.tiny_model import build_tiny_model

    init = build_tiny_model(tmp_path / "init", seed=0)
    right = {c: " ".join([c] * 4) for c in LETTERS}  # the reply that scores 1
    wrong = {c: right[LETTERS[(i + 1) % 4]] for i, c in enumerate(LETTERS)}  # another letter's: scores 0
    base = train_toward(init, tmp_path / "base", {writer_prompt(c): right[c] for c in "ae"})
    harmed = train_toward(init, tmp_path / "harmed", {writer_prompt(c): wrong[c] for c in LETTERS})
    better = train_toward(init, tmp_path / "better", {writer_prompt(c): right[c] for c in LETTERS})
    rng = np.random.default_rng(0)
    store = tmp_path / "store"
    pa, pb, pg = free_port(), free_port(), free_port()
    a, b, gw_url = (f"http://127.0.0.1:{p}" for p in (pa, pb, pg))
    publish = canary_publisher(f"{a},{b}", "full")
    with running_collector(store) as col:
        serve = start_tracerl(
            "serve", "--engine", "embedded", "--model", str(base), "--listen", f"127.0.0.1:{pa}",
            "--second-listen", f"127.0.0.1:{pb}", health=f"{b}/health", timeout=120,
        )  # fmt: skip
        gw = None
        tp = TracerProvider()
        tp.add_span_processor(
            SimpleSpanProcessor(OTLPSpanExporter(endpoint=col.grpc_endpoint, insecure=True))
        )
        OpenAIInstrumentor().instrument(tracer_provider=tp)
        try:
            assert httpx.get(f"{a}/health").status_code == 200
            gw = start_tracerl(
                "gateway", "--canary", str(SHARE), "--upstream-for", f"policy@0={a}",
                f"policy@1={b}", "--otlp", col.grpc_endpoint,
                "--listen", f"127.0.0.1:{pg}", health=f"{gw_url}/health",
            )  # fmt: skip
            client = OpenAI(base_url=f"{gw_url}/v1", api_key="x", max_retries=0)
            tracer = tp.get_tracer("agent")
            rewards = col.http_endpoint + "/v1/rewards"

            # round 0: the harmed checkpoint is published into the server not serving (b) as policy@1
            publish(PublishRequest("policy@1", 1, harmed, False, base, serving_version=0))
            canary_round(store, 0, 0)
            t0 = time.monotonic()
            n, looks = 0, []
            while True:
                run_rollouts(10, client, tracer, rng, rewards)
                n += 10
                converted(store, col, n)
                looks.append(promote(store, gw_url))
                assert looks[-1].returncode == 0, looks[-1].stdout + looks[-1].stderr
                status = read_rounds(parse_store(store))[0]["status"]
                if status != "canary" or n >= 120:
                    break
            print(f"\nround 0 (harmed): {status} after {n} rollouts, {time.monotonic() - t0:.0f}s; "
                  f"{looks[-1].stdout.strip()}")  # fmt: skip
            assert status == "rolled_back"
            c = json.loads(read_rounds(parse_store(store))[0]["canary"])
            assert c["n_serving"] + c["n_candidate"] == n  # every rollout counted, on the arm that served it
            route = httpx.get(f"{gw_url}/v1/canary").json()
            assert route["fraction"] == 0.0 and route["serving"]["upstream"] == a

            # round 1 trains from policy@0 (the rollback) and publishes a better checkpoint as policy@2;
            # the publisher picks b again (a serves policy@0), promote tells the gateway the new pair
            publish(PublishRequest("policy@2", 2, better, False, base, serving_version=0))
            assert httpx.get(f"{b}/weight_info").json()["weight_version"] == "2"
            canary_round(store, 1, 0)
            assert promote(store, gw_url).returncode == 0  # too few rollouts: waits, tells the pair
            route = httpx.get(f"{gw_url}/v1/canary").json()
            assert (route["candidate"]["version"], route["candidate"]["upstream"]) == ("policy@2", b)
            assert route["fraction"] == SHARE  # a new candidate starts at --canary's share, no restart
            published = read_rounds(parse_store(store))[1]["published_at"]
            decision, m = None, 0
            while decision is None or decision.action == "wait":  # as many as promote will need
                run_rollouts(20, client, tracer, rng, rewards)
                m += 20
                converted(store, col, n + m)
                decision = decide(*arm_sequence(parse_store(store), 0, 2, published))
                assert m <= 200, decision
            print(f"round 1 (better): {decision.action} after {m} rollouts: candidate {decision.mean_candidate:.3f} "
                  f"vs serving {decision.mean_serving:.3f}; {decision.reason}")  # fmt: skip
            assert decision.action == "promote"
            assert decision.mean_candidate > decision.mean_serving + 0.2  # measured through the gateway

            # kill -9 between the recorded decision and the gateway: a gateway that never answers
            with socket.socket() as hang:
                hang.bind(("127.0.0.1", 0))
                hang.listen()
                stuck = subprocess.Popen(
                    [str(BIN / "tracerl"), "promote", "--once", "--store", str(store), "--gateway",
                     f"http://127.0.0.1:{hang.getsockname()[1]}"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                deadline = time.monotonic() + 60
                while read_rounds(parse_store(store))[1]["status"] == "canary":
                    assert time.monotonic() < deadline and stuck.poll() is None
                    time.sleep(0.2)
                os.kill(stuck.pid, signal.SIGKILL)
                stuck.wait()
            assert read_rounds(parse_store(store))[1]["status"] == "promoted"
            assert httpx.get(f"{gw_url}/v1/canary").json()["fraction"] == SHARE  # not told yet
            again = promote(store, gw_url)  # the lock died with it; the rerun tells the recorded decision
            assert again.returncode == 0 and "promoted earlier" in again.stdout, again.stdout + again.stderr
            route = httpx.get(f"{gw_url}/v1/canary").json()
            assert route["fraction"] == 1.0 and route["candidate"]["upstream"] == b
            assert newest_canary(read_rounds(parse_store(store)))["round"] == 1
            con = connect_readonly(parse_store(store))
            try:  # every call joined to its gateway span: exact tokens, and the version that served it
                labels = con.execute(
                    "SELECT token_source, policy_version, canary_arm, count(*) FROM transitions "
                    "GROUP BY 1, 2, 3 ORDER BY 2"
                ).fetchall()
            finally:
                con.close()
            print(f"transitions by token source, version and canary arm: {labels}")
            # and the arm the gateway routed each rollout to, from its spans: policy@0 served, 1 and 2 candidates
            assert {(src, v, arm) for src, v, arm, _ in labels} == {
                ("gateway", 0, "serving"),
                ("gateway", 1, "candidate"),
                ("gateway", 2, "candidate"),
            }
        finally:
            OpenAIInstrumentor().uninstrument()
            tp.shutdown()
            if gw is not None:
                stop_tracerl(gw)
            stop_tracerl(serve)
