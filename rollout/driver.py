"""The rollout driver: run an unmodified agent once per (task, sample), configured only by env vars.

The agent never imports tracerl. Each run gets ``OTEL_RESOURCE_ATTRIBUTES`` with
``tracerl.rollout_id`` / ``tracerl.task_id`` (so the collector groups its spans into one rollout
of one task), ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the collector), ``OPENAI_BASE_URL`` (the
token-capturing gateway) and ``TRACERL_TASK`` (the task JSON, also on stdin or as the last
argument). An optional reward function scores the agent's stdout and the score goes to the
collector's ``POST /v1/rewards`` side channel, keyed by rollout id.

Continuous mode (``--continuous``) keeps ``--concurrency`` agents running over the tasks again and
again until stopped (or ``--max-rollouts``), for asynchronous rounds: the trainer trains while the
agents run, and each rollout's version is the one its first call was served by.

The pure logic lives beside this module (``tasks``: the plan and rollout ids; ``agent_env``: the
agent's environment; ``rewards``: scoring and posting; ``records``: records and the summary), tested
without processes; one agent process (start, timeout, kill its group) is ``agent_process``;
``run_rollouts`` is the thin I/O shell that schedules the agents and posts rewards.
A failed or timed-out agent is data, not a driver failure: it is recorded with its status.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from options import UsageError, opt
from rollout.agent_env import TASK_VIA, agent_argv, agent_env
from rollout.agent_process import AgentResult, Running, run_agent
from rollout.records import RolloutRecord, Tally
from rollout.rewards import RewardFn, compute_reward, post_reward, reward_post_delays
from rollout.tasks import Job, Task, job_stream, new_run_id, plan_jobs, rollout_id_for
from store.jsonl import JsonLines
from store.layout import DEFAULT_STORE
from store.location import StoreLocation, parse_store

OTLP_PROTOCOLS = ("grpc", "http/protobuf", "http/json")  # the values of OTEL_EXPORTER_OTLP_PROTOCOL
LAUNCHERS = ("exec", "fork")  # how an agent process starts (rollout/launcher.py)
DEFAULT_OTLP = "http://127.0.0.1:4317"
STDERR_TAIL_CHARS = 2000


@dataclass
class RolloutConfig:
    """Settings for ``tracerl rollout``."""

    tasks: str = opt("", "JSONL file: one JSON object per line, with an optional string `id`", metavar="FILE")
    n: int = opt(1, "samples per task (the group size for group-relative advantages)", flag="-n")
    concurrency: int = opt(4, "agent processes running at once")
    collector: str = opt(
        "http://127.0.0.1:4318",
        "collector OTLP/HTTP URL, for POST /v1/rewards ('' to only record rewards)",
        metavar="URL",
    )
    otlp: str = opt(
        DEFAULT_OTLP,
        "OTLP endpoint given to the agent (OTEL_EXPORTER_OTLP_ENDPOINT): the collector's "
        "gRPC port, or its HTTP port (the --collector URL) with an http/* --otlp-protocol",
        metavar="URL",
    )
    otlp_protocol: str = opt(
        "grpc",
        "OTLP protocol given to the agent (OTEL_EXPORTER_OTLP_PROTOCOL); "
        "http/protobuf is the default of the JavaScript SDK (Vercel AI SDK agents)",
        choices=list(OTLP_PROTOCOLS),
    )
    gateway: str = opt(
        "http://127.0.0.1:8100/v1",
        "OpenAI base URL given to the agent (OPENAI_BASE_URL); '' leaves the agent's own",
        metavar="URL",
    )
    reward: str = opt(
        "",
        "reward function `module:function` or `path/file.py:function`, called as "
        "fn(task: dict, stdout: str) -> float",
        metavar="MODULE:FN",
    )
    reward_name: str = opt("reward", "name of the posted reward")
    reward_retries: int = opt(
        5,
        "re-POSTs of a reward the collector could not take (503, 429, no connection), "
        "with exponential backoff from 0.2 s",
    )
    timeout_s: float = opt(60.0, "wall-clock limit per agent run; its whole process group is killed")
    retries: int = opt(1, "extra attempts for a run that failed or timed out (each under a new rollout id)")
    task_via: str = opt(
        "stdin", "how the task reaches the agent besides TRACERL_TASK", choices=list(TASK_VIA)
    )
    store: str = opt(
        DEFAULT_STORE,
        "store directory, or s3://bucket/prefix; records go to STORE/rollouts/",
        metavar="DIR|URI",
        env="TRACERL_STORE",
    )
    continuous: bool = opt(
        False,
        "keep --concurrency agents running over the tasks again and again (each "
        "task's -n samples started together) until stopped: Ctrl-C or SIGTERM lets "
        "the running agents finish (a second one kills them); for train --watch "
        "--max-staleness K",
    )
    max_rollouts: int = opt(
        0, "with --continuous: stop after this many rollouts; 0 runs until stopped", metavar="N"
    )
    launcher: str = opt(
        "exec",
        "how agents start: exec (a fresh process each: any program) or fork (a Python "
        "agent run as `[opentelemetry-instrument] python SCRIPT.py`, with this python, is "
        "forked from a server that imported the OTel SDK and exporter once: about 0.35 CPU-s "
        "less per agent here; other commands still start fresh)",
        choices=list(LAUNCHERS),
    )


# ---------------------------------------------------------------------------------------- policy
def should_retry(status: str, attempt: int, retries: int) -> bool:
    """Retry a failed or timed-out agent run while attempts remain; a finished run is kept as is."""
    return status in ("failed", "timeout") and attempt < retries


@dataclass
class Driver:
    """Everything one ``tracerl rollout`` run needs; built by the command from ``RolloutConfig``."""

    command: list[str]
    tasks: list[Task]
    n: int = 1
    concurrency: int = 4
    collector: str = ""
    otlp: str = DEFAULT_OTLP
    otlp_protocol: str = "grpc"
    gateway: str = ""
    reward_fn: RewardFn | None = None
    reward_name: str = "reward"
    reward_retries: int = 5
    timeout_s: float = 60.0
    retries: int = 1
    task_via: str = "stdin"
    store: StoreLocation = field(default_factory=lambda: parse_store(DEFAULT_STORE))
    """Where the records go (``STORE/rollouts/``): parsed from ``--store`` once, by the command."""
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    continuous: bool = False
    max_rollouts: int = 0
    progress: bool | None = None  # None: a bar only when stderr is a terminal
    # lower the agents' CPU priority by this much: where training bounds a round and shares the CPU with
    # the agents (asynchronous rounds on a few cores), the agents have slack and the trainer has none
    nice: int = 0
    launcher: str = "exec"  # exec | fork (rollout/launcher.py)


def validate(d: Driver) -> None:
    """Bad settings are usage errors (exit 2) that name the flag and the fix."""
    if not d.command:
        raise UsageError(
            "give the agent command after `--`, e.g. "
            "tracerl rollout --tasks tasks.jsonl -- opentelemetry-instrument python agent.py"
        )
    if d.n < 1:
        raise UsageError(f"-n must be at least 1, got {d.n}")
    if d.concurrency < 1:
        raise UsageError(f"--concurrency must be at least 1, got {d.concurrency}")
    if not d.timeout_s > 0:
        raise UsageError(f"--timeout-s must be positive, got {d.timeout_s}")
    if d.max_rollouts < 0:
        raise UsageError(f"--max-rollouts must be 0 (no limit) or more, got {d.max_rollouts}")
    if d.max_rollouts and not d.continuous:
        raise UsageError(
            "--max-rollouts applies to --continuous runs; without it the run is every task -n times"
        )
    if d.retries < 0 or d.reward_retries < 0:
        raise UsageError(
            f"--retries and --reward-retries must be 0 or more, got {d.retries}, {d.reward_retries}"
        )
    if d.launcher not in LAUNCHERS:
        raise UsageError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {d.launcher!r}")
    if d.task_via not in TASK_VIA:
        raise UsageError(f"--task-via must be one of {', '.join(TASK_VIA)}, got {d.task_via!r}")
    for name, url in (("--collector", d.collector), ("--otlp", d.otlp), ("--gateway", d.gateway)):
        if url and not url.startswith(("http://", "https://")):
            raise UsageError(f"{name} must be an http:// or https:// URL, got {url!r}")
    if d.otlp_protocol not in OTLP_PROTOCOLS:
        raise UsageError(
            f"--otlp-protocol must be one of {', '.join(OTLP_PROTOCOLS)}, got {d.otlp_protocol!r}"
        )
    if d.otlp_protocol != "grpc" and d.otlp == DEFAULT_OTLP:
        raise UsageError(
            f"--otlp-protocol {d.otlp_protocol} sends to the collector's OTLP/HTTP port, but --otlp is "
            f"its gRPC default {DEFAULT_OTLP}; pass --otlp with the HTTP URL, e.g. "
            f"--otlp {d.collector or 'http://127.0.0.1:4318'}"
        )


# -------------------------------------------------------------------------------------- I/O shell
@dataclass
class _Run:
    """One driver run's shared state: what every job reads, and the switch that stops new agents."""

    d: Driver
    run_id: str
    running: Running
    client: Any  # httpx.Client for posting rewards, or None
    stopping: threading.Event = field(default_factory=threading.Event)  # Ctrl-C or a driver error


def _attempts(run: _Run, job: Job, task_json: str) -> tuple[str, AgentResult, list[str], float]:
    """Run the agent for ``job``, again under a new rollout id while ``--retries`` allows; the last
    attempt's rollout id and result, the ids retried, and the time all attempts took."""
    d, tried, attempt, total_s = run.d, [], 0, 0.0
    while True:
        if run.stopping.is_set():
            raise RuntimeError("driver stopping")
        rid = rollout_id_for(run.run_id, job, attempt)
        env = agent_env(
            d.base_env,
            rollout_id=rid,
            task_id=job.task.id,
            task_json=task_json,
            otlp=d.otlp,
            gateway=d.gateway,
            otlp_protocol=d.otlp_protocol,
        )
        res = run_agent(
            agent_argv(d.command, task_json, d.task_via),
            env,
            task_json + "\n" if d.task_via == "stdin" else None,
            d.timeout_s,
            run.running,
            d.nice,
            d.launcher,
        )
        total_s += res.duration_s
        if not should_retry(res.status, attempt, d.retries):
            return rid, res, tried, total_s
        tried.append(rid)
        attempt += 1


def _one(run: _Run, job: Job) -> RolloutRecord:
    """One (task, sample): the agent's attempts, then its reward scored and posted to the collector."""
    d = run.d
    task_json = json.dumps(job.task.data, ensure_ascii=False)
    started = datetime.now(timezone.utc).isoformat()
    rid, res, tried, total_s = _attempts(run, job, task_json)
    rec = RolloutRecord(
        rollout_id=rid,
        task_id=job.task.id,
        sample=job.sample,
        status=res.status,
        exit_code=res.exit_code,
        duration_s=round(total_s, 4),
        attempts=len(tried) + 1,
        stderr_tail=res.stderr[-STDERR_TAIL_CHARS:],
        retried_rollout_ids=tried,
        run_id=run.run_id,
        started_at=started,
    )
    if res.status == "ok" and d.reward_fn is not None:
        rec.reward, rec.error = compute_reward(d.reward_fn, job.task.data, res.stdout)
        if rec.reward is not None and run.client is not None:
            post_error = post_reward(
                run.client,
                d.collector,
                rid,
                rec.reward,
                d.reward_name,
                reward_post_delays(d.reward_retries + 1),
            )
            rec.reward_posted = post_error is None
            rec.error = post_error
    return rec


def _schedule(
    run: _Run,
    jobs: Iterator[Job],
    on_done: Callable[[RolloutRecord], None],
    stop: threading.Event,
    abort: threading.Event | None,
) -> dict[tuple[str, int], int]:
    """Keep ``concurrency`` agents running until the jobs run out (or ``stop``); each finished record
    goes to ``on_done``. Any error, ``abort`` included, kills the running agents and propagates.
    Returns each (task, sample)'s position in the plan, to order the records by."""
    d, order = run.d, {}
    with ThreadPoolExecutor(max_workers=d.concurrency) as pool:
        in_flight: set[Future] = set()

        def fill() -> None:
            while len(in_flight) < d.concurrency and not stop.is_set() and not run.stopping.is_set():
                job = next(jobs, None)
                if job is None:
                    return
                order[(job.task.id, job.sample)] = job.index
                in_flight.add(pool.submit(_one, run, job))

        try:
            fill()
            while in_flight:
                done, _ = wait(in_flight, timeout=0.5, return_when=FIRST_COMPLETED)
                if abort is not None and abort.is_set():
                    raise RuntimeError("rollouts aborted: their owner stopped")
                for fut in done:
                    in_flight.discard(fut)
                    on_done(fut.result())
                fill()
        except BaseException:
            run.stopping.set()
            for fut in in_flight:
                fut.cancel()
            run.running.kill_all()
            raise
    return order


def run_rollouts(
    d: Driver, out=None, stop: threading.Event | None = None, abort: threading.Event | None = None
) -> tuple[list[RolloutRecord], str]:
    """Run every (task, sample), or with ``d.continuous`` the tasks over and over; append a record per
    rollout as it finishes; return them all.

    At most ``concurrency`` agents run at once and the next job starts as one finishes, so a
    continuous run holds a steady load. Setting ``stop`` starts no new agent and returns once the
    running ones finish (a continuous run's graceful end); setting ``abort`` kills them and raises
    (a driver run from a thread, whose owner was interrupted). Records are flushed line by line, so a
    driver killed midway leaves the finished ones in the store.
    """
    import httpx
    from tqdm import tqdm

    validate(d)
    out = out or sys.stdout
    run = _Run(
        d, new_run_id(), Running(), httpx.Client(timeout=10.0) if d.collector and d.reward_fn else None
    )
    log = JsonLines(
        d.store, "rollouts", f"driver-{run.run_id}"
    )  # through store/: a local file, or a bucket's objects
    jobs: Iterator[Job] = (
        job_stream(d.tasks, d.n, d.max_rollouts) if d.continuous else iter(plan_jobs(d.tasks, d.n))
    )
    bar = tqdm(
        total=(d.max_rollouts or None) if d.continuous else len(d.tasks) * d.n,
        unit="rollout",
        desc="rollouts",
        file=sys.stderr,
        disable=(not sys.stderr.isatty()) if d.progress is None else not d.progress,
    )
    records: list[RolloutRecord] = []
    tally = Tally()

    def done(rec: RolloutRecord) -> None:  # on the driver's thread: no lock needed
        records.append(rec)
        log.append(asdict(rec))
        tally.add(rec)
        bar.set_postfix(
            ok=tally.ok,
            failed=tally.failed,
            reward="n/a" if tally.mean_reward is None else f"{tally.mean_reward:.3f}",
        )
        bar.update(1)

    try:
        with log:
            order = _schedule(run, jobs, done, stop or threading.Event(), abort)
    finally:
        bar.close()
        if run.client is not None:
            run.client.close()
    records.sort(key=lambda r: order[(r.task_id, r.sample)])
    return records, log.path
