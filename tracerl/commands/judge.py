"""Score converted rollouts with an LLM judge and write the scores as rewards (source = judge).

For agents without a reward function. In group mode (the default; RULER-style) the judge sees all of a
task's rollouts in one prompt, their shared beginning once, and scores each from 0 to 1 relative to the
others; in pointwise mode it scores one rollout at a time against the rubric (live traffic, where no
task repeats). The judge is any OpenAI-compatible endpoint (vLLM, `tracerl serve`, a hosted API; key
from TRACERL_JUDGE_API_KEY or OPENAI_API_KEY). Scores are asked for as structured output where the
endpoint supports it (vLLM: guided decoding), else parsed from the text.

Each row records the judge model, a hash of rubric + mode + model, the judge's explanation and its
token counts. A rollout with a reward of --name is never judged again. An answer that cannot be parsed
gets one retry quoting the error, then no reward for that group (never a guessed score; counted, and not
asked again unless --retry-failed). An unreachable judge writes nothing: rollouts wait for the next pass.

The judge reads the transitions table: convert with --missing-reward keep so rollouts without any
other reward are in it; `tracerl convert` (or `collect --convert`) then picks up the judge's rows and
converts those rollouts again with the reward, so the next `tracerl train` trains on it.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from judge.config import JudgeSettings, UsageError, add_options, from_args
from judge.stage import run_once, stats_dict, watch
from store.location import parse_store

EPILOG = """\
examples:
  tracerl convert --missing-reward keep --quiet-s 0         # rollouts without a reward, kept for the judge
  tracerl judge --once --judge-url http://127.0.0.1:8000/v1 --judge-model Qwen/Qwen2.5-7B-Instruct
  OPENAI_API_KEY=... tracerl judge --once --judge-url https://api.openai.com/v1 --judge-model gpt-4.1-mini
  tracerl judge --watch --mode pointwise --rubric rubric.md --judge-model judge   # live traffic
  tracerl convert                                           # judged rollouts are converted with their reward
  tracerl sql "SELECT rollout_id, value, explanation FROM rewards WHERE source = 'judge'"
"""


def configure(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="one pass, then exit (the default; cron-safe)")
    mode.add_argument(
        "--watch", action="store_true", help="a pass every --every-s seconds until SIGTERM/Ctrl-C"
    )
    add_options(parser, JudgeSettings)


def run(args: argparse.Namespace) -> int:
    settings = from_args(JudgeSettings, args)
    settings.validate()
    if not args.watch and not parse_store(settings.store).files("transitions"):
        raise UsageError(
            f"--store {settings.store} has no transitions to judge; convert first, keeping rollouts that have "
            "no reward: tracerl convert --missing-reward keep (or point --store at the store you convert)"
        )
    if args.watch:
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        print(
            f"judging {settings.store} every {settings.every_s:g}s with {settings.judge_model} "
            f"at {settings.judge_url}; Ctrl-C stops",
            file=sys.stderr,
        )
        try:
            watch(settings, stop)
        except KeyboardInterrupt:
            stop.set()
        return 0
    stats = run_once(settings)
    print(json.dumps(stats_dict(stats), indent=2) if settings.json else stats.summary())
    return 1 if stats.unavailable and not stats.groups_scored else 0
