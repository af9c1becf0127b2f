"""``tracerl.demo.passive_omp``: training's OpenMP threads sleep at barriers on a shared machine, set only
where it can still apply (before torch loads its OpenMP runtime) and never over the user's own setting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # each test starts a python process (make test-fast runs none)

CHECK = "import os, sys; {pre}from tracerl.demo import passive_omp; print(passive_omp(), os.environ.get('OMP_WAIT_POLICY'))"


def _run(pre: str = "", **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return subprocess.run(
        [sys.executable, "-c", CHECK.format(pre=pre)],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()


def test_it_is_set_before_torch_loads_and_the_users_own_value_wins() -> None:
    assert _run() == "True PASSIVE"
    assert _run(OMP_WAIT_POLICY="ACTIVE") == "False ACTIVE"


def test_after_torch_loaded_it_is_not_pretended() -> None:
    assert _run(pre="import torch; ") == "False None"
