"""CPU defaults of the torch backend: one thread per training process, bf16 autocast where the CPU has bf16."""

from __future__ import annotations

import pytest
import torch

from trainer.backends.torch_backend import TorchBackend, autocast_dtype, cpu_has_bf16
from trainer.config import TrainSettings

CPU = torch.device("cpu")


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_training_on_cpu_uses_one_thread_unless_told(tiny_model_dir, restore_threads):
    torch.set_num_threads(2)
    TorchBackend.load(
        TrainSettings(model=str(tiny_model_dir), device="cpu", progress=False), tiny_model_dir, None
    )
    assert torch.get_num_threads() == 1
    TorchBackend.load(TrainSettings(model=str(tiny_model_dir), device="cpu", threads=2), tiny_model_dir, None)
    assert torch.get_num_threads() == 2
    torch.set_num_threads(3)
    TorchBackend.load(TrainSettings(model=str(tiny_model_dir), device="cpu", threads=0), tiny_model_dir, None)
    assert torch.get_num_threads() == 3  # 0: left as torch (or OMP_NUM_THREADS) set it


def test_no_bf16_trains_in_fp32_on_any_cpu():
    assert autocast_dtype(CPU, bf16=False) is None
    assert autocast_dtype(torch.device("cuda"), bf16=True) is torch.bfloat16


@pytest.mark.slow
@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no AVX512-BF16/AMX: it trains in fp32")
def test_a_bf16_cpu_runs_the_forward_pass_in_bf16(tiny_model_dir):
    backend = TorchBackend.load(
        TrainSettings(model=str(tiny_model_dir), device="cpu", threads=0), tiny_model_dir, None
    )
    ids = torch.tensor([[1, 2, 3, 4]])
    with backend._autocast():
        assert backend.model(input_ids=ids).logits.dtype is torch.bfloat16
    fp32 = TorchBackend.load(
        TrainSettings(model=str(tiny_model_dir), device="cpu", threads=0, bf16=False), tiny_model_dir, None
    )
    with fp32._autocast():
        assert fp32.model(input_ids=ids).logits.dtype is torch.float32
