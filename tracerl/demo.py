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
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from loop.rounds import LoopPlan, LoopResult, run_rounds
from options import UsageError
from store.location import parse_store
from tracerl.demo_config import DemoConfig, DemoRun, validate
from tracerl.demo_output import TABLE_HEADER, print_no_signal, print_round
from tracerl.demo_stages import DemoStages
from tracerl.demo_tasks import DEMO_DIR, DemoTask
from tracerl.signals import interrupt_on_signals, shielded
from tracerl.stack import StackConfig, StackPorts, start_stack
from tracerl.supervisor import Children, http_ok, pick_port


def _say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


MARKER = ".tracerl-demo"


def _prepare_store(store: Path, explicit: bool) -> None:
    """A fresh store; the previous demo's store at the default place (marked by the demo) is replaced."""
    if store.exists() and any(store.iterdir()):
        if explicit or not (store / MARKER).exists():
            raise UsageError(
                f"store {store} already holds data (the demo trains from policy@0 in a fresh store); "
                f"remove it, or pass --store (or --workdir) with a new directory"
            )
        _say(f"replacing the previous demo's store {store}")
        shutil.rmtree(store)
    store.mkdir(parents=True, exist_ok=True)
    (store / MARKER).write_text(
        "written by `tracerl demo`; a later demo with the same --workdir replaces it\n"
    )


def passive_omp() -> bool:
    """Make training's OpenMP threads sleep at a barrier instead of spinning (``OMP_WAIT_POLICY=PASSIVE``,
    unless set), before torch loads its OpenMP runtime, which reads the variable once; True if it applies.

    Why: the demo trains on 2 cores shared with the engine and the agents, and a spinning thread burns the
    core another process needs. A 2-thread micro-batch took 19-44 s against 1.9-2.2 s on 1 thread
    (bench/async_round.py, load 11-12: the thread chooser's first try of 2 threads cost a round ~20-40 s),
    and a 2-thread step of a 4-layer MLP burned 0.62-0.73 CPU-s against 0.26 on 1 thread; with PASSIVE,
    0.26 on either (same machine, load 11-14)."""
    if "torch" in sys.modules:  # too late for this process: its runtime read the variable already
        return os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return os.environ["OMP_WAIT_POLICY"].upper() == "PASSIVE"


TRAINER_GIL_SWITCH_S = 0.0001
"""How long another thread of the demo's process may keep the GIL while the trainer waits for it (Python's
default: 5 ms). The trainer shares its process with the rollouts' driver (agents watched, rewards scored,
the batch stored and converted), and a torch forward takes the GIL back after every op: a 135M LoRA step
(640 tokens, 1 thread) took 1.88 s alone, 17.7 s beside a Python thread that never sleeps, 2.2 s beside
one busy 30 % of the time; at 0.5 ms 3.5 s and 2.1 s, at 0.1 ms 2.5 s and 2.0 s (2 cores, 2026-11-28)."""


@contextlib.contextmanager
def trainer_first_gil() -> Iterator[None]:
    """The demo's process hands the GIL over every ``TRAINER_GIL_SWITCH_S`` while threads contend for it
    (only then: a lone thread is not interrupted), restored on the way out."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(TRAINER_GIL_SWITCH_S)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _model(cfg: DemoConfig, workdir: Path) -> Path:
    if cfg.model:
        model = Path(cfg.model).expanduser().resolve()
        if not (model / "config.json").exists():
            raise UsageError(
                f"--model {model} has no config.json; point it at a HF model directory, or leave "
                "--model out to build one"
            )
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


def run_demo(cfg: DemoConfig) -> DemoRun:
    """The whole loop; raises ``UsageError`` for bad settings, ``RuntimeError`` when a part fails."""
    if not (DEMO_DIR / "agent.py").exists():
        raise RuntimeError(
            f"the demo agent is missing ({DEMO_DIR / 'agent.py'}); run tracerl from its source "
            "checkout (pip install -e .)"
        )
    cfg = cfg.resolved()
    workdir = Path(cfg.workdir).expanduser().resolve()
    task = _demo_task(cfg, workdir)
    validate(cfg, task)
    t_start = time.perf_counter()
    store = cfg.resolved_store().resolve()
    ports = _pick_ports(cfg)
    _prepare_store(store, explicit=bool(cfg.store))
    workdir.mkdir(parents=True, exist_ok=True)
    passive_omp()  # before _quiet_transformers imports torch
    _quiet_transformers()
    model = _model(cfg, workdir)
    logs = workdir / "logs"
    run = DemoRun(store=store)
    children = Children()
    with interrupt_on_signals(), trainer_first_gil():
        try:
            _loop(
                cfg,
                run,
                children,
                model=model,
                store=store,
                workdir=workdir,
                logs=logs,
                task=task,
                ports=ports,
            )
        finally:
            with shielded():
                if children.items:
                    _say("stopping gateway, server and collector")
                children.stop_all()
    run.seconds = time.perf_counter() - t_start
    return run


def _demo_task(cfg: DemoConfig, workdir: Path) -> DemoTask:
    """The SQL task of the real demo (its database built in ``workdir``), or the tiny demo's letters."""
    from tracerl.demo_tasks import letter_task, sql_task

    if not cfg.tiny:
        workdir.mkdir(parents=True, exist_ok=True)
        return sql_task(workdir, cfg.rollouts_per_round, cfg.heldout_samples)
    try:
        return letter_task(cfg.letters, cfg.rollouts_per_round)
    except ValueError as e:
        raise UsageError(f"--letters: {e}") from None


def _pick_ports(cfg: DemoConfig) -> tuple[int | None, int, int, int]:
    """Free (or the given) ports on 127.0.0.1, said: ``tracerl serve`` (None with --server), the gateway,
    the collector's gRPC and HTTP."""
    taken: set[int] = set()
    http_port = pick_port(cfg.http_port, "--http-port", taken)
    grpc_port = pick_port(cfg.grpc_port, "--grpc-port", taken)
    gateway_port = pick_port(cfg.gateway_port, "--gateway-port", taken)
    serve_port = None if cfg.server else pick_port(cfg.serve_port, "--serve-port", taken)
    _say(
        f"ports on 127.0.0.1: collector gRPC {grpc_port}, HTTP {http_port}; gateway {gateway_port}"
        + ("" if cfg.server else f"; tracerl serve {serve_port}")
    )
    return serve_port, gateway_port, grpc_port, http_port


GATEWAY_MODELS_TTL_S = 0.5  # the demo's gateway trusts the server's model list this long (--models-ttl-s)
# after a publish the loop waits this long before recording the round: > GATEWAY_MODELS_TTL_S, so a
# call made after it is routed by a fresh model list (a LoRA publish's new name). The next batch was
# released when the round trained (BatchesAhead), so this covers the evaluation after the last round,
# not the next batch's first calls; both demo presets publish full weights, whose calls the gateway
# labels from the server's /weight_info, not from this list.
PUBLISH_SETTLE_S = GATEWAY_MODELS_TTL_S + 0.1


def _loop(
    cfg: DemoConfig,
    run: DemoRun,
    children: Children,
    *,
    model: Path,
    store: Path,
    workdir: Path,
    logs: Path,
    task: DemoTask,
    ports: tuple[int | None, int, int, int],
) -> None:
    """Start the processes, run the rounds (``loop.rounds.run_rounds``), then evaluate and plot."""
    # the real demo's agents mostly wait on the model: a whole round at once is one batch of the server
    concurrency = cfg.concurrency or (
        cfg.rollouts_per_round if task.name == "sql" else 2 * (os.cpu_count() or 1)
    )
    server_url = _start_processes(
        cfg, children, model=model, store=store, logs=logs, ports=ports, concurrency=concurrency
    )
    _write_task_files(workdir, task)
    plan = _plan(cfg, task, store)
    parts = DemoStages.build(
        cfg,
        run,
        children,
        task=task,
        store=store,
        logs=logs,
        model=model,
        server_url=server_url,
        ports=ports,
        concurrency=concurrency,
        plan=plan,
    )
    _print_intro(cfg, task, model, concurrency, judged=parts.judge is not None)
    evaluate = bool(task.heldout) and cfg.final_eval
    result = run_rounds(
        plan,
        parts.stages(evaluate),
        on_round=lambda d: print_round(run.rounds, d, lead=plan.lead),
        on_no_signal=lambda ns: print_no_signal(ns, run.judged[-1] if parts.judge else None),
    )
    _record_rounds(run, result, parts)
    k = result.version
    if evaluate:
        print(flush=True)
        parts.score_heldout(k, parts.heldout_rollouts(k))
    elif cfg.final_eval and not task.heldout:
        parts.final_eval(k)
    print(flush=True)
    _plot(run, store, workdir)


def _write_task_files(workdir: Path, task: DemoTask) -> None:
    """The round's and the held-out tasks as JSONL, for ``tracerl rollout --tasks`` by hand."""
    for name, batch in (("tasks", task.train), ("heldout", task.heldout)):
        if batch:
            (workdir / f"{name}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in batch))


def _plan(cfg: DemoConfig, task: DemoTask, store: Path) -> LoopPlan:
    """The loop's schedule and training threads: training alone has the machine (the engine idles between
    rounds); beside agents it shares it."""
    real = task.name == "sql"
    return LoopPlan(
        rounds=cfg.rounds,
        lead=cfg.max_staleness,
        alone_threads=cfg.train_threads
        if cfg.train_threads is not None
        else (os.cpu_count() or 1)
        if real
        else cfg.threads,
        shared_threads=cfg.threads if cfg.train_threads is None else cfg.train_threads,
        settle_s=PUBLISH_SETTLE_S,
        report_hint=f"tracerl report --store {store}",
        measure_threads=cfg.train_threads is None,
        heldout_first=cfg.heldout_first,
    )


def _print_intro(cfg: DemoConfig, task: DemoTask, model: Path, concurrency: int, *, judged: bool) -> None:
    """What the rounds will do, then the round table's header."""
    print(
        f"\n{cfg.rounds} rounds of {cfg.rollouts_per_round} rollouts ({task.per_round} tasks x {task.group} "
        f"samples), {concurrency} agents at a time; model {model}\n",
        flush=True,
    )
    if judged:
        print(
            "--reward judge: each round trains on the served model's own judgments (its mean_reward is the "
            "judge's); the grader's reward is posted beside them, for the agreement and the held-out evaluation\n",
            flush=True,
        )
    print(TABLE_HEADER, flush=True)


def _record_rounds(run: DemoRun, result: LoopResult, parts: DemoStages) -> None:
    """The loop's figures onto the run; with --reward judge, every round's judging together, printed."""
    run.samples, run.rollout_spans, run.train_spans = result.samples, result.rollout_spans, result.train_spans
    run.loop_rounds, run.thread_means = result.rounds, result.thread_means
    run.judge_total = parts.judge_total()
    if run.judge_total is not None:
        from judge.batch import format_judgment

        print(f"all rounds, {format_judgment(run.judge_total)}", flush=True)


def _plot(run: DemoRun, store: Path, workdir: Path) -> None:
    """The reward curve from the store's rounds manifest, with the held-out points; never fatal."""
    try:
        from trainer.report import plot, round_rows

        run.plot = plot(
            round_rows(parse_store(store)),
            workdir / "reward-curve.png",
            heldout=[(k, h.success, h.n) for k, h in run.heldout],
        )
    except Exception as e:  # a missing matplotlib must not hide a finished run
        _say(f"no plot ({type(e).__name__}: {e})")


def _start_processes(
    cfg: DemoConfig,
    children: Children,
    *,
    model: Path,
    store: Path,
    logs: Path,
    ports: tuple[int | None, int, int, int],
    concurrency: int,
) -> str:
    """``tracerl collect``, ``tracerl serve`` (unless --server) and ``tracerl gateway``, healthy; the
    server's URL."""
    serve_port, gateway_port, grpc_port, http_port = ports
    if cfg.server and not http_ok_quiet(f"{cfg.server.rstrip('/')}/v1/models"):
        raise UsageError(
            f"--server {cfg.server} does not answer GET /v1/models; start it first, or leave --server "
            "out to use the embedded CPU server"
        )
    serve_args = ["--max-num-seqs", str(max(8, concurrency))]
    if cfg.engine == "vllm":
        # rounds publish merged weights (on CPU an adapter costs ~4x decode speed), served in fp32: in
        # bf16 a round's update is below the weights' resolution (trainer/merge.py), and the engine's
        # logprobs, which the trainer's importance correction divides by, are coarse
        # a judge call holds a task's 8 trajectories (~1.4k tokens) and 64 + 200 per trajectory to answer
        max_len = "4096" if cfg.reward == "judge" else "1024"
        serve_args += ["--no-enable-lora", "--max-model-len", max_len, "--dtype", "float32"]
    else:
        serve_args += ["--threads", str(cfg.threads)]
    stack_cfg = StackConfig(
        store=str(store),
        logs=logs,
        model=str(model),
        server=cfg.server,
        engine=cfg.engine,
        collect_args=("--segment-age-s", "0.2"),
        serve_args=tuple(serve_args),
        gateway_args=("--models-ttl-s", str(GATEWAY_MODELS_TTL_S)),
        ports=StackPorts(grpc=grpc_port, http=http_port, serve=serve_port or 0, gateway=gateway_port),
    )
    t = time.perf_counter()
    urls = start_stack(stack_cfg, children).urls
    _say(
        f"up in {time.perf_counter() - t:.1f}s: collector {urls.otlp} (rewards {urls.collector}), "
        f"{'server' if cfg.server else 'tracerl serve --engine ' + cfg.engine} {urls.server}, gateway {urls.gateway}; "
        f"logs in {logs}"
    )
    return urls.server


def _quiet_transformers() -> None:
    """Training runs in this process: its per-round weight loading/saving bars would break the table."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with contextlib.suppress(Exception):
        import torch

        # what DeepSpeed (imported by transformers) picks anyway, minus its warning
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    # peft 0.21 asks transformers 5 for a renamed property on every LoRA model load: once per round
    warnings.filterwarnings(
        "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
    )


def http_ok_quiet(url: str) -> bool:
    try:
        return http_ok(url)
    except Exception:
        return False
