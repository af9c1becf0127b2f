"""CPU-seconds a demo run spent, per part of the loop, over the bench's measured window.

Why: on 2 cores, asynchronous rounds can shorten a window only down to the CPU work done in it over
the cores (``floor = cpu / cores``). Idle time can be overlapped away; work cannot. So the bench
says, per mode, how many CPU-seconds each part took in the window (the trainer with the loop in
the bench's own process, the agents, vLLM, the gateway/collector/server wrappers) and per sample
trained: the ratio asynchronous rounds can reach is bounded by the on-policy window over that floor.

The sampler reads ``psutil`` every ``every_s`` seconds: the bench process's own CPU time (the
trainer trains in it), its reaped children's (the agents: the rollout driver waits for each one), and
every live descendant's with its own reaped children (vLLM's API server, engine core and worker, the
gateway, the collector, the agents running now, the driver's fork server and the agents it forked). A process that exits between two samples moves from "live" to "reaped" with all
its time, so the totals stay monotonic. The arithmetic (``window_cpu``) is a pure function.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

GROUPS = ("bench process (trainer, driver, conversion)", "agents", "vllm", "gateway, collector, serve")


def group_of(cmdline: Sequence[str], name: str) -> str:
    """Which part of the loop a live descendant process is, from its command line and name."""
    text = " ".join(cmdline)
    if "vllm" in text.lower() or name.startswith("VLLM"):
        return GROUPS[2]
    if (
        "opentelemetry-instrument" in text
        or "forkserver" in text
        or any(a.endswith("agent.py") for a in cmdline)
    ):
        # an agent process, before or after opentelemetry-instrument exec'd python; or the driver's fork
        # server (--launcher fork) and the agents forked from it, which keep its command line
        return GROUPS[1]
    return GROUPS[3]


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU-seconds per group at wall-clock time ``at``."""

    at: float
    seconds: Mapping[str, float]


def _at(samples: Sequence[CpuSample], t: float, group: str) -> float:
    """A group's cumulative CPU-seconds at ``t``, linear between the samples around it (clamped at the ends)."""
    if t <= samples[0].at:
        return samples[0].seconds.get(group, 0.0)
    for a, b in itertools.pairwise(samples):
        if a.at <= t <= b.at:
            va, vb = a.seconds.get(group, 0.0), b.seconds.get(group, 0.0)
            return va if b.at == a.at else va + (vb - va) * (t - a.at) / (b.at - a.at)
    return samples[-1].seconds.get(group, 0.0)


def window_cpu(samples: Sequence[CpuSample], lo: float, hi: float) -> dict[str, float]:
    """CPU-seconds per group spent in [lo, hi] (wall clock), and their ``total``; empty without samples."""
    if not samples or hi <= lo:
        return {}
    seen = {g for s in samples for g in s.seconds}
    groups = [g for g in GROUPS if g in seen] + sorted(seen - set(GROUPS))
    out = {g: max(0.0, _at(samples, hi, g) - _at(samples, lo, g)) for g in groups}
    out["total"] = sum(out.values())
    return out


def cpu_bound(cpu: Mapping[str, float], window_s: float, samples: int, cores: int) -> dict[str, float]:
    """What the CPU figures say of a window: the share of the cores used, the CPU-seconds per sample
    trained, and the floor ``cpu / cores`` below which no schedule can bring the window."""
    total = cpu.get("total", 0.0)
    return {
        "cpu_s": round(total, 1),
        "cores_used": round(total / window_s, 2) if window_s > 0 else 0.0,
        "cpu_s_per_sample": round(total / samples, 3) if samples else 0.0,
        "floor_s": round(total / cores, 1) if cores else 0.0,
    }


@dataclass
class CpuSampler:
    """Samples the bench process tree's cumulative CPU per group every ``every_s`` seconds in a daemon
    thread (``with CpuSampler() as cpu: ...``; then ``cpu.samples``)."""

    every_s: float = 2.0
    samples: list[CpuSample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> CpuSample:
        import time

        import psutil

        me = psutil.Process()
        t = me.cpu_times()
        seconds = dict.fromkeys(GROUPS, 0.0)
        seconds[GROUPS[0]] = t.user + t.system
        seconds[GROUPS[1]] = t.children_user + t.children_system  # reaped: the driver's agents
        for p in me.children(recursive=True):
            try:
                with p.oneshot():
                    c = p.cpu_times()
                    # with its reaped children: the fork server's agents are its children, not ours
                    seconds[group_of(p.cmdline(), p.name())] += (
                        c.user + c.system + c.children_user + c.children_system
                    )
            except psutil.Error:  # exited between the listing and the read: counted once reaped
                continue
        return CpuSample(time.time(), seconds)

    def _run(self) -> None:
        while True:
            self.samples.append(self.sample())
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> CpuSampler:
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
