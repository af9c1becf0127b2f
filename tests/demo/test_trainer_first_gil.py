"""``tracerl.demo.trainer_first_gil``: the demo's process hands the GIL over quickly while it runs (the trainer
shares it with the rollouts' driver), and gives the caller's setting back however the demo ends."""

from __future__ import annotations

import sys

import pytest

from tracerl.demo import TRAINER_GIL_SWITCH_S, trainer_first_gil


def test_the_switch_interval_is_short_inside_and_restored_after() -> None:
    before = sys.getswitchinterval()
    with trainer_first_gil():
        assert sys.getswitchinterval() == pytest.approx(TRAINER_GIL_SWITCH_S)
        assert before > TRAINER_GIL_SWITCH_S
    assert sys.getswitchinterval() == before


def test_it_is_restored_when_the_demo_fails() -> None:
    before = sys.getswitchinterval()
    with pytest.raises(RuntimeError), trainer_first_gil():
        raise RuntimeError("a stage failed")
    assert sys.getswitchinterval() == before
