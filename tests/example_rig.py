"""The rig of the example-agent tests (tests/examples): each example's own virtualenv, a scripted model, the stack.

The examples are users' agents: they run in their own environment (their framework's pins, e.g.
autogen-core's protobuf 5, need not agree with tracerl's), with only OpenTelemetry packages
added and no tracerl import. So each test builds ``.venv-examples/<name>`` from
``examples/<name>/requirements.txt`` (cached by the file's hash), starts a real collector, a real
gateway and a scripted OpenAI-compatible engine on 127.0.0.1, runs the example through
``tracerl rollout`` exactly as its README says, and converts the spans with the real converter.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracerl_testing import BIN, building

from store.location import parse_store

ROOT = Path(__file__).resolve().parents[1]  # tests/example_rig.py -> the repository root
EXAMPLES = ROOT / "examples"
VENVS = ROOT / ".venv-examples"
FRAMEWORKS = ROOT / "tests" / "examples" / "frameworks"
VENV_REQUIREMENTS: dict[str, Path] = {  # every example virtualenv the tests build, by name
    "calculator_agent": EXAMPLES / "calculator_agent" / "requirements.txt",
    "frameworks-openai2": FRAMEWORKS / "requirements-openai2.txt",  # Strands, LlamaIndex
    "frameworks-openai3": FRAMEWORKS / "requirements-openai3.txt",  # smolagents
    "rag_agent": EXAMPLES / "rag_agent" / "requirements.txt",
    "sql_agent": EXAMPLES / "sql_agent" / "requirements.txt",
}


def example_venv(name: str) -> Path:
    """The bin directory of ``.venv-examples/<name>``, built from ``VENV_REQUIREMENTS[name]`` once per
    requirements hash.

    pip's own cache makes a rebuild cheap; the stamp makes an unchanged one free. A failed build
    leaves no stamp, so the next call retries from scratch. A build already under way in another process
    (the suite's background build, ``tests/prebuild.py``, or another pytest run) is waited for: a lock file.
    """
    req = VENV_REQUIREMENTS[name]
    digest = hashlib.sha256(req.read_bytes()).hexdigest()[:12]
    venv = VENVS / name
    stamp = venv / f".built-{digest}"
    with building(VENVS / f".{name}.lock"):
        if not stamp.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            subprocess.run([*pip, "-r", str(req)], check=True, timeout=900)
            stamp.touch()
    return venv / "bin"


def stored_spans(store: Path) -> list[dict]:
    """The stored spans' identity, names and attribute maps (as dicts), for checking a run's span tree."""
    from store.layout import StoreLayout
    from store.parquet import read_table

    table = read_table(StoreLayout.at(store).table("spans"), "spans")
    columns = [
        "rollout_id",
        "trace_id",
        "span_id",
        "parent_span_id",
        "name",
        "attributes",
        "resource_attributes",
    ]
    return [
        {
            **row,
            "attributes": dict(row["attributes"]),
            "resource_attributes": dict(row["resource_attributes"]),
        }
        for row in table.select(columns).to_pylist()
    ]


# -- a scripted OpenAI-compatible engine (vLLM-shaped answers) --------------------------------

Script = Callable[[dict], dict]
"""``script(request_body) -> assistant message``: ``{"content": str}`` and/or ``{"tool_calls": [...]}``
(OpenAI shape: ``{"id", "type": "function", "function": {"name", "arguments": str}}``)."""


def token_ids(text: str) -> list[int]:
    """The scripted engine's 'tokenizer': one token per UTF-8 byte, so ids are checkable by hand."""
    return list(text.encode())


def answer_text(message: dict) -> str:
    """What the scripted engine 'tokenizes' as an answer: the content, then the tool calls as canonical JSON."""
    content = message.get("content") or ""
    calls = json.dumps(message.get("tool_calls"), sort_keys=True) if message.get("tool_calls") else ""
    return content + calls


def prompt_text(body: dict) -> str:
    """What the scripted engine 'tokenizes' as the prompt: the messages as canonical JSON."""
    return json.dumps(body.get("messages"), sort_keys=True)


@dataclass
class ScriptedEngine:
    """An OpenAI-compatible chat engine whose answers come from ``script``, shaped like vLLM 0.11's:
    ``prompt_token_ids`` at the top level and ``token_ids`` per choice when ``return_token_ids``
    is asked, per-token ``logprobs`` when ``logprobs`` is asked (vllm/entrypoints/openai/protocol.py,
    ``ChatCompletionResponse``). It is the 'model' the gateway fronts in these tests; the gateway
    and everything after it are real."""

    script: Script
    requests: list[dict] = field(default_factory=list)
    _n: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, body: dict) -> dict:
        with self._lock:
            self.requests.append(body)
            self._n += 1
            n = self._n
        message = {"role": "assistant", "content": None, **self.script(body)}
        text = answer_text(message)
        ids = token_ids(text)
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
            "stop_reason": None,
        }
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {
                        "token": chr(b) if b < 128 else f"<{b}>",
                        "logprob": -0.25,
                        "bytes": [b],
                        "top_logprobs": [],
                    }
                    for b in ids
                ]
            }
        else:
            choice["logprobs"] = None
        prompt_ids = token_ids(prompt_text(body))
        resp: dict[str, Any] = {
            "id": f"chatcmpl-scripted-{n}",
            "object": "chat.completion",
            "created": 1700000000,
            "model": body.get("model"),
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt_ids) + len(ids),
            },
        }
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
            resp["prompt_token_ids"] = prompt_ids
        return resp

    def chunks(self, body: dict) -> Iterator[dict]:
        """The same answer as vLLM streams it: role chunk (with prompt ids), one delta, finish, usage."""
        full = self.answer(body)
        choice = full["choices"][0]
        base = {
            "id": full["id"],
            "object": "chat.completion.chunk",
            "created": full["created"],
            "model": full["model"],
        }
        first: dict[str, Any] = {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
        if "prompt_token_ids" in full:
            first["prompt_token_ids"] = full["prompt_token_ids"]
        yield first
        message = choice["message"]
        delta: dict[str, Any] = {}
        if message.get("content"):
            delta["content"] = message["content"]
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(message["tool_calls"])]
        body_choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "logprobs": choice["logprobs"],
            "finish_reason": None,
        }
        if "token_ids" in choice:
            body_choice["token_ids"] = choice["token_ids"]
        yield {**base, "choices": [body_choice]}
        yield {
            **base,
            "choices": [
                {"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
            ],
        }
        if (body.get("stream_options") or {}).get("include_usage"):
            yield {**base, "choices": [], "usage": full["usage"]}


def start_engine(engine: ScriptedEngine):
    """Serve ``engine`` on 127.0.0.1 (POST /v1/chat/completions, GET /v1/models)."""
    from scripted_server import Handler, Server

    class Scripted(Handler):
        def do_POST(self) -> None:
            body = self.read_json()
            if not self.path.rstrip("/").endswith("/chat/completions"):
                self.send_json(404, {"error": {"message": f"no route {self.path}", "type": "NotFound"}})
                return
            if not body.get("stream"):
                self.send_json(200, engine.answer(body))
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for chunk in engine.chunks(body):
                self._chunk(f"data: {json.dumps(chunk)}\n\n".encode())
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def do_GET(self) -> None:
            self.send_json(200, {"object": "list", "data": [{"id": "policy", "object": "model"}]})

    return Server(("127.0.0.1", 0), Scripted).start_background()


# -- the whole stack: collector + gateway + scripted engine -------------------------------------


@dataclass
class Stack:
    store: Path
    collector: Any
    gateway: Any
    provider: Any
    engine: ScriptedEngine

    def rollout(
        self, bin_dir: Path, agent: list[str], tasks: list[dict], **kw: Any
    ) -> subprocess.CompletedProcess:
        """``tracerl rollout --tasks … -- <bin_dir>/opentelemetry-instrument <agent…>``, as a user runs it.

        ``agent`` is the command after ``opentelemetry-instrument``; its first word is looked up in
        ``bin_dir`` (the example's virtualenv) when it is there. ``kw`` as for ``run_rollout``.
        """
        exe = bin_dir / agent[0]
        cmd = [str(bin_dir / "opentelemetry-instrument"), str(exe) if exe.exists() else agent[0], *agent[1:]]
        return self.run_rollout(cmd, tasks, **kw)

    def run_rollout(
        self,
        cmd: list[str],
        tasks: list[dict],
        *,
        n: int = 1,
        extra_env: dict[str, str] | None = None,
        timeout_s: float = 120,
        rollout_args: tuple[str, ...] = (),
        otlp_protocol: str = "grpc",
    ) -> subprocess.CompletedProcess:
        """``tracerl rollout --tasks … -- <cmd…>`` against this stack; the agent exports its spans over
        ``otlp_protocol`` (to the collector's gRPC port, or its HTTP port for ``http/*``)."""
        tasks_file = self.store.parent / "tasks.jsonl"
        tasks_file.write_text("".join(json.dumps(t) + "\n" for t in tasks))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_", "VIRTUAL_ENV"))}
        env.update(
            {
                "OTEL_EXPORTER_OTLP_INSECURE": "true",
                "OTEL_METRICS_EXPORTER": "none",
                "OPENAI_API_KEY": "sk-local",
                **(extra_env or {}),
            }
        )
        otlp = self.collector.grpc_endpoint if otlp_protocol == "grpc" else self.collector.http_endpoint
        proc = subprocess.run(
            [
                str(BIN / "tracerl"),
                "rollout",
                "--store",
                str(self.store),
                "--tasks",
                str(tasks_file),
                "-n",
                str(n),
                "--concurrency",
                "2",
                "--timeout-s",
                str(timeout_s),
                "--retries",
                "0",
                "--otlp",
                otlp,
                "--otlp-protocol",
                otlp_protocol,
                "--collector",
                self.collector.http_endpoint,
                "--gateway",
                f"{self.gateway.url}/v1",
                *rollout_args,
                "--",
                *cmd,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s * len(tasks) * n + 120,
        )
        assert proc.returncode == 0, f"rollout failed:\n{proc.stdout}\n{proc.stderr}"
        return proc

    def transitions(self, **convert: Any) -> list[dict]:
        """Flush every span (gateway and collector), convert with the real converter, return the rows
        in rollout/call order (timestamps as int ns)."""
        import pyarrow as pa

        from span_to_transition.convert import ConvertConfig
        from span_to_transition.store import convert_store
        from store.layout import StoreLayout
        from store.parquet import read_table

        self.provider.force_flush()
        self.collector.flush()
        stats = convert_store(
            parse_store(self.store), ConvertConfig(**{"quiet_s": 0, "missing_reward": "fill", **convert})
        )
        assert stats.problems == [], stats.problems
        table = read_table(StoreLayout.at(self.store).table("transitions"), "transitions")
        for name in ("started_at", "ended_at"):
            i = table.schema.get_field_index(name)
            table = table.set_column(i, name, table.column(name).cast(pa.int64()))
        return sorted(table.to_pylist(), key=lambda r: (r["rollout_id"], r["started_at"]))


@contextmanager
def running_stack(store: Path, script: Script) -> Iterator[Stack]:
    """Collector, gateway and scripted engine on 127.0.0.1 for one ``with`` block; the gateway's spans
    are flushed to the collector before it stops."""
    from collector_exporter.testing import running_collector
    from serving.gateway.config import GatewayConfig, make_tracer_provider
    from serving.gateway.proxy import Gateway

    engine = ScriptedEngine(script)
    upstream = start_engine(engine)
    try:
        with running_collector(store) as collector:
            provider = make_tracer_provider(collector.grpc_endpoint)
            gateway = Gateway(
                ("127.0.0.1", 0), GatewayConfig(upstreams=[upstream.url]), provider
            ).start_background()
            try:
                yield Stack(store, collector, gateway, provider, engine)
            finally:
                gateway.stop()
                provider.shutdown()
    finally:
        upstream.stop()
