"""The tiny model loads like a hub model, speaks ChatML with hermes tools, and is reproducible."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving.models.tiny_model import build_tiny_model
from tracerl.cli import main

pytestmark = pytest.mark.slow  # starts processes or builds models (make test-fast skips it)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_same_seed_gives_identical_files_and_other_seed_other_weights(tiny_model_dir: Path, tmp_path: Path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    names = sorted(p.name for p in tiny_model_dir.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    _match, mismatch, errors = filecmp.cmpfiles(tiny_model_dir, again, names, shallow=False)
    assert mismatch == [] and errors == []
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert (other / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (tiny_model_dir / "model.safetensors").read_bytes()


def test_reloads_with_auto_classes_and_text_round_trips(tiny_model_dir: Path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2"
    assert 300 <= len(tok) <= 512
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1, special
    text = 'Héllo 🌍! {"city": "Paris"}\n\tdef f(x): return x * 2'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    ids = torch.tensor([tok.encode("Hello", add_special_tokens=False)])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))


def test_chat_template_renders_tools_hermes_style_and_generation_prompt(tiny_model_dir: Path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"t": 21}'},
    ]
    text = tok.apply_chat_template(messages, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert '<|im_start|>user\n<tool_response>\n{"t": 21}\n</tool_response><|im_end|>\n' in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"


def test_init_model_command_writes_a_loadable_dir_and_refuses_to_overwrite(tmp_path: Path, capsys):
    out = tmp_path / "m"
    assert main(["init-model", str(out), "--arch", "llama", "--seed", "3"]) == 0
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "llama"
    assert main(["init-model", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
