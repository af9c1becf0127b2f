"""Fixtures of the example-agent tests; the rig itself is ``tests/example_rig.py``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from example_rig import Script, Stack, running_stack


@pytest.fixture
def stack_factory(tmp_path: Path) -> Iterator[Callable[[Script], Stack]]:
    """``stack = stack_factory(script)``: collector, gateway and scripted engine, stopped at teardown."""
    with ExitStack() as stacks:
        yield lambda script: stacks.enter_context(running_stack(tmp_path / "store", script))
