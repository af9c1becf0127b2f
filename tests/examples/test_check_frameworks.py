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
import subprocess
import sys
from pathlib import Path

import pytest
from example_rig import ScriptedEngine, example_venv, start_engine
from tracerl_testing import tracerl

from span_to_transition.check_report import message_lines

HERE = Path(__file__).resolve().parent / "frameworks"
sys.path.insert(0, str(HERE))
from model_script import reply  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.prebuilt("frameworks-openai2", "frameworks-openai3")]

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


def run_check(
    store: Path, upstream: str, bin_dir: Path, agent: str, task: str, *flags: str
) -> subprocess.CompletedProcess:
    """``tracerl check --upstream URL -- BIN/opentelemetry-instrument BIN/python AGENT TASK``, as a user runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_", "VIRTUAL_ENV"))}
    env.update({"OPENAI_API_KEY": "sk-local", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"})
    return tracerl(
        *("check", "--store", str(store), "--upstream", upstream, "--timeout-s", "120", *flags, "--"),
        *(str(bin_dir / "opentelemetry-instrument"), str(bin_dir / "python"), str(HERE / agent), task),
        check=False,
        timeout=240,
        env=env,
    )


@pytest.mark.parametrize("framework", list(CASES))
def test_check_prints_each_framework_as_the_trainer_sees_it(tmp_path: Path, framework: str) -> None:
    venv, agent, name, scope = CASES[framework]
    bin_dir = example_venv(f"frameworks-{venv}")
    engine = ScriptedEngine(reply)
    server = start_engine(engine)
    task = json.dumps({"question": f"What is the weather in Paris? ({framework})"})
    try:
        proc = run_check(tmp_path / "store", server.url, bin_dir, agent, task)
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
    # the agent emits no reward: named, with the fix; its environment probed (no note), with no false alarm
    assert "problem: no rewards" in out and proc.returncode == 1, out
    assert "is skipped" not in out and "framework:" not in out and "\nnote:" not in out, out


def venv_without(source_bin: Path, dest: Path, dist_info_prefix: str) -> Path:
    """A real virtualenv holding ``source_bin``'s packages (linked), less one distribution's record: to pip and to
    ``opentelemetry-instrument`` that distribution is not installed. Its own ``opentelemetry-instrument`` script,
    as pip writes one, names its own Python."""
    subprocess.run(
        [str(source_bin / "python"), "-m", "venv", "--without-pip", str(dest)], check=True, timeout=120
    )
    source_site = next((source_bin.parent / "lib").glob("python3*/site-packages"))
    site = next((dest / "lib").glob("python3*/site-packages"))
    for entry in source_site.iterdir():
        if not entry.name.startswith(dist_info_prefix):
            (site / entry.name).symlink_to(entry.resolve())
    script = dest / "bin" / "opentelemetry-instrument"
    script.write_text(
        f"#!{dest}/bin/python\nimport sys\n"
        "from opentelemetry.instrumentation.auto_instrumentation import run\nsys.exit(run())\n"
    )
    script.chmod(0o755)
    return dest / "bin"


def test_check_names_an_instrumentor_opentelemetry_instrument_skips_and_the_pip_command(
    tmp_path: Path,
) -> None:
    """Issue #30: a LlamaIndex install without ``openinference-instrumentation-llama-index[instruments]`` (here:
    the LlamaIndex virtualenv less ``llama-index-multi-modal-llms-openai``, which that extra brings) records
    nothing and nothing says why; check asks the agent's own Python and names the conflict and the fix."""
    source = example_venv("frameworks-openai2")
    bin_dir = venv_without(source, tmp_path / "venv", "llama_index_multi_modal_llms_openai-")
    server = start_engine(ScriptedEngine(reply))
    try:
        proc = run_check(tmp_path / "store", server.url, bin_dir, "llama_agent.py", "{}")
    finally:
        server.stop()
    out = proc.stdout
    assert "calls converted: 0" in out and proc.returncode == 1, out + proc.stderr
    assert (
        "problem: instrumentation llama_index is skipped: its [instruments] extra is not installed" in out
    ), out
    assert "needs llama-index-multi-modal-llms-openai>=" in out and "it has llama-index-core 0.14" in out
    pip = f"fix:   {bin_dir / 'python'} -m pip install 'openinference-instrumentation-llama-index[instruments]==4.6.1'"
    assert pip in out, out


def test_a_gateway_that_records_no_content_leaves_strands_retokenized_and_check_says_why(
    tmp_path: Path,
) -> None:
    """``--no-record-content`` (as ``tracerl gateway --no-record-content``): Strands sends no traceparent and records
    no response id, so only the content join could give its calls the exact ids; check names the switch."""
    bin_dir = example_venv("frameworks-openai2")
    server = start_engine(ScriptedEngine(reply))
    task = json.dumps({"question": "What is the weather in Paris? (no content)"})
    try:
        proc = run_check(
            tmp_path / "store", server.url, bin_dir, "strands_agent.py", task, "--no-record-content"
        )
    finally:
        server.stop()
    out = proc.stdout
    assert "calls converted: 2" in out and out.count("token_source retokenized") == 2, out + proc.stderr
    assert (
        "problem: the gateway records no content (--no-record-content), so the content join cannot apply"
        in out
    )
    assert "2 of 2 transitions have no exact token ids" in out and proc.returncode == 1, out
