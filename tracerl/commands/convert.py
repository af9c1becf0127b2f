"""Turn complete rollouts in the store into MDP transitions (one row per LLM call).

A rollout (one trace, every span sharing ``tracerl.rollout_id``, or with --rollout-key every
trace of one conversation) is converted once it is complete: its root span ended and no span arrived for --quiet-s seconds, or a span carried
``tracerl.rollout.end = true``. Calls are read in any GenAI dialect (OTel semconv, semconv log
events, OpenLLMetry, OpenInference), attributed to their nearest agent, credited with the
rollout's reward, and joined to the gateway's exact token ids when those exist. Re-running is
safe: converted rollouts are never written twice, and late spans are counted, not lost. A
reward posted after a rollout was converted converts it again; --rebuild converts everything
again with the current settings (after changing --agents, --credit, --missing-reward or --reward-from).
A rollout's reward is the sum of the rewards --reward-from selects: by default every reward but a
judge's, where the rollout has one (a judge scoring graded rollouts never adds to the grader's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass

import pyarrow.fs as pafs

from options import UsageError, add_options, from_args, from_fields, opt
from span_to_transition.convert import ConvertConfig
from span_to_transition.store import convert_store
from store.layout import default_store
from store.location import parse_store

EPILOG = """\
examples:
  tracerl convert --quiet-s 0                       # the agent has finished: convert everything now
  tracerl convert --agents 'writer|rewriter'        # train only these agents' calls
  tracerl convert --credit matched --missing-reward fill --fill-reward 0
  tracerl convert --rebuild --agents writer         # rewrite every row with new settings
  tracerl convert --rebuild --reward-from judge --missing-reward keep   # train on `tracerl judge` alone
  tracerl sql "SELECT agent_name, policy_version, avg(reward) FROM transitions GROUP BY ALL"
  tracerl sql "SELECT * FROM rollouts WHERE reward = 0"
"""


@dataclass
class ConvertCommandConfig(ConvertConfig):
    store: str = opt(default_store(), "store directory, or s3://bucket/prefix", metavar="DIR|URI",
                     env="TRACERL_STORE")
    json: bool = opt(False, "print the conversion stats as JSON")
    rebuild: bool = opt(False, "convert every complete rollout again with these settings (rows already "
                               "converted keep the settings they were converted with otherwise); earlier "
                               "transitions files are removed once the new rows are written")


def configure(parser: argparse.ArgumentParser) -> None:
    add_options(parser, ConvertCommandConfig)


def run(args: argparse.Namespace) -> int:
    cfg = from_args(ConvertCommandConfig, args)
    convert_cfg = from_fields(ConvertConfig, cfg)
    try:
        convert_cfg.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    loc = parse_store(cfg.store)
    if loc.fs.get_file_info(loc.table("spans")).type != pafs.FileType.Directory:
        raise UsageError(f"--store {cfg.store} has no spans/ directory; point --store (or TRACERL_STORE) at the "
                         "directory (or s3://bucket/prefix) `tracerl collect --store` writes")
    stats = convert_store(loc, convert_cfg, rebuild=cfg.rebuild)
    if cfg.json:
        print(json.dumps(dataclasses.asdict(stats), indent=2))
    else:
        print(stats.summary(), file=sys.stdout)
    return 0
