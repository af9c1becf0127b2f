"""``--launcher fork`` (rollout/launcher.py): which commands are forked, and a forked agent behaving as
the same command started fresh: argv, stdin, environment, exit code, stderr, timeout kill, niceness,
and its spans reaching a real collector."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from tracerl_testing import alive

from collector_exporter.testing import running_collector
from rollout.agent_env import agent_env
from rollout.agent_process import run_agent
from rollout.launcher import ForkPlan, fork_plan
from store.location import parse_store
from store.views import connect_readonly

HERE = Path(__file__).parent
FAKE = str(HERE / "fake_agent.py")
INSTRUMENT = str(Path(sys.executable).parent / "opentelemetry-instrument")


def test_only_this_python_running_a_script_is_forked() -> None:
    assert fork_plan([sys.executable, "a.py", "x"]) == ForkPlan("a.py", ("x",), instrument=False)
    assert fork_plan([INSTRUMENT, sys.executable, "a.py"]) == ForkPlan("a.py", (), instrument=True)
    assert fork_plan([sys.executable, "-m", "agent"]) is None  # flags: started fresh
    assert fork_plan([sys.executable, "-c", "print(1)"]) is None
    assert fork_plan([INSTRUMENT, "--traces_exporter", "console", sys.executable, "a.py"]) is None
    assert fork_plan(["/usr/bin/env", "node", "agent.js"]) is None
    assert fork_plan(["/no/such/python", "a.py"]) is None  # another interpreter: its own modules
    assert fork_plan([]) is None and fork_plan([sys.executable]) is None


def _both(argv: list[str], task: dict) -> tuple:
    """The same command and task started fresh, then forked."""
    env, text = dict(os.environ, TRACERL_TASK=json.dumps(task)), json.dumps(task) + "\n"
    return tuple(run_agent(argv, env, text, 30.0, launcher=launcher) for launcher in ("exec", "fork"))


@pytest.mark.slow
def test_a_forked_agent_sees_what_a_fresh_one_sees(tmp_path: Path) -> None:
    fresh_out, forked_out = tmp_path / "fresh.json", tmp_path / "forked.json"
    env = dict(os.environ, OTHER="kept")
    results = []
    for out, launcher in ((fresh_out, "exec"), (forked_out, "fork")):
        task = {"do": "env", "out": str(out), "answer": "yes"}
        env_k = dict(env, TRACERL_TASK=json.dumps(task))
        results.append(
            run_agent([sys.executable, FAKE, "arg1"], env_k, "the stdin\n", 30.0, launcher=launcher)
        )
    fresh, forked = (json.loads(p.read_text()) for p in (fresh_out, forked_out))
    assert [r.status for r in results] == ["ok", "ok"] and [r.stdout for r in results] == ["yes\n", "yes\n"]
    assert forked["argv"] == fresh["argv"] == ["arg1"]
    assert forked["stdin"] == fresh["stdin"] == "the stdin\n"
    # exactly the driver's environment (a fresh python adds nothing of its own but what these tolerate)
    drop = {"TRACERL_TASK", "LC_CTYPE"}
    assert {k: v for k, v in forked["env"].items() if k not in drop} == {
        k: v for k, v in fresh["env"].items() if k not in drop
    }


@pytest.mark.slow
def test_a_forked_agents_exit_code_and_stderr_are_kept() -> None:
    fresh, forked = _both([sys.executable, FAKE], {"do": "crash"})
    assert (fresh.status, fresh.exit_code) == (forked.status, forked.exit_code) == ("failed", 3)
    assert "agent blew up: boom" in forked.stderr
    code = "import sys; sys.exit('bad input')"  # sys.exit with a message: printed, exit 1, as python does
    script = Path(os.environ.get("TMPDIR", "/tmp")) / f"exit_msg_{os.getpid()}.py"
    script.write_text(code)
    try:
        fresh, forked = _both([sys.executable, str(script)], {})
    finally:
        script.unlink()
    assert fresh.exit_code == forked.exit_code == 1 and "bad input" in forked.stderr


@pytest.mark.slow
def test_a_forked_agent_that_hangs_is_killed_with_the_processes_it_started(tmp_path: Path) -> None:
    out = tmp_path / "pids.json"
    task = {"do": "hang", "out": str(out)}
    env = dict(os.environ, TRACERL_TASK=json.dumps(task))
    res = run_agent([sys.executable, FAKE], env, json.dumps(task), 3.0, launcher="fork")
    assert res.status == "timeout"
    time.sleep(0.3)
    for pid in json.loads(out.read_text()).values():
        assert not alive(pid), f"process {pid} of the timed-out agent survived"


@pytest.mark.slow
def test_a_forked_agent_runs_at_the_lower_priority(tmp_path: Path) -> None:
    script = tmp_path / "nice.py"
    script.write_text("import os, time; time.sleep(0.3); print(os.getpriority(os.PRIO_PROCESS, 0))")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    res = run_agent([sys.executable, str(script)], dict(os.environ), None, 30.0, nice=5, launcher="fork")
    assert res.status == "ok" and res.stdout.split() == [str(min(19, base + 5))]


@pytest.mark.slow
def test_a_forked_instrumented_agents_span_reaches_a_real_collector_under_its_rollout_id(
    tmp_path: Path,
) -> None:
    """The SDK is configured in the fork from the driver's environment (endpoint, resource attributes) and
    its batched span is flushed at exit: two forks in a row, each its own rollout."""
    store = tmp_path / "store"
    with running_collector(store) as c:
        for i in range(2):
            task = {"id": f"t{i}", "n": i}
            env = agent_env(
                dict(
                    os.environ,
                    OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="*",
                    OTEL_METRICS_EXPORTER="none",
                    OTEL_LOGS_EXPORTER="none",
                ),
                rollout_id=f"r{i}",
                task_id=f"t{i}",
                task_json=json.dumps(task),
                otlp=c.grpc_endpoint,
                gateway="",
            )
            res = run_agent(
                [INSTRUMENT, sys.executable, str(HERE / "traced_agent.py")],
                env,
                json.dumps(task),
                30.0,
                launcher="fork",
            )
            assert res.status == "ok", res.stderr
            assert res.stdout.startswith(f"t{i} []")
        c.flush()
    rows = (
        connect_readonly(parse_store(store))
        .execute("SELECT rollout_id, name FROM spans ORDER BY rollout_id")
        .fetchall()
    )
    assert rows == [("r0", "traced agent"), ("r1", "traced agent")]


@pytest.mark.slow
def test_forks_started_and_reaped_from_many_threads_keep_their_own_exit_codes(tmp_path: Path) -> None:
    """The driver runs each agent from its own thread: 24 forks at once, exit codes 0..5, none mixed up."""
    from concurrent.futures import ThreadPoolExecutor

    script = tmp_path / "code.py"
    script.write_text(
        "import sys, time; time.sleep(0.05 * (int(sys.argv[1]) % 3)); sys.exit(int(sys.argv[1]) % 6)"
    )

    def one(i: int) -> tuple[int, int | None]:
        return i % 6, run_agent(
            [sys.executable, str(script), str(i)], dict(os.environ), None, 30.0, launcher="fork"
        ).exit_code

    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(one, range(24)))
    assert all(want == code for want, code in got), got


@pytest.mark.slow
def test_tracerl_rollout_launcher_fork_runs_the_agents_and_refuses_an_unknown_launcher(
    tmp_path: Path,
) -> None:
    from tracerl_testing import BIN, tracerl

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "answer": str(i)}) + "\n" for i in range(3)))
    proc = tracerl(
        "rollout",
        "--tasks",
        str(tasks),
        "--store",
        str(tmp_path / "store"),
        "--collector",
        "",
        "--launcher",
        "fork",
        "--",
        str(BIN / "python"),
        FAKE,
        timeout=60,
    )
    assert "3 rollouts: 3 ok" in proc.stdout
    bad = tracerl(
        "rollout",
        "--tasks",
        str(tasks),
        "--store",
        str(tmp_path / "s2"),
        "--collector",
        "",
        "--launcher",
        "spawn",
        "--",
        str(BIN / "python"),
        FAKE,
        check=False,
    )
    assert bad.returncode == 2 and "--launcher" in bad.stderr
