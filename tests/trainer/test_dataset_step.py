"""The dataset step pays for the tokenizer only when a row needs retokenizing (bench/dataset_step.py)."""

from __future__ import annotations

import json

import pytest

from store.location import parse_store
from trainer.dataset import LazyTokenizer, pad_token_id_from_files
from trainer.dataset_step import dataset_step


def _tokenizer_files(tmp_path, pad, added=(), vocab=None):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": pad}))
    spec = {"added_tokens": [{"id": i, "content": c} for i, c in added], "model": {"vocab": vocab or {}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    return tmp_path


def test_pad_id_is_read_from_the_tokenizer_files(tmp_path):
    assert pad_token_id_from_files(_tokenizer_files(tmp_path, "<pad>", added=[(0, "<s>"), (7, "<pad>")])) == 7
    assert (
        pad_token_id_from_files(_tokenizer_files(tmp_path, {"content": "<pad>"}, added=[(9, "<pad>")])) == 9
    )
    assert pad_token_id_from_files(_tokenizer_files(tmp_path, "x", vocab={"a": 1, "x": 42})) == 42
    # unknown: the caller loads the real tokenizer instead of guessing
    assert pad_token_id_from_files(_tokenizer_files(tmp_path, None)) is None
    assert pad_token_id_from_files(_tokenizer_files(tmp_path, "<missing>")) is None
    assert pad_token_id_from_files(tmp_path / "nowhere") is None


def test_the_pad_id_is_remembered_while_the_tokenizer_file_is_unchanged_and_read_again_once_it_changes(
    tmp_path, monkeypatch
):
    import trainer.dataset as dataset

    files = _tokenizer_files(tmp_path, "<pad>", added=[(7, "<pad>")])
    assert pad_token_id_from_files(files) == 7
    parsed = []
    real_loads = dataset.json.loads
    monkeypatch.setattr(dataset.json, "loads", lambda text: parsed.append(len(text)) or real_loads(text))
    assert pad_token_id_from_files(files) == 7 and len(parsed) == 1  # the config only, not tokenizer.json
    _tokenizer_files(tmp_path, "<pad>", added=[(0, "<s>"), (12, "<pad>")])
    assert pad_token_id_from_files(files) == 12


def test_the_lazy_tokenizer_knows_the_pad_id_without_loading(tmp_path):
    tok = LazyTokenizer(_tokenizer_files(tmp_path, "<pad>", added=[(3, "<pad>")]))
    assert tok.pad_token_id == 3 and not tok.loaded


@pytest.mark.slow
def test_the_step_loads_the_tokenizer_only_to_retokenize(
    tmp_path, tiny_model_dir, tokenizer, make_rollouts, make_row, write_rows, train_settings
):
    from transformers import AutoTokenizer

    store = tmp_path / "store"
    write_rows(store, make_rollouts(0))
    step = dataset_step(train_settings(store), parse_store(store), 0, 0, tiny_model_dir)
    assert step.samples and step.stats.n_retokenized == 0 and not step.tokenizer.loaded
    assert step.tokenizer.pad_token_id == AutoTokenizer.from_pretrained(tiny_model_dir).pad_token_id

    retok = tmp_path / "retok"
    write_rows(retok, [make_row(f"r{i}", task_id="t", reward=float(i % 2)) for i in range(4)])
    step = dataset_step(train_settings(retok), parse_store(retok), 0, 0, tiny_model_dir)
    assert step.stats.n_retokenized == 4 and step.tokenizer.loaded
    assert (
        step.samples[0].prompt_ids
        == tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
    )
