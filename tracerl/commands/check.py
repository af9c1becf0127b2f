"""One preflight run of a new agent: start a collector (and a gateway, with --upstream), run the agent command
once through them, convert, and print what was captured as the trainer will see it, then what is wrong and the fix.

Printed: spans by instrumentation scope; each converted call with its agent name, token_source, reward and its
messages; the doctor's findings (content capture, dialect, rewards, token ids, malformed chat, agent names);
installed instrumentors that opentelemetry-instrument skips without a word (a dependency conflict, asked of the
agent's own Python: check_probe.py), with the pip command that fixes each; for a run that captured no LLM call,
what known frameworks need (Haystack's instrumentor must run after the import). The agent runs with
OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_TRACES_EXPORTER=otlp, tracerl.rollout_id in OTEL_RESOURCE_ATTRIBUTES and, with
--upstream, OPENAI_BASE_URL at the gateway; run it under opentelemetry-instrument as you would in production.
Exit status: 0 healthy, 1 problems found (or the agent failed), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass

from options import UsageError, add_options, from_args, opt

EPILOG = """\
examples:
  tracerl check -- opentelemetry-instrument python agent.py
  tracerl check --upstream http://127.0.0.1:8000 -- opentelemetry-instrument python agent.py   # exact token ids
"""

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check_probe.py")
"""Run with the agent's Python: its installed distributions and instrumentors (``check_probe.py``)."""


@dataclass
class CheckConfig:
    """Settings for ``tracerl check``."""

    store: str = opt(
        "", "store directory to collect into (default: a new temporary directory, kept)", metavar="DIR"
    )
    upstream: str = opt(
        "",
        "model server URL: the agent's calls go through a gateway in front of it "
        "(OPENAI_BASE_URL), for exact token ids",
        metavar="URL",
    )
    timeout_s: float = opt(600.0, "stop the agent after this many seconds")
    record_content: bool = opt(
        True,
        "with --upstream: the gateway records each call's request and response for the content join; "
        "--no-record-content checks what `tracerl gateway --no-record-content` gives this agent",
    )


def configure(parser: argparse.ArgumentParser) -> None:
    add_options(parser, CheckConfig)
    parser.add_argument("agent", nargs=argparse.REMAINDER, metavar="-- COMMAND ...", help="the agent command")


def agent_python(command: list[str], env: dict[str, str]) -> str | None:
    """The Python that runs the agent: the first word of the command that is a Python interpreter, or a script
    whose ``#!`` line names one (``opentelemetry-instrument``'s own, in the agent's virtualenv); None if neither."""
    for word in command:
        path = word if os.sep in word else shutil.which(word, path=env.get("PATH"))
        if not path or not os.path.isfile(path):
            continue
        if os.path.basename(path).startswith("python"):
            return path
        try:
            with open(path, "rb") as f:
                head = f.readline(512).decode(errors="replace")
        except OSError:
            continue
        if head.startswith("#!") and "python" in head:
            words = head[2:].split()
            if os.path.basename(words[0]) == "env":  # #!/usr/bin/env [-S] python3 [-u]
                name = next((w for w in words[1:] if not w.startswith("-")), "python")
                return shutil.which(name, path=env.get("PATH"))
            return words[0]
    return None


def _probe(python: str, env: dict[str, str]) -> dict | None:
    """``check_probe.py``'s facts from the agent's Python; None when it cannot run there (then said so)."""
    try:
        out = subprocess.run([python, PROBE], env=env, capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def _run_agent(command: list[str], cfg: CheckConfig, store: str) -> tuple[int, str, dict[str, str]]:
    from collector_exporter.collector import Collector, CollectorSettings

    collector = Collector(
        CollectorSettings(store=store, grpc="127.0.0.1:0", http="127.0.0.1:0", max_segment_age_s=0.2)
    ).start()
    gw = provider = None
    try:
        env = {
            **os.environ,
            "OTEL_EXPORTER_OTLP_ENDPOINT": collector.grpc_endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_RESOURCE_ATTRIBUTES": ",".join(
                filter(
                    None,
                    [
                        os.environ.get("OTEL_RESOURCE_ATTRIBUTES"),
                        f"tracerl.rollout_id=check-{uuid.uuid4().hex[:8]}",
                    ],
                )
            ),
        }
        if cfg.upstream:
            from serving.gateway.config import GatewayConfig, make_tracer_provider
            from serving.gateway.proxy import Gateway

            provider = make_tracer_provider(collector.grpc_endpoint)
            gw_cfg = GatewayConfig(upstreams=[cfg.upstream], record_content=cfg.record_content)
            gw = Gateway(("127.0.0.1", 0), gw_cfg, provider).start_background()
            env["OPENAI_BASE_URL"] = f"{gw.url}/v1"
        try:
            agent = subprocess.run(command, env=env, capture_output=True, text=True, timeout=cfg.timeout_s)
            code, tail = agent.returncode, (agent.stderr or "")[-2000:]
        except subprocess.TimeoutExpired:
            code, tail = 124, f"the agent ran past --timeout-s {cfg.timeout_s:g}"
        except OSError as e:
            raise UsageError(f"cannot start the agent command {command[0]!r}: {e}") from None
    finally:
        if gw is not None:
            gw.stop()
        if provider is not None:
            provider.shutdown()
        collector.flush()
        collector.stop()
    return code, tail, env


def run(args: argparse.Namespace) -> int:
    cfg = from_args(CheckConfig, args)
    command = list(args.agent[1:] if args.agent[:1] == ["--"] else args.agent)
    if not command:
        raise UsageError(
            "give the agent command after --, e.g. tracerl check -- opentelemetry-instrument python agent.py"
        )
    from span_to_transition.check_report import agent_hint, captured
    from span_to_transition.convert import ConvertConfig
    from span_to_transition.doctor import diagnose
    from span_to_transition.store import convert_store
    from span_to_transition.survey import gather
    from store.location import parse_store
    from store.views import connect_readonly

    store = cfg.store or tempfile.mkdtemp(prefix="tracerl-check-")
    code, tail, env = _run_agent(command, cfg, store)
    loc = parse_store(store)
    stats = convert_store(loc, ConvertConfig(quiet_s=0, max_wait_s=0, missing_reward="fill"))
    con = connect_readonly(loc)
    try:
        print(captured(con))
    finally:
        con.close()
    print(f"\nconvert: {stats.summary()}")
    facts = gather(loc)
    # one run has one reward: the next round's judgements (variance first) do not apply
    facts.training = None
    findings = diagnose(facts)
    env_findings, hints, note = _environment(command, env, stats.transitions_written > 0)
    print(f"\nagent exit status: {code}" + (f"; its stderr ends:\n{tail}" if code and tail else ""))
    for f in [*env_findings, *findings]:
        print("\n" + f.text())
    for h in hints:
        print(f"\nframework: {h}")
    for line in filter(None, [agent_hint(facts.transitions, facts.transitions_without_agent), note]):
        print(f"\nnote: {line}")
    print(f"\nstore: {store} (tracerl doctor --store {store}; tracerl sql --store {store} ...)")
    problems = env_findings or findings or hints
    return 0 if code == 0 and stats.transitions_written and not problems else 1


def _environment(
    command: list[str], env: dict[str, str], calls_captured: bool
) -> tuple[list, list[str], str]:
    """What the agent's own environment says (run in its Python): instrumentors ``opentelemetry-instrument``
    skips, the framework hints; and a note when that Python could not be found or probed."""
    from span_to_transition.check_report import framework_hints, instrumentor_findings

    python = agent_python(command, env)
    if python is None:
        return (
            [],
            [],
            (
                "could not tell which Python runs the agent (no python or #! script in the command), so "
                "its installed instrumentors were not checked; name it, e.g. tracerl check -- "
                ".venv/bin/opentelemetry-instrument .venv/bin/python agent.py"
            ),
        )
    facts = _probe(python, env)
    if facts is None:
        return (
            [],
            [],
            f"{python} could not run the environment probe ({PROBE}); its instrumentors were not checked",
        )
    installed = set(facts.get("installed", []))
    return instrumentor_findings(facts, python), framework_hints(installed, calls_captured), ""
