"""What both demo agents share: reading the task and one LLM call recorded as OTel GenAI spans.

Like frameworks with built-in OpenTelemetry (AutoGen, the OpenAI Agents SDK, Google ADK), the
agents record their own LLM calls with the plain OpenTelemetry API in the GenAI semantic
conventions: an agent span (`invoke_agent NAME`, `gen_ai.agent.name`) around a `chat MODEL` span
carrying `gen_ai.input.messages` / `gen_ai.output.messages`, with W3C `traceparent` on the HTTP
request so the gateway's token span joins it. `opentelemetry-instrument` configures the SDK and
exporter from environment variables; OPENAI_BASE_URL says where the model is.

Why not the `openai` client: importing it costs about 1.2 s of CPU per process, three times
everything else these agents do, and the demo runs one process per rollout on a laptop. The
examples in ../sql_agent, ../rag_agent and ../calculator_agent use frameworks and auto-instrumentation.
"""

import json
import os
import sys
import urllib.request

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

MODEL = os.environ.get("DEMO_MODEL", "policy")
MAX_TOKENS = int(os.environ.get("DEMO_MAX_TOKENS", "6"))
TEMPERATURE = float(os.environ.get("DEMO_TEMPERATURE", "1.0"))
BASE_URL = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8100/v1").rstrip("/")
API_KEY = os.environ.get("OPENAI_API_KEY", "")

tracer = trace.get_tracer("tracerl.examples.demo", "1.0")


def read_task() -> dict:
    """The task from the first argument, else stdin, else $TRACERL_TASK (whatever the launcher gives)."""
    if len(sys.argv) > 1:
        return json.loads(sys.argv[1])
    text = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    return json.loads(text.strip() or os.environ["TRACERL_TASK"])


def parts(role: str, text: str, finish_reason: str | None = None) -> dict:
    """One message in the GenAI semconv parts format."""
    m = {"role": role, "parts": [{"type": "text", "content": text}]}
    if finish_reason is not None:
        m["finish_reason"] = finish_reason
    return m


def chat(messages: list[dict], seed: int | None = None) -> str:
    """One chat completion of ``[{"role", "content"}]``, recorded as a GenAI semconv `chat` span
    (OTel semconv 1.37 attributes). ``seed`` makes the sample reproducible (the held-out evaluation)."""
    request = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": TEMPERATURE, "messages": messages}
    attributes = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": MODEL,
        "gen_ai.request.max_tokens": MAX_TOKENS,
        "gen_ai.request.temperature": TEMPERATURE,
        "gen_ai.input.messages": json.dumps([parts(m["role"], m["content"]) for m in messages]),
    }
    if seed is not None:
        request["seed"] = attributes["gen_ai.request.seed"] = seed
    with tracer.start_as_current_span(f"chat {MODEL}", kind=SpanKind.CLIENT, attributes=attributes) as span:
        headers = {"Content-Type": "application/json"}
        if API_KEY:
            headers["Authorization"] = f"Bearer {API_KEY}"
        propagate.inject(headers)  # traceparent: the gateway's span becomes this span's child
        req = urllib.request.Request(f"{BASE_URL}/chat/completions", json.dumps(request).encode(), headers)
        with urllib.request.urlopen(req, timeout=600) as r:
            body = json.load(r)
        choice = body["choices"][0]
        text = choice["message"].get("content") or ""
        usage = body.get("usage") or {}
        span.set_attributes(
            {
                "gen_ai.response.id": body.get("id", ""),
                "gen_ai.response.model": body.get("model", ""),
                "gen_ai.response.finish_reasons": [choice.get("finish_reason") or "stop"],
                "gen_ai.usage.input_tokens": usage.get("prompt_tokens", 0),
                "gen_ai.usage.output_tokens": usage.get("completion_tokens", 0),
                "gen_ai.output.messages": json.dumps(
                    [parts("assistant", text, choice.get("finish_reason") or "stop")]
                ),
            }
        )
        return text


def invoke_agent(name: str, messages: list[dict], seed: int | None = None) -> str:
    """One agent turn: an OTel GenAI agent span around one chat call."""
    with tracer.start_as_current_span(
        f"invoke_agent {name}",
        attributes={"gen_ai.agent.name": name, "gen_ai.operation.name": "invoke_agent"},
    ):
        return chat(messages, seed)
