"""``tracerl train --max-rollouts N``: a round takes the newest N rollouts of the serving version, so cron rounds
on a busy service stay bounded and on-policy; the rest are not consumed. The order is a pure function, the
candidates come from a real Parquet/DuckDB store, and rounds of the tiny model show the wiring."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from store.layout import StoreLayout
from store.location import parse_store
from store.views import connect_readonly
from tracerl.cli import main
from trainer.dataset import load_transitions
from trainer.manifest import read_rounds, read_selection
from trainer.round_cap import Candidate, candidates, newest_first, over_cap
from trainer.rounds import run_once

S = 1_000_000_000
NOW = 1_800_000_000 * S


def test_the_serving_version_comes_first_then_the_most_recently_ended() -> None:
    pool = [
        Candidate("old-but-latest", 0, NOW),  # stale: after every rollout of the newer version
        Candidate("new-early", 1, NOW - 60 * S),
        Candidate("new-late", 1, NOW - 5 * S),
        Candidate("new-untimed", 1, None),  # no times: last of its version
        Candidate("old-early", 0, NOW - 90 * S),
    ]
    kept, left = newest_first(pool, 3)
    assert kept == ["new-late", "new-early", "new-untimed"]
    assert left == {"old-but-latest", "old-early"}
    assert newest_first(pool, 0) == (
        ["new-late", "new-early", "new-untimed", "old-but-latest", "old-early"],
        set(),
    )  # 0: no cap
    assert newest_first(pool, 10)[1] == set()


def _rollout(
    make_row, rid: str, version: int, ended: int, *, reward: float = 1.0, complete: bool = True
) -> list[dict]:
    rows = [
        make_row(rid, task_id=rid, version=version, reward=reward, step=s, is_last=complete and s == 1)
        for s in range(2)
    ]
    for i, r in enumerate(rows):
        r.update(ended_at=ended - (1 - i) * S, started_at=ended - 2 * S)
    return rows


def test_candidates_are_complete_rewarded_unexcluded_rollouts_of_a_real_store(
    tmp_path: Path, write_rows, make_row
) -> None:
    store = tmp_path / "store"
    rows = (
        _rollout(make_row, "a", 0, NOW - 50 * S)
        + _rollout(make_row, "b", 1, NOW - 40 * S)
        + _rollout(make_row, "c", 1, NOW - 10 * S)
        + _rollout(make_row, "used", 1, NOW)
        + _rollout(make_row, "running", 1, NOW, complete=False)
    )
    write_rows(store, rows)
    con = connect_readonly(parse_store(store))
    table = load_transitions(con, (0, 1))
    con.close()
    found = {c.rollout_id: c for c in candidates(table, {"used"})}
    assert set(found) == {"a", "b", "c"}
    assert found["c"] == Candidate("c", 1, NOW - 10 * S)  # its last call's end, its version
    assert over_cap(table, {"used"}, 2) == {"a"}
    assert over_cap(table, {"used"}, 1) == {"a", "b"}
    assert over_cap(table, {"used"}, 0) == set()


def test_a_cap_below_min_rollouts_is_refused_with_the_fix(tmp_path: Path, capsys) -> None:
    code = main(["train", "--once", "--store", str(tmp_path), "--min-rollouts", "16", "--max-rollouts", "8"])
    err = capsys.readouterr().err
    assert code == 2 and "--max-rollouts 8 must be 0 (no cap) or >= --min-rollouts 16" in err
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--max-rollouts N" in help_text and "the newest N of the serving version" in help_text


@pytest.mark.slow
def test_a_capped_round_trains_the_newest_and_leaves_the_rest_for_the_next(
    tmp_path: Path, write_rows, make_rollouts, train_settings, monkeypatch
) -> None:
    store = tmp_path / "store"
    loc = StoreLayout.at(store).location
    rows = make_rollouts(0, n_tasks=3, per_task=4)  # 12 rollouts
    order = sorted({r["rollout_id"] for r in rows})
    ended = {rid: NOW - (len(order) - i) * S for i, rid in enumerate(order)}  # the last in `order` ended last
    for r in rows:
        r.update(ended_at=ended[r["rollout_id"]], started_at=ended[r["rollout_id"]] - S)
    write_rows(store, rows)
    monkeypatch.setattr("trainer.dataset_step.now_utc", lambda: datetime.fromtimestamp(NOW / 1e9 + 1, timezone.utc))
    s = train_settings(
        store, min_rollouts=4, max_rollouts=8, max_staleness=1, estimator="reinforce_plus_plus"
    )
    lines: list[str] = []
    out = run_once(s, log=lines.append)
    assert out.status == "trained"
    sel0 = set(read_selection(loc, 0)["rollout_ids"])
    assert sel0 == set(order[-8:])  # the newest 8; the 4 oldest are not consumed
    assert json.loads(read_rounds(loc)[0]["metrics"])["n_rollouts_over_cap"] == 4
    assert "over_cap=4" in lines[-1]
    out = run_once(s, log=lines.append)  # policy@1 serves now and made nothing yet: the stale 4 train
    assert out.status == "trained" and set(read_selection(loc, 1)["rollout_ids"]) == set(order[:4])
