"""Shared fixtures for the serving tests: one tiny model per session, built locally (no hub), and one real
vLLM server for the modules that drive it (test_publish_vllm.py, test_vllm.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.models.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def embedded(tiny_model_dir: Path):
    """One embedded server for read-only tests (nothing here loads adapters or weights)."""
    from serving.embedded.server import EmbeddedServer

    server = EmbeddedServer.start(str(tiny_model_dir))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def reference_model(tiny_model_dir: Path):
    """An independently loaded copy of the model, to recompute logprobs outside the server."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture
def spans():
    """An in-memory span sink and the provider that feeds it (for a gateway under test)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    exporter.provider = provider
    yield exporter
    provider.shutdown()


@pytest.fixture(scope="package")
def model32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model re-shaped for vLLM's CPU attention (2 heads of 32, 1 KV head; vLLM refuses head size 16)."""
    return build_tiny_model(tmp_path_factory.mktemp("vllm-model") / "tiny32", seed=0, heads=2, kv_heads=1)


@pytest.fixture(scope="package")
def vllm(model32: Path, tmp_path_factory: pytest.TempPathFactory):
    """Real vLLM (``tracerl serve --engine vllm``) in fp32 with runtime LoRA and dev mode, shared by the
    package's vLLM modules: started on first use, stopped when the package's tests are done."""
    from .vllm_rig import running_vllm

    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    with running_vllm(model32, log, "--dtype", "float32", "--max-model-len", "512", "--max-lora-rank", "8",
                      "--kv-cache-gb", "1", "--max-num-seqs", "16") as server:
        yield server
