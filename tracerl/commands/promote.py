"""Decide the newest canary round: promote policy@k+1 to all traffic, roll it back, or wait.

A round published with `tracerl train --canary` serves the gateway's `--canary` share beside the
version it trained from. `tracerl promote --once` compares the two arms' rollout rewards over the same
window (since the canary was published), in the order the rollouts began, with an exact always-valid
sequential test (loop/canary.py: paired blocks of the two arms, valid for rewards in --reward-range at
any success rate and any sample size, with no need to know the share), so cron may run it as often as
it likes: it promotes when the candidate is no worse than serving minus
--margin, rolls back when it is worse, and otherwise waits for more rollouts. The decision and its
numbers go into the rounds manifest (`tracerl report` shows them); with --gateway it then tells the
gateway the pair of versions (it finds each on its servers, so it follows round after round with no
restart) and the share: 1 on promote, 0 on rollback, its own --canary share while undecided. A
rolled-back round's data is kept, and the next `tracerl train` round starts from the version that
kept serving.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from options import UsageError, add_options, from_args, opt
from store.layout import default_store
from store.location import parse_store

EPILOG = """\
example (cron, every minute):
  tracerl promote --once --store ./tracerl-store --gateway http://127.0.0.1:8100
exit codes: 0 decided, waiting or nothing to do; 1 the gateway could not be told (rerun); 2 bad usage
"""


@dataclass
class PromoteConfig:
    """Settings for ``tracerl promote``."""

    store: str = opt(default_store(), "store holding rounds/ and transitions/", metavar="DIR|URI")
    once: bool = opt(False, "look once and exit (the only mode: run it from cron or after each round)")
    gateway: str = opt(
        "",
        "the `tracerl gateway --canary` to tell the pair of versions and the decision (POST "
        "/v1/canary); unset: record it only",
        metavar="URL",
    )
    gateway_token: str = opt("", "the gateway's --token, if it has one", env="TRACERL_GATEWAY_TOKEN")
    alpha: float = opt(
        0.05,
        "chance of each wrong answer (promoting a harm of --margin or more; rolling "
        "back a candidate no worse), over every look",
    )
    margin: float = opt(
        0.05,
        "loss of mean reward a new version may cost and still be promoted; a wider margin promotes a "
        "candidate no worse than serving sooner (an exactly equal one at success 0.25, share 0.2 and margin "
        "0.05 needs about 2,650 rollouts on average, whatever the test)",
    )
    min_per_arm: int = opt(20, "rewarded rollouts each arm needs before any decision")
    reward_range: str = opt("0,1", "LO,HI: the range rewards lie in", metavar="LO,HI")
    served_name: str = opt("policy", "served model name (the train command's --served-name)", metavar="NAME")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_options(parser, PromoteConfig)


def run(args: argparse.Namespace) -> int:
    from loop.canary import CanaryRule
    from loop.promote import gateway_orders, promote_once

    cfg = from_args(PromoteConfig, args)
    if not cfg.once:
        raise UsageError("give --once (promote looks once per run; run it from cron or after each round)")
    try:
        lo, hi = (float(x) for x in cfg.reward_range.split(","))
        rule = CanaryRule(cfg.alpha, cfg.margin, cfg.min_per_arm, (lo, hi))
    except ValueError as e:
        raise UsageError(f"{e} (--reward-range is LO,HI, e.g. 0,1)") from None
    from pathlib import Path

    loc = parse_store(cfg.store)
    if loc.is_local and not Path(loc.root).is_dir():
        raise UsageError(
            f"no store at {loc.root}; pass --store DIR (or TRACERL_STORE), where `tracerl train` writes"
        )
    tell = gateway_orders(cfg.gateway, cfg.gateway_token or None) if cfg.gateway else None
    try:
        promote_once(loc, rule, served_name=cfg.served_name, tell=tell)
    except RuntimeError as e:
        print(f"tracerl promote: {e}; the decision is recorded, rerun to tell the gateway")
        return 1
    return 0
