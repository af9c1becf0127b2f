"""The judge's agreement with a grader (Spearman, AUC) and its token cost per round, in `tracerl report`."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest

from judge.agreement import agreement, auc, average_ranks, spearman
from judge.config import JudgeSettings
from judge.report import format_judge, judge_report, judge_rounds
from judge.stage import run_once
from schemas.tables import REWARDS_SCHEMA
from store.layout import StoreLayout
from store.location import parse_store
from store.parquet import write_table_atomic

from .helpers import DRAFTS
from .store_rig import good_judge, make_store, scripted_judge


def test_ties_share_their_average_rank() -> None:
    assert average_ranks([3.0, 1.0, 3.0, 2.0]).tolist() == [3.5, 1.0, 3.5, 2.0]


def test_spearman_by_hand() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks x = 1, 2.5, 2.5, 4 and y = 1, 3, 2, 4: sum dx*dy = 4.5, sum dx^2 = 4.5, sum dy^2 = 5
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    assert spearman([0.5, 0.5, 0.5], [0, 1, 0]) is None  # a constant judge ranks nothing
    assert spearman([1.0], [1.0]) is None
    with pytest.raises(ValueError, match="pairs"):
        spearman([1, 2], [1])


def test_auc_by_hand() -> None:
    # passing {0.9, 0.3} vs failing {0.8, 0.1}: 0.9 beats both, 0.3 beats 0.1 only -> 3 of 4
    assert auc([0.9, 0.8, 0.3, 0.1], [True, False, True, False]) == 0.75
    assert auc([0.5, 0.5], [True, False]) == 0.5  # a tie counts half
    assert auc([0.2, 0.9], [True, True]) is None  # one class: undefined, not 1.0
    a = agreement([1.0, 0.1, 0.1], [1.0, 0.2, 0.05], threshold=0.5)
    assert (a.n, a.n_pass, a.auc) == (3, 1, 1.0) and a.spearman == pytest.approx(1.5 / math.sqrt(1.5 * 2))


def test_rounds_sum_tokens_and_leave_agreement_out_without_a_grader() -> None:
    rows = [
        {"round": 1, "judge": 1.0, "p": 100, "c": 10, "grader": 1.0},
        {"round": 1, "judge": 0.0, "p": 50, "c": 5, "grader": 0.0},
        {"round": 2, "judge": 0.5, "p": 70, "c": 7, "grader": None},
    ]
    r1, r2 = judge_rounds(rows)
    assert (r1.round, r1.rollouts, r1.prompt_tokens, r1.completion_tokens) == (1, 2, 150, 15)
    assert (r1.agreement.auc, r1.agreement.spearman) == (1.0, pytest.approx(1.0))
    assert r2.agreement is None
    text = format_judge([r1, r2])
    assert "spearman" in text and "  82 " in text  # (150 + 15) / 2 = 82.5 tokens per rollout
    assert format_judge([]) == ""


def test_report_shows_the_judge_against_the_grader_of_the_same_rollouts(tmp_path) -> None:
    drafts = make_store(tmp_path, tasks=2, per_task=4)
    with scripted_judge(good_judge) as (url, _):
        assert (
            run_once(
                JudgeSettings(store=str(tmp_path), judge_url=url, judge_model="m", group_wait_s=0)
            ).rows_written
            == 8
        )
    grader = [
        {
            "reward_id": f"g-{r}",
            "rollout_id": r,
            "name": "reward",
            "value": 1.0 if d == DRAFTS[0] else 0.0,
            "source": "side_channel",
        }
        for r, d in drafts.items()
    ]
    write_table_atomic(
        pa.Table.from_pylist(grader, schema=REWARDS_SCHEMA),
        StoreLayout.at(tmp_path).partition("rewards", "2026-11-27") / "part-grader.parquet",
        "rewards",
    )
    [r] = judge_report(parse_store(tmp_path))
    assert (r.rollouts, r.prompt_tokens, r.agreement.n) == (8, 200, 8)
    assert r.agreement.auc == 1.0 and r.agreement.spearman == pytest.approx(1.0)  # the scripted judge knows
    assert "judge (source=judge rewards" in format_judge([r])
