"""The deployed text-to-SQL service (examples/production_service) against the real stack: issue 27's two failures.

Everything is real and started as a team runs it: ``tracerl collect --convert``, vLLM (``tracerl serve
--engine vllm``, the tiny model re-shaped for vLLM's CPU attention: the failures are about identity,
not about what the model says), ``tracerl gateway``, and the service under ``opentelemetry-instrument
uvicorn`` with the FastAPI and OpenAI instrumentations, configured by env vars only. Feedback goes
through the service's ``/feedback`` to the collector's ``/v1/rewards``, keyed by the ids ``/ask`` returned.

* Schema and examples in the system prompt, the question the first user message: distinct questions are
  distinct tasks; ``tracerl doctor`` says a group estimator would not train (singletons) and that
  ``auto`` would; ``tracerl train --once`` trains a round with REINFORCE++ and says why in the manifest;
  after it the doctor is no longer healthy (nothing new to train). Feedback by trace id and by response
  id both join; feedback for a trace never seen is stored and counted as unjoined.
* Few-shot examples as user/assistant turns (every request's first user message the same): still one
  task per question, not one accidental group.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from tracerl_testing import BIN, free_port, tracerl

from tracerl.stack import StackConfig, running_stack
from tracerl.supervisor import http_ok

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "production_service"
QUESTIONS = 8
COLUMNS = ("rollout_id", "trace_id", "task_id", "reward", "token_source", "prompt_messages")


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """The demo's shop database and its training questions (the traffic's questions)."""
    sql_tasks = _load(ROOT / "examples" / "demo" / "sql_tasks.py", "prod_sql_tasks")
    db = sql_tasks.build_db(tmp_path_factory.mktemp("shop") / "shop.db")
    return Path(db), sql_tasks.questions(db)["train"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from serving.models.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("prod-model") / "tiny32", seed=0, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def vllm(model: Path, tmp_path_factory: pytest.TempPathFactory):
    rig = _load(ROOT / "tests" / "serving" / "vllm_rig.py", "prod_vllm_rig")
    log = tmp_path_factory.mktemp("prod-vllm") / "vllm.log"
    with rig.running_vllm(
        model,
        log,
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--kv-cache-gb",
        "1",
        "--max-num-seqs",
        "8",
    ) as server:
        yield server


@dataclass
class Deployment:
    store: Path
    service: str
    proc: subprocess.Popen

    def ask(self, question: str, seed: int) -> dict:
        r = httpx.post(f"{self.service}/ask", json={"question": question, "seed": seed}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def feedback(self, **row: object) -> None:
        r = httpx.post(f"{self.service}/feedback", json=row, timeout=30)
        assert r.status_code == 200, r.text

    def transitions(self, n: int, timeout_s: float = 90) -> list[dict]:
        """The transitions once ``n`` rollouts are converted (collect --convert runs its passes)."""
        from store.layout import StoreLayout
        from store.parquet import read_table

        deadline = time.monotonic() + timeout_s
        rows: list[dict] = []
        while time.monotonic() < deadline:
            table = StoreLayout.at(self.store).table("transitions")
            try:
                rows = read_table(table, "transitions").select(list(COLUMNS)).to_pylist()
            except (FileNotFoundError, OSError):
                rows = []
            if len({r["rollout_id"] for r in rows}) >= n:
                return rows
            time.sleep(0.5)
        raise AssertionError(
            f"{len(rows)} transitions after {timeout_s}s, wanted {n} rollouts; "
            f"{tracerl('doctor', '--store', str(self.store), '--quiet-s', '1', check=False).stdout}"
        )


def service_env(db: Path, grpc: str, gateway: str, rewards: str, layout: str) -> dict[str, str]:
    """What run.py gives the service: env vars only (OpenTelemetry's, OpenAI's, the service's own)."""
    run = _load(EXAMPLE / "run.py", "prod_run")
    return {**run.service_env(db, grpc, gateway, rewards), "SQL_SERVICE_LAYOUT": layout}


@contextmanager
def deployment(tmp: Path, vllm_url: str, db: Path, layout: str) -> Iterator[Deployment]:
    """``tracerl collect --convert``, ``tracerl gateway`` (tracerl.stack, as run.py starts them, in front of the
    module's vLLM) and the service, on a fresh store; collector and gateway must stop cleanly."""
    store = tmp / f"store-{layout}"
    cfg = StackConfig(
        store=str(store),
        logs=tmp / f"logs-{layout}",
        server=vllm_url,
        collect_args=("--convert", "--quiet-s", "1", "--convert-every-s", "0.5", "--segment-age-s", "0.2"),
        gateway_args=("--models-ttl-s", "0.2"),
    )
    with running_stack(cfg) as stack:
        env = service_env(db, stack.urls.otlp, stack.urls.gateway, stack.urls.rewards, layout)
        url = f"http://127.0.0.1:{free_port()}"
        service = stack.start(
            "service",
            [str(BIN / "opentelemetry-instrument"), str(BIN / "uvicorn"), "service:app", "--app-dir", str(EXAMPLE),
             "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1]],
            env=env,
        )  # fmt: skip
        service.wait_healthy(lambda: http_ok(f"{url}/health"), 60)
        yield Deployment(store, url, service.proc)
    assert stack.started["gateway"].proc.returncode == 0, stack.started["gateway"].log_tail()
    assert stack.started["collect"].proc.returncode == 0, stack.started["collect"].log_tail()


def doctor(store: Path, *args: str) -> tuple[int, list[dict]]:
    proc = tracerl("doctor", "--store", str(store), "--quiet-s", "1", "--json", *args, check=False)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout or "[]")


def problems(findings: list[dict]) -> list[str]:
    return [f["problem"] for f in findings]


def test_service_traffic_with_the_schema_in_the_system_prompt_trains_group_free(vllm, shop, model, tmp_path):
    db, questions = shop
    with deployment(tmp_path, vllm.url, db, "system") as d:
        answers = [d.ask(q["question"], seed=i) for i, q in enumerate(questions[:QUESTIONS])]
        assert len({a["trace_id"] for a in answers}) == QUESTIONS
        assert all(a["response_id"].startswith("chatcmpl-") for a in answers), answers
        # the users' verdicts: by trace id for half, by the OpenAI response id for the other half,
        # values and thumbs mixed; what each rollout must end up with
        expected: dict[str, float] = {}
        for i, a in enumerate(answers):
            key = {"trace_id": a["trace_id"]} if i % 2 == 0 else {"response_id": a["response_id"]}
            verdict = {"value": i / QUESTIONS} if i % 4 < 2 else {"thumbs": "up" if i % 4 == 2 else "down"}
            d.feedback(**key, **verdict)
            expected[a["trace_id"]] = (
                verdict["value"] if "value" in verdict else float(verdict["thumbs"] == "up")
            )

        rows = d.transitions(QUESTIONS)
        assert len(rows) == QUESTIONS, [(r["trace_id"], r["task_id"]) for r in rows]
        assert {r["trace_id"]: r["reward"] for r in rows} == pytest.approx(expected)
        assert len({r["task_id"] for r in rows}) == QUESTIONS  # distinct questions, distinct tasks
        assert {r["token_source"] for r in rows} == {"gateway"}
        first_user = {json.loads(r["prompt_messages"])[1]["content"] for r in rows}
        assert len(first_user) == QUESTIONS  # the question is the first user message

        code, found = doctor(d.store, "--estimator", "grpo")
        assert code == 1 and "every task seen once under a group estimator" in " ".join(problems(found)), (
            found
        )
        code, found = doctor(d.store)
        assert code == 0, found  # auto would train these: healthy

        out = tracerl(
            "train",
            "--once",
            "--store",
            str(d.store),
            "--model",
            str(model),
            "--server",
            vllm.url,
            "--lora-rank",
            "0",
            "--lr",
            "1e-4",
            "--threads",
            "2",
            timeout=600,
        )
        manifest = json.loads(
            tracerl(
                "sql",
                "--store",
                str(d.store),
                "--format",
                "json",
                "SELECT round, n_rollouts, estimator, estimator_reason, status FROM rounds",
            ).stdout
        )
        assert [(m["round"], m["n_rollouts"], m["estimator"]) for m in manifest] == [
            (0, QUESTIONS, "reinforce_plus_plus")
        ], (manifest, out.stdout)
        assert manifest[0]["estimator_reason"].startswith(f"auto: 0 of {QUESTIONS} rollouts share their task")
        code, found = doctor(d.store)
        assert code == 1, found  # everything of policy@0 was trained: the next round has nothing new

        unknown = "0123456789abcdef0123456789abcdef"
        d.feedback(trace_id=unknown, value=1.0)
        deadline = time.monotonic() + 60
        while True:
            status = json.loads(tracerl("status", "--store", str(d.store), "--json").stdout)
            if status["rewards_unjoined"]["count"]:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
        assert status["rewards_unjoined"]["count"] == 1 and unknown in " ".join(
            status["rewards_unjoined"]["samples"]
        )
        code, found = doctor(d.store)
        assert "feedback that matches no rollout" in problems(found), found


def test_few_shot_turns_do_not_make_one_accidental_group(vllm, shop, tmp_path):
    db, questions = shop
    n = 5
    with deployment(tmp_path, vllm.url, db, "fewshot") as d:
        answers = [d.ask(q["question"], seed=i) for i, q in enumerate(questions[:n])]
        for i, a in enumerate(answers):
            d.feedback(trace_id=a["trace_id"], value=float(i % 2))
        rows = d.transitions(n)
        # every request's first user message is the first worked example: the old task key grouped them all
        assert len({json.loads(r["prompt_messages"])[1]["content"] for r in rows}) == 1
        assert len({r["task_id"] for r in rows}) == n
        # (the doctor's grouping check reads every rollout, whatever version served it: the module's vLLM
        # may already serve a policy the other test published)
        _, found = doctor(d.store)
        assert "different requests grouped as one task" not in problems(found), found
