"""Asynchronous rounds (``--max-staleness K``): the window, the group rule, stale calls without
logprobs, the dropped-and-counted rule and exactly-once use across a kill -9, on a real Parquet
store with the tiny model (CPU). The loss itself is checked by hand in ``test_loss.py``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from store.layout import StoreLayout
from store.location import parse_store
from store.views import connect_readonly
from trainer.checkpoint import checkpoint_dir, read_manifest
from trainer.dataset import DatasetConfig, build_samples, load_transitions
from trainer.manifest import read_rounds, selection_path
from trainer.rounds import run_once

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)

REPO = Path(__file__).resolve().parents[2]


def ids_row(make_row, tokenizer, rid: str, *, task: str, version: int, reward: float, step: int = 0,
            is_last: bool = True, logprobs: bool = True) -> dict:
    p = tokenizer(f"question of {task}", add_special_tokens=False)["input_ids"]
    r = [*tokenizer(f"answer {rid} {step}", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    if not logprobs:  # a call recorded without token ids: retokenized, no engine logprobs
        return make_row(rid, task_id=task, step=step, version=version, reward=reward, is_last=is_last,
                        prompt=f"question of {task}", response=f"answer {rid}")
    return make_row(rid, task_id=task, step=step, version=version, reward=reward, is_last=is_last,
                    prompt_ids=p, response_ids=r, logprobs=[-1.5] * len(r))


def loaded(store: Path, lo: int, hi: int):
    con = connect_readonly(parse_store(store))
    try:
        return load_transitions(con, (lo, hi))
    finally:
        con.close()


def test_the_window_takes_each_rollout_by_the_version_it_started_on(tmp_path, write_rows, make_row, tokenizer):
    store = tmp_path / "store"
    write_rows(store, [
        ids_row(make_row, tokenizer, "straddles", task="t", version=0, reward=1.0, step=0, is_last=False),
        ids_row(make_row, tokenizer, "straddles", task="t", version=1, reward=1.0, step=1),  # after a publish
        ids_row(make_row, tokenizer, "old", task="t", version=0, reward=0.0),
        ids_row(make_row, tokenizer, "new", task="t", version=1, reward=0.0),
        ids_row(make_row, tokenizer, "newer", task="t", version=2, reward=0.0),
    ])
    rows = loaded(store, 1, 2)
    assert sorted(set(rows["rollout_id"].to_pylist())) == ["new", "newer"]  # 'straddles' started on 0
    rows = loaded(store, 0, 1)
    assert sorted(set(rows["rollout_id"].to_pylist())) == ["new", "old", "straddles"]
    by_id = {(r["rollout_id"], r["step"]): r for r in rows.to_pylist()}
    assert by_id[("straddles", 1)]["rollout_version"] == 0 and by_id[("straddles", 1)]["call_version"] == 1
    assert by_id[("straddles", 0)]["rollout_complete"]  # both of its calls came along: complete


def test_a_task_group_is_every_selected_rollout_of_the_task_whatever_its_version(tmp_path, write_rows, make_row,
                                                                                  tokenizer):
    store = tmp_path / "store"
    write_rows(store, [ids_row(make_row, tokenizer, f"v{v}-r{i}", task="t", version=v, reward=float(i))
                       for v in (0, 1) for i in (0, 1)])
    samples, stats = build_samples(loaded(store, 0, 1), tokenizer, DatasetConfig(), trained_version=1)
    assert stats.n_groups == 1 and len(samples) == 4  # one group of four, not two groups of two
    adv = {s.rollout_id: s.advantage for s in samples}
    assert adv["v0-r1"] == adv["v1-r1"] > 0 > adv["v0-r0"] == adv["v1-r0"]  # one baseline for all four
    assert stats.staleness == {0: 2, 1: 2}
    assert {s.rollout_id: s.staleness for s in samples} == {"v0-r0": 1, "v0-r1": 1, "v1-r0": 0, "v1-r1": 0}


def test_a_stale_call_without_engine_logprobs_is_dropped_and_counted_or_trained_by_setting(
        tmp_path, write_rows, make_row, tokenizer):
    store = tmp_path / "store"
    write_rows(store, [
        ids_row(make_row, tokenizer, "old-retok", task="t", version=0, reward=1.0, logprobs=False),
        ids_row(make_row, tokenizer, "old-exact", task="t", version=0, reward=0.0),
        ids_row(make_row, tokenizer, "new-retok", task="t", version=1, reward=0.5, logprobs=False),
    ])
    rows = loaded(store, 0, 1)
    samples, stats = build_samples(rows, tokenizer, DatasetConfig(), trained_version=1)
    assert sorted(s.rollout_id for s in samples) == ["new-retok", "old-exact"]  # on-policy retokenized: kept
    assert stats.n_stale_no_logprobs == 1 and stats.staleness == {0: 1, 1: 1}
    samples, stats = build_samples(rows, tokenizer, DatasetConfig(stale_without_logprobs="train"), trained_version=1)
    assert sorted(s.rollout_id for s in samples) == ["new-retok", "old-exact", "old-retok"]
    assert stats.n_stale_no_logprobs == 1 and stats.staleness == {0: 1, 1: 2}
    samples, _ = build_samples(rows, tokenizer, DatasetConfig(), trained_version=0)  # (0: nothing is stale)
    assert len(samples) == 3


def test_unused_rollouts_older_than_the_window_are_never_trained_and_are_counted(
        tmp_path, write_rows, make_rollouts, train_settings):
    store = tmp_path / "store"
    s = train_settings(store, max_staleness=1)
    write_rows(store, make_rollouts(0))
    assert run_once(s, log=lambda m: None).status == "trained"  # round 0
    write_rows(store, make_rollouts(1))
    assert run_once(s, log=lambda m: None).status == "trained"  # round 1: versions 0..1
    late = make_rollouts(0, n_tasks=2)  # policy@0 rollouts that finish only now: 2 versions behind round 2
    for r in late:
        r["rollout_id"], r["task_id"] = "late-" + r["rollout_id"], "late-" + r["task_id"]
    write_rows(store, late + make_rollouts(2))
    out = run_once(s, log=lambda m: None)
    assert out.status == "trained" and out.round == 2
    layout = StoreLayout.at(store)
    sel2 = json.loads(Path(selection_path(layout.location, 2)).read_text())
    assert sel2["versions"] == [1, 2]
    assert not any(rid.startswith("late-") for rid in sel2["rollout_ids"])
    metrics = json.loads(read_rounds(layout.location)[2]["metrics"])
    assert metrics["n_rollouts_too_stale"] == len({r["rollout_id"] for r in late})
    assert metrics["staleness"] == {"0": metrics["n_samples"]}  # every v1 rollout was used by round 1
    assert metrics["is_tokens"] > 0 and 0 < metrics["is_weight_min"] <= metrics["is_weight_mean"] \
        <= metrics["is_weight_max"]


def test_kill_9_mid_round_with_staleness_then_resume_uses_each_rollout_exactly_once(
        tmp_path, tiny_model_dir, write_rows, make_rollouts, train_settings):
    store = tmp_path / "store"
    v0 = make_rollouts(0)
    write_rows(store, v0)
    s = train_settings(store, max_staleness=1, pack_tokens=64, steps_per_epoch=3)
    assert run_once(s, log=lambda m: None).status == "trained"  # round 0 on v0
    late_v0 = make_rollouts(0, n_tasks=2)
    for r in late_v0:
        r["rollout_id"], r["task_id"] = "late-" + r["rollout_id"], "late-" + r["task_id"]
    v1 = make_rollouts(1)
    write_rows(store, late_v0 + v1)
    script = textwrap.dedent(f"""
        import os, signal
        from trainer.config import TrainSettings
        from trainer.rounds import run_once
        s = TrainSettings(store={str(store)!r}, model={str(tiny_model_dir)!r}, min_rollouts=8, lr=1e-3,
                          progress=False, pack_tokens=64, steps_per_epoch=3, max_staleness=1)
        def die(step, metrics):
            os.kill(os.getpid(), signal.SIGKILL)
        run_once(s, on_step=die)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    layout = StoreLayout.at(store)
    picked = json.loads(Path(selection_path(layout.location, 1)).read_text())
    more_v1 = make_rollouts(1, n_tasks=2)  # arrive while the trainer is dead
    for r in more_v1:
        r["rollout_id"], r["task_id"] = "more-" + r["rollout_id"], "more-" + r["task_id"]
    write_rows(store, more_v1)
    assert run_once(s, log=lambda m: None).status == "trained"  # round 1, resumed on its own selection
    assert json.loads(Path(selection_path(layout.location, 1)).read_text()) == picked
    trained = read_manifest(checkpoint_dir(layout.checkpoints, 2))["selection"]["transition_ids"]
    assert trained == picked["transition_ids"]
    out = run_once(s, log=lambda m: None)  # round 2, window 1..2: the newcomers, one version stale
    assert out.status == "trained" and out.round == 2
    sels = [set(json.loads(Path(selection_path(layout.location, k)).read_text())["rollout_ids"]) for k in range(3)]
    assert sels[2] == {r["rollout_id"] for r in more_v1}
    every = {r["rollout_id"] for r in v0 + late_v0 + v1 + more_v1}
    assert set().union(*sels) == every  # none lost
    assert sum(len(x) for x in sels) == len(every)  # none twice


def test_report_plots_staleness_and_importance_weights_of_asynchronous_rounds(tmp_path, write_rows, make_rollouts,
                                                                              train_settings):
    from PIL import Image

    from trainer.report import plot, round_rows

    store = tmp_path / "store"
    s = train_settings(store, max_staleness=1, min_rollouts=4)
    write_rows(store, make_rollouts(0))
    run_once(s, log=lambda m: None)
    late_v0 = [{**r, "rollout_id": "late-" + r["rollout_id"], "task_id": "late-" + r["task_id"]}
               for r in make_rollouts(0, n_tasks=2)]
    write_rows(store, late_v0 + make_rollouts(1, n_tasks=1))
    run_once(s, log=lambda m: None)
    rows = round_rows(parse_store(store))
    assert rows[0]["staleness"] == {0: rows[0]["n_transitions"]}
    assert rows[1]["staleness"][1] > 0 and rows[1]["staleness"][0] > 0  # late policy@0 calls beside policy@1's
    lo, mean, hi = rows[1]["is_weight"]
    assert 0 < lo <= mean <= hi
    sync_png = plot([{**r, "staleness": {0: 1}, "too_stale": 0} for r in rows], tmp_path / "sync.png")
    async_png = plot(rows, tmp_path / "async.png")
    if os.environ.get("TRACERL_KEEP_PLOTS"):
        shutil.copy(async_png, os.environ["TRACERL_KEEP_PLOTS"])
    assert Image.open(async_png).height > Image.open(sync_png).height  # two more panels


def test_threads_now_sets_the_torch_threads_before_every_micro_batch(tmp_path, write_rows, make_rollouts,
                                                                    train_settings):
    """The demo's asynchronous rounds train beside the next batch's agents on one core, then on all."""
    import torch

    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    asked: list[int] = []
    before = torch.get_num_threads()
    try:
        out = run_once(train_settings(store, pack_tokens=64, threads=1), log=lambda m: None,
                       threads_now=lambda: asked.append(2) or 2)
        assert out.status == "trained" and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    micro = read_manifest(checkpoint_dir(StoreLayout.at(store).checkpoints, 1))["metrics"]["micro_batches"]
    assert len(asked) == micro > 1
