"""Shared fixtures for the serving tests: one tiny model per session, built locally (no hub)."""

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
