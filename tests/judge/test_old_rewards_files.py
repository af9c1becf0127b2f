"""Rewards files written before the judge's columns existed still read everywhere (as nulls)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.tables import REWARDS_SCHEMA
from span_to_transition.convert import ConvertConfig
from span_to_transition.store import convert_store
from store.layout import StoreLayout
from store.location import parse_store
from store.parquet import read_table
from store.views import connect_readonly, view_sql

from .store_rig import LATER, make_store

OLD_COLUMNS = [
    "reward_id",
    "rollout_id",
    "trace_id",
    "span_id",
    "response_id",
    "name",
    "value",
    "source",
    "at",
]


def test_an_old_rewards_file_reaches_the_converter_the_views_and_the_reader(tmp_path):
    drafts = make_store(tmp_path, tasks=1, per_task=2)
    rid = sorted(drafts)[0]
    old = pa.schema([REWARDS_SCHEMA.field(c) for c in OLD_COLUMNS])
    table = pa.Table.from_pylist(
        [
            {
                "reward_id": "old-1",
                "rollout_id": rid,
                "name": "grader",
                "value": 0.75,
                "source": "side_channel",
            }
        ],
        schema=old,
    )
    path = StoreLayout.at(tmp_path).partition("rewards", "2026-11-20") / "part-old.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)  # as an older collector wrote it: no judge columns

    assert (
        convert_store(parse_store(tmp_path), ConvertConfig(quiet_s=0, missing_reward="keep", workers=1), now_ns=LATER
        ).rollouts_reconverted
        == 1
    )
    con = connect_readonly(parse_store(tmp_path))
    assert con.execute(
        "SELECT DISTINCT rollout_reward, reward_source FROM transitions WHERE rollout_id = ?", [rid]
    ).fetchall() == [(0.75, "side_channel")]
    assert con.execute(
        "SELECT value, judge_model, explanation, judge_prompt_tokens FROM rewards"
    ).fetchall() == [(0.75, None, None, None)]
    assert read_table(StoreLayout.at(tmp_path).table("rewards"), "rewards").column(
        "rubric_hash"
    ).to_pylist() == [None]
    assert "union_by_name=true" in view_sql(parse_store(tmp_path))  # an external DuckDB unions old and new files by name
