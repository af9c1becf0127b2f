"""`tracerl demo --reward judge`: the flag reaches the converter's reward selection and the judge, and a
round's convert step judges exactly its rollouts through the served model's URL (not the gateway's),
then trains them on the judge's scores alone. A scripted judge on 127.0.0.1 stands in for the server;
the run with real processes is the slow test in test_demo.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from loop.rounds import LoopPlan
from options import UsageError
from store.location import parse_store
from store.views import connect_readonly
from tracerl.demo_config import DemoConfig, DemoRun, validate
from tracerl.demo_stages import DemoStages
from tracerl.demo_tasks import letter_task
from tracerl.supervisor import Children

from .helpers import DRAFTS
from .store_rig import good_judge, make_store, scripted_judge
from .test_reward_from_store import post_grades


def stages(tmp_path: Path, server_url: str, reward: str) -> DemoStages:
    cfg = DemoConfig(tiny=True, reward=reward, workdir=str(tmp_path)).resolved()
    task = letter_task(cfg.letters, cfg.rollouts_per_round)
    return DemoStages.build(
        cfg,
        DemoRun(store=tmp_path),
        Children(),
        task=task,
        store=tmp_path,
        logs=tmp_path / "logs",
        model=tmp_path / "model",
        server_url=server_url,
        ports=(None, 1, 2, 3),
        concurrency=2,
        plan=LoopPlan(rounds=1),
    )


def test_reward_judge_selects_the_judges_reward_and_judges_through_the_server_not_the_gateway(tmp_path):
    parts = stages(tmp_path, "http://127.0.0.1:9", "judge")
    assert (parts.convert_cfg.reward_from, parts.convert_cfg.missing_reward) == ("judge", "keep")
    j = parts.judge
    assert j is not None and (j.judge_url, j.judge_model, j.mode, j.group_wait_s) == (
        "http://127.0.0.1:9/v1",
        "policy",
        "group",
        0.0,
    )
    assert (
        parts.driver["gateway"] != j.judge_url
    )  # the agent's calls go through the gateway; the judge's do not
    graded = stages(tmp_path, "http://127.0.0.1:9", "grader")
    assert (graded.convert_cfg.reward_from, graded.judge) == ("auto", None)


def test_a_judge_max_tokens_below_8_is_a_usage_error():
    cfg = DemoConfig(tiny=True, reward="judge", judge_max_tokens=4).resolved()
    with pytest.raises(UsageError, match="--judge-max-tokens must be at least 8"):
        validate(cfg, letter_task(cfg.letters, cfg.rollouts_per_round))


def test_the_round_is_judged_then_trained_on_the_judge_alone(tmp_path, capsys):
    drafts = make_store(tmp_path, tasks=2, per_task=3)
    post_grades(tmp_path, {r: 1.0 if d == DRAFTS[0] else 0.0 for r, d in drafts.items()})
    batch = sorted(drafts)[:3]  # task-0: this round's rollouts
    with scripted_judge(good_judge) as (url, seen):
        parts = stages(tmp_path, url.removesuffix("/v1"), "judge")
        converted, _ = parts.convert(batch)
    assert converted == 3 and len(seen) == 1  # one group call, task-1 untouched
    assert "3/3 rollouts judged, 0 train nothing" in capsys.readouterr().out
    con = connect_readonly(parse_store(tmp_path))
    got = dict(con.execute("SELECT DISTINCT rollout_id, reward_names FROM transitions").fetchall())
    assert got == {r: "judge" if r in batch else None for r in drafts}  # the grader's rows never train
    total = parts.judge_total()
    assert total is not None and total.judged == 3 and total.agreement is not None


def test_help_says_the_judge_is_poor_in_numbers(capsys):
    from tracerl.cli import main

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "--reward {grader,judge}" in out
        and "scored all 96 rollouts of 3 batches 1.0, AUC 0.50 against the grader (chance)" in out
    )


@pytest.mark.slow
def test_tiny_demo_with_reward_judge_reports_failed_judging_and_trains_nothing_made_up(tmp_path):
    """The embedded server ignores response_format and the random tiny model writes no JSON: every group's
    judging fails (after its one retry). The demo must say so each batch, train nothing, and write no score."""
    from tracerl_testing import tracerl

    from judge.stage import load_state

    work = tmp_path / "work"
    proc = tracerl(
        "demo",
        "--tiny",
        "--reward",
        "judge",
        "--rounds",
        "1",
        "--rollouts-per-round",
        "8",
        "--workdir",
        str(work),
        "--no-final-eval",
        timeout=600,
    )
    out = proc.stdout
    # 3 batches (the loop's no-signal limit), 4 task groups each, every one failed
    assert out.count("judge: 0 groups scored, 4 failed; 0/8 rollouts judged, 8 train nothing") == 3, out
    assert "all rounds, judge: 0 groups scored, 12 failed; 0/24 rollouts judged, 24 train nothing" in out
    assert "8 of 8 unjudged (judging failed)" in out and "tracerl demo: 0 rounds" in out
    store = parse_store(work / "store")
    con = connect_readonly(store)
    assert con.execute("SELECT source, name, count(*) FROM rewards GROUP BY ALL").fetchall() == [
        ("side_channel", "reward", 24)
    ]  # the grader's rows only: no judge score was made up
    assert con.execute(
        "SELECT count(DISTINCT rollout_id), count(rollout_reward) FROM transitions"
    ).fetchone() == (
        24,
        0,
    )  # converted, kept unrewarded: the grader's reward never trains under --reward-from judge
    # the judge asked the server directly: the gateway recorded the agents' calls only (writer + rewriter)
    assert con.execute(
        "SELECT count(*) FROM spans WHERE attributes['tracerl.gateway'] = 'true'"
    ).fetchone() == (48,)
    assert con.execute("SELECT count(*) FROM rounds WHERE status = 'published'").fetchone() == (0,)
    failed = next(iter(load_state(store, "judge")["failed"].values()))
    # answered, but no parseable scores (no JSON, mostly): never a refused request or a made-up score
    assert len(failed) == 24 and not any(reason.startswith("rejected") for reason in failed.values())


def test_a_batch_without_signal_says_whether_the_judge_failed_or_scored_all_alike(capsys):
    from judge.batch import BatchJudgment
    from loop.rounds import NoSignal
    from tracerl.demo_output import print_no_signal

    alike = BatchJudgment(32, 32, 4, 0, 0, 9493, 2140, None)
    print_no_signal(NoSignal(version=0, records=[], stopping=False), alike)
    print_no_signal(NoSignal(version=0, records=[], stopping=True), BatchJudgment(8, 0, 0, 4, 0, 1, 1, None))
    print_no_signal(NoSignal(version=0, records=[], stopping=True))
    first, second, third = capsys.readouterr().out.splitlines()
    assert "the judge scored all alike within each task" in first and "sampling policy@0 again" in first
    assert "8 of 8 unjudged (judging failed)" in second and "stopping" in second
    assert "mean reward" in third and "all alike within each task" in third  # --reward grader: as before
