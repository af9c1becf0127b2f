"""The demo agent + task: its reward function, its tasks, and a real end-to-end rollout.

End to end: `tracerl serve` (tiny model) ← `tracerl gateway` ← the unmodified demo agent under
`opentelemetry-instrument`, launched by `tracerl rollout`, exporting to `tracerl collect` (the three
started by tracerl/stack.py, as the demo starts them). The store must hold, per rollout, the spans of
both named agents (each with its `chat` span and the gateway's token span below it) and the rollout's
reward.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tracerl_testing import BIN, tracerl

from store.location import parse_store
from store.views import connect_readonly
from tracerl.stack import StackConfig, running_stack

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"demo_{name}", DEMO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reward, make_tasks = _load("reward"), _load("make_tasks")


def out(writer: str, final: str) -> str:
    return "log line\n" + json.dumps({"letter": "a", "writer": writer, "final": final}) + "\n"


def test_reward_is_one_only_when_both_agents_start_with_the_letter_and_use_no_other():
    task = {"id": "letter-a", "letter": "a", "letters": "aeot"}
    assert reward.score(task, out("a", " A!")) == 1.0
    assert reward.score(task, out("allall", "aaaa")) == 1.0
    # first ok, share 1/2; then 0
    assert reward.score(task, out("at", "xyz")) == pytest.approx((1 + 0.5) / 2 / 2)
    assert reward.score(task, out("the cat", "ba")) == pytest.approx(((0 + 1 / 4) / 2 + (0 + 1) / 2) / 2)
    assert reward.score(task, out("xyz", "")) == 0.0
    assert reward.score(task, "not json") == 0.0 and reward.score(task, "") == 0.0


def test_no_reply_that_ignores_the_task_beats_one_over_the_number_of_letters():
    letters = "aeot"
    for reply in ("tooltool", "allallal", "eat", "ouou", "the weather", "", "a e o t"):
        mean = sum(reward.letter_score(reply, c, letters) for c in letters) / len(letters)
        assert mean <= 1 / len(letters) + 1e-9, reply


@pytest.mark.slow
def test_tasks_are_one_per_letter_with_distinct_ids():
    assert make_tasks.make_tasks("ae") == [
        {"id": "letter-a", "letter": "a", "letters": "ae"},
        {"id": "letter-e", "letter": "e", "letters": "ae"},
    ]
    ids = [t["id"] for t in make_tasks.make_tasks("aeot", repeat=3)]
    assert len(ids) == 12 == len(set(ids))
    for bad in ("", "aa", "a1"):
        with pytest.raises(ValueError):
            make_tasks.make_tasks(bad)
    proc = subprocess.run(
        [sys.executable, str(DEMO / "make_tasks.py"), "--letters", "ot"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert [json.loads(line)["letter"] for line in proc.stdout.splitlines()] == ["o", "t"]


@pytest.mark.slow
def test_demo_agent_rollouts_store_both_agents_spans_and_rewards(tmp_path, tiny_model_dir):
    store = tmp_path / "store"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        subprocess.run(
            [sys.executable, str(DEMO / "make_tasks.py"), "--letters", "ae"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
    env.update(
        {
            "OTEL_SERVICE_NAME": "demo-agent",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
            "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "*",
        }
    )
    cfg = StackConfig(
        store=str(store),
        logs=tmp_path / "logs",
        model=str(tiny_model_dir),
        collect_args=("--segment-age-s", "0.2"),
    )
    with running_stack(cfg) as stack:  # stopped gateway first (it flushes its span batch), collector last
        urls = stack.urls
        proc = tracerl(
            "rollout",
            "--tasks",
            str(tasks),
            "-n",
            "2",
            "--concurrency",
            "2",
            "--store",
            str(store),
            "--collector",
            urls.collector,
            "--otlp",
            urls.otlp,
            "--gateway",
            f"{urls.gateway}/v1",
            "--reward",
            f"{DEMO / 'reward.py'}:score",
            "--timeout-s",
            "60",
            "--",
            str(BIN / "opentelemetry-instrument"),
            str(BIN / "python"),
            str(DEMO / "agent.py"),
            env=env,
            timeout=120,
        )
    assert all(c.proc.returncode == 0 for c in stack.started.values()), [
        c.log_tail() for c in stack.started.values()
    ]
    assert "4 rollouts: 4 ok, 0 failed, 0 timeout" in proc.stdout, proc.stdout + proc.stderr
    (records_file,) = (store / "rollouts").glob("driver-*.jsonl")
    recs = {r["rollout_id"]: r for r in map(json.loads, records_file.read_text().splitlines())}

    con = connect_readonly(parse_store(store))
    agents = con.execute("""
        SELECT rollout_id, resource_attributes['tracerl.task_id'], list(attributes['gen_ai.agent.name'] ORDER BY start_time_ns),
               count(DISTINCT trace_id)
        FROM spans WHERE attributes['gen_ai.agent.name'] IS NOT NULL GROUP BY 1, 2 ORDER BY 1""").fetchall()
    assert [(rid, task) for rid, task, _, _ in agents] == sorted((r, recs[r]["task_id"]) for r in recs)
    assert all(names == ["writer", "rewriter"] and traces == 1 for _, _, names, traces in agents)
    # below each agent span: its GenAI `chat` span, and below that the gateway's span with exact token ids
    calls = con.execute("""
        SELECT a.rollout_id, a.attributes['gen_ai.agent.name'], c.name, g.name, g.attributes['tracerl.response_token_ids']
        FROM spans a JOIN spans c ON c.parent_span_id = a.span_id JOIN spans g ON g.parent_span_id = c.span_id
        WHERE a.attributes['gen_ai.agent.name'] IS NOT NULL""").fetchall()
    assert len(calls) == 8
    assert {(c, g) for _, _, c, g, _ in calls} == {("chat policy", "tracerl.gateway policy")}
    assert all(json.loads(ids) for *_, ids in calls)
    rewards = dict(con.execute("SELECT rollout_id, value FROM rewards").fetchall())
    assert rewards == {rid: r["reward"] for rid, r in recs.items()}
    assert all(0.0 <= v <= 1.0 for v in rewards.values())
