"""Rounds with a canary: a rolled-back round's data is kept and the next round trains from the version
that kept serving, never from the rolled-back weights (real store, tiny model, CPU)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from loop.promote import GatewayOrder, promote_once
from store.location import parse_store
from trainer.checkpoint import checkpoint_dir, read_manifest
from trainer.manifest import read_rounds
from trainer.rounds import PublishRequest, run_once, watch

pytestmark = pytest.mark.slow  # builds the tiny model and trains it


def dated(rows: list[dict], at) -> list[dict]:
    return [{**r, "started_at": at + timedelta(milliseconds=i)} for i, r in enumerate(rows)]


def renamed(rows: list[dict], reward: float | None = None, prefix: str = "w-") -> list[dict]:
    """The rows as new rollouts (ids of their own: ``prefix`` + the old id), scoring ``reward`` when given."""
    score = {} if reward is None else {"reward": reward, "rollout_reward": reward}
    return [{**r, "rollout_id": prefix + r["rollout_id"], **score} for r in rows]


def test_rolled_back_round_is_kept_and_the_next_round_trains_from_the_serving_version(
    tmp_path, write_rows, make_rollouts, train_settings
):
    store = tmp_path / "store"
    published: list[PublishRequest] = []
    write_rows(store, make_rollouts(0))
    assert (
        run_once(train_settings(store), publisher=published.append, log=print).status == "published"
    )  # policy@1
    write_rows(store, make_rollouts(1))
    s = train_settings(store, canary=True)
    assert run_once(s, publisher=published.append, log=print).status == "canary"  # round 1: policy@2 canary
    assert run_once(s, publisher=published.append, log=print).status == "waiting"  # undecided: no round 2 yet
    at = read_rounds(parse_store(store))[1]["published_at"]
    # the canary window: policy@1 keeps its rewards (mean about 0.5), policy@2 collapsed to 0
    write_rows(store, dated(renamed(make_rollouts(1, n_tasks=8, per_task=5)), at + timedelta(seconds=1)))
    write_rows(store, dated(renamed(make_rollouts(2, n_tasks=6, per_task=5), 0.0), at + timedelta(seconds=1)))
    told: list[GatewayOrder] = []
    assert promote_once(parse_store(store), tell=told.append, log=print).status == "rolled_back"
    assert told == [GatewayOrder("policy@1", "policy@2", 0.0)]
    rounds = read_rounds(parse_store(store))
    assert rounds[1]["status"] == "rolled_back" and json.loads(rounds[1]["canary"])["n_candidate"] >= 20
    assert checkpoint_dir(store / "checkpoints", 2).exists()  # the rolled-back weights and data are kept
    # round 2 trains from policy@1's checkpoint on policy@1's rollouts, and publishes policy@3
    out = run_once(train_settings(store, min_rollouts=4, canary=True), publisher=published.append, log=print)
    assert out.status == "canary" and out.round == 2
    row = read_rounds(parse_store(store))[2]
    assert (row["policy_version"], row["parent_version"]) == (1, 1)
    man = read_manifest(checkpoint_dir(store / "checkpoints", 3))
    assert man["parent"] == str(checkpoint_dir(store / "checkpoints", 1)) and man["trained_on_version"] == 1
    assert man["publishes"] == "policy@3" and [p.name for p in published] == [
        "policy@1",
        "policy@2",
        "policy@3",
    ]
    chosen = set(man["selection"]["rollout_ids"])
    assert chosen and all(r.startswith("w-v1-") for r in chosen)  # the window's serving rollouts


def test_train_watch_decides_its_undecided_canary_between_polls_and_goes_on_from_the_serving_version(
    tmp_path, write_rows, make_rollouts, train_settings
):
    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    assert run_once(train_settings(store), publisher=lambda r: None, log=print).status == "published"
    write_rows(store, make_rollouts(1))
    s = train_settings(store, canary=True, min_rollouts=4)
    assert run_once(s, publisher=lambda r: None, log=print).status == "canary"  # round 1: policy@2
    at = read_rounds(parse_store(store))[1]["published_at"]
    write_rows(store, dated(renamed(make_rollouts(1, n_tasks=8, per_task=5)), at + timedelta(seconds=1)))
    write_rows(store, dated(renamed(make_rollouts(2, n_tasks=6, per_task=5), 0.0), at + timedelta(seconds=1)))
    told: list[GatewayOrder] = []
    polls: list[float] = []
    decide = lambda: promote_once(parse_store(store), tell=told.append, log=print)  # noqa: E731
    s.max_rounds = 1
    assert watch(s, publisher=lambda r: None, log=print, sleep=polls.append, between=decide) == 1
    rounds = read_rounds(parse_store(store))
    assert rounds[1]["status"] == "rolled_back" and told[0] == GatewayOrder("policy@1", "policy@2", 0.0)
    assert len(polls) == 1  # one idle poll: the decision, then round 2 trained at the next
    assert (rounds[2]["status"], rounds[2]["parent_version"]) == ("canary", 1)  # from the serving policy@1


def test_a_candidate_failing_the_eval_gate_never_becomes_a_canary_and_the_next_round_trains_from_serving(
    tmp_path, write_rows, make_rollouts, train_settings
):
    """--gate-tasks wiring (loop/gate.py): the gate's verdict comes back through the gated publisher; the
    held-out rewards are given here (the gate against real servers: tests/loop/test_gate.py)."""
    import dataclasses

    from loop.gate import gate_decision
    from trainer.publish import gated
    from trainer.report import canary_line

    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    assert run_once(train_settings(store), publisher=lambda r: None, log=print).status == "published"
    write_rows(store, make_rollouts(1))
    held_out = iter([([1, 1, 0, 1], [0, 0, 0, 0]), ([1, 1, 0, 1], [1, 0, 1, 1])])  # harmed, then sound

    def gate(req: PublishRequest):
        s, c = next(held_out)
        g = gate_decision(s, c, margin=0.05)
        return dataclasses.replace(g, serving_version=req.serving_version, candidate_version=req.version)

    loaded: list[PublishRequest] = []
    s = train_settings(store, canary=True, min_rollouts=4)
    out = run_once(s, publisher=gated(loaded.append, gate), log=print)
    assert (out.status, out.round) == ("rolled_back", 1) and [p.name for p in loaded] == ["policy@2"]
    row = read_rounds(parse_store(store))[1]
    rec = json.loads(row["canary"])
    assert (rec["serving_version"], rec["candidate_version"], rec["gate"]["passed"]) == (1, 2, False)
    assert rec["gate"]["success_candidate"] == 0.0 and rec["gate"]["success_serving"] == 0.75
    assert "eval gate v2 vs v1: rolled_back" in canary_line(1, row["status"], rec)
    told: list[GatewayOrder] = []  # promote finds it decided and keeps the gateway off it (share 0)
    assert promote_once(parse_store(store), tell=told.append, log=print).status == "rolled_back"
    assert told == [GatewayOrder("policy@1", "policy@2", 0.0)]
    # round 2 trains from policy@1 (never the gated weights), passes the gate and becomes the canary
    at = row["published_at"]
    write_rows(store, dated(renamed(make_rollouts(1, n_tasks=8, per_task=5)), at + timedelta(seconds=1)))
    out = run_once(s, publisher=gated(loaded.append, gate), log=print)
    assert (out.status, out.round) == ("canary", 2)
    row = read_rounds(parse_store(store))[2]
    assert (row["parent_version"], json.loads(row["canary"])["gate"]["passed"]) == (1, True)
    # the canary's decision keeps the gate's numbers beside its own
    at = row["published_at"]
    # the serving arm's rollouts are new ones: with the ids of round 2's training rows, each would have begun
    # when those did, before the canary was published, and fall out of its window when round 2 took over 1 s
    write_rows(
        store, dated(renamed(make_rollouts(1, n_tasks=8, per_task=5), 1.0, "s-"), at + timedelta(seconds=1))
    )
    write_rows(store, dated(renamed(make_rollouts(3, n_tasks=6, per_task=5), 0.0), at + timedelta(seconds=1)))
    assert promote_once(parse_store(store), log=print).status == "rolled_back"
    rec = json.loads(read_rounds(parse_store(store))[2]["canary"])
    assert rec["gate"]["passed"] and rec["n_candidate"] >= 20
