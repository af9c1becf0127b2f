"""``loop.rounds``: the round schedule, driven through plain-function stages (no process, no model).

The fakes keep a rounds manifest the way the trainer does (a published round k writes row k), so the
loop's checks run against what it would read from a real store.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from loop.rounds import (
    Batch,
    Beside,
    LoopPlan,
    NoSignal,
    RoundDone,
    Stages,
    Training,
    after_training,
    beside,
    check_converted,
    check_published,
    held_by_evaluation,
    run_rounds,
    thread_budget,
)
from rollout.records import RolloutRecord

PLAN = LoopPlan(rounds=2, alone_threads=8, shared_threads=1)


# ------------------------------------------------------------------------------------ pure rules
def test_a_round_trained_alone_takes_the_machine_and_publishes():
    assert thread_budget(PLAN, Beside.NOTHING, lambda: True) == Training(threads=8, publish=True)


def test_a_round_beside_the_held_out_evaluation_shares_the_cores_and_does_not_publish():
    assert thread_budget(PLAN, Beside.HELDOUT, lambda: True) == Training(threads=1, publish=False)


def test_a_round_beside_the_next_batch_takes_the_cores_once_its_agents_are_done():
    running = [True]
    t = thread_budget(PLAN, Beside.NEXT_BATCH, lambda: running[0])
    assert (t.threads, t.publish) == (1, True)
    assert t.threads_now() == 1
    running[0] = False
    assert t.threads_now() == 8


def test_what_runs_beside_a_round():
    ahead = LoopPlan(rounds=2, lead=1)
    assert beside(PLAN, heldout_pending=True) is Beside.HELDOUT
    assert beside(ahead, heldout_pending=True) is Beside.HELDOUT  # the evaluation holds the publish back
    assert beside(PLAN, heldout_pending=False) is Beside.NOTHING
    assert beside(ahead, heldout_pending=False) is Beside.NEXT_BATCH


def test_the_no_signal_rule_resamples_twice_then_stops_and_a_trained_round_resets_the_streak():
    assert after_training("waiting", 0, 3) == ("resample", 1)
    assert after_training("waiting", 1, 3) == ("resample", 2)
    assert after_training("waiting", 2, 3) == ("stop", 3)
    assert after_training("published", 2, 3) == ("record", 0)
    assert after_training("locked", 1, 3) == ("record", 0)  # not a lack of signal: the record check fails


def test_a_batch_whose_rewarded_rollouts_were_not_all_converted_is_refused():
    records = [_record("a", 1.0), _record("b", 0.0), _record("c", None)]
    check_converted(0, 2, records, "")  # the unrewarded one needs no transitions
    with pytest.raises(
        RuntimeError, match=r"round 3: only 1 of 2 rewarded rollouts were converted \(2 traces\)"
    ):
        check_converted(3, 1, records, "2 traces")


def test_a_round_is_recorded_only_when_trainer_and_manifest_both_say_published():
    published = _Outcome("published")
    assert check_published(1, published, {"status": "published"}, "x") == {"status": "published"}
    for outcome, row in [
        (_Outcome("trained", "no server"), {"status": "published"}),
        (published, None),
        (published, {"status": "trained"}),
    ]:
        with pytest.raises(
            RuntimeError, match=r"round 1: training did not publish policy@2 .*see .*: report here"
        ):
            check_published(1, outcome, row, "report here")


def test_a_plan_without_rounds_is_refused():
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        LoopPlan(rounds=0)


# ------------------------------------------------------------------------------------ the schedule
def test_on_policy_rounds_train_each_batch_alone_and_report_the_manifest_rows():
    fake = FakeStages(signal=[True, True])
    seen: list[RoundDone] = []
    result = run_rounds(PLAN, fake.stages(), on_round=seen.append)
    assert result.version == 2 and [d.round for d in seen] == [0, 1] and result.rounds == seen
    assert [d.row["policy_version"] for d in seen] == [0, 1]
    assert result.samples == 2 * 10  # each fake round trains on 10 calls
    assert fake.calls == [
        ("batch", 0),
        ("convert", 0),
        ("train", 8, True),
        ("batch", 1),
        ("convert", 1),
        ("train", 8, True),
    ]
    assert len(result.rollout_spans) == 2 and len(result.train_spans) == 2


def test_a_batch_its_producer_converted_is_not_converted_again_on_the_trainers_path():
    fake = FakeStages(signal=[True, True], producer_converts=True)
    run_rounds(PLAN, fake.stages())
    assert fake.calls == [
        ("batch", 0),
        ("convert", 0),  # inside the batch's producer
        ("train", 8, True),
        ("batch", 1),
        ("convert", 1),
        ("train", 8, True),
    ]


def test_a_batch_its_producer_converted_short_is_still_refused():
    fake = FakeStages(signal=[True, True], producer_converts=True, converted_short=1)
    with pytest.raises(RuntimeError, match=r"round 0: only 1 of 2 rewarded rollouts were converted"):
        run_rounds(PLAN, fake.stages())


def test_a_batch_without_signal_samples_the_same_policy_again():
    fake = FakeStages(signal=[False, True, True])
    quiet: list[NoSignal] = []
    result = run_rounds(PLAN, fake.stages(), on_no_signal=quiet.append)
    assert [(q.version, q.stopping) for q in quiet] == [(0, False)]
    assert quiet[0].records == fake.batches[0]
    assert result.version == 2
    assert [c[1] for c in fake.calls if c[0] == "batch"] == [0, 1, 2]  # one batch more than rounds
    # each recorded round ends with the span of the training that recorded it, not the one that found
    # no signal (the bench's rate after round 0 is measured between these)
    assert len(result.train_spans) == 3
    assert [d.trained_at for d in result.rounds] == [result.train_spans[1][1], result.train_spans[2][1]]


def test_three_batches_without_signal_in_a_row_stop_the_loop():
    fake = FakeStages(signal=[True, False, False, False, True])
    quiet: list[NoSignal] = []
    result = run_rounds(LoopPlan(rounds=3), fake.stages(), on_no_signal=quiet.append)
    assert [(q.version, q.stopping) for q in quiet] == [(1, False), (1, False), (1, True)]
    assert result.version == 1  # policy@1 published; the loop stopped sampling it
    assert not fake.abort.is_set()  # cleared: the caller's evaluation may run rollouts


def test_policy_0s_held_out_evaluation_runs_beside_round_0_and_is_scored_before_policy_1_is_published():
    fake = FakeStages(signal=[True, True])
    run_rounds(PLAN, fake.stages(heldout=True))
    assert fake.calls.index(("heldout", 0)) < fake.calls.index(("score", 0))  # ran in the background
    in_order = [c for c in fake.calls if c != ("heldout", 0)]
    assert in_order == [
        ("batch", 0),
        ("convert", 0),
        ("train", 1, False),
        ("score", 0),
        ("train", 8, True),
        ("batch", 1),
        ("convert", 1),
        ("train", 8, True),
    ]  # evaluated once only


def test_the_held_out_evaluation_counts_even_when_every_batch_lacked_signal():
    fake = FakeStages(signal=[False, False, False])
    result = run_rounds(PLAN, fake.stages(heldout=True))
    assert result.version == 0
    assert fake.calls.count(("score", 0)) == 1
    assert fake.abort_set_at_score is False  # scored after the batches stopped, with the abort cleared


def test_with_lead_1_the_next_batch_runs_while_the_round_trains():
    fake = FakeStages(signal=[True, True, True], lead=1)
    result = run_rounds(LoopPlan(rounds=2, lead=1, alone_threads=8, shared_threads=1), fake.stages())
    assert result.version == 2
    assert fake.started_while_training == [1]  # batch 1 ran beside round 0; batch 2 was not wanted
    assert fake.threads_seen == [1, 8]  # round 0 beside batch 1's agents; round 1 alone (no batch 2)


def test_a_round_takes_the_cores_once_the_next_batchs_agents_are_done_though_the_batch_is_still_stored():
    """``Stages.agents_running``: the batch's producer is still running (its spans stored, converted), but its
    agents are done, so the round training beside it is told the machine's threads, not the shared ones."""
    fake = FakeStages(signal=[True, True, True], lead=1)
    stages = fake.stages()
    stages.agents_running = lambda: False
    result = run_rounds(LoopPlan(rounds=2, lead=1, alone_threads=8, shared_threads=1), stages)
    assert result.version == 2
    assert fake.started_while_training == [1]  # batch 1's producer ran beside round 0
    assert fake.threads_seen == [8, 8]


def test_a_batch_ahead_waits_while_policy_0s_held_out_evaluation_is_planned_or_running():
    assert held_by_evaluation(1, 0, evaluating=True)  # beside round 0: the evaluation has the engine
    assert not held_by_evaluation(0, 0, evaluating=True)  # the batch round 0 trains on is never held
    assert not held_by_evaluation(1, 0, evaluating=False)
    assert not held_by_evaluation(2, 1, evaluating=False)


def test_with_lead_1_the_next_batch_starts_once_the_held_out_evaluation_is_done():
    """A slow evaluation beside round 0: batch 1 starts after its last rollout, not beside it (then it
    only shares the engine with it), and the rounds still train both batches."""
    fake = FakeStages(signal=[True, True])

    def slow_heldout(k: int) -> str:
        fake.calls.append(("heldout", k))
        time.sleep(0.5)
        fake.calls.append(("heldout done", k))
        return f"eval of policy@{k}"

    stages = fake.stages(heldout=True)
    stages.heldout = slow_heldout
    result = run_rounds(LoopPlan(rounds=2, lead=1, alone_threads=8, shared_threads=1), stages)
    assert result.version == 2
    assert fake.calls.index(("heldout done", 0)) < fake.calls.index(("batch", 1))
    assert fake.calls.count(("score", 0)) == 1


@pytest.mark.parametrize("lead", [0, 1])
def test_held_out_first_scores_policy_0_before_any_batch_and_trains_alone_or_beside_the_next_batch(lead):
    """``heldout_first``: the evaluation runs (and is scored) before batch 0, so no round trains beside
    it: every round publishes at once, and with a lead batch 1 runs beside round 0's training."""
    fake = FakeStages(signal=[True, True, True], lead=lead)
    plan = LoopPlan(rounds=2, lead=lead, alone_threads=8, shared_threads=1, heldout_first=True)
    result = run_rounds(plan, fake.stages(heldout=True))
    assert result.version == 2
    assert fake.calls[:3] == [("heldout", 0), ("score", 0), ("batch", 0)]
    assert fake.calls.count(("score", 0)) == 1
    assert all(c[2] for c in fake.calls if c[0] == "train")  # no round held its publish back for it
    assert fake.started_while_training == ([1] if lead else [])


def test_a_failed_batch_stops_the_loop_with_its_error():
    fake = FakeStages(signal=[True, True], fail_at=1)
    with pytest.raises(ValueError, match="batch 1 failed"):
        run_rounds(PLAN, fake.stages())
    assert not fake.abort.is_set()


def test_a_round_the_trainer_did_not_publish_is_an_error_naming_the_manifest():
    fake = FakeStages(signal=[True], publishes=False)
    with pytest.raises(RuntimeError, match=r"did not publish policy@1 .*tracerl report --store S"):
        run_rounds(LoopPlan(rounds=1, report_hint="tracerl report --store S"), fake.stages())


# ------------------------------------------------------------------------------------ fakes
@dataclass
class _Outcome:
    status: str
    message: str = ""


def _record(rollout_id: str, reward: float | None) -> RolloutRecord:
    return RolloutRecord(
        rollout_id=rollout_id,
        task_id="t",
        sample=0,
        status="ok",
        exit_code=0,
        duration_s=0.1,
        attempts=1,
        reward=reward,
    )


@dataclass
class FakeStages:
    """Stages as plain functions; ``signal[b]`` says whether batch b's rewards vary within a task."""

    signal: list[bool]
    lead: int = 0
    fail_at: int | None = None
    publishes: bool = True
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    batches: list[list[RolloutRecord]] = field(default_factory=list)
    manifest: dict[int, dict[str, Any]] = field(default_factory=dict)
    trained: int | None = None  # batch the pending checkpoint was trained on (trained, not published)
    taken: int = 0  # batches converted so far
    training: threading.Event = field(default_factory=threading.Event)
    started_while_training: list[int] = field(default_factory=list)
    threads_seen: list[int] = field(default_factory=list)
    batch_running: threading.Event = field(default_factory=threading.Event)
    batch_may_end: threading.Event = field(default_factory=threading.Event)
    abort: threading.Event = field(default_factory=threading.Event)
    abort_set_at_score: bool | None = None
    producer_converts: bool = False  # the batch converts itself once stored (the demo's training batches)
    converted_short: int = 0  # with producer_converts: rollouts the producer's conversion leaves out

    def stages(self, heldout: bool = False) -> Stages:
        return Stages(
            rollouts=self.rollouts,
            convert=self.convert,
            train=self.train,
            round_row=self.manifest.get,
            abort=self.abort,
            heldout=self.heldout if heldout else None,
            score_heldout=self.score,
        )

    def rollouts(self, b: int) -> Batch:
        self.calls.append(("batch", b))
        if self.lead and b == 1:  # batch 1 runs beside round 0's training, and ends once it was seen
            if self.training.wait(5):
                self.started_while_training.append(b)
            self.batch_running.set()
            self.batch_may_end.wait(5)
        if b == self.fail_at:
            raise ValueError(f"batch {b} failed")
        rewards = [1.0, 0.0] if self.signal[b] else [1.0, 1.0]
        records = [_record(f"r{b}-{i}", r) for i, r in enumerate(rewards)]
        self.batches.append(records)
        if self.producer_converts:
            n, summary = self.convert([r.rollout_id for r in records])
            return Batch(records, 0.01, converted=(n - self.converted_short, summary), convert_s=0.02)
        return Batch(records, 0.01)

    def convert(self, ids: list[str]) -> tuple[int, str]:
        self.calls.append(("convert", self.taken))
        self.taken += 1
        return len(ids), f"{len(ids)} rollouts"

    def train(self, t: Training) -> _Outcome:
        self.calls.append(("train", t.threads, t.publish))
        self.training.set()
        if self.lead and not self.threads_seen:
            self.batch_running.wait(5)
        self.threads_seen.append(t.threads_now() if t.threads_now else t.threads)
        self.batch_may_end.set()
        self.training.clear()
        b = self.taken - 1
        if self.trained is None:
            if not self.signal[b]:
                return _Outcome("waiting", "no reward spread")
            self.trained = b
        if not (t.publish and self.publishes):
            return _Outcome("trained")
        k = len(self.manifest)
        self.manifest[k] = {"status": "published", "policy_version": k, "n_rollouts": 2, "n_transitions": 10}
        self.trained = None
        return _Outcome("published")

    def heldout(self, k: int) -> str:
        self.calls.append(("heldout", k))
        return f"eval of policy@{k}"

    def score(self, k: int, result: str) -> None:
        assert result == f"eval of policy@{k}"
        self.calls.append(("score", k))
        self.abort_set_at_score = self.abort.is_set()
