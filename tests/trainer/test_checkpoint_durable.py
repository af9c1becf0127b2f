"""A checkpoint is staged on the round's critical path (whole, readable, not yet durable) and completed
beside the publish (fsync, then the manifest); a stop between the two never leaves a directory that looks
complete, and the next run completes it (same boot) or removes it (an older boot: its round is redone)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import trainer.checkpoint as ckpt
from trainer.checkpoint import (
    MANIFEST,
    PENDING,
    BackgroundWrite,
    boot_id,
    complete_checkpoint,
    is_complete,
    read_manifest,
    recover_checkpoints,
    stage_checkpoint,
    write_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "norm.weight": torch.ones(16),
    }


def save_model(seed: int):
    """A ``save`` like the backend's: a safetensors file, a config, and a nested tokenizer file."""

    def save(tmp: Path) -> None:
        from safetensors.torch import save_file

        save_file(weights(seed), str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps({"seed": seed}))
        (tmp / "tok").mkdir()
        (tmp / "tok" / "vocab.json").write_text("{}")

    return save


def assert_weights(path: Path, seed: int) -> None:
    back = load_file(str(path / "model.safetensors"))
    for name, t in weights(seed).items():
        torch.testing.assert_close(back[name], t, rtol=0, atol=0)


def test_a_staged_checkpoint_is_whole_and_readable_but_not_complete_until_completed(tmp_path):
    final = tmp_path / "policy-000001"
    stage_checkpoint(final, save_model(1), {"round": 0})
    assert_weights(final, 1)  # what the engine loads, before any fsync
    assert not is_complete(final) and (final / PENDING).is_file()
    assert not list(tmp_path.glob(".policy-*"))  # renamed, no temp dir left
    pending = json.loads((final / PENDING).read_text())
    assert pending["files"] == ["config.json", "model.safetensors", "tok/vocab.json"]
    assert pending["boot_id"] == boot_id() and pending["manifest"] == {"round": 0}

    complete_checkpoint(final)
    assert is_complete(final) and read_manifest(final) == {"round": 0} and not (final / PENDING).exists()
    assert_weights(final, 1)
    complete_checkpoint(final)  # idempotent
    assert read_manifest(final) == {"round": 0}


def test_staging_waits_for_no_disk_flush(tmp_path, monkeypatch):
    flushed: list[int] = []
    monkeypatch.setattr(os, "fsync", flushed.append)
    stage_checkpoint(tmp_path / "policy-000001", save_model(1), {"round": 0})
    assert flushed == []  # the round's critical path: the page cache only


def test_completion_fsyncs_every_staged_file_and_directory_before_the_manifest(tmp_path, monkeypatch):
    final = tmp_path / "policy-000001"
    stage_checkpoint(final, save_model(1), {"round": 0})
    order: list[str] = []
    real_fsync, real_write = os.fsync, ckpt.write_atomic

    def fsync(fd: int) -> None:
        order.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def write_atomic(path, data, fs=None) -> None:
        order.append(f"manifest {Path(path).name}")
        real_write(path, data, fs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(ckpt, "write_atomic", write_atomic)
    (final / "optimizer.pt").write_bytes(b"added after staging: its own writer makes it durable")
    complete_checkpoint(final)
    manifest_at = order.index(f"manifest {MANIFEST}")
    before = set(order[:manifest_at])
    real = final.resolve()
    wanted = {str(real / f) for f in ("config.json", "model.safetensors", "tok/vocab.json", "tok")}
    assert wanted | {str(real), str(real.parent)} <= before
    assert str(real / "optimizer.pt") not in order


def test_an_error_between_rename_and_manifest_leaves_an_incomplete_checkpoint_that_is_replaced(
    tmp_path, monkeypatch
):
    final = tmp_path / "policy-000001"
    stage_checkpoint(final, save_model(1), {"round": 0})

    def disk_full(*a, **kw) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "write_atomic", disk_full)
    with pytest.raises(OSError, match="No space left"):
        complete_checkpoint(final)
    monkeypatch.undo()
    assert not is_complete(final) and (final / "model.safetensors").exists()

    write_checkpoint(final, save_model(2), {"round": 0, "again": True})  # the round written again
    assert read_manifest(final) == {"round": 0, "again": True}
    assert_weights(final, 2)
    with pytest.raises(FileExistsError, match="never overwritten"):
        stage_checkpoint(final, save_model(3), {"round": 0})


def test_a_save_that_raises_leaves_nothing(tmp_path):
    def broken(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("cuda error")

    with pytest.raises(RuntimeError):
        stage_checkpoint(tmp_path / "policy-000001", broken, {"round": 0})
    assert list(tmp_path.iterdir()) == []


def test_recovery_completes_this_boots_stage_and_removes_an_older_boots(tmp_path, monkeypatch):
    ours = stage_checkpoint(tmp_path / "policy-000001", save_model(1), {"round": 0})
    monkeypatch.setattr(ckpt, "boot_id", lambda: "a-boot-before-the-power-loss")
    older = stage_checkpoint(tmp_path / "policy-000002", save_model(2), {"round": 1})
    monkeypatch.undo()
    done = write_checkpoint(tmp_path / "policy-000003", save_model(3), {"round": 2})
    by_hand = tmp_path / "policy-000004"
    by_hand.mkdir()
    (by_hand / "model.safetensors").write_bytes(b"copied by hand, no manifest")

    got = recover_checkpoints(tmp_path)
    assert (got.completed, got.removed) == ([ours], [older])
    assert is_complete(ours) and read_manifest(ours) == {"round": 0}
    assert not older.exists() and is_complete(done) and by_hand.is_dir()
    assert recover_checkpoints(tmp_path).completed == []  # nothing left to do


def test_recovery_removes_a_stage_that_lost_a_file(tmp_path):
    staged = stage_checkpoint(tmp_path / "policy-000001", save_model(1), {"round": 0})
    (staged / "tok" / "vocab.json").unlink()
    assert recover_checkpoints(tmp_path).removed == [staged] and not staged.exists()


def test_recovery_never_adopts_where_the_boot_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "boot_id", lambda: None)  # not Linux: the page cache cannot be vouched for
    staged = stage_checkpoint(tmp_path / "policy-000001", save_model(1), {"round": 0})
    assert recover_checkpoints(tmp_path).removed == [staged] and not staged.exists()


@pytest.mark.slow
def test_a_process_killed_between_rename_and_manifest_is_completed_by_the_next_run(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys
        from pathlib import Path
        import trainer.checkpoint as ckpt
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_checkpoint_durable import save_model
        final = ckpt.stage_checkpoint(Path({str(tmp_path)!r}) / "policy-000001", save_model(7), {{"round": 0}})
        os.kill(os.getpid(), signal.SIGKILL)  # before complete_checkpoint: no fsync, no manifest
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    final = tmp_path / "policy-000001"
    assert not is_complete(final) and (final / PENDING).exists()
    assert recover_checkpoints(tmp_path).completed == [final]
    assert read_manifest(final) == {"round": 0}
    assert_weights(final, 7)


def test_waiting_for_the_completion_does_not_wait_for_the_resume_state():
    release, order = threading.Event(), []

    def resume_state() -> None:
        assert release.wait(10)
        order.append("resume")

    bg = BackgroundWrite(lambda: order.append("complete"), resume_state)
    assert bg.wait(1) >= 0 and order == ["complete"]
    release.set()
    bg.wait()
    assert order == ["complete", "resume"] and len(bg.seconds) == 2


def test_a_failed_completion_is_raised_by_the_first_wait_and_stops_the_resume_state():
    ran: list[str] = []

    def complete() -> None:
        raise OSError(5, "Input/output error")

    bg = BackgroundWrite(complete, lambda: ran.append("resume"))
    with pytest.raises(OSError, match="Input/output"):
        bg.wait(1)
    with pytest.raises(OSError, match="Input/output"):
        bg.wait()
    assert ran == []


def test_a_failed_resume_state_is_raised_by_the_full_wait_only():
    def resume() -> None:
        raise OSError(28, "No space left on device")

    bg = BackgroundWrite(lambda: None, resume)
    bg.wait(1)
    with pytest.raises(OSError, match="No space"):
        bg.wait()
