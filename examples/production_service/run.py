"""The deployed text-to-SQL service learning from its own traffic, with training from cron.

Starts, on free ports of 127.0.0.1, what a team runs (each command printed as it starts, its output
in WORKDIR/logs/):

* ``tracerl collect --convert`` (the store: spans, feedback, transitions as rollouts complete);
* ``tracerl serve --engine vllm`` (SmolLM2-135M-Instruct on CPU, full weights in fp32, as the demo);
* ``tracerl gateway`` (exact token ids) in front of it;
* the service (service.py) under ``opentelemetry-instrument uvicorn``, configured by env vars only;
* the simulated users (traffic.py) for ``--minutes``: distinct questions, 60 % give feedback, late
  and noisy;

and, standing in for cron, ``tracerl train --once --feedback-window …`` every ``--train-every-s``
seconds; ``--estimator auto`` picks per round: REINFORCE++ while questions do not repeat within a
round, GRPO once the traffic asks the same question again (83 training questions; a busy service
repeats them within minutes). After a publish, at most every ``--eval-every-s`` (and before the first
round and at the end), it measures held-out success *through the service*:
the demo's 30 held-out questions x ``--heldout-samples``, each sample with its own seed, graded by the
demo's grader, with no feedback sent, so they never train (unrewarded rollouts are never
converted). WORKDIR/summary.json holds the curve (minutes of traffic, policy version, held-out
success and mean grade), the rounds' manifest rows and the load average sampled every 15 s.

    .venv/bin/python examples/production_service/run.py --workdir /tmp/prod --minutes 30
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tracerl.stack import Stack, StackConfig, running_stack
from tracerl.supervisor import ChildError, http_ok, pick_port

HERE = Path(__file__).resolve().parent
DEMO = HERE.parent / "demo"
BIN = Path(sys.executable).parent
TRACERL = str(BIN / "tracerl")
TRAIN = [
    "--lora-rank",
    "16",
    "--lora-targets",
    "q_proj,k_proj,v_proj,o_proj",
    "--lr",
    "1e-3",
    "--epochs",
    "1",
    "--steps-per-epoch",
    "1",
    "--max-prompt-tokens",
    "512",
    "--max-response-tokens",
    "64",
    "--pack-tokens",
    "640",
]  # the real demo's SQL preset (tracerl/demo_tasks.py) and its token limits (tracerl/demo.py)
sys.path.insert(0, str(HERE))
from traffic import _load  # noqa: E402  (the demo's tasks and grader, loaded by path)


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def service_env(db: Path, otlp: str, gateway: str, rewards: str, layout: str = "demo") -> dict[str, str]:
    """The service's whole configuration: env vars (OpenTelemetry's, OpenAI's, its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
    env.update(
        {
            "OTEL_SERVICE_NAME": "sql-assistant",
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
            "OTEL_PYTHON_FASTAPI_EXCLUDED_URLS": "feedback,health",  # a verdict is no request to learn from
            "TRACELOOP_TRACE_CONTENT": "true",  # OpenLLMetry records the messages (its default; said here)
            "OPENAI_BASE_URL": f"{gateway}/v1",
            "OPENAI_API_KEY": "unused",
            "SQL_SERVICE_DB": str(db),
            "SQL_SERVICE_FEEDBACK_URL": rewards,
            "SQL_SERVICE_LAYOUT": layout,
        }
    )
    return env


def start_service(stack: Stack, env: dict[str, str], port: int) -> str:
    """The service under ``opentelemetry-instrument uvicorn``, stopped with the stack (before it); its URL."""
    service = stack.start(
        "service",
        [
            str(BIN / "opentelemetry-instrument"),
            str(BIN / "uvicorn"),
            "service:app",
            "--app-dir",
            str(HERE),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-access-log",
        ],
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    service.wait_healthy(lambda: http_ok(f"{url}/health"), 120)
    return url


def heldout(service: str, tasks: list[dict], sql_reward, concurrency: int) -> dict:
    """Held-out success through the service: seeded samples, graded here, no feedback sent."""

    def one(task: dict) -> float:
        r = httpx.post(
            f"{service}/ask", json={"question": task["question"], "seed": task["seed"]}, timeout=600
        )
        r.raise_for_status()
        return sql_reward.grade(task, r.json()["sql"] or None)

    t = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        grades = list(pool.map(one, tasks))
    n = len(grades) or 1
    return {
        "n": len(grades),
        "success": sum(g >= 1.0 for g in grades) / n,
        "mean_grade": sum(grades) / n,
        "seconds": round(time.monotonic() - t, 1),
    }


def rounds(store: Path) -> list[dict]:
    """The rounds manifest (tracerl sql, as a user would query it)."""
    out = subprocess.run(
        [
            TRACERL,
            "sql",
            "--store",
            str(store),
            "--format",
            "json",
            "SELECT round, policy_version, n_rollouts, mean_reward, status, estimator, "
            "estimator_reason FROM rounds ORDER BY round",
        ],
        capture_output=True,
        text=True,
    )
    try:
        return json.loads(out.stdout) if out.returncode == 0 else []
    except json.JSONDecodeError:
        return []


class LoadSampler(threading.Thread):
    """/proc/loadavg's 1-minute figure every 15 s (what `uptime` shows)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append(float(Path("/proc/loadavg").read_text().split()[0]))
            self.stop.wait(15)


def stack_config(model: Path, store: Path, logs: Path, max_num_seqs: int) -> StackConfig:
    """Collector (converting), vLLM (fp32, full-weight publishes) and the gateway, as the team runs them."""
    return StackConfig(
        store=str(store),
        logs=logs,
        model=str(model),
        engine="vllm",
        collect_args=("--convert", "--quiet-s", "5", "--segment-age-s", "0.5"),
        serve_args=(
            "--no-enable-lora",
            "--max-model-len",
            "1024",
            "--dtype",
            "float32",
            "--max-num-seqs",
            str(max_num_seqs),
        ),
        serve_timeout_s=900,
        stop_grace_s=30,
        announce=say,
    )


def start_deployment(stack: Stack, db: Path, layout: str) -> dict[str, str]:
    """The service in front of the started stack, healthy; the URLs the run uses."""
    urls = stack.urls
    env = service_env(db, urls.otlp, urls.gateway, urls.rewards, layout)
    service = start_service(stack, env, pick_port(0, "", set()))
    return {"server": urls.server, "gateway": urls.gateway, "rewards": urls.rewards, "service": service}


def train_cmd(args: argparse.Namespace, store: Path, model: Path, server: str) -> list[str]:
    """The crontab line: ``tracerl train --once`` with the run's round sizing and the demo's learning settings."""
    return [
        TRACERL,
        "train",
        "--once",
        "--store",
        str(store),
        "--model",
        str(model),
        "--server",
        server,
        "--feedback-window",
        f"{args.feedback_window_s:g}",
        "--max-staleness",
        str(args.max_staleness),
        "--min-rollouts",
        str(args.min_rollouts),
        "--max-rollouts",
        str(args.max_rollouts),
        "--threads",
        str(args.train_threads),
        *TRAIN,
    ]


def train_once(args: argparse.Namespace, store: Path, model: Path, server: str, logs: Path) -> str:
    """One cron run of ``tracerl train --once``; its last output line."""
    cmd = train_cmd(args, store, model, server)
    with open(logs / "train.log", "a") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log.write(proc.stdout)
    lines = proc.stdout.strip().splitlines()
    return f"exit {proc.returncode}: {lines[-1] if lines else ''}"


def _service_and_users(p: argparse.ArgumentParser) -> None:
    """The deployment's side: the prompt layout, how many users, how often they ask, how they answer."""
    p.add_argument(
        "--layout",
        choices=["demo", "system", "fewshot"],
        default="demo",
        help="the service's prompt layout (SQL_SERVICE_LAYOUT): demo, the real-model demo's writer prompt, where "
        "the untrained SmolLM2 answers 5.8%% of held-out samples right through this service (run C); system (everything in the system "
        "prompt: 1.7%%, too rare for noisy feedback to teach) (default: %(default)s)",
    )
    p.add_argument("--minutes", type=float, default=30, help="minutes of traffic (default: %(default)s)")
    p.add_argument("--users", type=int, default=6, help="simulated users at once (default: %(default)s)")
    p.add_argument(
        "--think-s",
        type=float,
        default=10,
        help="mean pause between a user's requests, i.e. the request rate: users that never pause keep vLLM "
        "busy and each round trains everything that piled up since the last (default: %(default)s)",
    )
    p.add_argument("--delay-max-s", type=float, default=60, help="latest feedback (default: %(default)s)")
    p.add_argument(
        "--feedback-rate", type=float, default=0.6, help="share of users who answer (default: 0.6)"
    )
    p.add_argument(
        "--flip",
        type=float,
        default=0.05,
        help="probability a verdict is wrong: 5%% of users misjudging an answer (or clicking the wrong "
        "thumb) is a realistic rate; at 10%% and a low base rate false positives outnumber true ones "
        "(default: %(default)s)",
    )


def _training(p: argparse.ArgumentParser) -> None:
    """The cron job's side: how often it runs and how large a round is."""
    p.add_argument("--train-every-s", type=float, default=60, help="the cron period (default: %(default)s)")
    p.add_argument(
        "--feedback-window-s",
        type=float,
        default=90,
        help="tracerl train --feedback-window, seconds (default: %(default)s)",
    )
    p.add_argument("--min-rollouts", type=int, default=16, help="tracerl train --min-rollouts (default: 16)")
    p.add_argument(
        "--max-rollouts",
        type=int,
        default=32,
        help="tracerl train --max-rollouts: a round takes the newest N rewarded rollouts, so its size "
        "follows the demo's rounds (32 rollouts), not the traffic's backlog (default: %(default)s)",
    )
    p.add_argument("--max-staleness", type=int, default=2, help="tracerl train --max-staleness (default: 2)")
    p.add_argument("--train-threads", type=int, default=2, help="tracerl train --threads (default: 2)")
    p.add_argument(
        "--eval-every-s",
        type=float,
        default=540,
        help="measure held-out success after a publish at most this often, and at the end (default: %(default)s)",
    )
    p.add_argument(
        "--heldout-samples",
        type=int,
        default=4,
        help="seeded samples per held-out question (30 questions; 4 as the demo measured its base rate) "
        "(default: %(default)s)",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--workdir", default="./production-run", help="store, logs, summary (default: %(default)s)"
    )
    p.add_argument(
        "--model",
        default="",
        help="HF model dir; default: WORKDIR/smollm2 built with "
        "'tracerl init-model --from smollm2-135m-instruct'",
    )
    _service_and_users(p)
    _training(p)
    args = p.parse_args(argv)
    if args.feedback_window_s < args.delay_max_s:
        p.error(
            f"--feedback-window-s {args.feedback_window_s:g} < --delay-max-s {args.delay_max_s:g}: "
            "feedback would come after its rollout's window closed; raise the window"
        )
    if 0 < args.max_rollouts < args.min_rollouts:
        p.error(
            f"--max-rollouts {args.max_rollouts} < --min-rollouts {args.min_rollouts}: no round could start"
        )
    return args


def traffic_cmd(args: argparse.Namespace, service: str, db: Path, logs: Path) -> list[str]:
    """The simulated users, for --minutes."""
    flags = {"--service": service, "--db": str(db), "--users": str(args.users),
             "--duration-s": f"{args.minutes * 60:g}", "--delay-max-s": f"{args.delay_max_s:g}",
             "--feedback-rate": f"{args.feedback_rate:g}", "--flip": f"{args.flip:g}", "--think-s": f"{args.think_s:g}",
             "--log": str(logs / "requests.jsonl")}  # fmt: skip
    return [sys.executable, str(HERE / "traffic.py"), *(x for kv in flags.items() for x in kv)]


def ended_within(proc: subprocess.Popen, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``proc``; whether it has exited."""
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def serving_version(store: Path) -> int:
    """The version the server holds: one past the last published round (0 before any)."""
    done = [r["round"] for r in rounds(store) if r.get("status") == "published"]
    return max(done) + 1 if done else 0


def until_next_fire(t0: float, now: float, period: float) -> float:
    """Seconds from ``now`` to cron's next firing, every ``period`` seconds since ``t0``. A run that took longer
    than a period missed the firings meanwhile (cron would have started them and each would have found the lock
    held), so the next run starts at the next multiple of the period, not a whole period after this one ended."""
    return period - (now - t0) % period


def cron(
    args: argparse.Namespace,
    paths: dict[str, Path],
    urls: dict[str, str],
    traffic: subprocess.Popen,
    measure,
    summary: dict,
) -> None:
    """``tracerl train --once`` at every --train-every-s firing while the traffic runs; held-out success after a
    publish once --eval-every-s passed since the last measurement, and at the end."""
    t0, measured, last_eval = time.monotonic(), 0, time.monotonic()
    while True:
        ended = ended_within(traffic, until_next_fire(t0, time.monotonic(), args.train_every_s))
        line = train_once(args, paths["store"], paths["model"], urls["server"], paths["logs"])
        minute = (time.monotonic() - t0) / 60
        summary["cron"].append({"minute": round(minute, 1), "train": line})
        say(f"cron at minute {minute:.1f}: tracerl train --once: {line}")
        version = serving_version(paths["store"])
        if version > measured and (ended or time.monotonic() - last_eval >= args.eval_every_s):
            measure(minute, version)
            measured, last_eval = version, time.monotonic()
        (paths["work"] / "summary.json").write_text(json.dumps(summary, indent=1))
        if ended:
            return


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    work = Path(args.workdir).resolve()
    store, logs = work / "store", work / "logs"
    if store.exists() and any(store.iterdir()):
        raise SystemExit(f"{store} already holds data; pass a new --workdir")
    logs.mkdir(parents=True, exist_ok=True)
    model = Path(args.model).resolve() if args.model else work / "smollm2"
    if not args.model:
        subprocess.run([TRACERL, "init-model", str(model), "--from", "smollm2-135m-instruct"], check=True)
    sql_tasks, sql_reward = _load("sql_tasks"), _load("sql_reward")
    db = work / "shop.db"
    if not db.exists():
        sql_tasks.build_db(db)
    held = sql_tasks.with_seeds(sql_tasks.questions(db)["heldout"], args.heldout_samples)
    sampler = LoadSampler()
    sampler.start()
    summary: dict = {"settings": vars(args), "curve": [], "cron": []}
    try:
        with running_stack(stack_config(model, store, logs, max_num_seqs=max(16, args.users))) as stack:
            urls = start_deployment(stack, db, args.layout)

            def measure(minute: float, version: int) -> None:
                h = heldout(urls["service"], held, sql_reward, concurrency=16)
                summary["curve"].append({"minute": round(minute, 1), "policy_version": version, **h})
                say(
                    f"held-out policy@{version} at minute {minute:.1f}: success {h['success']:.3f}, mean grade "
                    f"{h['mean_grade']:.3f} ({h['n']} seeded requests, {h['seconds']}s)"
                )

            measure(0.0, 0)
            traffic = stack.start("traffic", traffic_cmd(args, urls["service"], db, logs)).proc
            paths = {"work": work, "store": store, "logs": logs, "model": model}
            cron(args, paths, urls, traffic, measure, summary)
    except KeyboardInterrupt:
        say("interrupted; stopping")
    except ChildError as e:  # a process exited or never answered: the message ends with its log's tail
        raise SystemExit(str(e)) from None
    finally:
        sampler.stop.set()
        summary["rounds"] = rounds(store)
        n = max(1, len(sampler.samples))
        summary["load_avg"] = {
            "mean": round(sum(sampler.samples) / n, 2),
            "max": max(sampler.samples, default=0.0),
        }
        (work / "summary.json").write_text(json.dumps(summary, indent=1))
        say(f"summary: {work / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
