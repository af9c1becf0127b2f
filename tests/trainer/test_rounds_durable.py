"""A round publishes its checkpoint as soon as it is staged, and records it ``published`` only once the
completion beside the publish (fsync, manifest) is done; a completion that failed, or a stage the machine
lost, is finished or redone by the next run (real Parquet store, tiny model, CPU)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

import trainer.checkpoint as ckpt
import trainer.round_train as round_train
from store.layout import StoreLayout
from trainer.checkpoint import PENDING, checkpoint_dir, is_complete, read_manifest
from trainer.manifest import read_rounds, selection_path
from trainer.rounds import PublishRequest, run_once

pytestmark = pytest.mark.slow  # builds and trains the tiny model


def test_the_publish_reads_the_staged_checkpoint_and_published_waits_for_its_completion(
    tmp_path, write_rows, make_rollouts, train_settings, monkeypatch
):
    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    layout = StoreLayout.at(store)
    published = threading.Event()
    seen: dict = {}
    real_complete = ckpt.complete_checkpoint

    def complete_after_the_publish(path: Path) -> None:  # the fsync is slower than the engine's load
        assert published.wait(60)
        real_complete(path)

    def publisher(req: PublishRequest) -> None:
        seen["complete"] = is_complete(req.checkpoint_path)
        seen["status"] = read_rounds(layout.location)[0]["status"]
        seen["weights"] = load_file(str(req.checkpoint_path / "model.safetensors"))
        published.set()

    monkeypatch.setattr(round_train, "complete_checkpoint", complete_after_the_publish)
    logs: list[str] = []
    out = run_once(train_settings(store), publisher=publisher, log=logs.append)
    assert out.status == "published" and seen["complete"] is False and seen["status"] == "trained"
    final = checkpoint_dir(layout.checkpoints, 1)
    assert is_complete(final) and read_manifest(final)["round"] == 0 and not (final / PENDING).exists()
    assert (final / "optimizer.pt").exists()
    on_disk = load_file(str(final / "model.safetensors"))
    assert on_disk.keys() == seen["weights"].keys()
    assert all(on_disk[k].equal(seen["weights"][k]) for k in on_disk)  # what was served is what was kept
    timings = json.loads(read_rounds(layout.location)[0]["timings"])
    assert timings["durable_wait"] >= 0 and any("made durable" in m for m in logs)


def test_a_failed_completion_leaves_the_round_trained_and_the_next_run_completes_and_publishes_it(
    tmp_path, write_rows, make_rollouts, train_settings, monkeypatch
):
    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    layout = StoreLayout.at(store)
    s = train_settings(store)

    def disk_error(path: Path) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(round_train, "complete_checkpoint", disk_error)
    got: list[PublishRequest] = []
    with pytest.raises(OSError, match="Input/output"):
        run_once(s, publisher=got.append, log=lambda m: None)
    monkeypatch.undo()
    final = checkpoint_dir(layout.checkpoints, 1)
    assert [g.name for g in got] == ["policy@1"]  # the engine took it ...
    assert read_rounds(layout.location)[0]["status"] == "trained"  # ... the round is not recorded published
    assert not is_complete(final) and not (final / "optimizer.pt").exists()  # no resume state after a failure
    mtime = (final / "model.safetensors").stat().st_mtime_ns

    logs: list[str] = []
    out = run_once(s, publisher=got.append, log=logs.append)  # same boot: completed, then published again
    assert out.status == "published" and not out.trained and [g.name for g in got] == ["policy@1", "policy@1"]
    assert any("made durable and complete" in m for m in logs)
    assert is_complete(final) and (final / "model.safetensors").stat().st_mtime_ns == mtime


def test_a_trained_round_staged_before_a_restart_is_trained_again_from_its_selection(
    tmp_path, write_rows, make_rollouts, train_settings, monkeypatch
):
    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    layout = StoreLayout.at(store)
    s = train_settings(store)

    def power_loss(path: Path) -> None:
        raise KeyboardInterrupt  # the machine stops before the fsync

    monkeypatch.setattr(round_train, "complete_checkpoint", power_loss)
    with pytest.raises(KeyboardInterrupt):
        run_once(s, log=lambda m: None)
    monkeypatch.undo()
    assert read_rounds(layout.location)[0]["status"] == "trained"
    selection = Path(selection_path(layout.location, 0)).read_text()

    monkeypatch.setattr(ckpt, "boot_id", lambda: "the-boot-after-the-restart")
    logs: list[str] = []
    got: list[PublishRequest] = []
    out = run_once(s, publisher=got.append, log=logs.append)
    assert (out.status, out.round, out.trained) == ("published", 0, True)
    assert any("removed, its round is trained again" in m for m in logs)
    assert any("training round 0 again" in m for m in logs) and any("(resumed)" in m for m in logs)
    assert Path(selection_path(layout.location, 0)).read_text() == selection  # the same rollouts
    final = checkpoint_dir(layout.checkpoints, 1)
    assert is_complete(final) and read_manifest(final)["round"] == 0 and [g.name for g in got] == ["policy@1"]


def test_a_failed_publish_still_finishes_the_checkpoint_before_the_run_lets_go_of_the_lock(
    tmp_path, write_rows, make_rollouts, train_settings, monkeypatch
):
    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    layout = StoreLayout.at(store)
    real_complete = ckpt.complete_checkpoint

    def slow_disk(path: Path) -> None:
        time.sleep(0.5)
        real_complete(path)

    monkeypatch.setattr(round_train, "complete_checkpoint", slow_disk)

    def down(req: PublishRequest) -> None:
        raise ConnectionError("server down")

    with pytest.raises(ConnectionError):
        run_once(train_settings(store), publisher=down, log=lambda m: None)
    final = checkpoint_dir(layout.checkpoints, 1)
    assert read_rounds(layout.location)[0]["status"] == "trained"
    assert is_complete(final) and (final / "optimizer.pt").exists()  # nothing still being written
