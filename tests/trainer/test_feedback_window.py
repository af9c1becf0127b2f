"""``tracerl train --feedback-window``: late and sparse feedback. Pure functions for the window rules,
a real Parquet/DuckDB store for what the trainer reads (a rollout's latest conversion), and rounds of
the tiny model for the round protocol: waiting rollouts are not trained nor consumed, rollouts closed
without feedback are left out and counted, and a window served by two versions trains the stale
calls with their importance weights."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from store.layout import StoreLayout
from store.location import parse_store
from store.views import connect_readonly
from trainer.dataset import load_transitions
from trainer.feedback_window import RolloutEnd, feedback_split, parse_duration, rollout_ends, split_by_window
from trainer.manifest import read_rounds, read_selection
from trainer.rounds import TrainError, run_once

S = 1_000_000_000
NOW = 1_800_000_000 * S
HOUR = 3600 * S


def test_durations_in_seconds_or_with_a_unit() -> None:
    assert [parse_duration(x) for x in ("0", "600", "600s", "10m", "2h", "1.5d", " 3 H ", 90)] == [
        0,
        600,
        600,
        600,
        7200,
        129600,
        10800,
        90,
    ]
    for bad in ("", "ten minutes", "10w", "-5m", "1e400"):
        with pytest.raises(ValueError, match="feedback-window"):
            parse_duration(bad)


def test_open_windows_wait_closed_ones_train_or_are_left_out_without_feedback() -> None:
    rollouts = [
        RolloutEnd("old-rewarded", NOW - 2 * HOUR, True),
        RolloutEnd("old-silent", NOW - 2 * HOUR, False),
        RolloutEnd("fresh-rewarded", NOW - HOUR // 2, True),  # feedback may still be corrected
        RolloutEnd("fresh-silent", NOW - HOUR // 4, False),
        RolloutEnd("just-closed", NOW - HOUR, True),
        RolloutEnd("no-times", None, True),
    ]
    split = split_by_window(rollouts, 3600, NOW)
    assert split.closed == {"old-rewarded", "just-closed", "no-times"}
    assert split.unrewarded == {"old-silent"}
    assert split.waiting == {"fresh-rewarded": 1800.0, "fresh-silent": 2700.0}
    assert "2 wait on their feedback window (the next closes in 30.0m)" in split.note()
    assert "1 got no feedback" in split.note()
    zero = split_by_window(rollouts, 0, NOW)  # no window: everything as today
    assert zero.closed == {r.rollout_id for r in rollouts} and not zero.waiting and not zero.unrewarded


def _row(
    make_row, rid: str, *, ended: int | None, source: str = "side_channel", conversion: int = 1, **kw
) -> dict:
    row = make_row(rid, **kw)
    row.update(
        ended_at=ended,
        started_at=None if ended is None else ended - S,
        reward_source=source,
        conversion=conversion,
    )
    return row


def test_the_trainer_sees_a_rollouts_latest_conversion(tmp_path: Path, write_rows, make_row) -> None:
    """A rollout converted with the fill reward, then converted again when its feedback arrived: the
    window judges the latest conversion, so it is rewarded (and a filled one is not)."""
    store = tmp_path / "store"
    write_rows(
        store,
        [
            _row(make_row, "late-fb", ended=NOW - 2 * HOUR, source="fill", conversion=1, reward=0.0),
            _row(make_row, "silent", ended=NOW - 2 * HOUR, source="fill", conversion=1, reward=0.0),
        ],
    )
    write_rows(
        store,
        [_row(make_row, "late-fb", ended=NOW - 2 * HOUR, source="side_channel", conversion=2, reward=1.0)],
    )
    con = connect_readonly(parse_store(store))
    rows = load_transitions(con, (0, 0))
    con.close()
    ends = {r.rollout_id: r for r in rollout_ends(rows)}
    assert ends["late-fb"].rewarded and not ends["silent"].rewarded
    assert ends["late-fb"].ended_ns == NOW - 2 * HOUR
    split = feedback_split("1h", rows, set(), NOW)
    assert (split.closed, split.unrewarded) == ({"late-fb"}, {"silent"})
    assert feedback_split("1h", rows, {"silent"}, NOW).unrewarded == set()  # used by an earlier round


def _at(ns: int):
    return lambda: datetime.fromtimestamp(ns / 1e9, timezone.utc)


def _ended(rows: list[dict], ns: int, source: str = "side_channel") -> list[dict]:
    for r in rows:
        r.update(ended_at=ns, started_at=ns - S, reward_source=source)
    return rows


@pytest.mark.slow
def test_rounds_wait_for_the_window_and_train_a_window_served_by_two_versions_with_importance_weights(
    tmp_path: Path, write_rows, make_rollouts, train_settings, monkeypatch
) -> None:
    store = tmp_path / "store"
    layout = StoreLayout.at(store)
    s = train_settings(store, feedback_window="1h", max_staleness=1, min_rollouts=4)
    closed = _ended(make_rollouts(0, n_tasks=2), NOW - 2 * HOUR)  # 8 rollouts, feedback window closed
    waiting = _ended(make_rollouts(0, n_tasks=1), NOW - HOUR // 2)  # served by policy@0, window still open
    for r in waiting:
        r["rollout_id"], r["task_id"] = "wait-" + r["rollout_id"], "wait-" + r["task_id"]
    silent = _ended(
        make_rollouts(0, n_tasks=1, per_task=2), NOW - 2 * HOUR, source="fill"
    )  # no feedback came
    for r in silent:
        r["rollout_id"], r["task_id"] = "silent-" + r["rollout_id"], "silent-" + r["task_id"]
    write_rows(store, closed + waiting + silent)
    monkeypatch.setattr("trainer.dataset_step.now_utc", _at(NOW))
    lines: list[str] = []
    out = run_once(s, log=lines.append)
    assert out.status == "trained" and out.round == 0
    sel = read_selection(layout.location, 0)
    ids = set(sel["rollout_ids"])
    assert {r["rollout_id"] for r in closed} <= ids and {r["rollout_id"] for r in silent} <= ids  # consumed
    assert not any(
        rid.startswith("wait-") for rid in ids
    )  # not trained, not consumed: a later round takes them
    assert not any(
        t.startswith("silent-") for t in sel["transition_ids"]
    )  # left out, not trained on the fill
    m0 = json.loads(read_rounds(layout.location)[0]["metrics"])
    n_wait, n_silent = len({r["rollout_id"] for r in waiting}), len({r["rollout_id"] for r in silent})
    assert (m0["n_rollouts_feedback_waiting"], m0["n_rollouts_unrewarded_at_close"]) == (n_wait, n_silent)
    assert f"feedback_waiting={n_wait} unrewarded_at_close={n_silent}" in lines[-1]

    # policy@1 was published inside the waiting rollouts' window; an hour later it has closed
    fresh = _ended(make_rollouts(1, n_tasks=1), NOW + HOUR - HOUR // 2)  # policy@1's, still open then
    for r in fresh:
        r["rollout_id"], r["task_id"] = "fresh-" + r["rollout_id"], "fresh-" + r["task_id"]
    done1 = _ended(make_rollouts(1, n_tasks=2), NOW)
    write_rows(store, fresh + done1)
    monkeypatch.setattr("trainer.dataset_step.now_utc", _at(NOW + HOUR + S))
    out = run_once(s, log=lines.append)
    assert out.status == "trained" and out.round == 1
    sel1 = read_selection(layout.location, 1)
    assert {r["rollout_id"] for r in waiting} <= set(sel1["rollout_ids"])
    m1 = json.loads(read_rounds(layout.location)[1]["metrics"])
    stale_calls = len(waiting)  # every call of the policy@0 rollouts, one version behind round 1
    assert m1["staleness"] == {"0": len(done1), "1": stale_calls}  # trained, and as stale: not dropped
    assert m1["n_stale_no_logprobs"] == 0 and m1["n_rollouts_feedback_waiting"] == len(
        {r["rollout_id"] for r in fresh}
    )
    # every trained token carries its importance weight pi_old / pi_behaviour, the stale ones included
    response_tokens = sum(len(r["response_token_ids"]) for r in waiting + done1)
    assert m1["is_tokens"] == response_tokens and m1["n_response_tokens"] == response_tokens
    assert 0 < m1["is_weight_min"] <= m1["is_weight_mean"] <= m1["is_weight_max"]
    # policy@1's last rollouts still wait: the next run trains nothing and says why
    out = run_once(s, log=lines.append)
    assert out.status == "waiting" and out.round == 2
    assert f"{len({r['rollout_id'] for r in fresh})} wait on their feedback window" in out.message


@pytest.mark.slow
def test_a_bad_feedback_window_is_refused_with_the_forms_it_takes(tmp_path: Path, train_settings) -> None:
    (tmp_path / "store").mkdir()
    with pytest.raises(TrainError, match=r"10m, 2h, 1d"):
        run_once(train_settings(tmp_path / "store", feedback_window="soon"), log=lambda m: None)
