"""The round protocol end to end on a real Parquet store with the tiny model (CPU).

Versions: the base model is policy@0; round k trains on transitions of policy_version k and
publishes policy@k+1 (trainer/rounds.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from store.layout import StoreLayout
from trainer.checkpoint import checkpoint_dir, read_manifest
from trainer.manifest import read_rounds, selection_path, train_lock, write_round
from trainer.rounds import PublishRequest, run_once

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)

REPO = Path(__file__).resolve().parents[2]


def snapshot(store: Path) -> dict[str, float]:
    return {str(p.relative_to(store)): p.stat().st_mtime_ns for p in store.rglob("*")
            if p.is_file() and not p.name.startswith(".")}


@pytest.mark.slow
def test_two_rounds_end_to_end_then_rerun_is_a_no_op(tmp_path, tiny_model_dir, write_rows, make_rollouts,
                                                      train_settings):
    store = tmp_path / "store"
    v0 = make_rollouts(0)
    v1 = make_rollouts(1)
    v2 = make_rollouts(2, n_tasks=1)  # 4 rollouts: below --min-rollouts
    write_rows(store, v0 + v2)
    write_rows(store, v1, date="2026-11-22")
    published: list[PublishRequest] = []
    s = train_settings(store)

    first = run_once(s, publisher=published.append, log=lambda m: None)
    second = run_once(s, publisher=published.append, log=lambda m: None)
    assert (first.status, first.round, second.status, second.round) == ("published", 0, "published", 1)

    layout = StoreLayout.at(store)
    rounds = read_rounds(layout.location)
    assert [r["status"] for r in rounds.values()] == ["published", "published"]
    assert [r["policy_version"] for r in rounds.values()] == [0, 1]
    assert rounds[1]["n_rollouts"] == 12 and rounds[1]["n_transitions"] == len(v1)
    assert rounds[0]["mean_reward"] == pytest.approx(sum(r["reward"] for r in {x["rollout_id"]: x for x in v0}.values())
                                                     / 12)
    for k in (0, 1):
        ckpt = checkpoint_dir(layout.checkpoints, k + 1)
        assert rounds[k]["checkpoint_path"] == str(ckpt)
        assert (ckpt / "config.json").exists() and (ckpt / "model.safetensors").exists()
        assert (ckpt / "optimizer.pt").exists() and (ckpt / "tokenizer.json").exists()
        man = read_manifest(ckpt)
        assert man["round"] == k and man["publishes"] == f"policy@{k + 1}" and man["adapter"] is False
        assert "git_sha" in man and man["settings"]["lr"] == 1e-3
    # the second round trained on version-1 rollouts only
    sel1 = json.loads(Path(selection_path(layout.location, 1)).read_text())
    assert set(sel1["rollout_ids"]) == {r["rollout_id"] for r in v1}
    assert set(sel1["transition_ids"]) == {r["transition_id"] for r in v1}
    assert [(p.name, p.version, p.adapter) for p in published] == [("policy@1", 1, False), ("policy@2", 2, False)]

    # the weights really changed, and round 1 started from round 0's checkpoint
    from safetensors.torch import load_file

    w0 = load_file(str(tiny_model_dir / "model.safetensors"))
    w1 = load_file(str(checkpoint_dir(layout.checkpoints, 1) / "model.safetensors"))
    w2 = load_file(str(checkpoint_dir(layout.checkpoints, 2) / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    assert not w0[name].equal(w1[name]) and not w1[name].equal(w2[name])

    before = snapshot(store)
    again = run_once(s, publisher=published.append, log=lambda m: None)
    assert again.status == "waiting" and again.round == 2
    assert snapshot(store) == before and len(published) == 2

    # more policy@2 rollouts arrive: round 2 trains on exactly the version-2 ones, old and new
    more_v2 = make_rollouts(2, n_tasks=2)
    for r in more_v2:
        r["rollout_id"], r["task_id"] = "more-" + r["rollout_id"], "more-" + r["task_id"]
    write_rows(store, more_v2)
    third = run_once(s, publisher=published.append, log=lambda m: None)
    assert (third.status, third.round) == ("published", 2)
    sel2 = json.loads(Path(selection_path(layout.location, 2)).read_text())
    assert set(sel2["rollout_ids"]) == {r["rollout_id"] for r in v2 + more_v2}
    assert published[-1].name == "policy@3"


@pytest.mark.slow
def test_kill_during_a_round_then_rerun_resumes_and_finishes(tmp_path, tiny_model_dir, write_rows,
                                                              make_rollouts, train_settings):
    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    script = textwrap.dedent(f"""
        import os, signal
        from trainer.config import TrainSettings
        from trainer.rounds import run_once
        s = TrainSettings(store={str(store)!r}, model={str(tiny_model_dir)!r}, min_rollouts=8, lr=1e-3,
                          progress=False, pack_tokens=64, steps_per_epoch=3)
        def die(step, metrics):
            print("killing after optimizer step", step, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        run_once(s, on_step=die)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert "killing after optimizer step 1" in proc.stdout
    layout = StoreLayout.at(store)
    assert read_rounds(layout.location)[0]["status"] == "started"
    assert not checkpoint_dir(layout.checkpoints, 1).exists()
    selection = Path(selection_path(layout.location, 0)).read_text()

    logs: list[str] = []
    out = run_once(train_settings(store, pack_tokens=64, steps_per_epoch=3), log=logs.append)
    assert out.status == "trained" and out.round == 0 and out.trained
    assert any("(resumed)" in m for m in logs)
    assert Path(selection_path(layout.location, 0)).read_text() == selection  # the same rollouts, not a new pick
    assert read_rounds(layout.location)[0]["status"] == "trained"
    assert read_manifest(checkpoint_dir(layout.checkpoints, 1))["metrics"]["optimizer_steps"] == 3
    assert not list(layout.checkpoints.glob(".policy-*"))  # no temp dirs left behind


@pytest.mark.slow
def test_checkpoint_renamed_before_the_kill_is_adopted_not_retrained(tmp_path, write_rows, make_rollouts,
                                                                      train_settings):
    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    s = train_settings(store)
    run_once(s, log=lambda m: None)
    layout = StoreLayout.at(store)
    row = read_rounds(layout.location)[0]
    write_round(layout.location, {**row, "status": "started"})  # as if killed between rename and manifest update
    ckpt = checkpoint_dir(layout.checkpoints, 1)
    mtime = (ckpt / "model.safetensors").stat().st_mtime_ns
    logs: list[str] = []
    out = run_once(s, log=logs.append)
    assert out.status == "trained" and any("adopting checkpoint" in m for m in logs)
    assert (ckpt / "model.safetensors").stat().st_mtime_ns == mtime
    assert read_rounds(layout.location)[0]["loss"] == pytest.approx(row["loss"])


@pytest.mark.slow
def test_a_trained_but_unpublished_round_is_published_by_the_next_run(tmp_path, write_rows, make_rollouts,
                                                                       train_settings):
    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    s = train_settings(store)

    def down(req: PublishRequest) -> None:
        raise ConnectionError("server down")

    with pytest.raises(ConnectionError):
        run_once(s, publisher=down, log=lambda m: None)
    layout = StoreLayout.at(store)
    assert read_rounds(layout.location)[0]["status"] == "trained"
    got: list[PublishRequest] = []
    out = run_once(s, publisher=got.append, log=lambda m: None)
    assert out.status == "published" and not out.trained and [g.name for g in got] == ["policy@1"]
    assert read_rounds(layout.location)[0]["published_at"] is not None


@pytest.mark.slow
def test_a_held_lock_makes_once_a_no_op(tmp_path, write_rows, make_rollouts, train_settings):
    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    with train_lock(StoreLayout.at(store).location) as got:
        assert got
        out = run_once(train_settings(store), log=lambda m: None)
    assert out.status == "locked" and read_rounds(StoreLayout.at(store).location) == {}


@pytest.mark.slow
def test_lora_rounds_write_adapters_and_chain(tmp_path, write_rows, make_rollouts, train_settings):
    store = tmp_path / "store"
    write_rows(store, make_rollouts(0) + make_rollouts(1))
    s = train_settings(store, lora_rank=4, kl_coef=0.05)
    got: list[PublishRequest] = []
    run_once(s, publisher=got.append, log=lambda m: None)
    run_once(s, publisher=got.append, log=lambda m: None)
    layout = StoreLayout.at(store)
    for v in (1, 2):
        ckpt = checkpoint_dir(layout.checkpoints, v)
        assert (ckpt / "adapter_config.json").exists() and (ckpt / "adapter_model.safetensors").exists()
        assert not (ckpt / "model.safetensors").exists()
    assert [g.adapter for g in got] == [True, True]
    rounds = read_rounds(layout.location)
    assert rounds[1]["kl"] > 0.0  # round 1 starts from round 0's adapter: it has moved away from the base

    from safetensors.torch import load_file

    a1 = load_file(str(checkpoint_dir(layout.checkpoints, 1) / "adapter_model.safetensors"))
    a2 = load_file(str(checkpoint_dir(layout.checkpoints, 2) / "adapter_model.safetensors"))
    key = next(k for k in a1 if "lora_B" in k)
    assert a1[key].abs().sum() > 0 and not a1[key].equal(a2[key])


@pytest.mark.slow
def test_cli_train_once_and_report(tmp_path, tiny_model_dir, write_rows, capsys, make_rollouts):
    from tracerl.cli import main

    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    args = ["--store", str(store), "--model", str(tiny_model_dir), "--min-rollouts", "8", "--no-progress",
            "--lr", "1e-3", "--pack-tokens", "128", "--max-prompt-tokens", "96", "--max-response-tokens", "32"]
    assert main(["train", "--once", *args]) == 0
    out = capsys.readouterr().out
    assert "round 0: policy@0 -> policy@1 status=trained rollouts=12" in out
    assert main(["train", "--once", *args]) == 0
    assert "waiting" in capsys.readouterr().out
    png = tmp_path / "r.png"
    assert main(["report", "--store", str(store), "--out", str(png)]) == 0
    table = capsys.readouterr().out
    assert "mean_reward" in table.splitlines()[0] and "trained" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["train", "--once", "--store", str(store)]) == 2  # no --model: usage error names the fix
    assert "tracerl init-model" in capsys.readouterr().err
    assert main(["train", "--once", *args, "--pack-tokens", "64"]) == 2
    assert "raise it or lower those" in capsys.readouterr().err


@pytest.mark.slow
def test_watch_trains_each_version_as_its_transitions_arrive(tmp_path, write_rows, make_rollouts,
                                                              train_settings):
    from trainer.rounds import watch

    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    naps: list[float] = []

    def sleep(seconds: float) -> None:
        # while the trainer waits for policy@1 data, the agents produce it
        naps.append(seconds)
        write_rows(store, make_rollouts(len(naps)))

    got: list[PublishRequest] = []
    n = watch(train_settings(store, max_rounds=2, poll_s=0.5), publisher=got.append,
              log=lambda m: None, sleep=sleep)
    assert n == 2 and naps == [0.5]
    assert [g.name for g in got] == ["policy@1", "policy@2"]
    rounds = read_rounds(StoreLayout.at(store).location)
    assert [(r["round"], r["status"]) for r in rounds.values()] == [(0, "published"), (1, "published")]


@pytest.mark.slow
def test_staleness_lets_a_round_use_unused_older_rollouts_once(tmp_path, write_rows, make_rollouts,
                                                                train_settings):
    store = tmp_path / "store"
    v0 = make_rollouts(0)
    late_v0 = make_rollouts(0, n_tasks=2)  # arrive after round 0 started
    for r in late_v0:
        r["rollout_id"] = "late-" + r["rollout_id"]
        r["task_id"] = "late-" + r["task_id"]
    v1 = make_rollouts(1)
    write_rows(store, v0)
    s = train_settings(store, max_staleness=1)
    run_once(s, log=lambda m: None)
    write_rows(store, late_v0 + v1)
    run_once(s, log=lambda m: None)
    layout = StoreLayout.at(store)
    sel0 = set(json.loads(Path(selection_path(layout.location, 0)).read_text())["rollout_ids"])
    sel1 = set(json.loads(Path(selection_path(layout.location, 1)).read_text())["rollout_ids"])
    assert sel0 == {r["rollout_id"] for r in v0}
    assert sel1 == {r["rollout_id"] for r in late_v0 + v1}  # old-but-unused in, already-used out
    assert not sel0 & sel1


@pytest.mark.slow
def test_every_trains_below_min_rollouts_once_the_interval_has_passed(tmp_path, write_rows, make_rollouts,
                                                                       train_settings):
    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))  # 12 rollouts
    assert run_once(train_settings(store, min_rollouts=100), log=lambda m: None).status == "waiting"
    out = run_once(train_settings(store, min_rollouts=100, every=3600), log=lambda m: None)
    assert out.status == "trained" and out.round == 0  # no earlier round: the interval is due
    write_rows(store, make_rollouts(1))
    out = run_once(train_settings(store, min_rollouts=100, every=3600), log=lambda m: None)
    assert out.status == "waiting"  # round 0 started less than an hour ago
    out = run_once(train_settings(store, min_rollouts=100, every=0.001, kl_coef=0.1),
                   log=lambda m: None)
    assert out.status == "trained" and out.round == 1
    assert out.row["kl"] > 0.0  # full fine-tune: KL to a frozen copy of the base, which round 0 moved away from


@pytest.mark.slow
def test_tracerl_train_command_smoke(tmp_path, tiny_model_dir, write_rows, make_rollouts):
    """cleanrl-style: the installed ``tracerl`` entry point trains two optimizer steps on CPU."""
    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    exe = Path(sys.executable).parent / "tracerl"
    cmd = [str(exe), "train", "--once", "--store", str(store), "--model", str(tiny_model_dir), "--min-rollouts", "4",
           "--steps-per-epoch", "2", "--pack-tokens", "64", "--max-prompt-tokens", "48", "--max-response-tokens", "16",
           "--lr", "1e-3", "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    line = next(m for m in proc.stdout.splitlines() if m.startswith("round 0: policy@0 -> policy@1"))
    assert "status=trained" in line and "steps=2" in line
    report = subprocess.run([str(exe), "report", "--store", str(store), "--no-plot"], capture_output=True, text=True,
                            timeout=60)
    assert report.returncode == 0 and "trained" in report.stdout


def test_a_round_of_all_distinct_tasks_trains_with_the_group_free_estimator(tmp_path, write_rows, make_rollouts,
                                                                             train_settings):
    """A service's traffic: twelve requests, twelve tasks, varied rewards. grpo finds only singleton groups
    and writes nothing; the default (auto) picks REINFORCE++, trains, and the manifest says why."""
    store = tmp_path / "store"
    write_rows(store, make_rollouts(0, n_tasks=12, per_task=1))
    logs: list[str] = []
    out = run_once(train_settings(store, estimator="grpo"), log=logs.append)
    assert out.status == "waiting" and "zero-reward-variance" in logs[-1] and "nothing written" in logs[-1]
    out = run_once(train_settings(store), log=logs.append)
    assert out.status == "trained" and out.round == 0
    row = read_rounds(StoreLayout.at(store).location)[0]
    assert row["estimator"] == "reinforce_plus_plus" and row["n_rollouts"] == 12
    assert row["estimator_reason"].startswith("auto: 0 of 12 rollouts share their task")
    assert "estimator=reinforce_plus_plus" in logs[-1]


def test_rounds_written_before_the_estimator_columns_still_read(tmp_path, write_rows, make_rollouts, train_settings):
    """A manifest file of the old schema (no estimator columns) sits beside a new one: both read, the old
    one with nulls, and the report shows it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from schemas.tables import ROUNDS_SCHEMA
    from trainer.report import format_table, round_rows

    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    run_once(train_settings(store), log=lambda m: None)
    layout = StoreLayout.at(store)
    new = read_rounds(layout.location)[0]
    old_schema = pa.schema([f for f in ROUNDS_SCHEMA if f.name not in ("estimator", "estimator_reason")])
    old = {k: v for k, v in new.items() if k in old_schema.names} | {"round": 7}
    part = store / "rounds" / "date=2026-01-01"
    part.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([old], schema=old_schema), part / "round-000007.parquet")
    rounds = read_rounds(layout.location)
    assert rounds[7]["estimator"] is None and rounds[0]["estimator"] == "grpo"
    assert rounds[0]["estimator_reason"].startswith("auto: 12 of 12 rollouts share their task")
    table = format_table(round_rows(layout.location))
    assert "round 0: estimator grpo: auto: 12 of 12" in table and table.count("\n") == 3
