"""Fixtures shared by every package's tests; plain helpers live in tracerl_testing.py."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"
