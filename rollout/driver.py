"""The rollout driver: run an unmodified agent once per (task, sample), configured only by env vars.

The agent never imports tracerl. Each run gets ``OTEL_RESOURCE_ATTRIBUTES`` with
``tracerl.rollout_id`` / ``tracerl.task_id`` (so the collector groups its spans into one rollout
of one task), ``OTEL_EXPORTER_OTLP_ENDPOINT`` (the collector), ``OPENAI_BASE_URL`` (the
token-capturing gateway) and ``TRACERL_TASK`` (the task JSON, also on stdin or as the last
argument). An optional reward function scores the agent's stdout and the score goes to the
collector's ``POST /v1/rewards`` side channel, keyed by rollout id.

Logic (task parsing, environment construction, retry policy, summary) is pure functions, tested
without processes; ``run_rollouts`` is the thin I/O shell that starts processes and posts rewards.
A failed or timed-out agent is data, not a driver failure: it is recorded with its status.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import math
import os
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from tracerl.options import UsageError, opt

TASK_VIA = ("stdin", "arg", "env")
OTLP_PROTOCOLS = ("grpc", "http/protobuf", "http/json")  # the values of OTEL_EXPORTER_OTLP_PROTOCOL
DEFAULT_OTLP = "http://127.0.0.1:4317"
STDERR_TAIL_CHARS = 2000
# Keys of OTEL_RESOURCE_ATTRIBUTES the driver owns; a value already in the environment is replaced.
ROLLOUT_KEY, TASK_KEY = "tracerl.rollout_id", "tracerl.task_id"
MAX_ID_CHARS = 200  # the collector accepts rollout ids up to 256 characters

RewardFn = Callable[[dict, str], float]


@dataclass
class RolloutConfig:
    """Settings for ``tracerl rollout``."""

    tasks: str = opt("", "JSONL file: one JSON object per line, with an optional string `id`", metavar="FILE")
    n: int = opt(1, "samples per task (the group size for group-relative advantages)", flag="-n")
    concurrency: int = opt(4, "agent processes running at once")
    collector: str = opt("http://127.0.0.1:4318", "collector OTLP/HTTP URL, for POST /v1/rewards "
                         "('' to only record rewards)", metavar="URL")
    otlp: str = opt(DEFAULT_OTLP, "OTLP endpoint given to the agent (OTEL_EXPORTER_OTLP_ENDPOINT): the collector's "
                    "gRPC port, or its HTTP port (the --collector URL) with an http/* --otlp-protocol", metavar="URL")
    otlp_protocol: str = opt("grpc", "OTLP protocol given to the agent (OTEL_EXPORTER_OTLP_PROTOCOL); "
                             "http/protobuf is the default of the JavaScript SDK (Vercel AI SDK agents)",
                             choices=list(OTLP_PROTOCOLS))
    gateway: str = opt("http://127.0.0.1:8100/v1", "OpenAI base URL given to the agent (OPENAI_BASE_URL); "
                       "'' leaves the agent's own", metavar="URL")
    reward: str = opt("", "reward function `module:function` or `path/file.py:function`, called as "
                      "fn(task: dict, stdout: str) -> float", metavar="MODULE:FN")
    reward_name: str = opt("reward", "name of the posted reward")
    reward_retries: int = opt(5, "re-POSTs of a reward the collector could not take (503, 429, no connection), "
                              "with exponential backoff from 0.2 s")
    timeout_s: float = opt(60.0, "wall-clock limit per agent run; its whole process group is killed")
    retries: int = opt(1, "extra attempts for a run that failed or timed out (each under a new rollout id)")
    task_via: str = opt("stdin", "how the task reaches the agent besides TRACERL_TASK", choices=list(TASK_VIA))
    store: str = opt("./tracerl-store", "store directory; records go to STORE/rollouts/", metavar="DIR",
                     env="TRACERL_STORE")


# ----------------------------------------------------------------------------------------- tasks
@dataclass(frozen=True)
class Task:
    """One line of the tasks file: its id, its fields, and where it came from (for messages)."""

    id: str
    data: dict[str, Any]
    line: int


def task_id_for(data: Mapping[str, Any]) -> str:
    """A stable id for a task without one: the hash of its canonical JSON, same across runs."""
    canon = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "t-" + hashlib.blake2b(canon.encode(), digest_size=8).hexdigest()


def parse_tasks(lines: Iterable[str], source: str = "tasks") -> list[Task]:
    """Parse JSONL tasks; any bad line fails the whole file before a single agent starts.

    Skipping a bad line would silently shrink the dataset (and spend compute on a run the user
    did not mean); so every problem is collected and reported together, each as
    ``FILE:LINE: what is wrong``, and the run does not start. Blank lines are ignored.
    """
    tasks: list[Task] = []
    errors: list[str] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            errors.append(f"{source}:{lineno}: not valid JSON ({e.msg} at column {e.colno}): {_clip(text, 60)}")
            continue
        if not isinstance(data, dict):
            errors.append(f"{source}:{lineno}: expected a JSON object, got {type(data).__name__}: {_clip(text, 60)}")
            continue
        if "id" in data:
            tid = data["id"]
            if isinstance(tid, bool) or not isinstance(tid, (str, int)) or str(tid) == "":
                errors.append(f"{source}:{lineno}: 'id' must be a non-empty string or integer, got {tid!r}")
                continue
            tid = str(tid)
            if len(tid) > MAX_ID_CHARS:
                errors.append(f"{source}:{lineno}: 'id' is {len(tid)} characters; the limit is {MAX_ID_CHARS}")
                continue
        else:
            tid = task_id_for(data)
        if tid in seen:
            errors.append(f"{source}:{lineno}: task id {tid!r} repeats line {seen[tid]}; give each task a "
                          f"unique 'id' (use -n for several samples of one task)")
            continue
        seen[tid] = lineno
        tasks.append(Task(tid, data, lineno))
    if errors:
        shown = errors[:20] + ([f"... and {len(errors) - 20} more"] if len(errors) > 20 else [])
        raise UsageError(f"{len(errors)} bad line(s) in {source}; fix them and rerun:\n  " + "\n  ".join(shown))
    if not tasks:
        raise UsageError(f"{source} holds no tasks; write one JSON object per line, e.g. "
                         '{"id": "t1", "question": "..."}')
    return tasks


def load_tasks(path: str) -> list[Task]:
    """Read and parse the tasks file, naming the file when it cannot be read."""
    p = Path(path)
    if not path:
        raise UsageError("--tasks FILE is required (JSONL, one JSON object per line)")
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read --tasks {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"--tasks {path} is not UTF-8 text: {e}") from None
    return parse_tasks(text.splitlines(), source=path)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


# ------------------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class Job:
    """One (task, sample) to run; ``index`` orders the plan (all samples of a task are adjacent)."""

    index: int
    task: Task
    sample: int


def plan_jobs(tasks: list[Task], n: int) -> list[Job]:
    """Task-major order, so a task's group of samples completes early (the trainer can start on it)."""
    return [Job(i * n + s, t, s) for i, t in enumerate(tasks) for s in range(n)]


def rollout_id_for(run_id: str, job: Job, attempt: int) -> str:
    """Unique per attempt, so spans of a failed attempt never mix into the retry's rollout."""
    base = f"{run_id}-{job.index:05d}"
    return base if attempt == 0 else f"{base}-a{attempt}"


def new_run_id(now: datetime | None = None) -> str:
    """Time-sortable and unique across concurrent drivers: ``YYYYmmddTHHMMSSZ-xxxx``."""
    now = now or datetime.now(timezone.utc)
    return now.strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(2)


# ------------------------------------------------------------------------------------------- env
def merge_resource_attributes(existing: str | None, extra: Mapping[str, str]) -> str:
    """Merge into an ``OTEL_RESOURCE_ATTRIBUTES`` value: keep the user's keys, ours win on conflict.

    Values are percent-encoded, as the OTel spec (and the Python SDK's decoder) expects, so a task
    id with ``,`` or ``=`` survives the trip.
    """
    pairs: list[tuple[str, str]] = []
    for item in (existing or "").split(","):
        if "=" not in item:
            continue
        key, value = item.split("=", 1)
        key = key.strip()
        if key and key not in extra:
            pairs.append((key, value.strip()))
    pairs += [(k, quote(v, safe="")) for k, v in extra.items()]
    return ",".join(f"{k}={v}" for k, v in pairs)


def parse_resource_attributes(value: str) -> dict[str, str]:
    """The inverse of ``merge_resource_attributes`` (as the SDK decodes it), for checks and tests."""
    out = {}
    for item in value.split(","):
        if "=" in item:
            k, v = item.split("=", 1)
            out[k.strip()] = unquote(v.strip())
    return out


def agent_env(base: Mapping[str, str], *, rollout_id: str, task_id: str, task_json: str,
              otlp: str, gateway: str, otlp_protocol: str = "grpc") -> dict[str, str]:
    """The complete environment of one agent run: the driver's own, plus what points it at tracerl.

    The OTLP protocol is set with the endpoint (``--otlp`` is the collector's gRPC port, or its HTTP
    port for ``http/*``), never left to the SDK's default, which differs by language (Python: grpc,
    JavaScript: http/protobuf); a signal-specific traces endpoint or protocol in the parent
    environment would override ours, so they are dropped.
    """
    env = dict(base)
    env.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
    env.pop("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", None)
    env.update({
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp,
        "OTEL_EXPORTER_OTLP_PROTOCOL": otlp_protocol,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_RESOURCE_ATTRIBUTES": merge_resource_attributes(
            base.get("OTEL_RESOURCE_ATTRIBUTES"), {ROLLOUT_KEY: rollout_id, TASK_KEY: task_id}),
        "TRACERL_TASK": task_json,
    })
    if gateway:
        env["OPENAI_BASE_URL"] = gateway
    env.setdefault("OPENAI_API_KEY", "tracerl")  # the openai client refuses to start without one
    return env


def agent_argv(command: list[str], task_json: str, task_via: str) -> list[str]:
    """The agent's command line: unchanged, or with the task JSON appended for ``--task-via arg``."""
    return [*command, task_json] if task_via == "arg" else list(command)


# ---------------------------------------------------------------------------------------- policy
def should_retry(status: str, attempt: int, retries: int) -> bool:
    """Retry a failed or timed-out agent run while attempts remain; a finished run is kept as is."""
    return status in ("failed", "timeout") and attempt < retries


def reward_post_delays(attempts: int = 6, base_s: float = 0.2, cap_s: float = 5.0) -> list[float]:
    """Waits before each re-POST of a reward (exponential backoff): 0.2, 0.4, 0.8, ... capped."""
    return [min(cap_s, base_s * 2**i) for i in range(attempts - 1)]


def is_retryable_status(code: int) -> bool:
    """The collector answers 503 (WAL backlog, low disk) or 429 when it wants the client to retry."""
    return code in (429, 502, 503, 504)


# --------------------------------------------------------------------------------------- records
@dataclass
class RolloutRecord:
    """One line of ``STORE/rollouts/driver-<run>.jsonl``: how one (task, sample) went."""

    rollout_id: str
    task_id: str
    sample: int
    status: str  # ok | failed | timeout
    exit_code: int | None
    duration_s: float
    attempts: int
    reward: float | None = None
    reward_posted: bool | None = None  # None: nothing to post
    error: str | None = None  # reward function or reward POST problem
    stderr_tail: str = ""
    retried_rollout_ids: list[str] = field(default_factory=list)
    run_id: str = ""
    started_at: str = ""


@dataclass
class Summary:
    """What a run produced, for the printed summary and the exit code."""

    total: int
    ok: int
    failed: int
    timeout: int
    rewarded: int
    mean_reward: float | None
    reward_errors: int
    unposted_rewards: int
    mean_duration_s: float


def summarize(records: list[RolloutRecord]) -> Summary:
    rewards = [r.reward for r in records if r.reward is not None]
    return Summary(
        total=len(records),
        ok=sum(r.status == "ok" for r in records),
        failed=sum(r.status == "failed" for r in records),
        timeout=sum(r.status == "timeout" for r in records),
        rewarded=len(rewards),
        mean_reward=statistics.fmean(rewards) if rewards else None,
        reward_errors=sum(r.error is not None and r.reward is None and r.status == "ok" for r in records),
        unposted_rewards=sum(r.reward_posted is False for r in records),
        mean_duration_s=statistics.fmean(r.duration_s for r in records) if records else 0.0,
    )


def format_summary(s: Summary, records_path: str) -> str:
    reward = "n/a" if s.mean_reward is None else f"{s.mean_reward:.3f} over {s.rewarded}"
    lines = [f"{s.total} rollouts: {s.ok} ok, {s.failed} failed, {s.timeout} timeout; "
             f"mean reward {reward}; mean duration {s.mean_duration_s:.2f}s",
             f"records: {records_path}"]
    if s.reward_errors:
        lines.append(f"{s.reward_errors} reward function error(s): see the 'error' field of the records")
    if s.unposted_rewards:
        lines.append(f"{s.unposted_rewards} reward(s) not posted to the collector: is `tracerl collect` "
                     f"running at --collector? The values are in the records file")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- reward
def load_reward_fn(spec: str) -> RewardFn:
    """``pkg.module:fn`` or ``path/to/file.py:fn`` → the callable; a usage error names what is wrong."""
    mod_name, sep, fn_name = spec.rpartition(":")
    if not sep or not mod_name or not fn_name:
        raise UsageError(f"--reward {spec!r} must be MODULE:FUNCTION or FILE.py:FUNCTION, e.g. "
                         f"examples/demo/reward.py:score")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            if not path.is_file():
                raise UsageError(f"--reward: no file {mod_name}")
            spec_obj = importlib.util.spec_from_file_location(f"tracerl_reward_{path.stem}", path)
            assert spec_obj and spec_obj.loader
            module = importlib.util.module_from_spec(spec_obj)
            spec_obj.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"--reward: cannot import {mod_name}: {type(e).__name__}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UsageError(f"--reward: {mod_name} has no function {fn_name!r}")
    return fn


def compute_reward(fn: RewardFn, task: dict, stdout: str) -> tuple[float | None, str | None]:
    """Call the user's reward function; a raise or a non-finite value is an error, not a crash."""
    try:
        value = fn(task, stdout)
    except Exception as e:
        return None, f"reward function raised {type(e).__name__}: {e}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None, f"reward function returned {value!r}; it must return a finite float"
    return float(value), None


def post_reward(client: Any, collector: str, rollout_id: str, value: float, name: str,
                delays: list[float] | None = None) -> str | None:
    """POST one reward to the collector; retry on 503/429/connection errors. Returns an error or None.

    ``reward_id`` is fixed per (rollout, name), so a retry after a lost ack is deduplicated.
    """
    import httpx

    url = collector.rstrip("/") + "/v1/rewards"
    body = {"rollout_id": rollout_id, "value": value, "name": name, "reward_id": f"{rollout_id}:{name}"}
    delays = reward_post_delays() if delays is None else delays
    last = ""
    for attempt in range(len(delays) + 1):
        wait = delays[attempt] if attempt < len(delays) else 0.0
        try:
            resp = client.post(url, json=body)
        except httpx.TransportError as e:
            last = f"{type(e).__name__}: {e}"
        else:
            if resp.status_code == 200:
                return None
            last = f"HTTP {resp.status_code}: {resp.text[:200]}"
            if not is_retryable_status(resp.status_code):
                return f"collector refused the reward ({last})"
            retry_after = resp.headers.get("Retry-After")
            if retry_after and retry_after.replace(".", "", 1).isdigit():
                wait = max(wait, min(float(retry_after), 10.0))
        if attempt < len(delays):
            time.sleep(wait)
    return f"could not post reward to {url} after {len(delays) + 1} attempts ({last})"


# -------------------------------------------------------------------------------------- I/O shell
@dataclass
class AgentResult:
    """What one agent process did."""

    status: str
    exit_code: int | None
    duration_s: float
    stdout: str
    stderr: str


def _kill_group(proc: subprocess.Popen, grace_s: float = 1.0) -> None:
    """SIGTERM the agent's whole process group (its exporters may flush), SIGKILL what is left after ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):  # children outlive the leader in its group
        os.killpg(proc.pid, signal.SIGKILL)


class _Running:
    """The process groups alive right now, so an interrupted driver leaves no agent behind.

    ``kill_all`` also closes the set: an agent a worker thread started just before it (between
    ``Popen`` and ``add``, or after its last ``stopping`` check) is killed as it is added, instead
    of running on until ``--timeout-s`` while the driver waits for it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        self._closed = False

    def add(self, p: subprocess.Popen) -> None:
        with self._lock:
            if not self._closed:
                self._procs.add(p)
                return
        _kill_group(p, grace_s=0.2)

    def discard(self, p: subprocess.Popen) -> None:
        with self._lock:
            self._procs.discard(p)

    def kill_all(self) -> None:
        with self._lock:
            self._closed = True
            procs = list(self._procs)
        for p in procs:
            _kill_group(p, grace_s=0.2)


def run_agent(argv: list[str], env: dict[str, str], stdin_text: str | None, timeout_s: float,
              running: _Running | None = None) -> AgentResult:
    """Run one agent in its own session (process group), feeding ``stdin_text`` and enforcing the timeout."""
    start = time.monotonic()
    try:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8",
                                errors="replace", start_new_session=True)
    except OSError as e:
        return AgentResult("failed", None, time.monotonic() - start, "", f"cannot start {argv[0]!r}: {e}")
    if running:
        running.add(proc)
    try:
        try:
            out, err = proc.communicate(stdin_text, timeout=timeout_s)
            status = "ok" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            status = "timeout"
    finally:
        if running:
            running.discard(proc)
    return AgentResult(status, proc.returncode, time.monotonic() - start, out or "", err or "")


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
    store: str = "./tracerl-store"
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    progress: bool | None = None  # None: a bar only when stderr is a terminal


def validate(d: Driver) -> None:
    """Bad settings are usage errors (exit 2) that name the flag and the fix."""
    if not d.command:
        raise UsageError("give the agent command after `--`, e.g. "
                         "tracerl rollout --tasks tasks.jsonl -- opentelemetry-instrument python agent.py")
    if d.n < 1:
        raise UsageError(f"-n must be at least 1, got {d.n}")
    if d.concurrency < 1:
        raise UsageError(f"--concurrency must be at least 1, got {d.concurrency}")
    if not d.timeout_s > 0:
        raise UsageError(f"--timeout-s must be positive, got {d.timeout_s}")
    if d.retries < 0 or d.reward_retries < 0:
        raise UsageError(f"--retries and --reward-retries must be 0 or more, got {d.retries}, {d.reward_retries}")
    if d.task_via not in TASK_VIA:
        raise UsageError(f"--task-via must be one of {', '.join(TASK_VIA)}, got {d.task_via!r}")
    for name, url in (("--collector", d.collector), ("--otlp", d.otlp), ("--gateway", d.gateway)):
        if url and not url.startswith(("http://", "https://")):
            raise UsageError(f"{name} must be an http:// or https:// URL, got {url!r}")
    if d.otlp_protocol not in OTLP_PROTOCOLS:
        raise UsageError(f"--otlp-protocol must be one of {', '.join(OTLP_PROTOCOLS)}, got {d.otlp_protocol!r}")
    if d.otlp_protocol != "grpc" and d.otlp == DEFAULT_OTLP:
        raise UsageError(f"--otlp-protocol {d.otlp_protocol} sends to the collector's OTLP/HTTP port, but --otlp is "
                         f"its gRPC default {DEFAULT_OTLP}; pass --otlp with the HTTP URL, e.g. "
                         f"--otlp {d.collector or 'http://127.0.0.1:4318'}")


def run_rollouts(d: Driver, out=None) -> tuple[list[RolloutRecord], Path]:
    """Run every (task, sample); append a record per rollout as it finishes; return them all.

    Records are flushed line by line, so a driver killed midway leaves the finished ones on disk.
    """
    import httpx
    from tqdm import tqdm

    validate(d)
    out = out or sys.stdout
    run_id = new_run_id()
    rollouts_dir = Path(d.store) / "rollouts"
    rollouts_dir.mkdir(parents=True, exist_ok=True)
    path = rollouts_dir / f"driver-{run_id}.jsonl"
    jobs = plan_jobs(d.tasks, d.n)
    running = _Running()
    client = httpx.Client(timeout=10.0) if d.collector and d.reward_fn else None
    lock = threading.Lock()
    records: list[RolloutRecord] = []
    stopping = threading.Event()  # set on Ctrl-C or a driver error: start no new agent

    def one(job: Job) -> RolloutRecord:
        task_json = json.dumps(job.task.data, ensure_ascii=False)
        started = datetime.now(timezone.utc).isoformat()
        tried: list[str] = []
        attempt = 0
        total_s = 0.0
        while True:
            if stopping.is_set():
                raise RuntimeError("driver stopping")
            rid = rollout_id_for(run_id, job, attempt)
            env = agent_env(d.base_env, rollout_id=rid, task_id=job.task.id, task_json=task_json,
                            otlp=d.otlp, gateway=d.gateway, otlp_protocol=d.otlp_protocol)
            res = run_agent(agent_argv(d.command, task_json, d.task_via), env,
                            task_json + "\n" if d.task_via == "stdin" else None, d.timeout_s, running)
            total_s += res.duration_s
            if not should_retry(res.status, attempt, d.retries):
                break
            tried.append(rid)
            attempt += 1
        rec = RolloutRecord(rollout_id=rid, task_id=job.task.id, sample=job.sample, status=res.status,
                            exit_code=res.exit_code, duration_s=round(total_s, 4), attempts=attempt + 1,
                            stderr_tail=res.stderr[-STDERR_TAIL_CHARS:], retried_rollout_ids=tried,
                            run_id=run_id, started_at=started)
        if res.status == "ok" and d.reward_fn is not None:
            rec.reward, rec.error = compute_reward(d.reward_fn, job.task.data, res.stdout)
            if rec.reward is not None and client is not None:
                post_error = post_reward(client, d.collector, rid, rec.reward, d.reward_name,
                                         reward_post_delays(d.reward_retries + 1))
                rec.reward_posted = post_error is None
                rec.error = post_error
        return rec

    bar = tqdm(total=len(jobs), unit="rollout", desc="rollouts", file=sys.stderr,
               disable=(not sys.stderr.isatty()) if d.progress is None else not d.progress)
    try:
        with open(path, "a", encoding="utf-8") as f, ThreadPoolExecutor(max_workers=d.concurrency) as pool:
            futures = [pool.submit(one, j) for j in jobs]
            try:
                for fut in as_completed(futures):
                    rec = fut.result()
                    with lock:
                        records.append(rec)
                        f.write(json.dumps(asdict(rec), ensure_ascii=False) + "\n")
                        f.flush()
                    s = summarize(records)
                    bar.set_postfix(ok=s.ok, failed=s.failed + s.timeout,
                                    reward="n/a" if s.mean_reward is None else f"{s.mean_reward:.3f}")
                    bar.update(1)
            except BaseException:
                stopping.set()
                for fut in futures:
                    fut.cancel()
                running.kill_all()
                raise
    finally:
        bar.close()
        if client is not None:
            client.close()
    order = {(j.task.id, j.sample): j.index for j in jobs}
    records.sort(key=lambda r: order[(r.task_id, r.sample)])
    return records, path
