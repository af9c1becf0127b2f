"""What ``tracerl demo`` prints: the round table (and its parser, for tests and scripts), the lines for a
round and for a batch with no signal, and the closing hints (the viewer, DuckDB queries)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loop.rounds import NoSignal, RoundDone
from schemas.attributes import GATEWAY_FLAG, POLICY_VERSION
from tracerl.supervisor import BIN

if TYPE_CHECKING:  # imported where used: training pulls in torch
    from judge.batch import BatchJudgment


TABLE_COLUMNS = ("round", "policy", "rollouts", "mean_reward", "loss", "kl", "seconds")


@dataclass
class RoundResult:
    """One printed row: the manifest's numbers for round k, and this demo's wall time for it."""

    round: int
    policy: str
    rollouts: int
    mean_reward: float | None
    loss: float | None
    kl: float | None
    seconds: float
    status: str = ""


def format_row(r: RoundResult) -> str:
    def num(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    return (f"{r.round!s:>5}  {r.policy:>9}  {r.rollouts:>8}  {num(r.mean_reward, '.3f'):>11}  "
            f"{num(r.loss, '.4f'):>8}  {num(r.kl, '.4f'):>7}  {r.seconds:>7.1f}")


TABLE_HEADER = (f"{'round':>5}  {'policy':>9}  {'rollouts':>8}  {'mean_reward':>11}  {'loss':>8}  {'kl':>7}  "
                f"{'seconds':>7}")


def parse_table(text: str) -> list[dict[str, str]]:
    """The rows of a printed round table (for tests and scripts): header line to the next blank line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == list(TABLE_COLUMNS))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        cells = line.split()
        if cells[0].isdigit() or cells[0] == "eval":  # other lines (a library's warning) are not rows
            rows.append(dict(zip(TABLE_COLUMNS, cells[:len(TABLE_COLUMNS)], strict=True)))
    return rows


def print_round(rounds: list[RoundResult], done: RoundDone, lead: int) -> None:
    """A row of the table: the manifest's numbers for the round, and where its wall time went."""
    row = done.row
    res = RoundResult(round=done.round, policy=f"policy@{row['policy_version']}", rollouts=row["n_rollouts"],
                      mean_reward=row["mean_reward"], loss=row["loss"], kl=row["kl"], seconds=done.seconds,
                      status=row["status"])
    rounds.append(res)
    print(format_row(res) + f"   (rollouts {done.rollout_s:.1f}s{' ahead' if lead else ''}, convert "
          f"{done.convert_s + done.batch_convert_s:.1f}s, train {done.train_s:.1f}s)", flush=True)


def print_no_signal(ns: NoSignal, judged: BatchJudgment | None = None) -> None:
    """A batch the trainer found no signal in; with --reward judge (``judged``: the batch's judging) the
    signal is the judge's scores: missing where a group's judging failed, else alike in every task."""
    from rollout.records import summarize

    s, k = summarize(ns.records), ns.version
    why = "all alike within each task"
    if judged is not None:
        why = (f"{judged.untrained} of {judged.rollouts} unjudged (judging failed), the judge's scores of the rest "
               f"alike within each task" if judged.untrained else "the judge scored all alike within each task")
    print(f"    -   policy@{k}: {s.total} rollouts, mean {'grader ' if judged else ''}reward "
          f"{s.mean_reward or 0:.3f}, {why}: no training signal; "
          f"{'stopping' if ns.stopping else f'sampling policy@{k} again'}", flush=True)


def tracerl_command() -> str:
    """How to type ``tracerl`` here: the bare name when it is on PATH, else this venv's full path
    (after `make`, .venv/bin is usually not on PATH)."""
    found = shutil.which("tracerl")
    own = BIN / "tracerl"
    return "tracerl" if found and Path(found).resolve() == own.resolve() else str(own)


def ui_hint(store: Path, url: str = "http://127.0.0.1:8700/") -> str:
    """The last lines of the demo: the viewer over this run, and its address."""
    return (f"see every round, rollout and call token by token in the browser:\n"
            f"  {tracerl_command()} ui --store {store}      # then open {url}")


def explore_queries(store: Path) -> str:
    s, t = f"--store {store}", tracerl_command()
    return "\n".join([
        "explore the run with DuckDB SQL:",
        f'  {t} sql {s} "SELECT round, policy_version, n_rollouts, mean_reward, loss, kl, status FROM rounds '
        'ORDER BY round"',
        f'  {t} sql {s} "SELECT policy_version, agent_name, count(*) AS calls, avg(reward) AS mean_reward '
        'FROM transitions GROUP BY ALL ORDER BY ALL"',
        f'  {t} sql {s} "SELECT policy_version, json_extract_string(response_message, \'$.content\') AS reply, '
        'count(*) AS n FROM transitions WHERE agent_name = \'writer\' GROUP BY ALL ORDER BY policy_version, n DESC"',
        f'  {t} sql {s} "SELECT attributes[\'{POLICY_VERSION}\'] AS version, count(*) AS calls FROM spans '
        f'WHERE attributes[\'{GATEWAY_FLAG}\'] = \'true\' GROUP BY 1 ORDER BY 1"',
        f'  {t} sql {s} "SELECT * FROM rollouts ORDER BY started_at DESC LIMIT 10"',
        f"  {t} report {s}",
    ])
