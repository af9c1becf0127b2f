"""One agent process: start it in its own session, feed its task, enforce the timeout, kill its whole group.

Two ways to start one (``--launcher``): a fresh process (``subprocess.Popen``), or a fork of the warm
server (``rollout.launcher``) for a Python agent. Both go through the same watch (``_supervise``): lower
its priority, register it so an interrupted driver can kill it, wait up to the timeout, kill the group
on expiry. A failed or timed-out agent is an ``AgentResult`` with its status, never an exception.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rollout.launcher import ForkPlan, ForkRun, fork_plan

T = TypeVar("T")


@dataclass
class AgentResult:
    """What one agent process did."""

    status: str
    exit_code: int | None
    duration_s: float
    stdout: str
    stderr: str


def _kill_group(proc: subprocess.Popen, grace_s: float = 1.0) -> None:
    """SIGTERM the agent's whole process group (its exporters may flush), SIGKILL what is left after ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(OSError):  # a fork killed before its setsid has no group yet
            proc.kill()
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):  # children outlive the leader in its group
        os.killpg(proc.pid, signal.SIGKILL)


class Running:
    """The process groups alive right now, so an interrupted driver leaves no agent behind.

    ``kill_all`` also closes the set: an agent a worker thread started just before it (between
    ``Popen`` and ``add``, or after its last ``stopping`` check) is killed as it is added, instead
    of running on until ``--timeout-s`` while the driver waits for it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        self._closed = False

    def add(self, p: subprocess.Popen) -> None:
        with self._lock:
            if not self._closed:
                self._procs.add(p)
                return
        _kill_group(p, grace_s=0.2)

    def discard(self, p: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(p)

    def kill_all(self) -> None:
        with self._lock:
            self._closed = True
            procs = list(self._procs)
        for p in procs:
            _kill_group(p, grace_s=0.2)


def _lower_priority(pid: int, nice: int) -> None:
    if nice > 0:
        with contextlib.suppress(OSError):  # it may have exited already
            os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, 0) + nice)


def _supervise(
    proc: Any,
    wait: Callable[[float], T],
    drain: Callable[[], T],
    timeout_s: float,
    running: Running | None,
    nice: int,
) -> tuple[str, T]:
    """The watch both launchers share: ``wait(timeout_s)`` for the started ``proc`` (registered in
    ``running`` meanwhile); on expiry its group is killed and ``drain()`` collects what it left.
    Returns the status (ok, failed, timeout) and what ``wait`` or ``drain`` returned."""
    _lower_priority(proc.pid, nice)
    if running:
        running.add(proc)
    try:
        try:
            got = wait(timeout_s)
            return ("ok" if proc.returncode == 0 else "failed"), got
        except subprocess.TimeoutExpired:
            _kill_group(proc)  # (a fork too, set up or not: see _kill_group)
            return "timeout", drain()
    finally:
        if running:
            running.discard(proc)


def _run_forked(
    plan: ForkPlan,
    env: dict[str, str],
    stdin_text: str | None,
    timeout_s: float,
    running: Running | None,
    nice: int,
) -> AgentResult:
    """``run_agent`` for a command forked from the warm server (``rollout.launcher``)."""
    start = time.monotonic()
    run = ForkRun(plan, env, stdin_text)
    try:
        proc = run.start()
    except OSError as e:
        return AgentResult("failed", None, time.monotonic() - start, "", f"cannot fork {plan.script!r}: {e}")
    status, _ = _supervise(proc, proc.wait, proc.wait, timeout_s, running, nice)
    out, err = run.output()
    return AgentResult(status, proc.returncode, time.monotonic() - start, out, err)


def run_agent(
    argv: list[str],
    env: dict[str, str],
    stdin_text: str | None,
    timeout_s: float,
    running: Running | None = None,
    nice: int = 0,
    launcher: str = "exec",
) -> AgentResult:
    """Run one agent in its own session (process group), feeding ``stdin_text`` and enforcing the timeout;
    ``nice`` > 0 lowers its CPU priority (and its children's) by that much. With ``launcher`` fork, a
    command ``fork_plan`` accepts is forked from the warm server instead of started fresh."""
    plan = fork_plan(argv) if launcher == "fork" else None
    if plan is not None:
        return _run_forked(plan, env, stdin_text, timeout_s, running, nice)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            errors="replace",
            start_new_session=True,
        )
    except OSError as e:
        return AgentResult("failed", None, time.monotonic() - start, "", f"cannot start {argv[0]!r}: {e}")
    # the retry after a timeout sends no input: communicate() keeps what it already read
    status, (out, err) = _supervise(
        proc, lambda t: proc.communicate(stdin_text, timeout=t), proc.communicate, timeout_s, running, nice
    )
    return AgentResult(status, proc.returncode, time.monotonic() - start, out or "", err or "")
