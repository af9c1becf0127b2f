"""The demo agent: two named agents, a writer and a rewriter, calling an OpenAI-compatible model.

It is an ordinary agent and knows nothing of tracerl. Like frameworks with built-in OpenTelemetry
(AutoGen, the OpenAI Agents SDK, Google ADK), it records its own LLM calls with the plain
OpenTelemetry API in the GenAI semantic conventions: an agent span (`invoke_agent NAME`,
`gen_ai.agent.name`) around a `chat MODEL` span carrying `gen_ai.input.messages` /
`gen_ai.output.messages`, with W3C `traceparent` on the HTTP request so the gateway's token
span joins it. `opentelemetry-instrument` configures the SDK and exporter from environment
variables; OPENAI_BASE_URL says where the model is.

Why not the `openai` client: importing it costs about 1.2 s of CPU per process, three times
everything else this agent does, and the demo runs one process per rollout on a laptop. The
examples in ../sql_agent, ../rag_agent and ../calculator_agent use frameworks and auto-instrumentation.

Task (JSON on stdin, or as the first argument): {"id": ..., "letter": "a"}. Prints one JSON line:
{"letter": ..., "writer": <writer's reply>, "final": <rewriter's reply>}.
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


def chat(prompt: str) -> str:
    """One chat completion, recorded as a GenAI semconv `chat` span (OTel semconv 1.37 attributes)."""
    request = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": TEMPERATURE,
               "messages": [{"role": "user", "content": prompt}]}
    with tracer.start_as_current_span(f"chat {MODEL}", kind=SpanKind.CLIENT, attributes={
            "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", "gen_ai.request.model": MODEL,
            "gen_ai.request.max_tokens": MAX_TOKENS, "gen_ai.request.temperature": TEMPERATURE,
            "gen_ai.input.messages": json.dumps([parts("user", prompt)])}) as span:
        headers = {"Content-Type": "application/json"}
        if API_KEY:
            headers["Authorization"] = f"Bearer {API_KEY}"
        propagate.inject(headers)  # traceparent: the gateway's span becomes this span's child
        req = urllib.request.Request(f"{BASE_URL}/chat/completions", json.dumps(request).encode(), headers)
        with urllib.request.urlopen(req, timeout=60) as r:
            body = json.load(r)
        choice = body["choices"][0]
        text = choice["message"].get("content") or ""
        usage = body.get("usage") or {}
        span.set_attributes({
            "gen_ai.response.id": body.get("id", ""), "gen_ai.response.model": body.get("model", ""),
            "gen_ai.response.finish_reasons": [choice.get("finish_reason") or "stop"],
            "gen_ai.usage.input_tokens": usage.get("prompt_tokens", 0),
            "gen_ai.usage.output_tokens": usage.get("completion_tokens", 0),
            "gen_ai.output.messages": json.dumps([parts("assistant", text, choice.get("finish_reason") or "stop")]),
        })
        return text


def invoke_agent(name: str, prompt: str) -> str:
    """One agent turn: an OTel GenAI agent span around one chat call."""
    with tracer.start_as_current_span(f"invoke_agent {name}", attributes={
            "gen_ai.agent.name": name, "gen_ai.operation.name": "invoke_agent"}):
        return chat(prompt)


def writer_prompt(letter: str) -> str:
    """The letter is repeated so it dominates the short prompt: a random-init model's attention
    then carries it to the reply position, and RL can learn to copy it (see README.md)."""
    return f"Reply with the letter {letter}: " + " ".join([letter] * 8)


def rewriter_prompt(letter: str, draft: str) -> str:
    return f"Rewrite the draft, keeping the letter {letter}: " + " ".join([letter] * 8) + f"\nDraft: {draft}"


def main() -> None:
    task = read_task()
    letter = task["letter"]
    with tracer.start_as_current_span("demo letter task", attributes={"demo.task_id": str(task.get("id", ""))}):
        draft = invoke_agent("writer", writer_prompt(letter))
        final = invoke_agent("rewriter", rewriter_prompt(letter, draft))
    print(json.dumps({"letter": letter, "writer": draft, "final": final}))


if __name__ == "__main__":
    main()
