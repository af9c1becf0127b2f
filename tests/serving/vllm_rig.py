"""Real vLLM for the tests: the CPU virtualenv, and a server started the way users start it.

The venv is built once per pin (``serving.vllm_venv``: ``make`` builds it too; about 2 minutes
cold) and the server is ``tracerl serve --engine vllm`` in its own process group, its output in a
log file (vLLM logs a lot; a pipe nobody reads would block it). Teardown kills the whole group,
so a failing test leaves no engine core or worker behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from tracerl_testing import BIN, free_port

from serving.vllm_venv import DEFAULT_DIR, build

ROOT = Path(__file__).resolve().parents[2]


def vllm_python() -> Path:
    """The repository's .venv-vllm interpreter, built on first use (cached by its pins)."""
    return build(ROOT / DEFAULT_DIR, log=lambda msg: print(msg, flush=True)).absolute()


@dataclass
class VLLM:
    url: str
    proc: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            return self.alive() and httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@contextlib.contextmanager
def running_vllm(model: Path, log: Path, *args: str, timeout_s: float = 600) -> Iterator[VLLM]:
    """``tracerl serve --engine vllm --model MODEL ARGS`` on a free port, healthy, stopped on exit."""
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen([str(BIN / "tracerl"), "serve", "--engine", "vllm", "--model", str(model),
                                 "--listen", f"127.0.0.1:{port}", "--vllm-python", str(vllm_python()), *args],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    server = VLLM(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + timeout_s
        while not server.healthy():
            assert server.alive(), f"vLLM exited {proc.returncode}:\n{server.tail()}"
            assert time.monotonic() < deadline, f"vLLM not healthy in {timeout_s}s:\n{server.tail()}"
            time.sleep(0.5)
        yield server
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
