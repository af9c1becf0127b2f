"""Shared test helpers (importable from any test: `tests/` is on pytest's pythonpath)."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BIN = Path(sys.executable).parent


def alive(pid: int) -> bool:
    """The process is running (a zombie waiting for its reaper counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


@contextmanager
def building(lock: Path) -> Iterator[None]:
    """Held while something the tests share is built or checked (an example virtualenv, the real model), so a
    second process (the suite's background build, ``tests/prebuild.py``, or another pytest run) waits."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def traces_request(n: int, scope: str = "tests") -> bytes:
    """An OTLP ExportTraceServiceRequest of ``n`` real SDK spans (``step-0`` …), serialized: the body of
    ``POST /v1/traces`` with ``content-type: application/x-protobuf``."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    mem = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(mem))
    for i in range(n):
        with tp.get_tracer(scope).start_as_current_span(f"step-{i}"):
            pass
    return encode_spans(mem.get_finished_spans()).SerializeToString()


def tracerl(*args: str, env: dict | None = None, timeout: float = 120, check: bool = True,
            input: str | None = None, cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess:
    """Run the installed `tracerl` command like a user would (in ``cwd``, default this process's)."""
    proc = subprocess.run(
        [str(BIN / "tracerl"), *args], capture_output=True, text=True, timeout=timeout, input=input,
        env={**os.environ, **(env or {})}, cwd=cwd,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"tracerl {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def start_tracerl(*args: str, health: str, timeout: float = 60) -> subprocess.Popen:
    """Start a long-running `tracerl` command (serve, gateway, collect) and wait for its health URL."""
    import time

    import httpx

    proc = subprocess.Popen([str(BIN / "tracerl"), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"tracerl {args[0]} exited {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(health, timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"tracerl {args[0]} did not become healthy within {timeout}s")


def stop_tracerl(proc: subprocess.Popen) -> None:
    """SIGTERM, as a user's Ctrl-C or a supervisor would; the command must exit cleanly (0)."""
    import signal

    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, proc.stderr.read()


def _npm_unavailable(why: str) -> None:
    import pytest

    if os.environ.get("CI"):
        pytest.fail(f"{why}; CI must run this test (install Node 20 + npm, e.g. apt-get install nodejs npm)")
    pytest.skip(why)


def npm_ci(project: Path) -> Path:
    """``npm ci`` in ``project`` (its package.json + package-lock.json, pinned), once per lock hash.

    The stamp lives in the ``node_modules`` that ``npm ci`` replaces, so a failed install leaves none
    and the next run retries. Skips when node/npm or the registry cannot be reached, fails under ``CI``.
    """
    import hashlib
    import shutil

    import pytest

    if shutil.which("node") is None or shutil.which("npm") is None:
        _npm_unavailable("node/npm are not installed")
    files = [project / "package.json", project / "package-lock.json"]
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]
    stamp = project / "node_modules" / f".installed-{digest}"
    if not stamp.exists():
        npm = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=project,
                             capture_output=True, text=True, timeout=600)
        if npm.returncode != 0:
            ping = subprocess.run(["npm", "ping"], cwd=project, capture_output=True, timeout=120)
            if ping.returncode != 0:
                _npm_unavailable("the npm registry cannot be reached")
            pytest.fail(f"npm ci in {project} failed:\n{npm.stderr[-3000:]}")
        stamp.touch()
    return project


def wire_message(m: dict) -> dict:
    """A chat message in canonical form: role, content (one text part as its text; "" or absent as null),
    tool calls as ``{id, type, function: {name, arguments}}``, ``tool_call_id``."""
    content = m.get("content")
    if isinstance(content, list):
        parts = [{"type": "text", "text": p["text"]} if p.get("type", "text") == "text" and "text" in p else p
                 for p in content]
        content = parts[0]["text"] if len(parts) == 1 and parts[0].get("type") == "text" else parts
    out = {"role": m["role"], "content": content if content != "" else None}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                             for c in m["tool_calls"]]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out
