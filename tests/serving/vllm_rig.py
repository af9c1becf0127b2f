"""Real vLLM for the tests: the CPU virtualenv, and a server started the way users start it.

The venv is built once per pin (``serving.vllm.cpu_venv``: ``make`` builds it too; about 2 minutes
cold) and the server is ``tracerl serve --engine vllm`` in its own process group, its output in a
log file (vLLM logs a lot; a pipe nobody reads would block it). Teardown kills the whole group,
so a failing test leaves no engine core or worker behind.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from tracerl_testing import BIN, free_port

from serving.vllm.cpu_venv import DEFAULT_DIR, build
from tracerl.supervisor import Child

ROOT = Path(__file__).resolve().parents[2]


def vllm_python() -> Path:
    """The repository's .venv-vllm interpreter, built on first use (cached by its pins)."""
    return build(ROOT / DEFAULT_DIR, log=lambda msg: print(msg, flush=True)).absolute()


@dataclass
class VLLM:
    url: str
    child: Child

    @property
    def log(self) -> Path:
        return self.child.log_path

    def alive(self) -> bool:
        return self.child.proc.poll() is None

    def healthy(self) -> bool:
        try:
            return self.alive() and httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def tail(self, n: int = 40) -> str:
        return self.child.log_tail(n)


@contextlib.contextmanager
def running_vllm(model: Path, log: Path, *args: str, timeout_s: float = 600) -> Iterator[VLLM]:
    """``tracerl serve --engine vllm --model MODEL ARGS`` on a free port, healthy, stopped on exit (its
    whole process group, as the demo stops its servers)."""
    port = free_port()
    child = Child("serve", [str(BIN / "tracerl"), "serve", "--engine", "vllm", "--model", str(model), "--listen",
                            f"127.0.0.1:{port}", "--vllm-python", str(vllm_python()), *args], log)
    server = VLLM(f"http://127.0.0.1:{port}", child)
    try:
        deadline = time.monotonic() + timeout_s
        while not server.healthy():
            assert server.alive(), f"vLLM exited {child.proc.returncode}:\n{server.tail()}"
            assert time.monotonic() < deadline, f"vLLM not healthy in {timeout_s}s:\n{server.tail()}"
            time.sleep(0.5)
        yield server
    finally:
        child.stop(grace_s=30)
