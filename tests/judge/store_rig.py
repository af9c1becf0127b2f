"""A real store for the judge's tests: SQL-agent rollouts as spans (no reward), converted with
``--missing-reward keep``, and a scripted OpenAI-compatible judge on 127.0.0.1 that records what it is asked."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from scripted_server import Handler, Server

from serving.asgi import HTTPError
from span_to_transition.convert import ConvertConfig
from span_to_transition.store import convert_store
from store.location import parse_store
from store.parquet import write_table_atomic

from .helpers import DRAFTS, QUESTION, rewriter_prompt, writer_prompt

_spec = importlib.util.spec_from_file_location(
    "judge_test_factory", Path(__file__).resolve().parents[1] / "span_to_transition" / "factory.py"
)
factory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(factory)

S = 1_000_000_000
LATER = 2_000_000_000 * S


def sql_spans(trace_id: str, task: str, draft: str) -> list:
    """One demo-like rollout: a root with ``tracerl.task_id``, the writer's call, the rewriter's call."""
    t = factory.TraceBuilder(trace_id, received_at_ns=100 * S)
    root = t.span("sql task", attrs={"tracerl.task_id": task})
    t.chat(
        t.span("invoke_agent writer", root, agent="writer"),
        writer_prompt(),
        draft,
        response_id=f"w{trace_id[:6]}",
    )
    t.chat(
        t.span("invoke_agent rewriter", root, agent="rewriter"),
        rewriter_prompt(draft),
        draft,
        response_id=f"r{trace_id[:6]}",
    )
    return t.spans


def make_store(root: Path | str, tasks: int = 2, per_task: int = 3) -> dict[str, str]:
    """``tasks`` x ``per_task`` rollouts, converted with null rewards; returns rollout id -> its draft."""
    drafts = {}
    spans = []
    for k in range(tasks):
        for i in range(per_task):
            tid = f"{k:02x}{i:02x}" + "a" * 28
            drafts[tid] = DRAFTS[(k * per_task + i) % len(DRAFTS)]
            spans += sql_spans(tid, f"task-{k}", drafts[tid])
    loc = parse_store(root)  # a directory, or s3://bucket/prefix
    if loc.is_local:
        Path(loc.path("spans", "date=2026-11-27")).mkdir(parents=True, exist_ok=True)
    write_table_atomic(
        factory.spans_table(spans), loc.path("spans", "date=2026-11-27", "a.parquet"), "spans", fs=loc.fs
    )
    stats = convert_store(loc, ConvertConfig(quiet_s=0, missing_reward="keep", workers=1), now_ns=LATER)
    assert stats.rollouts_converted == tasks * per_task, stats.summary()
    return drafts


def trajectories_in(prompt: str) -> dict[str, str]:
    """Trajectory id -> its text, from a judge prompt."""
    return dict(re.findall(r'<trajectory id="(\d+)">\n(.*?)\n</trajectory>', prompt, re.S))


def grade(prompt: str) -> dict[str, Any]:
    """A judge that knows the answer: 1 for the right count query, 0.1 otherwise."""
    return {
        "scores": {
            i: {
                "explanation": "counts Madrid" if DRAFTS[0] in text else "wrong query",
                "score": 1.0 if DRAFTS[0] in text else 0.1,
            }
            for i, text in trajectories_in(prompt).items()
        }
    }


def answer(content: str, prompt_tokens: int = 100, completion_tokens: int = 20) -> dict[str, Any]:
    return {
        "id": "j",
        "object": "chat.completion",
        "model": "judge",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
    }


@contextlib.contextmanager
def scripted_judge(
    script: Callable[[dict[str, Any], int], tuple[int, dict[str, Any]]],
    token: str | None = None,
) -> Iterator[tuple[str, list]]:
    """An OpenAI-compatible endpoint whose answer to the n-th request is ``script(body, n)``; yields
    (base URL, the request bodies it got). With ``token``, a request without ``Bearer <token>`` gets 401."""
    seen: list[dict[str, Any]] = []

    class Judge(Handler):
        def do_POST(self) -> None:
            try:
                self.check_bearer(token)
            except HTTPError as e:
                self.send_error_json(e)
                return
            body = self.read_json()
            seen.append(body)
            status, obj = script(body, len(seen))
            self.send_json(status, obj)

    server = Server(("127.0.0.1", 0), Judge).start_background()
    try:
        yield server.url + "/v1", seen
    finally:
        server.stop()


def user_prompt(body: dict[str, Any]) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "user")


def good_judge(body: dict[str, Any], n: int) -> tuple[int, dict[str, Any]]:
    return 200, answer(json.dumps(grade(user_prompt(body))))


__all__ = [
    "LATER",
    "QUESTION",
    "answer",
    "good_judge",
    "grade",
    "make_store",
    "scripted_judge",
    "user_prompt",
]
