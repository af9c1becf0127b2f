"""The eval gate before a canary (loop/gate.py): the pure rule, which server is which arm, the report line,
the CLI's checks, and the gate run for real: `tracerl serve --second-listen` (two embedded servers of the
tiny model), the trainer's canary publisher, the rollout driver and an unchanged agent process on the real
`openai` client."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from tracerl_testing import free_port, start_tracerl, stop_tracerl

from loop.gate import GatePlan, arm_servers, gate_decision, server_gate
from options import UsageError
from rollout.tasks import Task
from trainer.config import TrainSettings
from trainer.report import canary_line


def test_a_candidate_no_worse_within_the_margin_passes_and_a_worse_one_fails():
    ok = gate_decision([1, 1, 0, 0], [1, 0, 0, 0], margin=0.25)
    assert ok.passed and ok.success_serving == 0.5 and ok.success_candidate == 0.25
    bad = gate_decision([1, 1, 0, 0], [1, 0, 0, 0], margin=0.2)
    assert not bad.passed and "worse on the held-out tasks" in bad.reason
    assert gate_decision([0.5, 0.5], [0.9, 0.1], margin=0.0).passed  # equal means pass at margin 0


def test_a_run_without_reward_counts_as_a_failure_and_is_counted():
    g = gate_decision([1.0, 1.0], [1.0, None], margin=0.1)
    assert (g.success_candidate, g.unscored_candidate, g.unscored_serving) == (0.5, 1, 0) and not g.passed


def test_bad_gate_inputs_name_the_fix():
    with pytest.raises(ValueError, match="--gate-tasks"):
        gate_decision([], [1.0], margin=0.0)
    with pytest.raises(ValueError, match="margin"):
        gate_decision([1.0], [1.0], margin=-0.1)


def test_arm_servers_follow_the_weight_tags_as_the_servers_trade_places():
    a, b = "http://a", "http://b"
    assert arm_servers({a: None, b: "1"}, serving=0, candidate=1) == (a, b)  # untouched a serves policy@0
    assert arm_servers({a: "3", b: "2"}, serving=2, candidate=3) == (b, a)
    with pytest.raises(ValueError, match=r"no server serves policy@5"):
        arm_servers({a: "3", b: "4"}, serving=4, candidate=5)


def test_a_gated_rollback_reads_in_the_report_with_the_gates_numbers():
    g = gate_decision([1, 1, 1, 0], [0, 0, 0, 0], margin=0.05)
    rec = {**g.record(), "serving_version": 1, "candidate_version": 2}
    line = canary_line(1, "rolled_back", json.loads(json.dumps(rec)))
    assert "eval gate v2 vs v1: rolled_back" in line and "0.000 (n=4) vs 0.750 (n=4)" in line


def test_gate_tasks_without_its_companions_is_a_usage_error_naming_them():
    from tracerl.commands.train import check_gate

    with pytest.raises(UsageError, match=r"--canary, --server A,B, --gate-agent CMD, --gate-reward FN"):
        check_gate(TrainSettings(gate_tasks="held.jsonl"))
    with pytest.raises(UsageError, match="--gate-samples"):
        check_gate(
            TrainSettings(
                gate_tasks="h", canary=True, server="u", gate_agent="a", gate_reward="r:f", gate_samples=0
            )
        )
    check_gate(TrainSettings(gate_tasks="h", canary=True, server="u", gate_agent="a", gate_reward="r:f"))


AGENT = textwrap.dedent("""\
    import json, os
    from openai import OpenAI
    task = json.loads(os.environ["TRACERL_TASK"])
    r = OpenAI(api_key="none").chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task["prompt"]}], max_tokens=4, temperature=0.0)
    print(json.dumps(r.choices[0].message.content or ""))
""")

PROMPTS = ["What is 2+2?", "Name a colour.", "Say hi.", "Count to three.", "Pick a number."]


def greedy(url: str, prompt: str) -> str:
    r = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=60,
        json={
            "model": "policy",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 4,
            "temperature": 0.0,
        },
    )
    return r.json()["choices"][0]["message"]["content"] or ""


def exact(task: dict, stdout: str) -> float:
    """1 when the agent said the serving model's own greedy answer."""
    return float(json.loads(stdout.strip().splitlines()[-1]) == task["expect"])


@pytest.mark.slow  # starts two servers and agent processes
def test_the_gate_stops_a_harmed_candidate_and_passes_a_sound_one_against_real_servers(tmp_path: Path):
    from serving.models.tiny_model import build_tiny_model
    from trainer.publish import canary_publisher, weight_tag
    from trainer.rounds import PublishRequest

    base = build_tiny_model(tmp_path / "base", seed=0)
    harmed = build_tiny_model(tmp_path / "harmed", seed=1)
    same = build_tiny_model(tmp_path / "same", seed=0)
    (tmp_path / "agent.py").write_text(AGENT)
    pa, pb = free_port(), free_port()
    a, b = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
    serve = start_tracerl(
        "serve",
        "--engine",
        "embedded",
        "--model",
        str(base),
        "--listen",
        f"127.0.0.1:{pa}",
        "--second-listen",
        f"127.0.0.1:{pb}",
        health=f"{b}/health",
        timeout=120,
    )
    try:
        tasks = [Task(f"t{i}", {"prompt": p, "expect": greedy(a, p)}, i) for i, p in enumerate(PROMPTS)]
        plan = GatePlan(tasks, [sys.executable, str(tmp_path / "agent.py")], exact, margin=0.2, concurrency=2)
        gate = server_gate([a, b], plan, weight_tag)
        publish = canary_publisher(f"{a},{b}", "full")
        stopped = PublishRequest("policy@1", 1, harmed, False, base, serving_version=0)
        publish(stopped)  # into b, the server not serving policy@0
        g = gate(stopped)
        print(f"\nharmed: {g.describe()}")
        assert (g.serving_version, g.candidate_version) == (0, 1)
        assert g.success_serving == 1.0 and g.n_serving == len(PROMPTS) and not g.passed
        sound = PublishRequest("policy@2", 2, same, False, base, serving_version=0)
        publish(sound)  # b again: a still serves policy@0 (the rollback)
        g = gate(sound)
        print(f"sound: {g.describe()}")
        assert g.passed and g.success_candidate == 1.0
    finally:
        stop_tracerl(serve)


def test_the_viewer_shows_the_gates_numbers_alone_and_beside_a_canary_decision():
    import numpy as np

    from loop.canary import CanaryRule, decide
    from loop.promote import canary_json
    from ui.app import templates

    g = gate_decision([1, 1, 1, 0], [0, 0, 0, 0], margin=0.05)
    alone = {**g.record(), "serving_version": 1, "candidate_version": 2}
    cand = np.arange(200) % 5 == 0  # 40 candidate rollouts scoring 0 among 160 serving ones at 0.25
    d = decide(cand, np.where(cand, 0.0, (np.arange(200) % 5 == 1).astype(float)))
    beside = json.loads(canary_json(d, CanaryRule(), 1, 2, gate_decision([1], [1], 0.05).record()["gate"]))
    cols = [
        "n_rollouts",
        "n_transitions",
        "mean_reward",
        "loss",
        "kl",
        "clip_fraction",
        "staleness",
        "estimator",
        "estimator_reason",
        "published_at",
        "git_sha",
        "checkpoint_path",
        "adapter",
        "seconds",
        "settings_json",
        "timings",
    ]
    rows = [
        {"round": k, "policy_version": 1, "status": "rolled_back", "canary_info": c, **dict.fromkeys(cols)}
        for k, c in ((1, alone), (2, beside))
    ]
    html = (
        templates()
        .get_template("rounds.html")
        .render(
            rounds=rows,
            charts=[],
            heldout=None,
            tasks_re="",
            live=False,
            nav="rounds",
            generation=0,
            store="",
        )
    )
    assert "eval gate failed: held-out success 0.000 (n=4) vs 0.750 (n=4)" in html
    assert "eval gate passed" in html and "difference -0.250" in html  # the decision and its gate, one cell
