"""`tracerl promote --once` over a real store (Parquet + DuckDB): decide, record, tell the gateway, resume."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from loop.canary import CanaryRule
from loop.promote import GatewayOrder, promote_once
from schemas.tables import TRANSITIONS_SCHEMA
from store.layout import StoreLayout
from store.location import parse_store
from store.parquet import write_table_atomic
from trainer.manifest import read_rounds, start_version, write_round
from trainer.report import format_table, round_rows

T0 = datetime(2026, 11, 27, 9, 0, tzinfo=timezone.utc)


def rollout_rows(version: int, rewards: list[float], at: datetime, calls: int = 2) -> list[dict]:
    rows = []
    for i, reward in enumerate(rewards):
        rid = f"v{version}-{uuid.uuid4().hex[:8]}"
        for step in range(calls):
            rows.append(
                {
                    "transition_id": f"{rid}-{step}",
                    "rollout_id": rid,
                    "task_id": f"t{i}",
                    "step": step,
                    "model": f"policy@{version}",
                    "policy_version": version,
                    "rollout_reward": reward,
                    "reward": reward,
                    "is_last": step == calls - 1,
                    "started_at": at + timedelta(seconds=i, milliseconds=step),
                }
            )
    return rows


def write_transitions(store: Path, rows: list[dict]) -> None:
    table = pa.Table.from_pylist(rows, schema=TRANSITIONS_SCHEMA)
    write_table_atomic(
        table,
        StoreLayout.at(store).partition("transitions", "2026-11-27") / f"part-{uuid.uuid4().hex}.parquet",
        "transitions",
    )


def canary_store(tmp_path: Path, serving: list[float], candidate: list[float], seed: int = 0) -> Path:
    """Round 0 published policy@1 as a canary at T0 beside policy@0; rollouts of both arms after it, one a
    second in a seeded random order (the test is sequential: live rollouts arrive mixed), and policy@0
    rollouts from before it (all reward 1: outside the window, they must not count)."""
    store = tmp_path / "store"
    write_round(
        parse_store(store),
        {
            "round": 0,
            "policy_version": 0,
            "parent_version": 0,
            "status": "canary",
            "published_at": T0,
            "n_rollouts": 8,
            "timings": "{}",
        },
    )
    write_transitions(store, rollout_rows(0, [1.0] * 50, T0 - timedelta(hours=1)))
    arms = [(0, r) for r in serving] + [(1, r) for r in candidate]
    rows = []
    for pos, i in enumerate(np.random.default_rng(seed).permutation(len(arms))):
        rows += rollout_rows(arms[i][0], [arms[i][1]], T0 + timedelta(seconds=1 + pos))
    if rows:
        write_transitions(store, rows)
    return store


def bernoulli(n: int, p: float) -> list[float]:
    k = round(n * p)
    return [1.0] * k + [0.0] * (n - k)


def test_a_harmed_canary_is_rolled_back_recorded_with_its_numbers_and_the_gateway_told(tmp_path):
    store = canary_store(tmp_path, bernoulli(160, 0.25), bernoulli(40, 0.0))
    told: list[GatewayOrder] = []
    out = promote_once(parse_store(store), tell=told.append, log=lambda m: None)
    assert out.status == "rolled_back" and told == [GatewayOrder("policy@0", "policy@1", 0.0)]
    row = read_rounds(parse_store(store))[0]
    c = json.loads(row["canary"])
    assert row["status"] == "rolled_back"
    # the window: only rollouts after the publish (the 50 earlier ones scored 1.0 would raise serving's mean)
    assert (c["n_serving"], c["n_candidate"]) == (160, 40)
    assert c["mean_serving"] == pytest.approx(0.25) and c["mean_candidate"] == 0.0
    assert c["e_rollback"] >= 20 and c["test"] == "paired-blocks"
    assert (c["serving_version"], c["candidate_version"]) == (0, 1)
    report = format_table(round_rows(parse_store(store)))
    assert "round 0: canary v1 vs v0: rolled_back: candidate 0.000 (n=40) vs serving 0.250 (n=160)" in report
    assert f"evidence {c['e_rollback']:.3g} worse" in report


def test_a_better_canary_is_promoted(tmp_path):
    store = canary_store(tmp_path, bernoulli(160, 0.25), bernoulli(40, 0.6))
    told: list[GatewayOrder] = []
    assert promote_once(parse_store(store), tell=told.append, log=lambda m: None).status == "promoted"
    assert (
        told == [GatewayOrder("policy@0", "policy@1", 1.0)]
        and read_rounds(parse_store(store))[0]["status"] == "promoted"
    )


def test_too_few_rollouts_waits_and_records_the_look(tmp_path):
    store = canary_store(tmp_path, bernoulli(40, 0.25), bernoulli(10, 0.0))
    told: list[GatewayOrder] = []
    out = promote_once(parse_store(store), tell=told.append, log=lambda m: None)
    assert out.status == "canary" and told == [
        GatewayOrder("policy@0", "policy@1", None)
    ]  # the pair, its share as is
    c = json.loads(read_rounds(parse_store(store))[0]["canary"])
    assert c["action"] == "wait" and c["n_candidate"] == 10 and "each arm needs 20" in c["reason"]


def test_killed_before_the_gateway_heard_the_next_run_tells_it_the_recorded_decision(tmp_path):
    store = canary_store(tmp_path, bernoulli(160, 0.25), bernoulli(40, 0.0))

    def gateway_down(order: GatewayOrder) -> None:
        raise RuntimeError("gateway http://127.0.0.1:1 unreachable")

    with pytest.raises(RuntimeError):
        promote_once(parse_store(store), tell=gateway_down, log=lambda m: None)
    assert (
        read_rounds(parse_store(store))[0]["status"] == "rolled_back"
    )  # recorded before the gateway was told
    # more rollouts arrive; the rerun does not decide again, it pushes what was decided
    write_transitions(store, rollout_rows(1, bernoulli(200, 0.9), T0 + timedelta(minutes=5)))
    told: list[GatewayOrder] = []
    assert promote_once(parse_store(store), tell=told.append, log=lambda m: None).status == "rolled_back"
    assert told == [GatewayOrder("policy@0", "policy@1", 0.0)]


def test_an_undecided_canary_rerun_from_scratch_gives_the_same_decision(tmp_path):
    # killed before the manifest was written: the decision is a pure function of the store
    a = canary_store(tmp_path / "a", bernoulli(160, 0.25), bernoulli(40, 0.0))
    first = promote_once(parse_store(a), rule=CanaryRule(min_per_arm=1000), log=lambda m: None)  # waits
    assert first.status == "canary"
    again = promote_once(parse_store(a), log=lambda m: None)
    assert again.status == "rolled_back" and again.decision.n_candidate == 40


def test_nothing_to_decide_without_a_canary_round(tmp_path):
    store = tmp_path / "store"
    write_round(parse_store(store), {"round": 0, "policy_version": 0, "status": "published", "timings": "{}"})
    assert promote_once(parse_store(store), log=lambda m: None).status == "nothing"


def test_the_round_after_a_rollback_starts_from_the_version_that_kept_serving():
    rounds = {
        0: {"status": "published", "parent_version": 0},
        1: {"status": "rolled_back", "parent_version": 1},
    }
    assert start_version(rounds, 1) == 1 and start_version(rounds, 2) == 1
    # two rollbacks in a row still go back to the last version that served
    rounds[2] = {"status": "rolled_back", "parent_version": 1}
    assert start_version(rounds, 3) == 1
    # manifests written before parent_version existed: a round started from its own number
    assert start_version({0: {"status": "rolled_back", "parent_version": None}}, 1) == 0
    assert start_version({0: {"status": "promoted", "parent_version": 0}}, 1) == 1


def test_cli_promote_once_tells_a_real_gateway_and_says_when_it_cannot(tmp_path, capsys):
    import socket

    from serving.gateway.proxy import Gateway, GatewayConfig
    from tracerl.cli import main

    store = canary_store(tmp_path, bernoulli(160, 0.25), bernoulli(40, 0.0))
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert main(["promote", "--once", "--store", str(store), "--gateway", dead]) == 1
    assert (
        "unreachable" in capsys.readouterr().out
        and read_rounds(parse_store(store))[0]["status"] == "rolled_back"
    )
    from opentelemetry.sdk.trace import TracerProvider
    from weights_rig import weights_server

    a, b = weights_server(None), weights_server("1")  # policy@0 untouched on a, policy@1 reloaded on b
    cfg = GatewayConfig(canary=0.2, upstream_for={"policy@0": a.url, "policy@1": b.url})
    gw = Gateway(("127.0.0.1", 0), cfg, TracerProvider()).start_background()
    try:
        assert main(["promote", "--once", "--store", str(store), "--gateway", gw.url + "/v1"]) == 0
        assert gw.route.fraction == 0.0  # rolled back: every new rollout to policy@0
        assert (gw.route.serving.upstream, gw.route.candidate.upstream) == (a.url, b.url)
        b.weights.tag = "7"  # policy@1 is served nowhere now: the gateway refuses, promote says so
        assert main(["promote", "--once", "--store", str(store), "--gateway", gw.url]) == 1
        assert "409" in capsys.readouterr().out and gw.route.fraction == 0.0
    finally:
        gw.stop()
        a.stop()
        b.stop()
    assert main(["promote", "--store", str(store)]) == 2  # --once is required
    assert main(["report", "--store", str(store), "--no-plot"]) == 0
    assert "canary v1 vs v0: rolled_back" in capsys.readouterr().out


def test_the_viewer_shows_the_decision_with_its_numbers(tmp_path):
    from starlette.testclient import TestClient

    from ui.app import UiConfig, make_app

    store = canary_store(tmp_path, bernoulli(160, 0.25), bernoulli(40, 0.0))
    promote_once(parse_store(store), log=lambda m: None)
    html = TestClient(make_app(UiConfig(store=parse_store(store)))).get("/rounds").text
    assert "rolled_back" in html and "policy@1 0.000 (n=40) vs policy@0 0.250 (n=160)" in html


def test_train_watch_decides_with_its_gateway_and_says_when_the_gateway_cannot_be_told(tmp_path, capsys):
    import socket

    from tracerl.commands.train import canary_decision
    from trainer.config import TrainSettings

    store = canary_store(tmp_path, bernoulli(160, 0.25), bernoulli(40, 0.0))
    assert canary_decision(TrainSettings(store=str(store), canary=True)) is None  # cron decides instead
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    decide = canary_decision(TrainSettings(store=str(store), canary=True, gateway=dead))
    decide()  # the watch goes on: said, and told again at the next poll
    out = capsys.readouterr().out
    assert "rolled back" in out and "unreachable" in out and "next poll tells the gateway again" in out
    assert read_rounds(parse_store(store))[0]["status"] == "rolled_back"


def stream_store(tmp_path: Path, p_serving: float, p_candidate: float, n: int, seed: int) -> Path:
    """A canary window of ``n`` rollouts in arrival order, each on the candidate with probability 0.2."""
    rng = np.random.default_rng(seed)
    store = canary_store(tmp_path, [], [])
    rows = []
    for i in range(n):
        cand = bool(rng.random() < 0.2)
        reward = float(rng.random() < (p_candidate if cand else p_serving))
        rows += rollout_rows(int(cand), [reward], T0 + timedelta(seconds=1 + i))
    write_transitions(store, rows)
    return store


def test_a_window_is_decided_in_the_order_its_rollouts_began(tmp_path):
    """The store's window, read in order, gives the decision the pure function gives on the same stream."""
    from loop.canary import decide
    from loop.promote import arm_sequence

    store = stream_store(tmp_path, 0.25, 0.0, 600, seed=3)
    cand, x = arm_sequence(parse_store(store), 0, 1, T0)
    out = promote_once(parse_store(store), log=lambda m: None)
    assert out.status == "rolled_back" and "the candidate is worse" in out.decision.reason
    assert out.decision == decide(cand, x) and cand.size == 600
    line = format_table(round_rows(parse_store(store)))
    assert "evidence" in line and "in [" not in line.split("round 0: canary")[1]


def test_a_sound_canary_is_promoted_and_too_few_wait(tmp_path):
    few = stream_store(tmp_path / "few", 0.25, 0.25, 60, seed=4)
    assert promote_once(parse_store(few), log=lambda m: None).status == "canary"
    store = stream_store(tmp_path, 0.25, 0.45, 1200, seed=5)
    assert promote_once(parse_store(store), log=lambda m: None).status == "promoted"
