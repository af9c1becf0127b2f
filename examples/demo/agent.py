"""The demo agent: two named agents, a writer and a rewriter, on the plain `openai` client.

It is an ordinary agent and knows nothing of tracerl: `opentelemetry-instrument` exports its
spans (OpenLLMetry instruments the openai calls) and environment variables say where the model
(OPENAI_BASE_URL) and the collector (OTEL_EXPORTER_OTLP_ENDPOINT) are. Each agent's call runs
inside an OTel GenAI agent span (`invoke_agent NAME` with `gen_ai.agent.name`), so training can
attribute every LLM call to the agent that made it.

Task (JSON on stdin, or as the first argument): {"id": ..., "letter": "a"}. Prints one JSON line:
{"letter": ..., "writer": <writer's reply>, "final": <rewriter's reply>}.
"""

import json
import os
import sys

from openai import OpenAI
from opentelemetry import trace

MODEL = os.environ.get("DEMO_MODEL", "policy")
MAX_TOKENS = int(os.environ.get("DEMO_MAX_TOKENS", "6"))
TEMPERATURE = float(os.environ.get("DEMO_TEMPERATURE", "1.0"))

tracer = trace.get_tracer("tracerl.examples.demo", "1.0")


def read_task() -> dict:
    """The task from the first argument, else stdin, else $TRACERL_TASK (whatever the launcher gives)."""
    if len(sys.argv) > 1:
        return json.loads(sys.argv[1])
    text = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    return json.loads(text.strip() or os.environ["TRACERL_TASK"])


def invoke_agent(client: OpenAI, name: str, prompt: str) -> str:
    """One agent turn: an OTel GenAI agent span around one chat call."""
    with tracer.start_as_current_span(f"invoke_agent {name}", attributes={
            "gen_ai.agent.name": name, "gen_ai.operation.name": "invoke_agent"}):
        r = client.chat.completions.create(model=MODEL, max_tokens=MAX_TOKENS, temperature=TEMPERATURE,
                                           messages=[{"role": "user", "content": prompt}])
        return r.choices[0].message.content or ""


def writer_prompt(letter: str) -> str:
    """The letter is repeated so it dominates the short prompt: a random-init model's attention
    then carries it to the reply position, and RL can learn to copy it (see README.md)."""
    return f"Reply with the letter {letter}: " + " ".join([letter] * 8)


def rewriter_prompt(letter: str, draft: str) -> str:
    return f"Rewrite the draft, keeping the letter {letter}: " + " ".join([letter] * 8) + f"\nDraft: {draft}"


def main() -> None:
    task = read_task()
    letter = task["letter"]
    client = OpenAI()
    with tracer.start_as_current_span("demo letter task", attributes={"demo.task_id": str(task.get("id", ""))}):
        draft = invoke_agent(client, "writer", writer_prompt(letter))
        final = invoke_agent(client, "rewriter", rewriter_prompt(letter, draft))
    print(json.dumps({"letter": letter, "writer": draft, "final": final}))


if __name__ == "__main__":
    main()
