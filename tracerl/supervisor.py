"""The demo's process supervisor: free ports, child processes with their logs, readiness checks.

A started child is stopped (SIGTERM, then SIGKILL after a grace period, its whole process group) when
its owner stops, however the owner ends; a child that dies early is reported with the tail of its
log. Used by ``tracerl demo`` (through ``tracerl.stack``), the real-vLLM test rig and ``bench/round.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from options import UsageError
from serving.processes import die_with_parent

BIN = Path(sys.executable).parent


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_port(port: int, flag: str, taken: set[int]) -> int:
    """``port`` if free, any free port for 0; a taken port is a usage error naming ``flag``."""
    if port == 0:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                p = s.getsockname()[1]
            if p not in taken:
                taken.add(p)
                return p
    if not 0 < port < 65536:
        raise UsageError(f"{flag} {port} is not a port number; pass 1..65535, or 0 for any free port")
    if port in taken or not port_free(port):
        raise UsageError(
            f"port {port} on 127.0.0.1 is in use; pass {flag} with another port, or {flag} 0 "
            "for any free port"
        )
    taken.add(port)
    return port


class ChildError(RuntimeError):
    """A child exited early or never became ready; the message names it and ends with its log's tail."""


class Child:
    """One long-running ``tracerl`` server process, its log file, and a health check."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.name, self.argv, self.log_path = name, argv, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 (closed in stop())
        # own session: a Ctrl-C reaches only the demo, which then stops the children in order; and the
        # kernel stops a child whose owner died without stopping it (kill -9; PR_SET_PDEATHSIG is tied to
        # the thread that forks: children are started from the owner's main thread)
        parent = os.getpid()
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=lambda: die_with_parent(signal.SIGTERM, parent),
        )

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line for line in lines[-n:])

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise ChildError(
                f"`tracerl {self.name}` exited with code {self.proc.returncode}; "
                f"its log ({self.log_path}) ends with:\n{self.log_tail()}"
            )

    def wait_healthy(self, ready: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(0.1)
        raise ChildError(
            f"`tracerl {self.name}` did not become ready within {timeout_s:.0f}s; see {self.log_path}:"
            f"\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM (servers flush: the gateway its spans, the collector its WAL), SIGKILL after ``grace_s``."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):  # anything left in its group
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


class Children:
    """Started children, stopped in reverse order on exit, on failure, on Ctrl-C and on SIGTERM."""

    def __init__(self) -> None:
        self.items: list[Child] = []

    def start(self, child: Child) -> Child:
        self.items.append(child)
        return child

    def check_alive(self) -> None:
        for c in self.items:
            c.check_alive()

    def stop_all(self, grace_s: float = 15.0) -> None:
        while self.items:
            self.items.pop().stop(grace_s)


def http_ok(url: str) -> bool:
    import httpx

    return httpx.get(url, timeout=1.0).status_code == 200


def tcp_open(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1.0):
        return True
