"""The split of a demo run's wall time that bench/async_round.py prints (bench/_phases.py)."""

from __future__ import annotations

import pytest

from bench._phases import Agent, both, covered, mean_in_flight, merged, phases


def test_merged_joins_overlaps_and_clips_to_the_window() -> None:
    assert merged([(5, 7), (0, 2), (1, 3), (9, 20)], 1, 10) == [(1, 3), (5, 7), (9, 10)]
    assert covered([(5, 7), (0, 2), (1, 3), (9, 20)], 1, 10) == 5


def test_both_counts_only_time_covered_by_each_side() -> None:
    engine = [(0, 4), (6, 10)]
    trainer = [(3, 7)]
    assert both(engine, trainer, 0, 10) == 2  # 3..4 and 6..7
    assert both(engine, [], 0, 10) == 0


def test_mean_in_flight_is_time_weighted_over_busy_time() -> None:
    # two calls together for 2 s, one alone for 2 s: 6 call-seconds over 4 busy seconds
    assert mean_in_flight([(0, 4), (0, 2)], 0, 10) == pytest.approx(1.5)


def test_on_policy_round_shows_the_gap_between_rollouts_and_training() -> None:
    """Batch 0..10 (agents start at 0, first call at 1, last call ends at 8, batch stored at 10),
    round 10..16, batch 16..26: the engine idles while the round trains and at each batch's edges."""
    agents = [Agent(0, 9, [(1, 5), (5.5, 8)]), Agent(16, 25, [(17, 24)])]
    p = phases(
        (0, 26), [(0, 10), (16, 26)], [(10, 16)], agents, [], [{"train": 4.0, "publish": 1.0}], 0.5, 20
    )
    assert p.window == 26
    assert p.engine_busy == pytest.approx(6.5 + 7)
    assert p.engine_idle == pytest.approx(26 - 13.5)
    assert p.trainer_busy == 6
    assert p.trainer_parts == {"train": 4.0, "publish": 1.0}
    # neither a call in flight nor a round training: 0..1, 5..5.5, 8..10, 16..17, 24..26
    assert p.both_idle == pytest.approx(1 + 0.5 + 2 + 1 + 2)
    assert p.batch_head == pytest.approx(1 + 1)
    assert p.batch_tail == pytest.approx(2 + 2)
    assert p.agent_start == pytest.approx(1)
    assert p.agent_exit == pytest.approx(1)


def test_held_out_calls_are_engine_work_but_not_training_batch_work() -> None:
    agents = [Agent(0, 5, [(1, 4)])]
    p = phases((0, 10), [(0, 5)], [(5, 9)], agents, [(3, 7)], [], 0.0, 0.0)
    assert p.engine_busy == 3
    assert p.engine_heldout_only == 3  # 4..7
    assert p.engine_idle == 10 - 6
    labels = [label for label, _ in p.rows()]
    assert labels[0] == "window" and "both idle" in labels
