"""Start a Python agent by forking a warm interpreter instead of a fresh one (``--launcher fork``).

A fresh ``opentelemetry-instrument python agent.py`` costs about 0.35 CPU-s before the agent's first
line on this machine: two interpreters start, and the second imports the OTel SDK, its configurator,
the distro and the OTLP exporter (gRPC, protobuf) and scans every installed package's entry points.
The demo starts 32 agents a round beside the trainer on 2 cores: ~11 CPU-s a round taken from
training. Here one server process (``multiprocessing``'s forkserver) imports those modules once; each
agent is a fork of it that does what ``opentelemetry-instrument`` then ``python SCRIPT`` would do:
its own session (so the driver kills its whole group), its own stdin/stdout/stderr, exactly the
environment the driver built, ``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT`` sets them, the
SDK configured from that environment (the auto-instrumentation's ``initialize``, as its
``sitecustomize`` calls it), the script run as ``__main__``, and on the way out the ``atexit``
handlers an interpreter exit runs (the SDK's flush of the spans it batched).

Only ``[opentelemetry-instrument] PYTHON SCRIPT.py [ARGS]`` with PYTHON this interpreter is forked
(``fork_plan``); anything else is started as a fresh process. The SDK's batch processor and the gRPC
exporter are made in the child, after the fork, so no thread or channel crosses it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRELOAD = (
    "opentelemetry.sdk.trace",
    "opentelemetry.sdk._configuration",
    "opentelemetry.instrumentation.auto_instrumentation",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "rollout.launcher",
)
"""What the server imports once: the modules every instrumented agent imports before its first line."""

INSTRUMENT = "opentelemetry-instrument"


@dataclass(frozen=True)
class ForkPlan:
    """How to run a command in a fork: the script, its arguments, and whether the SDK is configured first."""

    script: str
    args: tuple[str, ...]
    instrument: bool


def _same_python(exe: str) -> bool:
    """``exe`` is this interpreter (by path, through links), the one whose modules the server imported."""
    with contextlib.suppress(OSError):
        return os.path.samefile(exe, sys.executable)
    return False


def fork_plan(argv: list[str]) -> ForkPlan | None:
    """The fork plan of ``argv`` when it is ``[opentelemetry-instrument] PYTHON SCRIPT.py [ARGS]`` with
    PYTHON this interpreter and no interpreter or instrument flags; None: start it as a fresh process."""
    rest, instrument = list(argv), False
    if rest and Path(rest[0]).name == INSTRUMENT:
        rest, instrument = rest[1:], True
    if len(rest) < 2 or not _same_python(rest[0]) or not rest[1].endswith(".py") or rest[1].startswith("-"):
        return None
    return ForkPlan(rest[1], tuple(rest[2:]), instrument)


def _rebind_std(stdin: str, stdout: str, stderr: str) -> None:
    """fds 0/1/2 onto the given files, and ``sys.std*`` onto fds 0/1/2 (the server's own are elsewhere)."""
    for fd, path, flags in ((0, stdin, os.O_RDONLY), (1, stdout, os.O_WRONLY), (2, stderr, os.O_WRONLY)):
        f = os.open(path, flags)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115 (the process's own)
    sys.stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False, buffering=1)  # noqa: SIM115


def _exit_code(e: SystemExit) -> int:
    """What the interpreter would exit with for ``sys.exit(code)``."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def agent_main(plan: ForkPlan, env: dict[str, str], stdin: str, stdout: str, stderr: str) -> None:
    """The forked agent (runs in the child): see the module docstring. Exits with the script's code."""
    import atexit
    import runpy
    import traceback

    os.setsid()
    _rebind_std(stdin, stdout, stderr)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [plan.script, *plan.args]
    sys.path[0] = os.path.dirname(os.path.abspath(plan.script))
    code = 0
    try:
        if plan.instrument:
            from opentelemetry.instrumentation.auto_instrumentation import initialize

            initialize()
        runpy.run_path(plan.script, run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what an interpreter exit runs: the SDK's span flush among them
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    raise SystemExit(code)  # multiprocessing exits the fork with this code


_REAP = threading.Lock()
"""Held to start a fork and to read one's exit code: ``Process.start`` polls every earlier fork, and a
fork's exit code is read once from a pipe, so two threads reading it at once (the driver runs each
agent from its own thread) would leave one of them a made-up 255."""


class Forked:
    """A forked agent, shaped like the ``subprocess.Popen`` ``rollout.agent_process`` watches and kills (``pid``, ``wait``)."""

    def __init__(self, process: Any) -> None:
        self._p = process
        self.pid: int = process.pid
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        from multiprocessing.connection import wait

        if not wait([self._p.sentinel], timeout):  # readable once the fork exited; nothing read here
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
        with _REAP:
            self._p.join()
            self.returncode = self._p.exitcode
            self._p.close()
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        """SIGKILL the fork itself (its group is killed by the caller; this covers a fork killed before
        its ``setsid``, whose group does not exist yet)."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(self.pid, signal.SIGKILL)


_context: Any = None


def _server() -> Any:
    """The forkserver context, its preload set once per process (the server starts on the first fork)."""
    global _context
    if _context is None:
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        _context = ctx
    return _context


@dataclass
class ForkRun:
    """One forked agent's files and process; ``start`` then ``output``."""

    plan: ForkPlan
    env: dict[str, str]
    stdin_text: str | None
    tmp: tempfile.TemporaryDirectory | None = None
    proc: Forked | None = None

    def start(self) -> Forked:
        self.tmp = tempfile.TemporaryDirectory(prefix="tracerl-agent-")
        d = Path(self.tmp.name)
        (d / "stdin").write_text(self.stdin_text or "", encoding="utf-8")
        for name in ("stdout", "stderr"):
            (d / name).touch()
        p = _server().Process(
            target=agent_main,
            args=(self.plan, self.env, str(d / "stdin"), str(d / "stdout"), str(d / "stderr")),
            daemon=False,
        )
        try:
            with _REAP:
                p.start()
        except BaseException:
            self.tmp.cleanup()  # no agent, so no ``output`` call to remove its files
            raise
        self.proc = Forked(p)
        return self.proc

    def output(self) -> tuple[str, str]:
        """The agent's stdout and stderr; the files are removed."""
        assert self.tmp is not None
        d = Path(self.tmp.name)
        try:
            return tuple(  # type: ignore[return-value]
                (d / name).read_text(encoding="utf-8", errors="replace") for name in ("stdout", "stderr")
            )
        finally:
            self.tmp.cleanup()
