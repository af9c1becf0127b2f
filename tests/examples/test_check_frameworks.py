"""``tracerl check -- <agent>`` on every framework virtualenv we have: what it prints is what the trainer gets.

Each framework agent (``tests/examples/frameworks/*_agent.py``) runs unchanged in its own virtualenv under its
``opentelemetry-instrument``, through the gateway ``tracerl check --upstream`` starts in front of the scripted
engine (``model_script.reply``: call ``get_weather``, then answer; it logs every request, so the printed
messages are checked against what went over the wire). Checked per framework: both calls converted with the
gateway's exact token ids, the agent named as its user named it, the instrumentation scope its spans came from,
every message of every call as the engine received it, and the one problem such a run has: no reward.

CrewAI is not here: no virtualenv of it is built on this machine (its recorded fixture is covered by
``tests/span_to_transition/test_frameworks.py``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from example_rig import ScriptedEngine, example_venv, start_engine
from tracerl_testing import tracerl

from span_to_transition.check_report import message_lines

HERE = Path(__file__).resolve().parent / "frameworks"
sys.path.insert(0, str(HERE))
from model_script import reply  # noqa: E402

pytestmark = pytest.mark.slow

CASES = {  # framework -> (virtualenv, agent, the agent's name as its user gave it, the scope of its spans)
    "strands": ("openai2", "strands_agent.py", "weather", "strands.telemetry.tracer"),
    "llamaindex": ("openai2", "llama_agent.py", "weather", "openinference.instrumentation.llama_index"),
    "smolagents": ("openai3", "smol_agent.py", "calculator", "openinference.instrumentation.smolagents"),
}


def printed_call(request: dict) -> str:
    """One call as ``tracerl check`` must print it: the request's messages as sent, then the engine's reply."""
    lines = ["    " + line for m in request["messages"] for line in message_lines(m)]
    lines += ["    => " + line for line in message_lines({"role": "assistant", **reply(request)})]
    return "\n".join(lines)


@pytest.mark.parametrize("framework", list(CASES))
def test_check_prints_each_framework_as_the_trainer_sees_it(tmp_path: Path, framework: str) -> None:
    venv, agent, name, scope = CASES[framework]
    bin_dir = example_venv(f"frameworks-{venv}", HERE / f"requirements-{venv}.txt")
    engine = ScriptedEngine(reply)
    server = start_engine(engine)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_", "VIRTUAL_ENV"))}
    env.update({"OPENAI_API_KEY": "sk-local", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"})
    task = json.dumps({"question": f"What is the weather in Paris? ({framework})"})
    try:
        proc = tracerl(
            "check",
            "--store",
            str(tmp_path / "store"),
            "--upstream",
            server.url,
            "--timeout-s",
            "120",
            "--",
            str(bin_dir / "opentelemetry-instrument"),
            str(bin_dir / "python"),
            str(HERE / agent),
            task,
            check=False,
            timeout=240,
            env=env,
        )
    finally:
        server.stop()
    out = proc.stdout
    assert "calls converted: 2" in out, out + proc.stderr
    assert len(engine.requests) == 2
    assert out.count("token_source gateway") == 2, out
    assert out.count(f"agent {name}, ") == 2, out
    assert f"  {scope}: " in out and "  tracerl.gateway: 2" in out, out
    for request in engine.requests:
        assert printed_call(request) in out, (printed_call(request), out)
    assert "agent exit status: 0" in out
    assert "problem: no rewards" in out and proc.returncode == 1, (
        out
    )  # the agent emits none: named, with the fix
    assert "instrumentation skipped" not in out and "framework:" not in out, out  # no false alarm
