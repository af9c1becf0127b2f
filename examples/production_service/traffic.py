"""Simulated users of the text-to-SQL service: distinct questions, sparse, late and noisy feedback.

Each user asks the service one question at a time (the demo's SQL training questions, shuffled,
each asked once before any repeats), then maybe gives feedback, as users of a deployed assistant do:

* only a share of users answer at all (``--feedback-rate``, 0.6);
* the verdict comes late: a delay drawn uniformly from ``--delay-min-s``..``--delay-max-s``;
* it is noisy: with ``--flip`` probability (0.1) the user says the opposite of the truth;
* it is keyed by what the client holds: the trace id or the OpenAI response id the service returned
  (``--key``: ``trace_id``, ``response_id`` or ``mixed``, alternating).

The user knows the right answer: the verdict is the demo's SQL grade (examples/demo/sql_reward.py:
1.0 for the gold rows, 0.2 for SQL that runs and names the question's value, 0.05 for SQL that runs,
else 0), sent as ``value`` (``--verdict graded``), or as thumbs up for the gold rows and down otherwise
(``--verdict thumbs``). A flipped graded verdict is ``1 - grade``.

    python examples/production_service/traffic.py --service http://127.0.0.1:8000 --db shop.db \\
        --users 8 --duration-s 1800 --delay-max-s 120

Prints one JSON line per request (question id, grade, the feedback sent and when) to --log, and a
summary at the end.
"""

from __future__ import annotations

import argparse
import heapq
import importlib.util
import json
import random
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

DEMO = Path(__file__).resolve().parents[1] / "demo"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"production_{name}", DEMO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class UserModel:
    """How the simulated users give feedback."""

    feedback_rate: float = 0.6  # share of requests whose user gives any verdict
    delay_min_s: float = 5.0  # the verdict comes this long after the answer, at least
    delay_max_s: float = 60.0  # and at most
    flip: float = 0.1  # probability that a verdict says the opposite of the truth
    verdict: str = "graded"  # graded: value = the SQL grade; thumbs: up for the gold rows, down otherwise
    key: str = "mixed"  # trace_id, response_id, or mixed (alternating)


@dataclass(frozen=True)
class Verdict:
    """One piece of feedback to send: its body for POST /feedback and when (seconds after the answer)."""

    body: dict
    delay_s: float
    truth: float  # the grade, before any flip


def verdict(grade: float, answer: dict, n: int, model: UserModel, rng: random.Random) -> Verdict | None:
    """The user's verdict on request number ``n`` with this ``grade``, or None (this user gives none).

    Pure but for ``rng``: draws, in order, whether to answer, whether to flip, and the delay."""
    if rng.random() >= model.feedback_rate:
        return None
    flipped = rng.random() < model.flip
    delay = rng.uniform(model.delay_min_s, model.delay_max_s)
    key = model.key if model.key != "mixed" else ("trace_id", "response_id")[n % 2]
    body: dict = {key: answer[key]}
    if model.verdict == "thumbs":
        up = (grade >= 1.0) != flipped
        body["thumbs"] = "up" if up else "down"
    else:
        body["value"] = 1.0 - grade if flipped else grade
    return Verdict(body, delay, grade)


def question_stream(questions: list[dict], seed: int) -> Iterator[dict]:
    """Every question once in a shuffled order, then again in a new order: distinct requests."""
    rng = random.Random(seed)
    while True:
        order = list(questions)
        rng.shuffle(order)
        yield from order


class FeedbackQueue(threading.Thread):
    """Sends each verdict when it is due (a heap of due times), so late feedback is late for real."""

    def __init__(self, client: httpx.Client, service: str) -> None:
        super().__init__(daemon=True)
        self.client, self.service = client, service
        self.heap: list[tuple[float, int, dict]] = []
        self.cond = threading.Condition()
        self.closing = False
        self.sent = self.failed = 0
        self._n = 0

    def put(self, due: float, body: dict) -> None:
        with self.cond:
            self._n += 1
            heapq.heappush(self.heap, (due, self._n, body))
            self.cond.notify()

    def close(self, drain: bool) -> None:
        """Stop; with ``drain`` send every verdict still queued first (at its due time)."""
        with self.cond:
            if not drain:
                self.heap.clear()
            self.closing = True
            self.cond.notify()
        self.join()

    def run(self) -> None:
        while True:
            with self.cond:
                while not self.heap and not self.closing:
                    self.cond.wait()
                if not self.heap:
                    return
                due, _, body = self.heap[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self.cond.wait(wait)
                    continue
                heapq.heappop(self.heap)
            try:
                ok = self.client.post(f"{self.service}/feedback", json=body).status_code == 200
            except httpx.HTTPError:
                ok = False
            self.sent += ok
            self.failed += not ok


def grade_answer(sql_reward, task: dict, answer: dict) -> float:
    return sql_reward.grade(task, answer.get("sql") or None)


def run_traffic(args: argparse.Namespace) -> dict:
    """Users in threads until --duration-s or --requests; returns the summary."""
    sql_tasks, sql_reward = _load("sql_tasks"), _load("sql_reward")
    db = Path(args.db).resolve()
    if not db.is_file():
        sql_tasks.build_db(db)
    stream = question_stream(sql_tasks.questions(db)["train"], args.seed)
    model = UserModel(
        args.feedback_rate, args.delay_min_s, args.delay_max_s, args.flip, args.verdict, args.key
    )
    lock, counts = (
        threading.Lock(),
        {"requests": 0, "errors": 0, "feedback": 0, "grade_sum": 0.0, "solved": 0},
    )
    log = open(args.log, "a") if args.log else None  # noqa: SIM115  (closed below)
    deadline = time.monotonic() + args.duration_s if args.duration_s else float("inf")
    client = httpx.Client(timeout=600)
    queue = FeedbackQueue(client, args.service.rstrip("/"))
    queue.start()

    def user(u: int) -> None:
        rng = random.Random(args.seed * 1000 + u)
        while time.monotonic() < deadline:
            with lock:
                if args.requests and counts["requests"] >= args.requests:
                    return
                n = counts["requests"]
                counts["requests"] += 1
                task = next(stream)
            try:
                r = client.post(f"{args.service.rstrip('/')}/ask", json={"question": task["question"]})
                r.raise_for_status()
                answer = r.json()
            except httpx.HTTPError as e:
                with lock:
                    counts["errors"] += 1
                print(f"user {u}: request failed: {e}", file=sys.stderr, flush=True)
                time.sleep(1)
                continue
            grade = grade_answer(sql_reward, task, answer)
            v = verdict(grade, answer, n, model, rng)
            if v is not None:
                queue.put(time.monotonic() + v.delay_s, v.body)
            with lock:
                counts["feedback"] += v is not None
                counts["grade_sum"] += grade
                counts["solved"] += grade >= 1.0
                if log:
                    log.write(
                        json.dumps(
                            {
                                "at": time.time(),
                                "task": task["id"],
                                "grade": grade,
                                "trace_id": answer["trace_id"],
                                "response_id": answer["response_id"],
                                "feedback": asdict(v) if v else None,
                            }
                        )
                        + "\n"
                    )
                    log.flush()
            if args.think_s:
                time.sleep(rng.uniform(0, 2 * args.think_s))

    threads = [threading.Thread(target=user, args=(u,), daemon=True) for u in range(args.users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queue.close(drain=args.drain)
    client.close()
    if log:
        log.close()
    n = counts["requests"] - counts["errors"]
    return {
        "requests": n,
        "errors": counts["errors"],
        "feedback_queued": counts["feedback"],
        "feedback_sent": queue.sent,
        "feedback_failed": queue.failed,
        "mean_grade": counts["grade_sum"] / n if n else 0.0,
        "success": counts["solved"] / n if n else 0.0,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--service", required=True, help="the service's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--db", required=True, help="the shop database the service answers over (built if missing)"
    )
    p.add_argument("--users", type=int, default=8, help="users asking at once (default: %(default)s)")
    p.add_argument(
        "--duration-s", type=float, default=0, help="stop after this long; 0: no limit (default: 0)"
    )
    p.add_argument("--requests", type=int, default=0, help="stop after this many requests; 0: no limit")
    p.add_argument(
        "--think-s", type=float, default=0.0, help="mean pause between a user's requests (default: 0)"
    )
    p.add_argument(
        "--feedback-rate", type=float, default=0.6, help="share of requests with feedback (default: 0.6)"
    )
    p.add_argument(
        "--delay-min-s", type=float, default=5.0, help="earliest feedback, seconds after the answer"
    )
    p.add_argument(
        "--delay-max-s", type=float, default=60.0, help="latest feedback, seconds after the answer"
    )
    p.add_argument(
        "--flip", type=float, default=0.1, help="probability a verdict is the opposite (default: 0.1)"
    )
    p.add_argument("--verdict", choices=["graded", "thumbs"], default="graded", help="graded value or thumbs")
    p.add_argument(
        "--key",
        choices=["trace_id", "response_id", "mixed"],
        default="mixed",
        help="which id the feedback carries (default: mixed, alternating)",
    )
    p.add_argument(
        "--drain",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="at the end, wait for and send the feedback still due (default: on)",
    )
    p.add_argument("--seed", type=int, default=0, help="question order and user draws (default: 0)")
    p.add_argument("--log", default="", help="append one JSON line per request to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    for name in ("feedback_rate", "flip"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            p.error(f"--{name.replace('_', '-')} must be within 0..1, got {getattr(args, name)}")
    if not 0 <= args.delay_min_s <= args.delay_max_s:
        p.error(f"need 0 <= --delay-min-s <= --delay-max-s, got {args.delay_min_s} and {args.delay_max_s}")
    if not args.duration_s and not args.requests:
        p.error("give --duration-s or --requests (else the users never stop)")
    print(json.dumps(run_traffic(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
