"""Train the agent's policy on its own traces, one on-policy round at a time.

Round k reads the transitions of policy@k (the base model --model is policy@0), computes
group-relative advantages per task, runs PPO-clip updates, writes STORE/checkpoints/policy-<k+1>
(HF weights + optimizer state + a manifest of what it trained on) and the STORE/rounds manifest,
then publishes policy@k+1 to --server. --once does at most one round and is safe from cron: it
takes a lock, resumes an interrupted round, and a rerun with no new data changes nothing.
--watch keeps doing rounds as data arrives.

--store may be s3://bucket/prefix: the manifest, the selections and the lock (a lease that expires
when its trainer dies) live in the bucket; checkpoints are written under --checkpoints on this host
and copied into the bucket, so a trainer on another host goes on where this one stopped.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

from options import UsageError, add_options, from_args

if TYPE_CHECKING:
    from trainer.config import TrainSettings

EPILOG = """\
examples:
  tracerl init-model ./tiny && tracerl train --once --model ./tiny --min-rollouts 8
  tracerl train --watch --model ./tiny --server http://127.0.0.1:8000 --every 600
  */10 * * * *  tracerl train --once --store /data/tracerl-store --model /models/base   (crontab)
  tracerl train --watch --store s3://bucket/runs/a --checkpoints /scratch/ckpt --model /models/base
  tracerl train --watch --canary --gateway http://127.0.0.1:8100 --model ./smol \
      --server http://127.0.0.1:8000,http://127.0.0.1:8001      (a canary per round, decided here)
  tracerl train --watch --canary --server http://127.0.0.1:8000,http://127.0.0.1:8001 --model ./smol \
      --gate-tasks heldout.jsonl --gate-agent "python examples/demo/agent.py" \
      --gate-reward examples/demo/reward.py:score     (an eval gate before each canary)
"""


def configure(parser: argparse.ArgumentParser) -> None:
    from trainer.config import TrainSettings

    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--once", action="store_true", help="do at most one round, then exit (cron-safe)")
    mode.add_argument("--watch", action="store_true", help="keep training rounds as transitions arrive")
    add_options(parser, TrainSettings)


def run(args: argparse.Namespace) -> int:
    from trainer.config import TrainSettings
    from trainer.rounds import TrainError, run_once, watch

    settings = from_args(TrainSettings, args)
    if settings.min_rollouts < 1 or settings.epochs < 1 or settings.steps_per_epoch < 1:
        raise UsageError("--min-rollouts, --epochs and --steps-per-epoch must be >= 1")
    if settings.max_rollouts < 0 or 0 < settings.max_rollouts < settings.min_rollouts:
        raise UsageError(f"--max-rollouts {settings.max_rollouts} must be 0 (no cap) or >= --min-rollouts "
                         f"{settings.min_rollouts}, else a round could never start; raise it or lower --min-rollouts")
    if settings.pack_tokens < settings.max_prompt_tokens + settings.max_response_tokens:
        raise UsageError(f"--pack-tokens {settings.pack_tokens} is smaller than the longest possible sample "
                         f"(--max-prompt-tokens {settings.max_prompt_tokens} + --max-response-tokens "
                         f"{settings.max_response_tokens}); raise it or lower those")
    if settings.keep_checkpoints < 0 or settings.keep_checkpoints == 1:
        raise UsageError(f"--keep-checkpoints {settings.keep_checkpoints} must be 0 (keep all) or >= 2 (the serving "
                         "policy and the one a failed reload restores)")
    if settings.dual_clip is not None and settings.dual_clip <= 1.0:
        raise UsageError(f"--dual-clip must be > 1 (it bounds the loss at dual_clip * advantage), got {settings.dual_clip}")
    check_gate(settings)
    try:
        publisher = None
        if settings.server:
            from trainer.publish import canary_publisher, gated, server_publisher

            make = canary_publisher if settings.canary else server_publisher
            publisher = make(settings.server, settings.publish)
            if settings.gate_tasks:
                publisher = gated(publisher, eval_gate(settings))
        if args.watch:
            from loop.watch import new_data_sleep
            from store.location import parse_store

            watch(settings, publisher=publisher, between=canary_decision(settings),
                  sleep=new_data_sleep(parse_store(settings.store)))
            return 0
        run_once(settings, publisher=publisher)
        return 0
    except TrainError as e:
        raise UsageError(str(e)) from e


def check_gate(settings: TrainSettings) -> None:
    """``--gate-tasks`` needs a canary over servers, an agent and a reward: say which is missing."""
    if not settings.gate_tasks:
        return
    missing = [flag for flag, ok in (("--canary", settings.canary), ("--server A,B", settings.server),
                                     ("--gate-agent CMD", settings.gate_agent),
                                     ("--gate-reward FN", settings.gate_reward)) if not ok]
    if missing:
        raise UsageError(f"--gate-tasks {settings.gate_tasks} also needs {', '.join(missing)}: the gate runs the "
                         "held-out tasks with that agent and reward against the canary's two servers")
    if settings.gate_samples < 1 or settings.gate_margin < 0:
        raise UsageError(f"--gate-samples must be >= 1 and --gate-margin >= 0, got {settings.gate_samples}, "
                         f"{settings.gate_margin}")


def eval_gate(settings: TrainSettings) -> Callable:
    """The eval gate of ``--gate-tasks`` (``loop.gate.server_gate``), its files read now so a bad one fails
    before the first round trains."""
    import shlex

    from loop.gate import GatePlan, server_gate
    from rollout.rewards import load_reward_fn
    from rollout.tasks import load_tasks
    from trainer.publish import server_urls, weight_tag

    try:  # the rollout command's loaders, their messages in this command's flags
        tasks, reward_fn = load_tasks(settings.gate_tasks), load_reward_fn(settings.gate_reward)
    except UsageError as e:
        raise UsageError(str(e).replace("--tasks", "--gate-tasks").replace("--reward", "--gate-reward")) from None
    plan = GatePlan(tasks=tasks, command=shlex.split(settings.gate_agent), reward_fn=reward_fn,
                    n=settings.gate_samples, margin=settings.gate_margin)
    return server_gate(server_urls(settings.server or ""), plan, weight_tag, settings.served_name)


def canary_decision(settings: TrainSettings) -> Callable[[], None] | None:
    """``--watch --canary --gateway URL``: each idle poll decides the newest canary and tells the
    gateway (``loop.promote``); a gateway that cannot be told is said and told again next poll."""
    if not (settings.canary and settings.gateway):
        return None
    from loop.promote import gateway_orders, promote_once
    from store.location import parse_store

    loc, tell = parse_store(settings.store), gateway_orders(settings.gateway)

    def decide() -> None:
        try:
            promote_once(loc, tell=tell, log=lambda m: None if m.startswith("another") else print(m))
        except RuntimeError as e:
            print(f"tracerl train: {e}; the decision is recorded, the next poll tells the gateway again")

    return decide
