"""``tracerl doctor`` on a store that converts fine but would not train: singleton groups under a group
estimator, different requests grouped as one task, feedback that matches no rollout, feedback coverage
per version, rollouts waiting on their feedback window, no reward variance, nothing new to train.
"Healthy" means the next round would train. Real Parquet stores, converted by ``convert_store``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tracerl_testing import tracerl

from span_to_transition.convert import ConvertConfig
from span_to_transition.doctor import Finding, diagnose
from span_to_transition.records import Span
from span_to_transition.store import convert_store
from span_to_transition.survey import gather
from store.location import parse_store

from .factory import TraceBuilder, spans_table, user
from .test_feedback import side
from .test_store import put
from .test_tokens import gateway_attrs

S = 1_000_000_000
LATER = 2_000_000_000 * S
SYSTEM = {"role": "system", "content": "You write SQL for this schema: CREATE TABLE t (a INT, b TEXT) ..."}


def request(
    i: int,
    reward: float | None,
    *,
    prompt: list[dict] | None = None,
    task: str | None = None,
    version: int = 0,
) -> list[Span]:
    """One request of a deployed text-to-SQL service: its own trace, one call through the gateway, an
    in-band reward (or none)."""
    t = TraceBuilder(f"{i + 1:032x}", received_at_ns=100 * S)
    root = t.span("POST /ask", None, {"tracerl.task_id": task} if task else None)
    call = t.chat(
        root,
        prompt or [SYSTEM, user(f"question number {i}?")],
        "SELECT 1",
        response_id=f"chatcmpl-{i}",
        model=f"policy@{version}",
    )
    t.span("gateway chat", call, gateway_attrs(f"chatcmpl-{i}", [1, 2, 3], [4, 5], version=version))
    if reward is not None:
        t.reward(root, reward)
    return t.spans


def converted(store: Path, spans: list[Span], **config: object) -> None:
    put(store, "spans", spans_table(spans), "a")
    convert_store(parse_store(store), ConvertConfig(quiet_s=0, **config), now_ns=LATER)  # type: ignore[arg-type]


def problems(store: Path, **kw: object) -> dict[str, Finding]:
    return {f.problem: f for f in diagnose(gather(parse_store(store), now_ns=kw.pop("now_ns", LATER), **kw))}  # type: ignore[arg-type]


def test_distinct_requests_under_a_group_estimator_never_train_and_the_doctor_says_so(store: Path) -> None:
    converted(store, [s for i in range(6) for s in request(i, float(i % 2))])
    got = problems(store, estimator="grpo")
    f = got["every task seen once under a group estimator"]
    assert "6 rollouts of policy@0 in 6 tasks" in f.saw and "grpo (set by --estimator)" in f.saw
    assert "--estimator auto" in f.fix and "--task-key" in f.fix
    assert problems(store, estimator="auto") == {}  # REINFORCE++ learns from the batch: healthy
    assert problems(store, estimator="reinforce_plus_plus") == {}


def test_different_requests_in_one_task_are_named_as_an_accidental_group(store: Path) -> None:
    converted(store, [s for i in range(6) for s in request(i, float(i % 2), task="sql")])
    f = problems(store, estimator="auto")["different requests grouped as one task"]
    assert "6 rollouts share task 'sql' but 6 of them were asked something different" in f.saw
    assert "--task-key" in f.fix and "tracerl.task_id" in f.fix and "--rebuild" in f.fix


def test_the_same_request_sampled_several_times_is_no_accidental_group(store: Path) -> None:
    same = [SYSTEM, user("how many rows?")]
    converted(store, [s for i in range(6) for s in request(i, float(i % 2), prompt=same, task="sql")])
    assert problems(store, estimator="grpo") == {}


def test_equal_rewards_give_no_signal(store: Path) -> None:
    same = [SYSTEM, user("how many rows?")]
    converted(store, [s for i in range(4) for s in request(i, 1.0, prompt=same)])
    f = problems(store, estimator="grpo")["no reward variance"]
    assert "4 rollouts of policy@0, rewards [1.0]: every task group got one reward" in f.saw


def test_feedback_for_unknown_keys_is_shown_with_what_to_check(store: Path) -> None:
    put(store, "rewards", side("fb-x", 1.0, 200, trace_id="e" * 32), "r1")
    put(store, "rewards", side("fb-y", 0.0, 200, response_id="chatcmpl-nobody"), "r2")
    converted(store, [s for i in range(4) for s in request(i, float(i % 2))])
    f = problems(store, estimator="auto")["feedback that matches no rollout"]
    assert (
        "2 feedback rows" in f.saw
        and "trace_id=" + "e" * 32 in f.saw
        and "response_id=chatcmpl-nobody" in f.saw
    )
    assert "gen_ai.response.id" in f.fix and "trace_id" in f.fix and "tracerl status" in f.fix


def test_feedback_coverage_per_version_is_part_of_the_unrewarded_finding(store: Path) -> None:
    spans = (
        [s for i in range(3) for s in request(i, float(i % 2))]
        + request(3, None)
        + [s for i in range(4, 6) for s in request(i, float(i % 2), version=1)]
        + request(6, None, version=1)
        + request(7, None, version=1)
    )
    converted(store, spans)
    f = problems(store, estimator="auto")["rollouts excluded for want of a reward"]
    assert "feedback coverage: policy@0: 3 of 4 rollouts (75%); policy@1: 2 of 4 rollouts (50%)" in f.saw


def test_rollouts_waiting_on_their_feedback_window_are_counted_until_it_closes(store: Path) -> None:
    spans = [s for i in range(4) for s in request(i, float(i % 2))]
    converted(store, spans)
    end = max(s.end_time_ns for s in spans)
    f = problems(store, estimator="auto", feedback_window_s=3600, now_ns=end + 600 * S)[
        "rollouts waiting on their feedback window"
    ]
    assert "4 rollouts of policy@0 ended less than --feedback-window 3600s ago" in f.saw
    assert "--feedback-window" in f.fix
    assert problems(store, estimator="auto", feedback_window_s=3600, now_ns=end + 3601 * S) == {}


def test_rollouts_without_feedback_at_the_close_do_not_make_a_store_healthy(store: Path) -> None:
    """With convert --missing-reward fill every rollout has a reward, but none came from feedback."""
    converted(store, [s for i in range(4) for s in request(i, None)], missing_reward="fill")
    f = problems(store, estimator="auto", feedback_window_s=60)["nothing for the next round to train"]
    assert "4 unused rollouts of policy@0, none complete with a reward closed without feedback" in f.saw


def test_rollouts_used_by_earlier_rounds_leave_nothing_new(store: Path) -> None:
    converted(store, [s for i in range(4) for s in request(i, float(i % 2))])
    sel = store / "checkpoints" / "round-000000.json"
    sel.parent.mkdir(parents=True)
    sel.write_text(json.dumps({"round": 0, "rollout_ids": [f"{i + 1:032x}" for i in range(4)]}))
    f = problems(store, estimator="auto")["nothing for the next round to train"]
    assert "every rollout was used by an earlier round" in f.saw


@pytest.mark.slow
def test_cli_takes_the_trainers_estimator_and_window(store: Path) -> None:
    converted(store, [s for i in range(4) for s in request(i, float(i % 2))])
    grpo = tracerl("doctor", "--store", str(store), "--estimator", "grpo", check=False)
    assert grpo.returncode == 1 and "every task seen once under a group estimator" in grpo.stdout
    auto = tracerl(
        "doctor", "--store", str(store), "--estimator", "auto", "--feedback-window", "1m", check=False
    )
    assert auto.returncode == 0 and "healthy" in auto.stdout and "next round" in auto.stdout
    bad = tracerl("doctor", "--store", str(store), "--feedback-window", "soon", check=False)
    assert bad.returncode == 2 and "10m, 2h, 1d" in bad.stderr
