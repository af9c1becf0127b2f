"""``BatchesAhead``: batch b starts only once b - lead batches were released, in order, one at a time."""

from __future__ import annotations

import threading

import pytest

from loop.ahead import BatchesAhead


class Recorder:
    """A batch function that records starts and blocks each batch until the test lets it finish."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.started: list[int] = []
        self.cond = threading.Condition()
        self.allowed: set[int] = set()
        self.fail_at = fail_at

    def __call__(self, b: int) -> str:
        with self.cond:
            self.started.append(b)
            self.cond.notify_all()
            self.cond.wait_for(lambda: b in self.allowed, timeout=10)
        if b == self.fail_at:
            raise ValueError(f"batch {b} failed")
        return f"batch {b}"

    def finish(self, b: int) -> None:
        with self.cond:
            self.allowed.add(b)
            self.cond.notify_all()

    def wait_started(self, n: int) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: len(self.started) >= n, timeout=10)

    def stays(self, n: int) -> bool:
        """True when no batch beyond the first n starts within a short wait (the positive case is checked
        by wait_started: this one only has to catch a batch that starts too early)."""
        with self.cond:
            return not self.cond.wait_for(lambda: len(self.started) > n, timeout=0.3)


def test_lead_0_runs_the_next_batch_only_after_the_trainer_released_this_one():
    rec = Recorder()
    ahead = BatchesAhead(rec, lead=0, wanted=lambda b: b < 3)
    rec.finish(0)
    assert ahead.get(0) == "batch 0"
    assert rec.stays(1)  # the trainer still trains on batch 0: no agent runs
    ahead.release()
    assert rec.wait_started(2)
    rec.finish(1)
    assert ahead.get(1) == "batch 1"
    ahead.close()


def test_lead_1_runs_one_batch_while_the_trainer_trains_and_no_more():
    rec = Recorder()
    ahead = BatchesAhead(rec, lead=1, wanted=lambda b: b < 5)
    rec.finish(0)
    assert ahead.get(0) == "batch 0"
    assert rec.wait_started(2)  # batch 1 runs while batch 0 is trained on
    rec.finish(1)
    assert rec.stays(2)  # batch 2 would be 2 versions ahead: it waits
    ahead.release()
    assert rec.wait_started(3) and rec.started == [0, 1, 2]
    ahead.close(timeout_s=0)
    rec.finish(2)


def test_a_batch_not_wanted_yet_waits_until_the_consumer_asks_for_it():
    rec = Recorder()
    wanted = [1]
    ahead = BatchesAhead(rec, lead=2, wanted=lambda b: b < wanted[0])
    rec.finish(0)
    assert ahead.get(0) == "batch 0"
    assert rec.stays(1)
    wanted[0] = 2
    ahead.changed()
    assert rec.wait_started(2)
    rec.finish(1)
    assert ahead.get(1) == "batch 1"
    ahead.close()


def test_a_failed_batch_is_raised_by_get_and_close_unblocks_a_waiting_get():
    rec = Recorder(fail_at=0)
    ahead = BatchesAhead(rec, lead=1, wanted=lambda b: True)
    rec.finish(0)
    with pytest.raises(ValueError, match="batch 0 failed"):
        ahead.get(0)
    ahead.close()
    with pytest.raises(RuntimeError, match="stopped"):
        ahead.get(1)
    assert len(ahead.spans) == 1


def test_running_says_whether_a_batch_is_under_way():
    rec = Recorder()
    ahead = BatchesAhead(rec, lead=0, wanted=lambda b: b < 1)
    assert rec.wait_started(1) and ahead.running
    rec.finish(0)
    ahead.get(0)
    assert not ahead.running
    ahead.close()
