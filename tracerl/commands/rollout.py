"""Run an unmodified agent once per task and sample, pointed at tracerl by environment variables only.

Each run gets OTEL_RESOURCE_ATTRIBUTES=tracerl.rollout_id=…,tracerl.task_id=… (merged with yours),
OTEL_EXPORTER_OTLP_ENDPOINT (--otlp), OPENAI_BASE_URL (--gateway) and TRACERL_TASK (the task JSON,
also on stdin or as the last argument). An optional --reward function scores stdout; the score is
POSTed to the collector's /v1/rewards. One JSON line per rollout goes to STORE/rollouts/.
Exit 0 when every rollout ran (failed agents are data), 1 when the driver failed, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys
import threading

from options import UsageError, add_options, from_args, from_fields
from rollout.driver import Driver, RolloutConfig, run_rollouts
from rollout.records import format_summary, summarize
from rollout.rewards import load_reward_fn
from rollout.tasks import load_tasks
from store.location import parse_store
from tracerl.signals import drain_then_interrupt, interrupt_on_signals

EPILOG = """\
example (collector, server and gateway already running):
  python examples/demo/make_tasks.py > tasks.jsonl
  tracerl rollout --tasks tasks.jsonl -n 4 --concurrency 8 --reward examples/demo/reward.py:score \\
      -- opentelemetry-instrument python examples/demo/agent.py

a Node agent (the JavaScript SDK exports OTLP/HTTP; see examples/vercel_agent):
  tracerl rollout --tasks tasks.jsonl --otlp-protocol http/protobuf --otlp http://127.0.0.1:4318 \\
      -- node --import ./instrumentation.mjs agent.mjs

asynchronous rounds: agents keep running while the trainer trains (stop with Ctrl-C):
  tracerl rollout --tasks tasks.jsonl -n 4 --continuous --reward examples/demo/reward.py:score \\
      -- opentelemetry-instrument python examples/demo/agent.py &
  tracerl train --watch --max-staleness 1 --model DIR --server http://127.0.0.1:8000

tasks.jsonl: one JSON object per line; `id` (string or integer) names the task, else a hash of the
line is used. A bad line stops the run before any agent starts, with FILE:LINE and the problem.
"""


def configure(parser: argparse.ArgumentParser) -> None:
    add_options(parser, RolloutConfig)
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                        help="the agent command, unchanged (after `--`)")


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    cfg = from_args(RolloutConfig, args)
    if not command:
        raise UsageError("give the agent command after `--`, e.g. "
                         "tracerl rollout --tasks tasks.jsonl -- opentelemetry-instrument python agent.py")
    tasks = load_tasks(cfg.tasks)
    reward_fn = load_reward_fn(cfg.reward) if cfg.reward else None
    try:  # --store parsed once, here: the driver writes its records through this location
        store = parse_store(cfg.store)
    except (OSError, ValueError) as e:  # pyarrow's: an unknown scheme, a malformed URI
        raise UsageError(f"--store {cfg.store}: {str(e).strip().splitlines()[0]}; give a directory or "
                         "s3://bucket/prefix") from None
    # every flag of the same name by name; the ones the command turned into another form, given
    driver = from_fields(Driver, cfg, command=command, tasks=tasks, reward_fn=reward_fn, store=store)
    if cfg.continuous:  # stopping is how a continuous run ends: let the running agents finish
        stop = threading.Event()

        def say() -> None:
            print("tracerl rollout: stopping: waiting for the running agents to finish (Ctrl-C again kills "
                  "them)", file=sys.stderr, flush=True)

        with drain_then_interrupt(stop, say):
            records, path = run_rollouts(driver, stop=stop)
    else:
        with interrupt_on_signals():  # Ctrl-C or SIGTERM: agents killed, finished records kept
            records, path = run_rollouts(driver)
    summary = summarize(records)
    print(format_summary(summary, str(path)), flush=True)
    if summary.unposted_rewards:
        print(f"tracerl rollout: error: {summary.unposted_rewards} reward(s) could not be posted to "
              f"{cfg.collector}; start `tracerl collect` or pass the right --collector", file=sys.stderr)
        return 1
    return 0
