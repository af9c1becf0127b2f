"""``keep_model``: a round continues with the model the previous round of the same process trained, and
ends exactly where a round that read it back from the checkpoint ends (real tiny model, real store)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from store.layout import StoreLayout
from trainer import kept_model
from trainer.checkpoint import checkpoint_dir
from trainer.config import TrainSettings
from trainer.kept_model import Kept, reusable, same_run
from trainer.manifest import read_rounds
from trainer.rounds import run_once


@pytest.fixture(autouse=True)
def nothing_kept():
    kept_model.drop()
    yield
    kept_model.drop()


def test_only_the_checkpoint_just_staged_with_the_same_settings_is_continued_from(tmp_path):
    s = TrainSettings(store=str(tmp_path / "store"), model=str(tmp_path / "base"), lora_rank=4, keep_model=True)
    kept = Kept(object(), tmp_path / "policy-1", "2026-11-28T10:00:00+00:00", s)
    assert reusable(kept, dataclasses.replace(s, threads=2), tmp_path / "policy-1", kept.created_at)
    assert not reusable(kept, s, None, None)  # round 0 starts from the base model
    assert not reusable(kept, s, tmp_path / "policy-2", kept.created_at)
    assert not reusable(kept, s, tmp_path / "policy-1", "2026-11-28T10:05:00+00:00")  # trained again since
    assert not reusable(kept, dataclasses.replace(s, lr=s.lr * 2), tmp_path / "policy-1", kept.created_at)
    assert same_run(s, dataclasses.replace(s, threads=3)) and not same_run(s, dataclasses.replace(s, seed=1))


def _three_rounds(store: Path, write_rows, rollouts, settings) -> None:
    write_rows(store, rollouts)
    for k in range(3):
        out = run_once(settings, publisher=lambda _req: None, log=lambda _m: None)
        assert (out.status, out.round) == ("published", k)
    assert [r["status"] for r in read_rounds(StoreLayout.at(store).location).values()] == ["published"] * 3


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if (ckpt / "adapter_config.json").exists() else "model.safetensors"
    out = {f"w:{k}": v for k, v in load_file(str(ckpt / name)).items()}
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)["state"]
    for i, st in state.items():
        out.update({f"opt:{i}:{k}": v for k, v in st.items()})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [4, 0])
def test_rounds_that_keep_the_model_write_the_checkpoints_rounds_that_reload_it_write(
    tmp_path, write_rows, make_rollouts, train_settings, monkeypatch, lora_rank
):
    import trainer.backends as backends

    loaded: list[Path | None] = []
    real = backends.load_backend

    def counting(name, settings, base_model, parent):
        loaded.append(parent)
        return real(name, settings, base_model, parent)

    monkeypatch.setattr(backends, "load_backend", counting)
    rollouts = make_rollouts(0) + make_rollouts(1) + make_rollouts(2)
    stores = {keep: tmp_path / f"keep-{keep}" for keep in (False, True)}
    for keep, store in stores.items():
        kept_model.drop()
        loaded.clear()
        _three_rounds(store, write_rows, rollouts, train_settings(store, lora_rank=lora_rank, keep_model=keep))
        # reloading: every round reads its parent; kept: only round 0 builds a model
        assert len(loaded) == (1 if keep else 3)
    for v in (1, 2, 3):
        a, b = (_tensors(checkpoint_dir(StoreLayout.at(s).checkpoints, v)) for s in stores.values())
        assert a.keys() == b.keys() and len(a) > 0
        assert all(torch.equal(a[k], b[k]) for k in a), f"policy@{v} differs"


@pytest.mark.slow
def test_a_checkpoint_trained_again_is_read_back_not_continued_from(
    tmp_path, write_rows, make_rollouts, train_settings
):
    store = tmp_path / "store"
    write_rows(store, make_rollouts(0) + make_rollouts(1))
    s = train_settings(store, lora_rank=4, keep_model=True)
    assert run_once(s, publisher=lambda _req: None, log=lambda _m: None).status == "published"
    parent = checkpoint_dir(StoreLayout.at(store).checkpoints, 1)
    man = parent / "tracerl_checkpoint.json"
    man.write_text(man.read_text().replace('"created_at": "', '"created_at": "1999'))  # another checkpoint now
    assert kept_model.take(s, parent) is None
    assert kept_model.take(s, parent) is None  # and nothing is held any more
