"""``tracerl check -- <agent command>``: one preflight run of a new agent, what was captured, and the fixes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tracerl_testing import BIN, tracerl

from span_to_transition.check_report import (
    FRAMEWORK_HINTS,
    agent_hint,
    framework_hints,
    instrumentor_findings,
    message_lines,
)
from tracerl.commands.check import agent_python

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
    # no agent name: the ways to name one, as a note (not a problem)
    assert "note: 2 of 2 calls have no agent name" in out and "gen_ai.agent.name=NAME" in out
    assert proc.returncode == 1 and "problem: no rewards" in out  # the agent emits none: named, with the fix


LLAMA = {"name": "llama_index", "dist": "openinference-instrumentation-llama-index", "version": "4.6.1"}
CORE = {"requirement": "llama-index-core>=0.14.19", "name": "llama-index-core", "extra": "instruments"}
MULTI = {
    "requirement": "llama-index-multi-modal-llms-openai>=0.1.7",
    "name": "llama-index-multi-modal-llms-openai",
    "extra": "instruments",
}


def test_an_instrumentor_without_its_instruments_extra_is_named_with_the_pip_command() -> None:
    probe = {
        "instrumentors": [
            {
                **LLAMA,
                "targets": [{**CORE, "installed": "0.14.25"}, {**MULTI, "installed": None}],
                "conflict": {"required": MULTI["requirement"], "found": None},
            }
        ]
    }
    [f] = instrumentor_findings(probe, "/venv/bin/python")
    assert f.problem == "instrumentation llama_index is skipped: its [instruments] extra is not installed"
    assert (
        "needs llama-index-multi-modal-llms-openai>=0.1.7" in f.saw
        and "it has llama-index-core 0.14.25" in f.saw
    )
    assert (
        f.fix
        == "/venv/bin/python -m pip install 'openinference-instrumentation-llama-index[instruments]==4.6.1'"
    )


def test_an_instrumentor_outside_its_librarys_version_range_is_named_with_the_pip_command() -> None:
    probe = {
        "instrumentors": [
            {
                **LLAMA,
                "targets": [{**CORE, "installed": "0.13.0"}, {**MULTI, "installed": "0.6.2"}],
                "conflict": {
                    "required": CORE["requirement"] + '; extra == "instruments"',
                    "found": "llama-index-core 0.13.0",
                },
            }
        ]
    }
    [f] = instrumentor_findings(probe, "/my venv/bin/python")
    assert "the installed llama-index-core 0.13.0 is outside its range" in f.problem
    # the requirement as pip takes it (no marker), the interpreter quoted for the shell
    assert f.fix == (
        "'/my venv/bin/python' -m pip install 'llama-index-core>=0.14.19' (or install the release of "
        "openinference-instrumentation-llama-index that instruments llama-index-core 0.13.0)"
    )
    assert "instruments llama-index-core>=0.14.19; the agent's environment" in f.saw


def test_an_instrumentor_of_a_library_the_agent_does_not_have_is_no_problem() -> None:
    absent = {
        **LLAMA,
        "targets": [{**CORE, "installed": None}, {**MULTI, "installed": None}],
        "conflict": {"required": CORE["requirement"], "found": None},
    }
    fine = {**LLAMA, "targets": [{**CORE, "installed": "0.14.25"}], "conflict": None}
    assert instrumentor_findings({"instrumentors": [absent, fine]}, "python") == []


def test_the_agents_python_is_its_interpreter_or_the_one_its_script_names(tmp_path: Path) -> None:
    venv_python = tmp_path / "bin" / "python3.11"
    venv_python.parent.mkdir()
    venv_python.write_text("")
    venv_python.chmod(0o755)
    script = tmp_path / "bin" / "opentelemetry-instrument"
    script.write_text(f"#!{venv_python}\nimport sys\n")
    env = {"PATH": str(tmp_path / "bin")}
    assert agent_python([str(script), "python", "agent.py"], env) == str(venv_python)
    assert agent_python(["python3.11", "agent.py"], env) == str(venv_python)
    assert agent_python(["node", "agent.js"], env) is None
    via_env = tmp_path / "bin" / "agent"
    via_env.write_text("#!/usr/bin/env -S python3.11 -u\n")
    assert agent_python([str(via_env)], env) == str(venv_python)


def test_gateway_and_check_take_no_record_content() -> None:
    import argparse

    from options import from_args
    from tracerl.commands import check, gateway

    for module, config in ((gateway, gateway.GatewayCommandConfig), (check, check.CheckConfig)):
        parser = argparse.ArgumentParser()
        module.configure(parser)
        assert from_args(config, parser.parse_args(["--no-record-content"])).record_content is False
        assert from_args(config, parser.parse_args([])).record_content is True


def test_calls_without_an_agent_name_get_the_ways_to_name_one() -> None:
    hint = agent_hint(transitions=3, without_agent=2)
    assert hint is not None and hint.startswith("2 of 3 calls have no agent name")
    assert "OTEL_RESOURCE_ATTRIBUTES=gen_ai.agent.name=NAME" in hint and "--agent-from span-name" in hint
    assert agent_hint(transitions=3, without_agent=0) is None
