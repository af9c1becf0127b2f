"""Show the training rounds: a table of reward, loss, KL per round, and a PNG plot of them.

Reads STORE/rounds (written by 'tracerl train'); the PNG goes to --out (default
STORE/report.png). Where `tracerl judge` wrote rewards, a second table shows the judge's token cost
per round and, for rollouts a grader also rewarded, its agreement with the grader: Spearman rank
correlation, and AUC on pass/fail (pass: grader reward >= --pass-threshold).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from options import add_options, from_args, opt
from store.layout import default_store
from store.location import parse_store


@dataclass
class ReportConfig:
    store: str = opt(default_store(), "store directory holding rounds/", metavar="DIR")
    out: str | None = opt(None, "PNG file to write (default: STORE/report.png)", metavar="FILE")
    plot: bool = opt(True, "write the PNG (--no-plot prints the table only)")
    judge_name: str = opt("judge", "reward name of the judge's rows (tracerl judge --name)")
    pass_threshold: float = opt(0.5, "a grader reward at least this is a pass, for the judge's AUC")


def configure(parser: argparse.ArgumentParser) -> None:
    add_options(parser, ReportConfig)


def run(args: argparse.Namespace) -> int:
    from judge.report import format_judge, judge_report
    from trainer.report import format_table, plot, round_rows

    cfg = from_args(ReportConfig, args)
    where = parse_store(cfg.store)
    rows = round_rows(where)
    judged = format_judge(judge_report(where, cfg.judge_name, cfg.pass_threshold))
    if judged:
        print(judged + "\n")
    if not rows:
        print(f"no rounds in {where.table('rounds')} yet; run 'tracerl train --once' first")
        return 0
    print(format_table(rows))
    if cfg.plot:
        out = Path(cfg.out) if cfg.out else Path(where.root) / "report.png" if where.is_local else Path("report.png")
        print(f"wrote {plot(rows, out)}")
    return 0
