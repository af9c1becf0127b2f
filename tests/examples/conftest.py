"""Fixtures of the example-agent tests; the rig itself is ``tests/example_rig.py``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from example_rig import Script, ScriptedEngine, Stack, start_engine


@pytest.fixture
def stack_factory(tmp_path: Path) -> Iterator[Callable[[Script], Stack]]:
    """``stack = stack_factory(script)``: collector, gateway and scripted engine, stopped at teardown."""
    from collector_exporter.testing import running_collector
    from serving.gateway import Gateway, GatewayConfig, make_tracer_provider

    started: list[Callable[[], None]] = []

    def make(script: Script) -> Stack:
        engine = ScriptedEngine(script)
        upstream = start_engine(engine)
        started.append(upstream.stop)
        cm = running_collector(tmp_path / "store")
        collector = cm.__enter__()
        started.append(lambda: cm.__exit__(None, None, None))
        provider = make_tracer_provider(collector.grpc_endpoint)
        gateway = Gateway(("127.0.0.1", 0), GatewayConfig(upstreams=[upstream.url]), provider).start_background()
        started.append(provider.shutdown)
        started.append(gateway.stop)
        return Stack(tmp_path / "store", collector, gateway, provider, engine)

    yield make
    for stop in reversed(started):
        stop()
