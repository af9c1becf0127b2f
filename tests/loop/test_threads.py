"""The trainer's threads chosen by measurement (loop/threads.py) and their use by the loop's budget."""

from __future__ import annotations

from loop.rounds import Beside, LoopPlan, thread_budget
from loop.threads import ThreadChooser, candidates, pick_threads


def test_candidates_are_one_the_powers_of_two_and_the_limit() -> None:
    assert candidates(1) == [1]
    assert candidates(2) == [1, 2]
    assert candidates(6) == [1, 2, 4, 6]
    assert candidates(0) == [1]


def test_untried_counts_come_first_largest_first() -> None:
    assert pick_threads({}, 2, 0, 8) == 2
    assert pick_threads({2: 5.0}, 2, 1, 8) == 1


def test_the_fastest_count_wins_and_the_runner_up_is_retried_now_and_then() -> None:
    means = {1: 1.0, 2: 1.5}  # a quiet machine where 1 thread happened to win: retried every 6 asks
    picks = [pick_threads(means, 2, asked, 4) for asked in range(12)]
    assert picks == [1, 1, 1, 1, 1, 2] * 2


def test_a_count_that_lost_badly_is_retried_seldom() -> None:
    means = {1: 1.0, 2: 5.0}  # a busy machine: 2 threads wait on each other, 5x slower
    picks = [pick_threads(means, 2, asked, 4) for asked in range(40)]
    assert picks.count(2) == 2  # every 20th ask: the retries cost 8 of 48 micro-batch-seconds, not 40


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run_micro_batches(
    chooser: ThreadChooser, clock: Clock, limit: int, seconds: dict[int, float], n: int
) -> list[int]:
    """Ask before each of ``n`` micro-batches; each takes ``seconds[threads]``."""
    chosen = []
    for _ in range(n):
        k = chooser.choose(limit)
        chosen.append(k)
        clock.t += seconds[k]
    return chosen


def test_on_a_busy_machine_the_chooser_settles_on_one_thread() -> None:
    clock = Clock()
    chooser = ThreadChooser(reprobe_every=8, clock=clock)
    chooser.begin()
    chosen = run_micro_batches(chooser, clock, 2, {1: 3.3, 2: 16.7}, 20)  # 192 vs 38 tokens/s, measured
    assert chosen[:2] == [2, 1]
    assert chosen[2:].count(1) == 18


def test_on_a_quiet_machine_the_chooser_keeps_two_threads() -> None:
    clock = Clock()
    chooser = ThreadChooser(reprobe_every=8, clock=clock)
    chooser.begin()
    chosen = run_micro_batches(chooser, clock, 2, {1: 3.9, 2: 2.8}, 10)
    assert chosen[2:].count(2) >= 7


def test_time_between_trainer_calls_is_not_taken_for_a_micro_batch() -> None:
    clock = Clock()
    chooser = ThreadChooser(clock=clock)
    chooser.begin()
    run_micro_batches(chooser, clock, 2, {1: 1.0, 2: 1.0}, 2)
    clock.t += 100.0  # the round ended; rollouts ran; the next round starts
    chooser.begin()
    chooser.choose(2)
    assert max(chooser.means[2].values()) < 2.0


def test_counts_measured_beside_the_agents_are_kept_apart_from_counts_measured_alone() -> None:
    clock = Clock()
    chooser = ThreadChooser(clock=clock)
    chooser.begin()
    run_micro_batches(chooser, clock, 1, {1: 9.0}, 3)  # beside a batch: slow, and only 1 allowed
    run_micro_batches(chooser, clock, 2, {1: 2.0, 2: 3.0}, 3)
    assert chooser.means[1] == {1: 9.0}
    assert chooser.means[2] == {2: 3.0, 1: 2.0}


PLAN = LoopPlan(rounds=2, lead=1, alone_threads=2, shared_threads=1, measure_threads=True)


def test_the_budget_with_a_chooser_caps_it_by_what_runs_beside() -> None:
    running = [True]
    clock = Clock()
    chooser = ThreadChooser(clock=clock)
    t = thread_budget(PLAN, Beside.NEXT_BATCH, lambda: running[0], chooser)
    assert t.publish and t.threads_now is not None
    assert t.threads_now() == 1  # the batch's agents run: the limit is the shared threads
    running[0] = False
    assert t.threads_now() == 2  # alone now: the largest count is tried first
    held = thread_budget(PLAN, Beside.HELDOUT, lambda: True, chooser)
    assert not held.publish and held.threads_now is not None and held.threads_now() == 1
