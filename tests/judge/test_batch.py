"""A batch judged as the demo judges a round: only its rollouts, with the judge's agreement with the grader
read back from a real store (scripted judge on 127.0.0.1), and failed groups counted as training nothing."""

from __future__ import annotations

import json
from pathlib import Path

from judge.agreement import Agreement
from judge.batch import BatchJudgment, combine, format_judgment, judge_batch, summarize
from judge.config import JudgeSettings
from judge.stage import JudgeStats

from .helpers import DRAFTS
from .store_rig import answer, good_judge, make_store, scripted_judge
from .test_reward_from_store import post_grades


def settings(store: Path, url: str) -> JudgeSettings:
    return JudgeSettings(store=str(store), judge_url=url, judge_model="m", group_wait_s=0)


def test_summarize_counts_groups_untrained_rollouts_and_agreement_on_rollouts_with_both() -> None:
    stats = JudgeStats(groups_scored=1, failures={"no_json": 1}, prompt_tokens=300, completion_tokens=40)
    pairs = [("a", 1.0, 1.0), ("b", 0.2, 0.0), ("c", None, 1.0), ("d", 0.5, None)]
    j = summarize(stats, pairs, rollouts=5, threshold=1.0)
    assert (j.judged, j.untrained, j.groups_scored, j.groups_failed) == (3, 2, 1, 1)
    assert j.agreement == Agreement(n=2, n_pass=1, spearman=1.0, auc=1.0)
    line = format_judgment(j)
    assert "1 groups scored, 1 failed; 3/5 rollouts judged, 2 train nothing; 300 + 40 judge tokens" in line
    assert "AUC 1.00, Spearman 1.00" in line


def test_an_undefined_agreement_is_shown_as_such_never_as_a_number() -> None:
    constant = summarize(JudgeStats(), [("a", 1.0, 1.0), ("b", 1.0, 0.0)], rollouts=2, threshold=1.0)
    assert "AUC 0.50, Spearman -" in format_judgment(constant)  # a judge that scores all alike ranks nothing
    nothing = BatchJudgment(2, 0, 0, 1, 0, 0, 0, None)
    assert "no rollout has both a judge score and a grader reward" in format_judgment(nothing)


def test_only_the_batchs_rollouts_are_judged_and_agreement_comes_from_the_store(tmp_path: Path) -> None:
    drafts = make_store(tmp_path, tasks=2, per_task=3)
    batch = [r for r in sorted(drafts) if r.startswith("00")]  # task-0's three rollouts
    post_grades(tmp_path, {r: 1.0 if d == DRAFTS[0] else 0.0 for r, d in drafts.items()})
    with scripted_judge(good_judge) as (url, seen):
        j = judge_batch(settings(tmp_path, url), batch)
    assert len(seen) == 1 and (j.rollouts, j.judged, j.groups_scored, j.untrained) == (3, 3, 1, 0)
    passed = sum(drafts[r] == DRAFTS[0] for r in batch)
    assert j.agreement is not None and (j.agreement.n, j.agreement.n_pass) == (3, passed)
    assert j.agreement.auc == (1.0 if 0 < passed < 3 else None)  # good_judge ranks the gold draft first


def test_a_failed_group_is_counted_and_its_rollouts_train_nothing(tmp_path: Path) -> None:
    drafts = make_store(tmp_path, tasks=1, per_task=3)
    with scripted_judge(lambda body, n: (200, answer("I cannot rank these."))) as (url, seen):
        j = judge_batch(settings(tmp_path, url), sorted(drafts))
    assert len(seen) == 2  # the answer, then the one retry quoting the parse error
    assert (j.groups_scored, j.groups_failed, j.judged, j.untrained, j.agreement) == (0, 1, 0, 3, None)
    assert json.dumps(j.prompt_tokens) == "200"  # both calls paid for


def test_combine_sums_counts_and_takes_agreement_over_every_rollout_again() -> None:
    one = summarize(JudgeStats(groups_scored=1, prompt_tokens=10), [("a", 1.0, 1.0), ("b", 0.0, 0.0)], 2, 1.0)
    two = summarize(JudgeStats(failures={"no_json": 1}, prompt_tokens=5), [("c", None, 1.0)], 2, 1.0)
    both = combine([one, two], [("a", 1.0, 1.0), ("b", 0.0, 0.0), ("c", None, 1.0), ("d", 0.5, 0.0)], 1.0)
    assert (both.rollouts, both.judged, both.untrained, both.groups_scored, both.groups_failed) == (
        4,
        3,
        1,
        1,
        1,
    )
    assert both.prompt_tokens == 15 and both.agreement is not None and both.agreement.n == 3
