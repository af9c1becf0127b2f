"""The two tasks of ``tracerl demo``: what the agent is, what it is asked, and how it is evaluated.

* ``letters`` (``--tiny``, the CI smoke test): a tiny random model learns to reply with a
  letter (examples/demo/agent.py); every round asks every letter; the evaluation is one more
  batch of the same tasks.
* ``sql`` (the default): SmolLM2-135M-Instruct learns text-to-SQL over a generated SQLite
  database (examples/demo/sql_agent.py, a writer and a rewriter that sees the execution result).
  Each round asks the next few questions of the training split; the held-out split (questions
  never trained on, every template represented) is evaluated before the first round and after
  the last, with a fixed seed per sample, so both policies are scored on the same random draws.

Presets are named instances (the tiny and the real demo's training settings); a flag the user
gives wins over its preset value.
"""

from __future__ import annotations

import random
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEMO_DIR = REPO / "examples" / "demo"

# per-task defaults of the DemoConfig fields left at None
PRESETS: dict[str, dict[str, Any]] = {
    "letters": {
        "rounds": 60,
        "rollouts_per_round": 16,
        "lr": 6e-3,
        "lora_rank": 0,
        "max_tokens": 6,
        "temperature": 1.0,
        "epochs": 2,
        "steps_per_epoch": 2,
        "timeout_s": 60.0,
        "estimator": "grpo",
        "engine": "embedded",  # vLLM's CPU attention refuses the tiny model's head size 16
        "judge_max_tokens": 16,  # --reward judge: the random model writes no JSON; its answers fail fast
    },
    # LoRA r=16 on q/k/v/o, one PPO step per round (the shape of the issue-14 check that learned
    # this task in-process, there at lr 3e-4 over 12 rounds; fewer rounds here, so a larger lr);
    # temperature 0.7: at 1.0 most of a 135M model's queries are prose; RLOO advantages in reward
    # units, so a solved question outweighs partial credit (GRPO scales every group to unit std)
    "sql": {
        # a round costs 20-30 s on 2 quiet cores (the trainer computes a group's shared prompt once,
        # trainer/packing.py; agents start by fork): 14 rounds, both evaluations and vLLM's start took
        # 8.9-9.3 min (2026-11-28). 9 rounds gained +10.8 to +16.6 points over three runs, at the 15-point
        # target's edge; 14 rounds see 56 of the 83 training questions instead of 36
        "rounds": 14,
        "rollouts_per_round": 32,
        "lr": 1e-3,
        "lora_rank": 16,
        "max_tokens": 32,
        "temperature": 0.7,
        "epochs": 1,
        "steps_per_epoch": 1,
        "timeout_s": 600.0,
        "estimator": "rloo",
        "engine": "vllm",
        "judge_max_tokens": 200,  # --reward judge: room to close guided JSON (judge --max-tokens)
    },
}
# samples per question per round (the advantage group): with about 5 % of samples right at first,
# a group of 8 holds a success about a third of the time, a group of 4 a fifth
SQL_GROUP = 8
LORA_TARGETS = {"letters": "all-linear", "sql": "q_proj,k_proj,v_proj,o_proj"}


@dataclass
class DemoTask:
    """One demo task: the agent command, its reward function, and which tasks each batch asks."""

    name: str
    agent: Path
    reward: str  # "path.py:function" for rollout.driver.load_reward_fn
    train: list[dict]
    group: int  # samples per task per round
    per_round: int  # tasks per round
    heldout: list[dict] = field(default_factory=list)  # seeded, one sample each; empty: evaluate on train
    train_tasks_regex: str | None = None  # the trainer's --tasks: held-out tasks are never trained on

    def round_tasks(self, k: int) -> list[dict]:
        """Round k's tasks: the next ``per_round`` of the training split, cycling."""
        start = (k * self.per_round) % len(self.train)
        return [self.train[(start + i) % len(self.train)] for i in range(self.per_round)]


def letter_task(letters: str, rollouts_per_round: int) -> DemoTask:
    sys.path.insert(0, str(DEMO_DIR))
    from make_tasks import make_tasks  # examples/demo

    tasks = make_tasks(letters)  # ValueError names the bad letters
    return DemoTask(
        "letters",
        DEMO_DIR / "agent.py",
        f"{DEMO_DIR / 'reward.py'}:score",
        tasks,
        group=max(1, rollouts_per_round // len(tasks)),
        per_round=len(tasks),
    )


def sql_task(workdir: Path, rollouts_per_round: int, heldout_samples: int, seed: int = 0) -> DemoTask:
    sys.path.insert(0, str(DEMO_DIR))
    from sql_tasks import build_db, questions, with_seeds  # examples/demo

    db = workdir / "shop.db"
    if not db.exists():
        build_db(db)
    split = questions(db)
    train = list(split["train"])
    random.Random(seed).shuffle(train)  # rounds mix templates instead of walking through one at a time
    return DemoTask(
        "sql",
        DEMO_DIR / "sql_agent.py",
        f"{DEMO_DIR / 'sql_reward.py'}:score",
        train,
        group=SQL_GROUP,
        per_round=max(1, rollouts_per_round // SQL_GROUP),
        heldout=with_seeds(split["heldout"], heldout_samples),
        train_tasks_regex="^train-",
    )


def question_of(task_id: str) -> str:
    """A seeded held-out copy's question id: ``heldout-city-count-madrid-s3`` -> ``heldout-city-count-madrid``."""
    head, _, tail = task_id.rpartition("-s")
    return head if head and tail.isdigit() else task_id


@dataclass
class HeldOut:
    """A held-out evaluation from the store's rewards: success (gold result), mean reward, spread."""

    n: int
    success: float
    mean_reward: float
    group_variance: float  # mean over questions of the variance of their samples' rewards
    runs: float  # share of rollouts whose SQL ran (reward > 0)


def reward_shares(values: Sequence[float]) -> tuple[float, float, float]:
    """(success, mean reward, runs) of SQL-task rewards: the share at 1.0 (the gold result set), the
    mean, and the share above 0 (the SQL ran); zeros for no values."""
    n = len(values) or 1
    return sum(v >= 1.0 for v in values) / n, sum(values) / n, sum(v > 0 for v in values) / n


def held_out_summary(rewards: dict[str, float]) -> HeldOut:
    """``rewards`` by task id (seeded copies); success counts reward 1.0 (the gold result set)."""
    values = list(rewards.values())
    groups: dict[str, list[float]] = defaultdict(list)
    for tid, v in rewards.items():
        groups[question_of(tid)].append(v)
    variances = [statistics.pvariance(g) for g in groups.values() if len(g) > 1]
    success, mean_reward, runs = reward_shares(values)
    return HeldOut(
        n=len(values),
        success=success,
        mean_reward=mean_reward,
        group_variance=statistics.fmean(variances) if variances else 0.0,
        runs=runs,
    )
