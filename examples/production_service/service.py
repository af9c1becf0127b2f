"""A text-to-SQL assistant deployed as a web service: FastAPI, a plain ``openai`` client, env vars only.

This is the app a team already runs in production. It knows nothing of tracerl: no tracerl import,
no ``tracerl.*`` attribute. It is started under ``opentelemetry-instrument`` with the FastAPI and
the OpenAI (OpenLLMetry) instrumentations, so each request is one trace (the FastAPI server span,
the ``openai.chat`` span under it, and the gateway's span with the exact token ids under that,
through the ``traceparent`` the OpenAI instrumentation sends):

    OTEL_SERVICE_NAME=sql-assistant OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 \\
    OPENAI_BASE_URL=http://127.0.0.1:8100/v1 OPENAI_API_KEY=unused SQL_SERVICE_DB=shop.db \\
    SQL_SERVICE_FEEDBACK_URL=http://127.0.0.1:4318/v1/rewards \\
    opentelemetry-instrument uvicorn service:app --port 8000

Endpoints:

* ``POST /ask {"question", "seed"?}`` -> ``{"trace_id", "response_id", "sql", "rows", "error"}``: the
  trace id of this request (what a feedback widget keeps) and the OpenAI response id the app got back.
* ``POST /feedback {"trace_id" | "response_id", "value" | "thumbs"}`` -> the user's verdict, forwarded
  to the collector's ``/v1/rewards`` (where a widget would post it).

Knobs (env): ``SQL_SERVICE_DB`` (the SQLite database, required), ``SQL_SERVICE_LAYOUT`` (``system``:
schema and worked examples in the system prompt, the question the first user message; ``fewshot``: the
examples as user/assistant turns before the question; ``demo``: the real-model demo's writer prompt, the
bare instruction as the system prompt and the schema in the first example's turn), ``SQL_SERVICE_MODEL`` (``policy``),
``SQL_SERVICE_TEMPERATURE`` (0.7), ``SQL_SERVICE_MAX_TOKENS`` (32), ``SQL_SERVICE_FEEDBACK_URL``.

The prompt's pieces (instruction, schema, three worked examples) and the SQL extraction are the
real-model demo's writer's (examples/demo/sql_agent.py), so held-out success here and there compare.
"""

from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path
from typing import Literal

import httpx
from fastapi import FastAPI, HTTPException
from openai import OpenAI
from opentelemetry import trace
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))
from sql_agent import EXAMPLES, SCHEMA, SYSTEM, extract_sql, writer_messages  # the demo writer's prompt

LAYOUTS = ("system", "fewshot", "demo")


def system_prompt_messages(question: str) -> list[dict]:
    """The common layout: instruction, schema and examples in the system prompt; the question alone
    as the first user message."""
    shots = "\n".join(f"{q}\nSQL: {sql}" for q, sql in EXAMPLES)
    return [
        {"role": "system", "content": f"{SYSTEM}\n{SCHEMA}\nExamples:\n{shots}"},
        {"role": "user", "content": f"Question: {question}"},
    ]


def fewshot_messages(question: str) -> list[dict]:
    """The few-shot layout: the examples as user/assistant turns, then the question (so the first
    user message is the same for every request)."""
    shots = [
        m
        for q, sql in EXAMPLES
        for m in ({"role": "user", "content": q}, {"role": "assistant", "content": sql})
    ]
    return [
        {"role": "system", "content": f"{SYSTEM}\n{SCHEMA}"},
        *shots,
        {"role": "user", "content": f"Question: {question}"},
    ]


def demo_messages(question: str) -> list[dict]:
    """The real-model demo's writer layout (examples/demo/sql_agent.py): the bare instruction as the system
    prompt, the schema in the first worked example's user turn, the examples as user/assistant turns, then
    the question. The untrained SmolLM2 writes SQL far more often in it (5.8 % of held-out samples right
    through this service, run C of the README; 1.7 % with everything in the system prompt), which is what gives RL a signal to learn from."""
    return writer_messages(question)


def messages_for(layout: str, question: str) -> list[dict]:
    """The request's messages in one of the ``LAYOUTS``; a ValueError naming SQL_SERVICE_LAYOUT otherwise."""
    builders = {"system": system_prompt_messages, "fewshot": fewshot_messages, "demo": demo_messages}
    if layout not in builders:
        raise ValueError(f"SQL_SERVICE_LAYOUT={layout!r}; use one of {', '.join(LAYOUTS)}")
    return builders[layout](question)


def run_readonly(db: str, sql: str, limit: int = 20) -> list[list]:
    """The query's first rows, on a read-only connection (a DELETE cannot change the database)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return [list(r) for r in con.execute(sql).fetchmany(limit)]
    finally:
        con.close()


class Ask(BaseModel):
    question: str
    seed: int | None = None  # a reproducible sample (the held-out evaluation sends one)


class Answer(BaseModel):
    trace_id: str
    response_id: str
    sql: str
    rows: list[list] | None
    error: str | None


class Feedback(BaseModel):
    trace_id: str | None = None
    response_id: str | None = None
    value: float | None = None
    thumbs: Literal["up", "down"] | None = None


DB = os.environ.get("SQL_SERVICE_DB", "")
LAYOUT = os.environ.get("SQL_SERVICE_LAYOUT", "system")
MODEL = os.environ.get("SQL_SERVICE_MODEL", "policy")
TEMPERATURE = float(os.environ.get("SQL_SERVICE_TEMPERATURE", "0.7"))
MAX_TOKENS = int(os.environ.get("SQL_SERVICE_MAX_TOKENS", "32"))
FEEDBACK_URL = os.environ.get("SQL_SERVICE_FEEDBACK_URL", "")
if not Path(DB).is_file():
    raise SystemExit(
        f"SQL_SERVICE_DB={DB!r} is not a file; build it: python examples/demo/sql_tasks.py --db shop.db"
    )
messages_for(LAYOUT, "")  # a bad SQL_SERVICE_LAYOUT stops the service at start, not at its first request

app = FastAPI(title="text-to-SQL assistant")
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment


@app.post("/ask")
def ask(req: Ask) -> Answer:
    """Answer a question with one SQL query and its rows; the ids a feedback widget keeps come back too."""
    completion = client.chat.completions.create(
        model=MODEL,
        messages=messages_for(LAYOUT, req.question),
        temperature=TEMPERATURE,
        max_tokens=MAX_TOKENS,
        seed=req.seed,
    )
    sql = extract_sql(completion.choices[0].message.content or "")
    rows, error = None, None
    if not sql:
        error = "no SQL query in the answer"
    else:
        try:
            rows = run_readonly(DB, sql)
        except (sqlite3.Error, sqlite3.Warning, ValueError) as e:
            error = str(e)
    trace_id = format(trace.get_current_span().get_span_context().trace_id, "032x")
    return Answer(trace_id=trace_id, response_id=completion.id, sql=sql, rows=rows, error=error)


@app.post("/feedback")
def feedback(fb: Feedback) -> dict:
    """Forward one verdict to the collector's /v1/rewards, keyed by what the client holds."""
    if not FEEDBACK_URL:
        raise HTTPException(503, "SQL_SERVICE_FEEDBACK_URL is not set; feedback has nowhere to go")
    if (fb.trace_id is None) == (fb.response_id is None):
        raise HTTPException(400, "give exactly one of trace_id, response_id")
    if (fb.value is None) == (fb.thumbs is None):
        raise HTTPException(400, "give exactly one of value, thumbs")
    row = fb.model_dump(exclude_none=True)
    r = httpx.post(FEEDBACK_URL, json=row, timeout=30)
    if r.status_code >= 300:
        raise HTTPException(502, f"the feedback store answered {r.status_code}: {r.text[:200]}")
    return {"stored": row}


@app.get("/health")
def health() -> dict:
    return {"ok": True}
