"""Shared test helpers (importable from any test: `tests/` is on pytest's pythonpath)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tracerl(*args: str, env: dict | None = None, timeout: float = 120, check: bool = True,
            input: str | None = None) -> subprocess.CompletedProcess:
    """Run the installed `tracerl` command like a user would."""
    proc = subprocess.run(
        [str(BIN / "tracerl"), *args], capture_output=True, text=True, timeout=timeout, input=input,
        env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"tracerl {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc
