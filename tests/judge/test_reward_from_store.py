"""``--reward-from`` on a real store: a grader's rows and a judge's rows (written by ``tracerl judge``
against a scripted endpoint) on the same rollouts, converted into transitions that say whose reward
trained them; files written before ``reward_names`` existed read as nulls."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from judge.config import JudgeSettings
from judge.stage import run_once
from schemas.tables import REWARDS_SCHEMA, TRANSITIONS_SCHEMA
from span_to_transition.convert import ConvertConfig
from span_to_transition.store import convert_store
from store.layout import StoreLayout
from store.location import parse_store
from store.parquet import read_table, write_table_atomic
from store.views import connect_readonly

from .helpers import DRAFTS
from .store_rig import LATER, good_judge, make_store, scripted_judge


def post_grades(store: Path, grades: dict[str, float]) -> None:
    """Grader rows as the collector's side channel writes them (name ``grade``)."""
    rows = [
        {"reward_id": f"{r}:grade", "rollout_id": r, "name": "grade", "value": v, "source": "side_channel"}
        for r, v in grades.items()
    ]
    loc = parse_store(store)
    Path(loc.path("rewards", "date=2026-11-27")).mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=REWARDS_SCHEMA)
    write_table_atomic(table, loc.path("rewards", "date=2026-11-27", "grades.parquet"), "rewards", fs=loc.fs)


def trained(store: Path) -> dict[str, tuple]:
    """rollout -> (rollout_reward, reward_source, reward_names), from the transitions view."""
    con = connect_readonly(parse_store(store))
    rows = con.execute(
        "SELECT DISTINCT rollout_id, rollout_reward, reward_source, reward_names FROM transitions"
    ).fetchall()
    con.close()
    return {r: (v, s, n) for r, v, s, n in rows}


def convert(store: Path, **config: object):
    cfg = ConvertConfig(quiet_s=0, missing_reward="keep", workers=1, **config)
    return convert_store(parse_store(store), cfg, now_ns=LATER, rebuild=bool(config))


def test_auto_trains_graded_rollouts_on_the_grader_and_the_rest_on_the_judge(tmp_path: Path) -> None:
    drafts = make_store(tmp_path, tasks=2, per_task=3)
    with scripted_judge(good_judge) as (url, _):
        stats = run_once(JudgeSettings(store=str(tmp_path), judge_url=url, judge_model="m", group_wait_s=0))
    assert stats.rows_written == 6
    graded = sorted(drafts)[:4]
    post_grades(
        tmp_path, {r: 0.0 if drafts[r] == DRAFTS[0] else 1.0 for r in graded}
    )  # a grader that disagrees
    judge_score = {r: 1.0 if d == DRAFTS[0] else 0.1 for r, d in drafts.items()}  # what good_judge gives

    assert convert(tmp_path).rollouts_reconverted == 6
    got = trained(tmp_path)
    for r in drafts:
        if r in graded:  # the judge's score is not added to the grader's
            assert got[r] == (0.0 if drafts[r] == DRAFTS[0] else 1.0, "side_channel", "grade"), r
        else:
            assert got[r] == (judge_score[r], "judge", "judge"), r

    convert(tmp_path, reward_from="judge")  # the same rows, trained on the judge alone
    assert trained(tmp_path) == {r: (judge_score[r], "judge", "judge") for r in drafts}
    convert(tmp_path, reward_from="grade")
    assert {r: v for r, (v, _, _) in trained(tmp_path).items() if v is not None} == {
        r: 0.0 if drafts[r] == DRAFTS[0] else 1.0 for r in graded
    }  # the ungraded two are kept reward-less (--missing-reward keep)


def test_a_reward_of_an_unselected_name_never_retries_an_excluded_rollout(tmp_path: Path) -> None:
    """With --reward-from judge, a graded rollout waits for the judge: the grader's row must not make
    every pass read and convert it again to the same exclusion."""
    drafts = make_store(tmp_path, tasks=1, per_task=2)  # converted once (keep), so rebuild them under exclude
    cfg = ConvertConfig(quiet_s=0, workers=1, reward_from="judge")
    first = convert_store(parse_store(tmp_path), cfg, now_ns=LATER, rebuild=True)
    assert first.rollouts_excluded_no_reward == 2
    post_grades(tmp_path, dict.fromkeys(drafts, 1.0))
    again = convert_store(parse_store(tmp_path), cfg, now_ns=LATER)
    assert (again.span_files_read, again.rollouts_converted) == (0, 0)
    auto = convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0, workers=1), now_ns=LATER)
    assert auto.rollouts_converted == 2  # under auto the same rows do retry them


def test_transitions_written_before_reward_names_read_it_as_null(tmp_path: Path) -> None:
    make_store(tmp_path, tasks=1, per_task=2)
    layout = StoreLayout.at(tmp_path)
    for path in Path(layout.table("transitions")).rglob("*.parquet"):
        pq.write_table(pq.read_table(path).drop_columns(["reward_names"]), path)  # an older writer's file
    old = read_table(layout.table("transitions"), "transitions")
    assert old.schema.names == TRANSITIONS_SCHEMA.names and old.column("reward_names").null_count == len(old)
    assert {n for _, _, n in trained(tmp_path).values()} == {None}
