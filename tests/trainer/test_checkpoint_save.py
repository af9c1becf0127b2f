"""The checkpoint as the engine loads it (bf16 when training in bf16), the resume state beside it
(fp32 master weights and the optimizer), and a round that resumes exactly from them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from trainer.backends.policy_model import load_policy, resume_weights
from trainer.backends.torch_backend import MASTER_DIR, OPTIMIZER_FILE, TorchBackend, served_dtype
from trainer.checkpoint import BackgroundWrite, save_weights
from trainer.config import TrainSettings
from trainer.dataset import Sample, assign_weights
from trainer.packing import make_batches


def test_save_weights_writes_tied_tensors_once_and_casts_floats(tmp_path):
    emb = torch.randn(4, 3)
    state = {"embed.weight": emb, "head.weight": emb, "steps": torch.tensor([1, 2]), "w": torch.randn(2)}
    save_weights(state, tmp_path / "a.safetensors", torch.bfloat16)
    back = load_file(str(tmp_path / "a.safetensors"))
    assert set(back) == {"embed.weight", "steps", "w"}
    assert back["embed.weight"].dtype == torch.bfloat16 and back["steps"].dtype == torch.int64
    torch.testing.assert_close(back["embed.weight"], emb.to(torch.bfloat16), rtol=0, atol=0)


def test_bf16_is_served_where_a_gpu_trains_in_bf16():
    assert served_dtype(torch.device("cuda"), bf16=True) is torch.bfloat16
    assert served_dtype(torch.device("cuda"), bf16=False) is None
    assert served_dtype(torch.device("cpu"), bf16=True) is None


def test_a_failed_background_write_is_raised_by_wait():
    def boom() -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        BackgroundWrite(boom).wait()
    assert BackgroundWrite(lambda: None).wait() >= 0


def _trained_backend(model_dir):
    settings = TrainSettings(model=str(model_dir), device="cpu", progress=False, lr=1e-2)
    backend = TorchBackend.load(settings, model_dir, None)
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            f"t{i}",
            f"r{i}",
            torch.randint(3, 200, (6,), generator=g).tolist(),
            torch.randint(3, 200, (4,), generator=g).tolist(),
            None,
            advantage=1.0 - i,
        )
        for i in range(2)
    ]
    assign_weights(samples, "rollout")
    backend.train(make_batches(samples, 32))
    return settings, backend


@pytest.mark.slow
def test_bf16_served_weights_with_fp32_master_resume_exactly(tmp_path, tiny_model_dir):
    settings, backend = _trained_backend(tiny_model_dir)
    backend.served_dtype = torch.bfloat16  # what a CUDA (or bf16 CPU) round serves
    backend.defer_resume_state = True
    ckpt = tmp_path / "policy-1"
    backend.save(ckpt)
    served = load_file(str(ckpt / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in served.values())
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == "bfloat16"
    assert not (ckpt / OPTIMIZER_FILE).exists() and resume_weights(ckpt) == ckpt  # deferred
    BackgroundWrite(lambda: backend.write_resume_state(ckpt)).wait()
    assert resume_weights(ckpt) == ckpt / MASTER_DIR and (ckpt / OPTIMIZER_FILE).exists()
    trained = {k: v.detach().clone() for k, v in backend.model.state_dict().items()}
    model, _ = load_policy(settings, tiny_model_dir, ckpt)
    for name, t in model.state_dict().items():  # the fp32 weights, not their bf16 rounding
        torch.testing.assert_close(t, trained[name], rtol=0, atol=0, msg=name)
    assert any((served[k].float() != trained[k]).any() for k in served)  # bf16 did round something
    nxt = TorchBackend.load(settings, tiny_model_dir, ckpt)
    assert nxt.optimizer.state_dict()["state"].keys() == backend.optimizer.state_dict()["state"].keys()


@pytest.mark.slow
def test_fp32_training_serves_fp32_with_save_pretrained_names(tmp_path, tiny_model_dir):
    _, backend = _trained_backend(tiny_model_dir)
    assert backend.served_dtype is None  # a CPU serves fp32, even where it trains under bf16 autocast
    backend.save(tmp_path / "ours")
    backend.model.save_pretrained(tmp_path / "hf")
    ours, hf = (
        load_file(str(tmp_path / "ours" / "model.safetensors")),
        load_file(str(tmp_path / "hf" / "model.safetensors")),
    )
    assert ours.keys() == hf.keys()
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["dtype"] == json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
    for k in hf:
        torch.testing.assert_close(ours[k], hf[k], rtol=0, atol=0)
    assert (tmp_path / "ours" / OPTIMIZER_FILE).exists() and not (tmp_path / "ours" / MASTER_DIR).exists()
    # the base model's tokenizer, copied as it is (not loaded and re-saved each round), and loadable
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "ours" / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tmp_path / "ours")("SELECT 1")["input_ids"]
    assert ids == AutoTokenizer.from_pretrained(tiny_model_dir)("SELECT 1")["input_ids"]


@pytest.mark.slow
def test_a_kill_during_the_resume_write_leaves_no_half_file(tmp_path, tiny_model_dir, monkeypatch):
    settings, backend = _trained_backend(tiny_model_dir)
    backend.defer_resume_state = True
    ckpt = tmp_path / "policy-1"
    backend.save(ckpt)

    def killed(obj, path, *a, **kw):  # the process dies after writing part of the file
        with open(path, "wb") as f:
            f.write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        BackgroundWrite(lambda: backend.write_resume_state(ckpt)).wait()
    monkeypatch.undo()
    assert not (ckpt / OPTIMIZER_FILE).exists()  # the next round starts with fresh moments
    nxt = TorchBackend.load(settings, tiny_model_dir, ckpt)
    assert not nxt.optimizer.state_dict()["state"]
