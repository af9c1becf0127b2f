"""The CPU accounting of bench/async_round.py (bench/_cpu.py): the window arithmetic, the bound it
gives, and the sampler against real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench._cpu import GROUPS, CpuSample, cpu_bound, group_of, window_cpu

BENCH, AGENTS, VLLM, OTHER = GROUPS
ROOT = Path(__file__).resolve().parents[2]


def test_window_cpu_interpolates_between_samples_and_clamps_at_the_ends() -> None:
    samples = [
        CpuSample(0.0, {BENCH: 0.0, VLLM: 0.0}),
        CpuSample(10.0, {BENCH: 10.0, VLLM: 5.0}),
        CpuSample(20.0, {BENCH: 30.0, VLLM: 5.0}),
    ]
    cpu = window_cpu(samples, 5.0, 15.0)
    assert cpu[BENCH] == pytest.approx(20.0 - 5.0)  # 5 at t=5, 20 at t=15
    assert cpu[VLLM] == pytest.approx(5.0 - 2.5)
    assert cpu["total"] == pytest.approx(17.5)
    assert list(cpu) == [BENCH, VLLM, "total"]  # the groups in GROUPS' order
    assert window_cpu(samples, -5.0, 100.0)[BENCH] == pytest.approx(30.0)  # clamped to what was sampled
    assert window_cpu([], 0.0, 1.0) == {} and window_cpu(samples, 3.0, 3.0) == {}


def test_cpu_bound_gives_the_floor_no_schedule_can_pass() -> None:
    b = cpu_bound({"total": 300.0}, window_s=200.0, samples=240, cores=2)
    assert b == {"cpu_s": 300.0, "cores_used": 1.5, "cpu_s_per_sample": 1.25, "floor_s": 150.0}
    assert cpu_bound({}, 0.0, 0, 2)["cores_used"] == 0.0


def test_group_of_tells_the_loops_processes_apart() -> None:
    assert group_of(["VLLM::Worker"], "VLLM::Worker") == VLLM
    assert group_of(["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"], "python") == VLLM
    assert group_of(["/v/bin/python", "/repo/examples/demo/sql_agent.py"], "python") == AGENTS
    fork_server = ["/v/bin/python", "-c", "from multiprocessing.forkserver import main; main(3, 4, [])"]
    assert group_of(fork_server, "python") == AGENTS  # --launcher fork: the server and the agents it forks
    assert (
        group_of(["/v/bin/python", "/v/bin/opentelemetry-instrument", "python", "x.py"], "python") == AGENTS
    )
    assert (
        group_of(["/v/bin/python", "/v/bin/tracerl", "gateway", "--listen", "127.0.0.1:1"], "tracerl")
        == OTHER
    )


# Run in a fresh interpreter: the sampler counts every child of its process, and the pytest process has
# other children (servers of earlier tests' fixtures, and finished ones that ``subprocess`` reaps when the
# next ``Popen`` starts, whose CPU would then move into the reaped column beside this test's child).
SAMPLER_RUN = """
import json, subprocess, sys, time
from bench._cpu import GROUPS, CpuSampler
BENCH, AGENTS, VLLM, OTHER = GROUPS
sampler = CpuSampler(every_s=0.1)
before = sampler.sample().seconds
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])  # burns 0.6 CPU-s, then sleeps
try:
    deadline = time.monotonic() + 10
    live = 0.0
    while time.monotonic() < deadline and live < 0.5:
        live = sampler.sample().seconds[OTHER] - before[OTHER]
        time.sleep(0.1)
finally:
    child.kill()
    child.wait()
after = sampler.sample().seconds
print(json.dumps({"live": live, "other_after": after[OTHER] - before[OTHER], "reaped": after[AGENTS] - before[AGENTS]}))
"""


@pytest.mark.slow
def test_the_sampler_counts_a_live_child_then_the_same_child_once_reaped() -> None:
    """A real child burning CPU: counted while alive (not one of the loop's parts: OTHER), and after
    it is reaped its time is in the reaped-children column (AGENTS, where the driver's agents land),
    never twice."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\ntime.sleep(5)"
    out = subprocess.run(
        [sys.executable, "-c", SAMPLER_RUN, burn], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["live"] >= 0.5
    assert got["other_after"] < 0.1 and got["reaped"] >= 0.5  # no longer live
    assert got["reaped"] < got["live"] + 0.5  # moved, not added
