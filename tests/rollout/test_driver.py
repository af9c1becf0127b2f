"""`tracerl rollout` over real agent processes, a real collector and real HTTP on 127.0.0.1."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from tracerl_testing import BIN, alive, tracerl

from collector_exporter.testing import running_collector
from rollout.agent_env import parse_resource_attributes
from store.location import parse_store
from store.views import connect_readonly

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)

HERE = Path(__file__).parent
AGENT = [str(BIN / "python"), str(HERE / "fake_agent.py")]
REWARDS = str(HERE / "reward_fns.py")


def write_tasks(path: Path, tasks: list[dict]) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def records(store: Path) -> list[dict]:
    (path,) = (store / "rollouts").glob("driver-*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def rollout(tmp_path: Path, tasks: list[dict], *flags: str, env: dict | None = None, check: bool = True):
    tasks_file = write_tasks(tmp_path / "tasks.jsonl", tasks)
    return tracerl(
        "rollout",
        "--tasks",
        str(tasks_file),
        "--store",
        str(tmp_path / "store"),
        "--collector",
        "",
        *flags,
        "--",
        *AGENT,
        env=env,
        check=check,
        timeout=60,
    )


def test_only_env_vars_stdin_and_args_reach_the_unmodified_agent(tmp_path):
    tasks = [
        {"id": "t,1", "do": "env", "out": str(tmp_path / "env1.json")},
        {"do": "env", "out": str(tmp_path / "env2.json")},
    ]
    proc = rollout(
        tmp_path,
        tasks,
        "--otlp",
        "http://127.0.0.1:4999",
        "--gateway",
        "http://127.0.0.1:8199/v1",
        env={"OTEL_RESOURCE_ATTRIBUTES": "team=rl,tracerl.task_id=stale", "OPENAI_API_KEY": ""},
    )
    assert "2 rollouts: 2 ok, 0 failed, 0 timeout" in proc.stdout
    recs = {r["task_id"]: r for r in records(tmp_path / "store")}
    for i, task in enumerate(tasks, start=1):
        seen = json.loads((tmp_path / f"env{i}.json").read_text())
        env, rec = seen["env"], recs[task.get("id") or next(k for k in recs if k != "t,1")]
        assert parse_resource_attributes(env["OTEL_RESOURCE_ATTRIBUTES"]) == {
            "team": "rl",
            "tracerl.rollout_id": rec["rollout_id"],
            "tracerl.task_id": rec["task_id"],
        }
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:4999"
        assert (env["OTEL_EXPORTER_OTLP_INSECURE"], env["OTEL_TRACES_EXPORTER"]) == ("true", "otlp")
        assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:8199/v1"
        assert json.loads(env["TRACERL_TASK"]) == task and json.loads(seen["stdin"]) == task
        assert seen["argv"] == []
    assert recs["t,1"]["task_id"] == "t,1" and len({r["rollout_id"] for r in recs.values()}) == 2

    write_tasks(tmp_path / "tasks.jsonl", [{"do": "env", "out": str(tmp_path / "env3.json")}])
    tracerl(
        "rollout",
        "--tasks",
        str(tmp_path / "tasks.jsonl"),
        "--store",
        str(tmp_path / "s2"),
        "--collector",
        "",
        "--task-via",
        "arg",
        "--",
        *AGENT,
        "--flag",
    )
    seen = json.loads((tmp_path / "env3.json").read_text())
    assert seen["argv"][0] == "--flag" and json.loads(seen["argv"][1])["do"] == "env" and seen["stdin"] == ""


def test_crashing_agent_is_recorded_failed_and_the_others_still_run(tmp_path):
    tasks = [{"id": "good", "do": "ok"}, {"id": "bad", "do": "crash"}, {"id": "good2", "do": "ok"}]
    proc = rollout(tmp_path, tasks, "-n", "2", "--retries", "1", "--reward", f"{REWARDS}:exact")
    assert proc.returncode == 0, "failed agents are data; the driver itself succeeded"
    assert "6 rollouts: 4 ok, 2 failed, 0 timeout; mean reward 1.000 over 4" in proc.stdout
    recs = records(tmp_path / "store")
    bad = [r for r in recs if r["task_id"] == "bad"]
    assert [(r["status"], r["exit_code"], r["attempts"], r["reward"]) for r in bad] == [
        ("failed", 3, 2, None)
    ] * 2
    assert all("agent blew up: boom" in r["stderr_tail"] for r in bad)
    assert all(
        len(r["retried_rollout_ids"]) == 1 and r["retried_rollout_ids"][0] != r["rollout_id"] for r in bad
    )
    good = [r for r in recs if r["task_id"].startswith("good")]
    assert [(r["status"], r["exit_code"], r["attempts"], r["reward"]) for r in good] == [
        ("ok", 0, 1, 1.0)
    ] * 4


def test_a_flaky_agent_succeeds_on_retry_under_a_new_rollout_id(tmp_path):
    rollout(tmp_path, [{"id": "f", "do": "flaky", "out": str(tmp_path / "marker")}], "--retries", "2")
    (rec,) = records(tmp_path / "store")
    assert (rec["status"], rec["attempts"]) == ("ok", 2)
    assert rec["retried_rollout_ids"] == [rec["rollout_id"].removesuffix("-a1")] and rec[
        "rollout_id"
    ].endswith("-a1")


def test_hanging_agent_times_out_and_its_whole_process_group_is_killed(tmp_path):
    pids = tmp_path / "pids.json"
    proc = rollout(
        tmp_path,
        [{"id": "h", "do": "hang", "out": str(pids)}, {"id": "ok", "do": "ok"}],
        "--timeout-s",
        "1.5",
        "--retries",
        "0",
    )
    assert "2 rollouts: 1 ok, 0 failed, 1 timeout" in proc.stdout
    hung = next(r for r in records(tmp_path / "store") if r["task_id"] == "h")
    assert hung["status"] == "timeout" and 1.5 <= hung["duration_s"] < 5
    for pid in json.loads(pids.read_text()).values():
        assert not alive(pid), f"process {pid} of the timed-out agent survived"


def test_bad_task_line_stops_the_run_before_any_agent_starts_and_names_the_line(tmp_path):
    tasks_file = tmp_path / "tasks.jsonl"
    marker = tmp_path / "ran.json"
    tasks_file.write_text(json.dumps({"id": "a", "do": "env", "out": str(marker)}) + '\n\n{"id": "b",\n')
    proc = tracerl(
        "rollout", "--tasks", str(tasks_file), "--store", str(tmp_path / "store"), "--", *AGENT, check=False
    )
    assert proc.returncode == 2
    assert f"{tasks_file}:3: not valid JSON" in proc.stderr
    assert not marker.exists() and not (tmp_path / "store" / "rollouts").exists()


def test_usage_errors_exit_2_with_the_fix(tmp_path):
    write_tasks(tmp_path / "t.jsonl", [{"id": "a"}])
    for args, msg in [
        ((), "give the agent command after `--`"),
        (("--reward", "nope"), "MODULE:FUNCTION"),
        (("--reward", f"{REWARDS}:missing"), "no function 'missing'"),
        (("--concurrency", "0"), "--concurrency must be at least 1"),
    ]:
        extra = () if not args and msg.startswith("give") else ("--", *AGENT)
        proc = tracerl(
            "rollout",
            "--tasks",
            str(tmp_path / "t.jsonl"),
            "--store",
            str(tmp_path / "s"),
            *args,
            *extra,
            check=False,
        )
        assert proc.returncode == 2 and msg in proc.stderr, (args, proc.stderr)
    proc = tracerl("rollout", "--tasks", str(tmp_path / "missing.jsonl"), "--", *AGENT, check=False)
    assert proc.returncode == 2 and "cannot read --tasks" in proc.stderr


def test_concurrency_runs_agents_in_parallel_but_never_more_than_the_limit(tmp_path):
    log = tmp_path / "times.log"
    tasks = [{"id": f"s{i}", "do": "sleep", "secs": 0.8, "out": str(log)} for i in range(6)]
    rollout(tmp_path, tasks, "--concurrency", "3")
    events = sorted(
        (float(t), +1 if kind == "start" else -1)
        for kind, t in (line.split() for line in log.read_text().splitlines())
    )
    running, peak = 0, 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    # the agents' own start/end log shows the overlap; a wall-clock bound would depend on the machine's load
    assert peak == 3, f"expected exactly 3 agents at once at the peak, saw {peak}"


def test_rewards_reach_a_real_collector_keyed_by_rollout_id(tmp_path):
    store = tmp_path / "store"
    tasks = [{"id": "right", "answer": "42"}, {"id": "wrong", "answer": "7"}]
    with running_collector(store) as c:
        tasks_file = write_tasks(tmp_path / "tasks.jsonl", tasks)
        proc = tracerl(
            "rollout",
            "--tasks",
            str(tasks_file),
            "--store",
            str(store),
            "-n",
            "2",
            "--collector",
            c.http_endpoint,
            "--reward",
            f"{REWARDS}:exact",
            "--reward-name",
            "match",
            "--",
            *AGENT,
        )
        c.flush()
    assert "mean reward 0.500 over 4" in proc.stdout
    recs = records(store)
    assert all(r["reward_posted"] is True for r in recs)
    got = (
        connect_readonly(parse_store(store))
        .execute("SELECT rollout_id, value, name, source FROM rewards ORDER BY rollout_id")
        .fetchall()
    )
    want = sorted(
        (r["rollout_id"], 1.0 if r["task_id"] == "right" else 0.0, "match", "side_channel") for r in recs
    )
    assert got == want


def test_rewards_that_cannot_be_posted_fail_the_driver_but_keep_the_records(tmp_path):
    from tracerl_testing import free_port

    tasks_file = write_tasks(tmp_path / "tasks.jsonl", [{"id": "a"}])
    proc = tracerl(
        "rollout",
        "--tasks",
        str(tasks_file),
        "--store",
        str(tmp_path / "store"),
        "--retries",
        "0",
        "--reward-retries",
        "1",
        "--collector",
        f"http://127.0.0.1:{free_port()}",
        "--reward",
        f"{REWARDS}:exact",
        "--",
        *AGENT,
        check=False,
    )
    assert proc.returncode == 1 and "could not be posted" in proc.stderr
    (rec,) = records(tmp_path / "store")
    assert rec["reward"] == 1.0 and rec["reward_posted"] is False and "ConnectError" in rec["error"]


def test_a_reward_function_bug_is_recorded_per_rollout(tmp_path):
    proc = rollout(tmp_path, [{"id": "a"}], "--reward", f"{REWARDS}:broken")
    assert proc.returncode == 0 and "1 reward function error(s)" in proc.stdout
    (rec,) = records(tmp_path / "store")
    assert rec["reward"] is None and "ValueError: reward bug" in rec["error"]


@pytest.mark.parametrize("sigint", ["default", "inherited as ignored"])
def test_ctrl_c_stops_the_driver_and_leaves_no_agent_behind(tmp_path, sigint):
    """Also when started in the background by a shell without job control (`cmd &`), which leaves
    SIGINT ignored: Python's own Ctrl-C handling would never fire there."""
    import signal
    import subprocess

    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    tasks = [{"id": f"h{i}", "do": "hang", "out": str(tmp_path / f"pids{i}.json")} for i in range(2)]
    tasks_file = write_tasks(tmp_path / "tasks.jsonl", tasks)
    driver = subprocess.Popen(
        [
            str(BIN / "tracerl"),
            "rollout",
            "--tasks",
            str(tasks_file),
            "--store",
            str(tmp_path / "store"),
            "--collector",
            "",
            "--concurrency",
            "2",
            "--retries",
            "3",
            "--",
            *AGENT,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ignore_sigint if sigint != "default" else None,
    )
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"pids{i}.json").exists() for i in range(2)):
        assert time.monotonic() < deadline, "agents did not start"
        time.sleep(0.05)
    time.sleep(0.2)
    driver.send_signal(signal.SIGINT)
    assert driver.wait(timeout=15) == 130
    for i in range(2):
        for pid in json.loads((tmp_path / f"pids{i}.json").read_text()).values():
            assert not alive(pid), f"process {pid} survived the interrupted driver"
    (path,) = (tmp_path / "store" / "rollouts").glob("driver-*.jsonl")
    assert path.read_text() == "", "interrupted rollouts must not be recorded as if they had finished"


def test_an_agent_started_while_the_driver_stops_is_killed_as_it_is_registered():
    """The race behind a Ctrl-C that hung for --timeout-s: a worker thread had started an agent
    (``Popen`` returned) but not yet registered it when the interrupted driver killed the running
    ones. Registering it after ``kill_all`` now kills it at once."""
    import signal
    import subprocess

    from rollout.agent_process import Running

    running = Running()
    before = subprocess.Popen(["sleep", "30"], start_new_session=True)
    running.add(before)
    running.kill_all()
    late = subprocess.Popen(["sleep", "30"], start_new_session=True)
    running.add(late)
    assert before.wait(timeout=10) == late.wait(timeout=10) == -signal.SIGTERM


def _levels(path: Path) -> list[int]:
    """How many ``sleep`` agents were running after each start or end in their shared log."""
    events = sorted(
        (float(t), +1 if kind == "start" else -1)
        for kind, t in (line.split() for line in path.read_text().splitlines())
    )
    level, out = 0, []
    for _, step in events:
        level += step
        out.append(level)
    return out


def test_continuous_runs_the_tasks_again_and_again_at_the_concurrency_until_max_rollouts(tmp_path):
    log = tmp_path / "runs.log"
    tasks = [{"id": f"t{i}", "do": "sleep", "secs": 0.4, "out": str(log)} for i in range(2)]
    proc = rollout(tmp_path, tasks, "--continuous", "--max-rollouts", "9", "--concurrency", "3", "-n", "2")
    assert "9 rollouts: 9 ok" in proc.stdout
    recs = records(tmp_path / "store")
    assert sorted((r["task_id"], r["sample"]) for r in recs) == [  # (the file is in order of completion)
        ("t0", 0),
        ("t0", 1),
        ("t0", 2),
        ("t0", 3),
        ("t0", 4),
        ("t1", 0),
        ("t1", 1),
        ("t1", 2),
        ("t1", 3),
    ]
    levels = _levels(log)
    assert len(levels) == 18 and levels[-1] == 0  # 9 starts, 9 ends
    assert max(levels) == 3  # --concurrency agents at once, never more


def test_stopping_a_continuous_run_lets_the_running_agents_finish_and_exits_0(tmp_path):
    import signal
    import subprocess

    log = tmp_path / "runs.log"
    tasks_file = write_tasks(
        tmp_path / "tasks.jsonl", [{"id": "t", "do": "sleep", "secs": 1.5, "out": str(log)}]
    )
    driver = subprocess.Popen(
        [
            str(BIN / "tracerl"),
            "rollout",
            "--tasks",
            str(tasks_file),
            "--store",
            str(tmp_path / "store"),
            "--collector",
            "",
            "--continuous",
            "--concurrency",
            "2",
            "--",
            *AGENT,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 20
    while not (log.exists() and log.read_text().count("start") >= 2):
        assert time.monotonic() < deadline, "agents did not start"
        time.sleep(0.05)
    driver.send_signal(signal.SIGTERM)
    out, err = driver.communicate(timeout=20)
    assert driver.returncode == 0, err
    assert "stopping: waiting for the running agents to finish" in err
    text = log.read_text()
    started = text.count("start")
    assert text.count("end") == started, "a running agent was killed instead of finishing"
    recs = records(tmp_path / "store")
    assert len(recs) == started and all(r["status"] == "ok" for r in recs)
    assert f"{started} rollouts: {started} ok" in out


def test_a_niced_agent_and_the_processes_it_starts_run_at_the_lower_priority():
    """Real processes: the agent reports its own niceness and its child's (Driver.nice, used where the
    agents run beside training on a shared CPU)."""
    import sys

    from rollout.agent_process import run_agent

    code = (
        "import os, subprocess, sys, time; time.sleep(0.2); print(os.getpriority(os.PRIO_PROCESS, 0)); "
        "sys.stdout.flush(); "
        "subprocess.run([sys.executable, '-c', 'import os; print(os.getpriority(os.PRIO_PROCESS, 0))'])"
    )
    base = os.getpriority(os.PRIO_PROCESS, 0)
    plain = run_agent([sys.executable, "-c", code], dict(os.environ), None, 30.0)
    niced = run_agent([sys.executable, "-c", code], dict(os.environ), None, 30.0, nice=5)
    assert plain.status == niced.status == "ok", (plain.stderr, niced.stderr)
    assert plain.stdout.split() == [str(base), str(base)]
    assert niced.stdout.split() == [str(min(19, base + 5))] * 2
