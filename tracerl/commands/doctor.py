"""Why a store yields no (or few) transitions, and the fix.

Reads spans, logs, rewards, transitions and the converter's state (read-only) and reports, per
problem, what it saw, what it means and the exact fix: no spans, no LLM spans (and which
instrumentation scopes it did see), content capture off (the setting for that instrumentation),
calls without prompt messages, LLM calls in a dialect the converter does not read (with a sample
span's attribute keys), no rewards (and which reward spellings exist), no token ids (gateway not
in the path, traceparent not propagated), rollouts still pending (on --quiet-s or --max-wait-s), and
whether the next training round would train: every task seen once under a group estimator, different
requests grouped as one task, feedback whose keys match no rollout, feedback coverage per policy
version, rollouts waiting on their --feedback-window, no reward variance, nothing new to train; and
judge groups whose answers could not be used (`tracerl judge`).
Exit status: 0 healthy (the next round has rollouts with a learning signal), 1 problems found, 2 bad usage.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pyarrow.fs as pafs

from options import UsageError, add_options, from_args, opt
from span_to_transition.convert import ConvertConfig
from store.layout import default_store
from store.location import parse_store
from trainer.advantages import AUTO, ESTIMATORS
from trainer.config import TrainSettings

EPILOG = """\
examples:
  tracerl doctor                                   # the store in ./tracerl-store (or $TRACERL_STORE)
  tracerl doctor --store /data/tracerl --json      # one JSON list of {problem, saw, means, fix}
  tracerl doctor --quiet-s 5                       # judge pending rollouts with the settings you convert with
  tracerl doctor --estimator auto --feedback-window 1h   # judge the next round as tracerl train would run it
"""


@dataclass
class DoctorConfig:
    store: str = opt(
        default_store(), "store directory, or s3://bucket/prefix", metavar="DIR|URI", env="TRACERL_STORE"
    )
    quiet_s: float = opt(
        ConvertConfig.quiet_s, "judge pending rollouts by this --quiet-s (the one you convert with)"
    )
    max_wait_s: float = opt(ConvertConfig.max_wait_s, "judge pending rollouts by this --max-wait-s")
    estimator: str = opt(
        TrainSettings.estimator, "judge the next round by this tracerl train --estimator", choices=[AUTO, *ESTIMATORS]
    )
    feedback_window: str = opt(
        "0",
        "judge the next round by this tracerl train --feedback-window (600, 10m, 2h, 1d)",
        metavar="DURATION",
    )
    json: bool = opt(False, "print the findings as JSON")


def configure(parser: argparse.ArgumentParser) -> None:
    add_options(parser, DoctorConfig)


def run(args: argparse.Namespace) -> int:
    from judge.doctor import judge_findings, judge_states
    from span_to_transition.doctor import Finding, as_json, diagnose, report
    from span_to_transition.survey import gather
    from tracerl.commands.status import collect_status

    cfg = from_args(DoctorConfig, args)
    loc = parse_store(cfg.store)
    if loc.fs.get_file_info(loc.root).type != pafs.FileType.Directory:
        raise UsageError(
            f"--store {cfg.store} is not a directory; point --store (or TRACERL_STORE) at the "
            "directory (or s3://bucket/prefix) `tracerl collect --store` writes"
        )
    from trainer.feedback_window import parse_duration

    try:
        ConvertConfig(quiet_s=cfg.quiet_s, max_wait_s=cfg.max_wait_s).validate()
        window_s = parse_duration(cfg.feedback_window)
    except ValueError as e:
        raise UsageError(str(e)) from None
    facts = gather(
        loc,
        cfg.quiet_s,
        cfg.max_wait_s,
        wal_backlog_bytes=collect_status(loc)["wal"]["backlog_bytes"],
        estimator=cfg.estimator,
        feedback_window_s=window_s,
    )
    findings = diagnose(facts)
    findings += [Finding(*f) for f in judge_findings(judge_states(loc))]
    print(as_json(findings) if cfg.json else report(findings, loc.root if loc.is_local else loc.uri))
    return 1 if findings else 0
