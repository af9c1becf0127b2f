"""Who is judged with whom: task groups, chunks, the wait for siblings, singletons, earlier failures."""

from __future__ import annotations

from judge.groups import chunks, plan

from .helpers import sql_rollout

NOW = 10**18 + 60 * 10**9  # a minute after the helpers' rollouts ended


def test_chunks_are_near_equal_and_keep_order() -> None:
    items = [sql_rollout(i) for i in range(17)]
    parts = chunks(items, 16)
    assert [len(p) for p in parts] == [9, 8] and [r for p in parts for r in p] == items
    assert [len(p) for p in chunks(items[:8], 8)] == [8]


def test_one_call_per_task_and_singletons_scored_on_their_own() -> None:
    rollouts = [sql_rollout(i, "a") for i in range(8)] + [sql_rollout(0, "b")]
    p = plan(rollouts, mode="group", rubric="r", now_ns=NOW, group_wait_s=30)
    assert [len(r.rollout_ids) for r in p.requests] == [8, 1]
    assert "relative to the others" in p.requests[0].messages[0]["content"]
    assert "against the rubric" in p.requests[1].messages[0]["content"]


def test_a_task_whose_newest_rollout_is_recent_waits_and_failed_ones_are_skipped() -> None:
    fresh = [sql_rollout(i, "new", ended_ns=NOW - 10**9) for i in range(3)]
    old = [sql_rollout(i, "old") for i in range(4)]
    p = plan(
        fresh + old,
        mode="group",
        rubric="r",
        now_ns=NOW,
        group_wait_s=30,
        failed=frozenset({old[0].rollout_id}),
    )
    assert (p.waiting, p.skipped_failed) == (3, 1)
    assert [sorted(r.rollout_ids) for r in p.requests] == [sorted(r.rollout_id for r in old[1:])]
    point = plan(fresh, mode="pointwise", rubric="r", now_ns=NOW, group_wait_s=30)
    assert (point.waiting, len(point.requests)) == (0, 3)  # pointwise never waits for siblings
