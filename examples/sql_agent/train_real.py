"""Train the LangGraph SQL agent (paper shape) on a real model with the tracerl CLI, round by round.

The commands a user would type, run in order and printed as they start (nothing here trains or
converts by itself):

* ``tracerl serve --model MODEL --threads 1`` (SmolLM2-135M-Instruct on CPU), ``tracerl collect
  --convert`` and ``tracerl gateway``, on free ports of 127.0.0.1;
* ``tracerl train --watch`` (LoRA r=16 on q/k/v/o, lr 1e-3, bf16 autocast, one PPO step per round,
  ``--min-rollouts`` = one batch, ``--tasks '^train-'``: held-out questions are never trained on);
* per round, ``tracerl rollout`` of the next training questions x ``--samples`` under
  ``opentelemetry-instrument python examples/sql_agent/agent.py`` (the example's own venv,
  ``SQL_AGENT_SHAPE=paper``), scored by the demo's graded reward; then it waits for the trainer's
  ``round k: published`` line, so the next batch is sampled from the new policy;
* before the first and after the last round, ``tracerl rollout`` of the held-out questions, each
  sample with its own seed (the same draws for both policies);
* ``tracerl report`` (the rounds table and its PNG, from the store).

The questions and the reward are the real-model demo's (examples/demo/sql_tasks.py, sql_reward.py):
113 questions from 16 templates, 83 training and 30 held-out; 1.0 for the gold rows, 0.2 for SQL
that runs. WORKDIR/summary.json holds what the README reports: per-round rewards, wall times,
held-out scores and the load average sampled every 15 s.

    .venv/bin/python examples/sql_agent/train_real.py --model .models/smollm2-135m-instruct \\
        --agent-bin .venv-examples/sql_agent/bin --workdir /tmp/sql-real
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tracerl.demo_tasks import reward_shares  # one definition of success / mean / runs with the demo
from tracerl.stack import StackConfig, StackUrls, running_stack
from tracerl.supervisor import ChildError

HERE = Path(__file__).resolve().parent
DEMO = HERE.parent / "demo"
TRACERL = str(Path(sys.executable).parent / "tracerl")
LORA = ["--lora-rank", "16", "--lora-targets", "q_proj,k_proj,v_proj,o_proj"]


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def wait_until(ok, what: str, timeout_s: float, check_alive) -> None:
    """Poll ``ok`` until it holds; exit naming the process that ended meanwhile (``check_alive`` raises)."""
    deadline = time.monotonic() + timeout_s
    while not ok():
        try:
            check_alive()
        except ChildError as e:
            raise SystemExit(f"{e}\n(while waiting for {what})") from None
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what} after {timeout_s:.0f}s")
        time.sleep(1)


def trainer_said(log: Path, k: int, seen: int) -> str | None:
    """ "published" once ``tracerl train --watch`` published round k; "alike" when, after offset ``seen`` of
    its log, its last line says round k is due but every group's rewards are alike (no signal)."""
    text = log.read_text()
    if f"round {k}: published" in text:
        return "published"
    new_lines = text[seen:].strip().splitlines()
    return "alike" if new_lines and f"round {k}: waiting: all" in new_lines[-1] else None


class LoadSampler(threading.Thread):
    """/proc/loadavg's 1-minute figure every ``every_s`` seconds (what `uptime` shows)."""

    def __init__(self, every_s: float = 15.0) -> None:
        super().__init__(daemon=True)
        self.every_s, self.samples, self.stop = every_s, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append(float(Path("/proc/loadavg").read_text().split()[0]))
            self.stop.wait(self.every_s)


def interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", required=True, help="HF model dir (tracerl init-model DIR --from smollm2-135m-instruct)"
    )
    p.add_argument(
        "--agent-bin", required=True, help="bin/ of the example's venv (pip install -r requirements.txt)"
    )
    p.add_argument(
        "--workdir", default="./sql-real", help="store, tasks, logs, summary (default: %(default)s)"
    )
    p.add_argument("--rounds", type=int, default=4, help="training rounds (default: %(default)s)")
    p.add_argument(
        "--questions", type=int, default=4, help="training questions per round (default: %(default)s)"
    )
    p.add_argument(
        "--samples",
        type=int,
        default=8,
        help="samples per question: the advantage group (default: %(default)s)",
    )
    p.add_argument(
        "--heldout-samples",
        type=int,
        default=1,
        help="seeded samples per held-out question (30), before and after; 0 skips (default: %(default)s)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=0,
        help="agent processes at once; 0: a whole batch, one batch of the server (default: %(default)s)",
    )
    p.add_argument(
        "--estimator",
        default="rloo",
        choices=["grpo", "rloo", "reinforce_baseline"],
        help="advantage estimator; rloo keeps reward units, so partial credit weighs less than a solved "
        "question (default: %(default)s)",
    )
    p.add_argument("--lr", default="1e-3", help="learning rate (default: %(default)s)")
    return p.parse_args(argv), p


def stack_config(store: Path, logs: Path, model: str, concurrency: int) -> StackConfig:
    """``tracerl collect --convert`` (the paper shape's two trainable agents), the embedded server on one
    thread and the gateway, as a user starts them."""
    return StackConfig(
        store=str(store),
        logs=logs,
        model=model,
        collect_args=("--convert", "--quiet-s", "5", "--workers", "1", "--agents", "writer|rewriter"),
        serve_args=("--threads", "1", "--max-num-seqs", str(max(8, concurrency))),
        gateway_args=("--models-ttl-s", "0.5"),
        serve_timeout_s=300,
        stop_grace_s=60,  # train, gateway (flushes its spans), serve, then collect: one at a time
        announce=say,
    )


def train_cmd(args: argparse.Namespace, store: Path, model: str, server: str, batch: int) -> list[str]:
    """``tracerl train --watch``: LoRA r=16, bf16 autocast, one PPO step per round of ``batch`` rollouts, never on
    held-out questions."""
    flags = {"--store": str(store), "--model": model, "--server": server, "--min-rollouts": str(batch),
             "--tasks": "^train-", "--lr": args.lr, "--estimator": args.estimator}  # fmt: skip
    limits = {"--threads": "1", "--epochs": "1", "--steps-per-epoch": "1", "--max-prompt-tokens": "512",
              "--max-response-tokens": "64", "--pack-tokens": "640", "--max-rounds": str(args.rounds),
              "--poll-s": "3"}  # fmt: skip
    pairs = [x for kv in flags.items() for x in kv]
    return [TRACERL, "train", "--watch", *pairs, *LORA, "--bf16", *(x for kv in limits.items() for x in kv),
            "--no-progress"]  # fmt: skip


def agent_env() -> dict[str, str]:
    """The agent's environment: the paper shape, sampled, its spans to the collector (``tracerl rollout`` sets
    the endpoints)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_", "VIRTUAL_ENV"))}
    env.update(
        {
            "SQL_AGENT_SHAPE": "paper",
            "SQL_AGENT_TEMPERATURE": "0.7",
            "SQL_AGENT_MAX_TOKENS": "32",
            "OPENAI_API_KEY": "unused",
            "OTEL_SERVICE_NAME": "sql-agent",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
        }
    )
    return env


@dataclass
class Driver:
    """What the rounds share: where things are, the started stack's URLs, the agent, the summary being filled."""

    args: argparse.Namespace
    work: Path
    store: Path
    logs: Path
    urls: StackUrls
    agent: list[str]
    concurrency: int
    summary: dict

    def rollout(self, name: str, tasks: list[dict], n: int) -> list[dict]:
        """``tracerl rollout`` of ``tasks`` x ``n``; its records (one per rollout, with the reward)."""
        f = self.work / f"{name}.jsonl"
        f.write_text("".join(json.dumps(t) + "\n" for t in tasks))
        cmd = [TRACERL, "rollout", "--store", str(self.store), "--tasks", str(f), "-n", str(n),
               "--concurrency", str(self.concurrency), "--timeout-s", "600", "--retries", "0",
               "--otlp", self.urls.otlp, "--collector", self.urls.collector, "--gateway", f"{self.urls.gateway}/v1",
               "--reward", f"{DEMO / 'sql_reward.py'}:score", "--", *self.agent]  # fmt: skip
        say(f"$ {shlex.join(cmd)}")
        runs = self.store / "rollouts"
        before = set(runs.glob("*.jsonl")) if runs.exists() else set()
        t0 = time.monotonic()
        out = subprocess.run(cmd, env=agent_env(), capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(
                f"tracerl rollout failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
            )
        records = [json.loads(line) for f in sorted(set(runs.glob("*.jsonl")) - before) for line in f.open()]
        rewards = [r.get("reward") or 0.0 for r in records]
        say(
            f"{name}: {len(records)} rollouts in {time.monotonic() - t0:.0f}s, {sum(r['status'] == 'ok' for r in records)} ok, "
            f"mean reward {sum(rewards) / max(1, len(rewards)):.3f}"
        )
        return records

    def evaluate(self, label: str, heldout: list[dict]) -> None:
        """The held-out questions, each sample with its own seed, scored into the summary."""
        if not heldout:
            return
        t0 = time.monotonic()
        records = self.rollout(f"heldout-{label}", heldout, 1)
        rewards = [r.get("reward") or 0.0 for r in records]
        success, mean_reward, runs = reward_shares(rewards)
        self.summary["heldout"][label] = {
            "n": len(rewards),
            "success": success,
            "mean_reward": mean_reward,
            "runs": runs,
            "seconds": round(time.monotonic() - t0, 1),
        }
        say(f"held-out {label}: {self.summary['heldout'][label]}")

    def train_round(self, k: int, train: list[dict], batches: int, check_alive) -> int:
        """Sample policy@k on the next training questions until the trainer publishes round k (a batch whose
        groups all scored alike gives no signal: sample again); record the round. Returns the batches used."""
        args, batch, train_log = self.args, self.args.questions * self.args.samples, self.logs / "train.log"
        t0 = time.monotonic()
        while True:
            start_q = batches * args.questions
            tasks = [train[(start_q + i) % len(train)] for i in range(args.questions)]
            batches += 1
            seen = len(train_log.read_text())  # the trainer's lines about this batch come after this
            records = self.rollout(f"round{k}-batch{batches}", tasks, args.samples)
            t_roll = time.monotonic() - t0
            ok = sum(r["status"] == "ok" and r.get("reward") is not None for r in records)
            if ok < batch:  # the trainer waits for --min-rollouts rewarded rollouts of policy@k
                raise SystemExit(
                    f"round {k}: only {ok} of {batch} agent runs finished with a reward; see "
                    f"{self.store / 'rollouts'} (stderr_tail) and {self.logs}"
                )
            wait_until(
                lambda seen=seen: trainer_said(train_log, k, seen) is not None,
                f"round {k} to be trained",
                1200,
                check_alive,
            )
            if trainer_said(train_log, k, seen) == "published":
                break
            say(f"round {k}: every group scored alike; sampling policy@{k} again")
        time.sleep(1.5)  # > the gateway's --models-ttl-s: the next batch calls policy@{k+1}
        success, mean_reward, runs = reward_shares([r.get("reward") or 0.0 for r in records])
        self.summary["rounds"].append(
            {
                "round": k,
                "rollouts": len(records),
                "mean_reward": mean_reward,
                "success": success,
                "runs": runs,
                "rollout_s": round(t_roll, 1),
                "round_s": round(time.monotonic() - t0, 1),
                "load_1min": float(Path("/proc/loadavg").read_text().split()[0]),
            }
        )
        say(f"round {k}: {self.summary['rounds'][-1]}")
        return batches


def questions(work: Path, heldout_samples: int) -> tuple[list[dict], list[dict]]:
    """The demo's training questions (shuffled: rounds mix the templates, as tracerl demo does) and the
    held-out ones with ``heldout_samples`` seeds each."""
    tasks_mod = load(DEMO / "sql_tasks.py")
    db = work / "shop.db"
    if not db.exists():
        tasks_mod.build_db(db)
    split = tasks_mod.questions(db)
    train = list(split["train"])
    random.Random(0).shuffle(train)
    heldout = tasks_mod.with_seeds(split["heldout"], heldout_samples) if heldout_samples else []
    return train, heldout


def finish(summary: dict, sampler: LoadSampler, t_start: float, work: Path) -> None:
    """The wall time and the load average into WORKDIR/summary.json."""
    sampler.stop.set()
    summary["wall_s"] = round(time.monotonic() - t_start, 1)
    loads = sampler.samples or [0.0]
    summary["load_1min"] = {
        "min": min(loads),
        "mean": round(sum(loads) / len(loads), 2),
        "max": max(loads),
        "samples": len(loads),
    }
    (work / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    args, p = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupted)  # stop the servers on SIGTERM as on Ctrl-C
    work = Path(args.workdir).resolve()
    store, logs = work / "store", work / "logs"
    if store.exists() and any(store.iterdir()):
        p.error(f"{store} already holds data; pass a new --workdir")
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "train.log").unlink(missing_ok=True)  # the rounds are read from it: no earlier run's lines
    agent_bin = Path(args.agent_bin).resolve()
    if not (agent_bin / "opentelemetry-instrument").exists():
        p.error(
            f"no opentelemetry-instrument in {agent_bin}; build the example's venv: python -m venv .venv-sql && "
            ".venv-sql/bin/pip install -r examples/sql_agent/requirements.txt"
        )
    model = str(Path(args.model).resolve())
    train, heldout = questions(work, args.heldout_samples)
    batch = args.questions * args.samples
    concurrency = args.concurrency or batch
    sampler = LoadSampler()
    sampler.start()
    t_start = time.monotonic()
    summary: dict = {"settings": vars(args), "rounds": [], "heldout": {}}
    agent = [str(agent_bin / "opentelemetry-instrument"), str(agent_bin / "python"), str(HERE / "agent.py")]
    try:
        with running_stack(stack_config(store, logs, model, concurrency)) as stack:
            stack.start("train", train_cmd(args, store, model, stack.urls.server, batch))
            driver = Driver(args, work, store, logs, stack.urls, agent, concurrency, summary)
            driver.evaluate("policy@0", heldout)
            batches = 0
            for k in range(args.rounds):
                batches = driver.train_round(k, train, batches, stack.check_alive)
            driver.evaluate(f"policy@{args.rounds}", heldout)
    except ChildError as e:  # a process exited or never answered: the message ends with its log's tail
        raise SystemExit(str(e)) from None
    finally:
        finish(summary, sampler, t_start, work)
    report = [TRACERL, "report", "--store", str(store), "--out", str(work / "report.png")]
    say(f"$ {shlex.join(report)}")
    subprocess.run(report, check=False)
    say(f"wall {summary['wall_s']:.0f}s; load {summary['load_1min']}; summary in {work / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
