"""A store made by a real round, shared by the ui tests (``tracerl demo`` itself, about 30 s).

Spans, transitions with exact token ids and logprobs, a rounds manifest and a checkpoint: the tiny
model behind `tracerl serve`, the gateway, the collector and the unmodified demo agent; one round
trained and published, then policy@1 evaluated, so the store holds two policy versions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tracerl_testing import tracerl


@pytest.fixture(scope="session")
def real_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real round's store (``tracerl demo``: 2 letters x 2 samples, 1 round, then policy@1 evaluated)."""
    work = tmp_path_factory.mktemp("ui-demo")
    proc = tracerl("demo", "--tiny", "--rounds", "1", "--rollouts-per-round", "4", "--letters", "ae", "--workdir", str(work),
                   timeout=240)
    (work / "demo.out").write_text(proc.stdout)  # for the test of the demo's last lines
    return work / "store"
