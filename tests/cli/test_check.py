"""``tracerl check -- <agent command>``: one preflight run of a new agent, what was captured, and the fixes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tracerl_testing import BIN, tracerl

from span_to_transition.check_report import FRAMEWORK_HINTS, framework_hints, message_lines

HERE = Path(__file__).parent.parent / "span_to_transition"


def test_messages_print_as_the_trainer_sees_them() -> None:
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
            }
        ],
    }
    assert message_lines(call) == ["assistant: ", '  -> tool call c1: get_weather({"city": "Paris"})']
    assert message_lines({"role": "tool", "content": "sunny", "tool_call_id": "c1"}) == [
        "tool (answers c1): sunny"
    ]


def test_framework_hints_only_when_nothing_was_captured() -> None:
    assert framework_hints({"haystack-ai", "openai"}, calls_captured=False) == [
        FRAMEWORK_HINTS["haystack-ai"]
    ]
    assert "after `import haystack`" in FRAMEWORK_HINTS["haystack-ai"]
    assert framework_hints({"haystack-ai"}, calls_captured=True) == []
    assert framework_hints({"openai"}, calls_captured=False) == []


@pytest.mark.slow
def test_no_command_is_a_usage_error() -> None:
    proc = tracerl("check", check=False)
    assert proc.returncode == 2 and "give the agent command after --" in proc.stderr


@pytest.mark.slow
def test_an_agent_behind_the_gateway_is_captured_with_exact_ids(tmp_path: Path) -> None:
    from serving.embedded.server import EmbeddedServer
    from serving.models.tiny_model import build_tiny_model

    engine = EmbeddedServer.start(str(build_tiny_model(tmp_path / "tiny", seed=0)))
    try:
        proc = tracerl(
            "check",
            "--store",
            str(tmp_path / "store"),
            "--upstream",
            engine.url,
            "--",
            str(BIN / "opentelemetry-instrument"),
            str(BIN / "python"),
            str(HERE / "gateway_agent.py"),
            check=False,
            timeout=300,
            env={"OPENAI_API_KEY": "x", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"},
        )
    finally:
        engine.stop()
    out = proc.stdout
    assert "calls converted: 2" in out, out + proc.stderr
    assert out.count("token_source gateway") == 2
    assert "user: What is the weather in Paris?" in out
    assert "opentelemetry.instrumentation.openai" in out  # the scope its spans came from
    assert proc.returncode == 1 and "problem: no rewards" in out  # the agent emits none: named, with the fix
