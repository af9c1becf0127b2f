"""The merged copy a LoRA round publishes to a CPU vLLM (``trainer/merge.py``): the plain-LoRA fold against
peft's own ``merge_and_unload`` on real adapters of a real (tiny) model, tied and untied."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import is_complete
from trainer.merge import _peft_merged, merge_adapter, merged_dir, plain_lora_scale


@pytest.fixture(scope="module")
def tied_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its output head tied to its embeddings (as SmolLM2's is): one tensor on disk."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, config=config, dtype=torch.float32)
    model.lm_head.weight = model.model.embed_tokens.weight  # the tiny model's own head differs: tie it
    out = tmp_path_factory.mktemp("tied") / "model"
    model.save_pretrained(out)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # one tensor, as SmolLM2's
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tiny_model_dir / name).is_file():
            (out / name).write_bytes((tiny_model_dir / name).read_bytes())
    return out


def _adapter(base: Path, out: Path, **lora: object) -> Path:
    """A real peft adapter of ``base`` with random (nonzero) A and B, saved as the trainer saves one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False, **lora)
    get_peft_model(model, cfg).save_pretrained(out)
    return out


def _merged_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(merged_dir(checkpoint) / "model.safetensors"))


@pytest.mark.slow  # builds models (make test-fast runs none)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("lora", [{"r": 4, "lora_alpha": 8}, {"r": 8, "lora_alpha": 4, "use_rslora": True}],
                         ids=["alpha/r", "rslora"])
def test_the_fold_writes_what_peft_merges(tiny_model_dir, tied_model, tmp_path, tied, lora):
    base = tied_model if tied else tiny_model_dir
    ckpt = _adapter(base, tmp_path / "policy-000001", **lora)
    assert plain_lora_scale(json.loads((ckpt / "adapter_config.json").read_text())) is not None
    out = merge_adapter(base, ckpt)
    assert out == merged_dir(ckpt) and is_complete(out)
    got, want = _merged_tensors(ckpt), _peft_merged(base, ckpt, torch.float32)
    assert sorted(got) == sorted(want)  # the same names (a tied head once), so a reload matches the served shapes
    for name, t in want.items():
        assert torch.equal(got[name], t), name  # peft's arithmetic: W + (B @ A) * scale, in fp32
    changed = [n for n in want if n.endswith(("q_proj.weight", "v_proj.weight", "o_proj.weight"))]
    assert changed and all(not torch.equal(got[n], _base_tensor(base, n)) for n in changed)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and config["tie_word_embeddings"] is tied


def _base_tensor(base: Path, name: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(base / "model.safetensors"))[name].to(torch.float32)


@pytest.mark.slow
def test_an_adapter_beyond_plain_lora_is_merged_by_peft(tiny_model_dir, tmp_path):
    ckpt = _adapter(tiny_model_dir, tmp_path / "policy-000001", r=4, lora_alpha=8, use_dora=True)
    assert plain_lora_scale(json.loads((ckpt / "adapter_config.json").read_text())) is None
    merge_adapter(tiny_model_dir, ckpt)
    got, want = _merged_tensors(ckpt), _peft_merged(tiny_model_dir, ckpt, torch.float32)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], t) for n, t in want.items())


def test_plain_lora_scale_refuses_what_the_fold_does_not_do():
    plain = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "bias": "none"}
    assert plain_lora_scale(plain) == 2.0
    assert plain_lora_scale({**plain, "use_rslora": True}) == 8.0
    for extra in ({"use_dora": True}, {"rank_pattern": {"q_proj": 4}}, {"alpha_pattern": {"v_proj": 2}},
                  {"modules_to_save": ["lm_head"]}, {"bias": "all"}, {"fan_in_fan_out": True},
                  {"target_parameters": ["experts.gate_up_proj"]}, {"peft_type": "IA3"}, {"r": 0}):
        assert plain_lora_scale({**plain, **extra}) is None, extra


@pytest.mark.slow
def test_a_finished_merge_is_reused(tiny_model_dir, tmp_path):
    ckpt = _adapter(tiny_model_dir, tmp_path / "policy-000001", r=4, lora_alpha=8)
    out = merge_adapter(tiny_model_dir, ckpt)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    (ckpt / ".merged.crashed").mkdir()  # a merge killed midway elsewhere does not matter once one finished
    assert merge_adapter(tiny_model_dir, ckpt) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
