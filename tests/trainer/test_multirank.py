"""``--nproc N``: the round's training in N torchrun ranks (gloo on CPU), checked against one process.

The ranks are real processes started by ``python -m torch.distributed.run``; nothing is faked.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from store.layout import StoreLayout
from store.location import parse_store
from trainer.checkpoint import checkpoint_dir, read_manifest
from trainer.dataset import Sample, assign_weights
from trainer.distributed import step_plan
from trainer.manifest import read_rounds, selection_path
from trainer.packing import Batch, make_batches
from trainer.rounds import TrainError, run_once

REPO = Path(__file__).resolve().parents[2]
# small enough for 2 CPU cores: several micro-batches, two optimizer steps, KL to the base
FAST = {"pack_tokens": 64, "max_prompt_tokens": 48, "max_response_tokens": 16, "steps_per_epoch": 2,
        "kl_coef": 0.05}
# One optimizer step where one process and N ranks are compared: a second step's metrics are computed on
# weights the first step moved, and Adam moves near-zero-gradient weights by up to lr on float rounding
# alone (assert_same_adam_step), so only the first step's arithmetic has a bound worth asserting.
ONE_STEP = {**FAST, "steps_per_epoch": 1}


@pytest.mark.parametrize("n_batches,steps,world", [(7, 2, 2), (5, 1, 2), (3, 3, 2), (10, 3, 4), (1, 1, 3)])
def test_step_plan_shards_each_step_across_ranks_without_overlap(n_batches, steps, world):
    single = step_plan(n_batches, steps)
    shards = [step_plan(n_batches, steps, r, world) for r in range(world)]
    assert all(len(s) == len(single) for s in shards)  # every rank takes part in every optimizer step
    for j, indices in enumerate(single):
        got = [i for s in shards for i in s[j]]
        assert sorted(got) == indices and len(got) == len(set(got))  # the same step, each batch once
        sizes = [len(s[j]) for s in shards]
        assert max(sizes) - min(sizes) <= 1  # balanced; a rank may get none when batches < ranks
    assert single == [list(range(j, n_batches, len(single))) for j in range(len(single))]


def test_batch_state_round_trip_rebuilds_the_packing_mask():
    samples = [Sample(f"t{i}", f"r{i}", list(range(3, 8 + i)), list(range(9, 12 + i)), None, advantage=1.0)
               for i in range(4)]
    assign_weights(samples, "rollout")
    for b in make_batches(samples, pack_tokens=32):
        state = b.state()
        assert "attention_mask" not in state
        back = Batch.from_state(state)
        assert back.attention_mask.equal(b.attention_mask) and back.sample_spans == b.sample_spans
        assert all(getattr(back, k).equal(v) for k, v in state.items() if isinstance(v, torch.Tensor))


@pytest.mark.slow
def test_two_ranks_train_the_same_round_as_one_process(tmp_path, write_rows, make_rollouts, train_settings,
                                                       capsys):
    rows = make_rollouts(0)
    stores = {n: tmp_path / f"store{n}" for n in (1, 2)}
    for store in stores.values():
        write_rows(store, rows)
    steps: list[int] = []
    logs: list[str] = []
    one = run_once(train_settings(stores[1], **ONE_STEP), log=lambda m: None)
    two = run_once(train_settings(stores[2], nproc=2, progress=True, **ONE_STEP),
                   on_step=lambda i, m: steps.append(i), log=logs.append)
    assert one.status == two.status == "trained"
    assert any("in 2 ranks" in m for m in logs) and steps == [1]  # rank 0's step reached on_step

    ckpt = {n: checkpoint_dir(StoreLayout.at(s).checkpoints, 1) for n, s in stores.items()}
    from safetensors.torch import load_file

    w1, w2 = (load_file(str(ckpt[n] / "model.safetensors")) for n in (1, 2))
    assert w1.keys() == w2.keys()
    base = load_file(str(train_settings(stores[1]).model) + "/model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    assert (w1[name] - base[name]).abs().max() > 1e-4  # the step moved the weights: equality is not vacuous
    o1, o2 = (torch.load(ckpt[n] / "optimizer.pt", weights_only=True)["state"] for n in (1, 2))
    for i in o1:  # Adam moments too: the next round starts from the same optimizer either way
        torch.testing.assert_close(o2[i]["exp_avg"], o1[i]["exp_avg"], rtol=1e-4, atol=1e-7)
    assert_same_adam_step(w1, w2, base, o1, param_names(train_settings(stores[1]).model), lr=1e-3)

    m1, m2 = (read_manifest(ckpt[n]) for n in (1, 2))
    for key in ("rollout_ids", "transition_ids"):
        assert m1["selection"][key] == m2["selection"][key]
    assert m2["settings"]["nproc"] == 2 and m2["dataset"] == m1["dataset"]
    for key in ("micro_batches", "tokens", "optimizer_steps"):
        assert m2["metrics"][key] == m1["metrics"][key]
    for key in ("loss", "kl", "clip_fraction", "ppo_kl", "grad_norm"):
        assert m2["metrics"][key] == pytest.approx(m1["metrics"][key], rel=1e-4, abs=1e-7), key
    assert not list(StoreLayout.at(stores[2]).checkpoints.glob(".policy-*"))  # the work dir is gone

    row = read_rounds(StoreLayout.at(stores[2]).location)[0]
    metrics = json.loads(row["metrics"])
    assert metrics["nproc"] == 2 and metrics["tokens"] == m1["metrics"]["tokens"] > 0
    assert metrics["tokens_per_s"] > 0 and metrics["n_retokenized"] == 0 and metrics["n_samples"] == len(rows)

    # rank 0's progress bar reached our stderr; rank 1 (with a different count) stayed quiet
    n = m1["metrics"]["micro_batches"]
    local = [sum(len(s) for s in step_plan(n, ONE_STEP["steps_per_epoch"], r, 2)) for r in (0, 1)]
    err = capsys.readouterr().err
    assert f"/{local[0]} [" in err
    if local[1] != local[0]:
        assert f"/{local[1]} [" not in err


@pytest.mark.slow
def test_a_failing_rank_is_a_train_error_naming_its_error(tmp_path, write_rows, make_rollouts, train_settings,
                                                          capsys):
    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    # a LoRA target the model does not have: peft raises in every rank's TorchBackend.load
    with pytest.raises(TrainError) as info:
        run_once(train_settings(store, nproc=2, lora_rank=4, lora_targets="no_such_proj", **FAST), log=lambda m: None)
    msg = str(info.value)
    assert msg.startswith("training in 2 ranks failed (torchrun exit status 1)")
    assert re.search(r"^rank [01]: \S+Error: Target modules \{'no_such_proj'\} not found", msg, re.M), msg
    assert ", in inject_adapter" in msg  # the traceback tail says where
    err = capsys.readouterr().err  # rank 0's output (if it got that far before torchrun stopped it), not rank 1's
    assert err.count("Error: Target modules {'no_such_proj'}") <= 1

    layout = StoreLayout.at(store)
    assert read_rounds(layout.location)[0]["status"] == "failed" and read_rounds(layout.location)[0]["metrics"] is None
    assert Path(selection_path(layout.location, 0)).exists() and not checkpoint_dir(layout.checkpoints, 1).exists()
    assert not list(layout.checkpoints.glob(".policy-*"))  # the work dir is removed on failure too


def _processes_mentioning(text: str) -> list[str]:
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args:
            out.append(args)
    return out


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_started_with_die_with_parent_ends_when_its_parent_is_killed(tmp_path):
    """The mechanism that stops torchrun (and torchrun's ranks) when ``tracerl train`` is killed -9."""
    script = textwrap.dedent("""
        import os, signal, subprocess
        from trainer.launcher import die_with_parent
        child = subprocess.Popen(["sleep", "60"], preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        print(child.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -9, proc.stderr
    pid = int(proc.stdout)
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid)  # without it, ``sleep 60`` would outlive its parent


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc to find leftover ranks")
def test_kill_during_a_multirank_round_stops_the_ranks_and_the_rerun_resumes(
        tmp_path, tiny_model_dir, write_rows, make_rollouts, train_settings):
    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    killed = {**FAST, "epochs": 20}  # 40 optimizer steps: seconds of work left when step 1 kills the parent
    script = textwrap.dedent(f"""
        import os, signal
        from trainer.config import TrainSettings
        from trainer.rounds import run_once
        s = TrainSettings(store={str(store)!r}, model={str(tiny_model_dir)!r}, min_rollouts=8, lr=1e-3,
                          progress=False, nproc=2, **{killed!r})
        def die(step, metrics):
            print("killing after optimizer step", step, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        run_once(s, on_step=die)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert "killing after optimizer step 1" in proc.stdout
    deadline = time.monotonic() + 30
    while _processes_mentioning(str(store)) and time.monotonic() < deadline:  # the kernel killed torchrun,
        time.sleep(0.2)                                                       # and its ranks died with it
    assert not _processes_mentioning(str(store))
    layout = StoreLayout.at(store)
    # had the ranks outlived the parent, they would have finished: rank 0 writes result.json last
    assert not list(layout.checkpoints.glob(".policy-*/result.json"))
    assert read_rounds(layout.location)[0]["status"] == "started"
    assert not checkpoint_dir(layout.checkpoints, 1).exists()
    selection = Path(selection_path(layout.location, 0)).read_text()

    logs: list[str] = []
    out = run_once(train_settings(store, nproc=2, **FAST), log=logs.append)
    assert out.status == "trained" and any("(resumed)" in m for m in logs)
    assert Path(selection_path(layout.location, 0)).read_text() == selection  # the same rollouts, not a new pick
    assert read_manifest(checkpoint_dir(layout.checkpoints, 1))["metrics"]["optimizer_steps"] == 2
    assert not list(layout.checkpoints.glob(".policy-*"))  # the killed run's work dir is cleaned up


@pytest.mark.slow
def test_nproc_below_one_is_refused(tmp_path, train_settings):
    with pytest.raises(TrainError, match="--nproc must be >= 1"):
        run_once(train_settings(tmp_path / "store", nproc=0), log=lambda m: None)


def test_rounds_files_written_before_the_metrics_column_still_read(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from schemas.tables import ROUNDS_SCHEMA
    from trainer.report import format_table, round_rows

    store = tmp_path / "store"
    old_schema = pa.schema([f for f in ROUNDS_SCHEMA if f.name != "metrics"])
    row = {"round": 0, "policy_version": 0, "n_rollouts": 4, "n_transitions": 5, "mean_reward": 0.5,
           "loss": 0.1, "kl": 0.0, "clip_fraction": 0.0, "timings": json.dumps({"train": 1.0}),
           "status": "trained"}
    path = StoreLayout.at(store).partition("rounds", "2026-01-01") / "round-000000.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([row], schema=old_schema), path)
    got = read_rounds(StoreLayout.at(store).location)[0]
    assert got["metrics"] is None and got["loss"] == 0.1
    assert "trained" in format_table(round_rows(parse_store(store)))


def param_names(model_dir: Path) -> list[str]:
    """The optimizer's parameter order (its state is keyed by index): the model's named parameters."""
    from transformers import AutoModelForCausalLM

    return [n for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters() if p.requires_grad]


def assert_same_adam_step(w1, w2, base, o1, names, *, lr, eps=1e-8) -> None:
    """One process and N ranks reduce the same gradients in a different order, so they differ by float
    rounding (the moments above agree to rtol 1e-4). Adam's first step moves each weight by
    lr * g / (|g| + eps): where |g| is near eps (a sum that cancels to ~0, which some of a hundred thousand
    weights always do) that rounding moves the update by up to lr, in either direction. So, derived from the
    arithmetic rather than tuned to one CPU's float path (bf16 autocast or fp32):
    - every weight: |w2 - w1| <= 2 lr (the update's magnitude is below lr in both runs);
    - every weight whose gradient was well conditioned, |g| >= 10 eps (read off run 1's v = (1-b2) g^2),
      must agree to 1e-5 as before: there a rounding error dg moves the update by lr (eps/g) (dg/g) <= lr dg/g / 10,
      below 1e-5 for any relative error under 10 % (bf16 autocast's is ~1e-2);
    and those must be most of the weights the step moved (g > 0; an embedding row of a token the batch lacks
    has g = 0), so the tight check is not vacuous."""
    tight = total = 0
    for i, name in enumerate(names):
        diff = (w2[name] - w1[name]).abs()
        assert diff.max() <= 2 * lr + 1e-6, (name, float(diff.max()))
        g = (o1[i]["exp_avg_sq"] / (1 - 0.999)).sqrt()
        ok = g >= 10 * eps
        tight, total = tight + int(ok.sum()), total + int((g > 0).sum())
        torch.testing.assert_close(w2[name][ok], w1[name][ok], rtol=0, atol=1e-5, msg=name)
    print(f"weights checked to 1e-5: {tight} of the {total} the step moved")
    assert tight >= 0.5 * total, (tight, total)
