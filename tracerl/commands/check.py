"""One preflight run of a new agent: start a collector (and a gateway, with --upstream), run the agent command
once through them, convert, and print what was captured as the trainer will see it, then what is wrong and the fix.

Printed: spans by instrumentation scope; each converted call with its agent name, token_source, reward and its
messages; the doctor's findings (content capture, dialect, rewards, token ids, malformed chat, agent names); for
a run that captured no LLM call, what the frameworks installed in the agent's environment need (Haystack's
instrumentor must run after the import; LlamaIndex's needs its [instruments] extra). The agent runs with
OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_TRACES_EXPORTER=otlp, tracerl.rollout_id in OTEL_RESOURCE_ATTRIBUTES and, with
--upstream, OPENAI_BASE_URL at the gateway; run it under opentelemetry-instrument as you would in production.
Exit status: 0 healthy, 1 problems found (or the agent failed), 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass

from options import UsageError, add_options, from_args, opt

EPILOG = """\
examples:
  tracerl check -- opentelemetry-instrument python agent.py
  tracerl check --upstream http://127.0.0.1:8000 -- opentelemetry-instrument python agent.py   # exact token ids
"""

INSTALLED = "import importlib.metadata as m; print('\\n'.join(sorted({d.metadata['Name'] or '' for d in m.distributions()})))"
"""Run with the agent's Python: the distributions installed in its environment (for the framework hints)."""


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


def configure(parser: argparse.ArgumentParser) -> None:
    add_options(parser, CheckConfig)
    parser.add_argument("agent", nargs=argparse.REMAINDER, metavar="-- COMMAND ...", help="the agent command")


def _installed(command: list[str], env: dict[str, str]) -> set[str]:
    python = next((c for c in command if os.path.basename(c).startswith("python")), sys.executable)
    try:
        out = subprocess.run([python, "-c", INSTALLED], env=env, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {line.strip().lower() for line in out.stdout.splitlines() if line.strip()}


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
            from serving.gateway.proxy import Gateway, GatewayConfig, make_tracer_provider

            provider = make_tracer_provider(collector.grpc_endpoint)
            gw = Gateway(
                ("127.0.0.1", 0), GatewayConfig(upstreams=[cfg.upstream]), provider
            ).start_background()
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
    command = (
        [a for a in args.agent if a != "--"] if args.agent and args.agent[0] == "--" else list(args.agent)
    )
    if not command:
        raise UsageError(
            "give the agent command after --, e.g. tracerl check -- opentelemetry-instrument python agent.py"
        )
    from span_to_transition.check_report import captured, framework_hints
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
    facts.training = (
        None  # (one run has one reward: the next round's judgements, variance first, do not apply)
    )
    findings = diagnose(facts)
    hints = framework_hints(_installed(command, env), stats.transitions_written > 0)
    print(f"\nagent exit status: {code}" + (f"; its stderr ends:\n{tail}" if code and tail else ""))
    for f in findings:
        print("\n" + f.text())
    for h in hints:
        print(f"\nframework: {h}")
    print(f"\nstore: {store} (tracerl doctor --store {store}; tracerl sql --store {store} ...)")
    return 0 if code == 0 and stats.transitions_written and not findings and not hints else 1
