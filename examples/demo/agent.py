"""The demo agent: two named agents, a writer and a rewriter, calling an OpenAI-compatible model.

It is an ordinary agent and knows nothing of tracerl: it records its own LLM calls as OTel GenAI
spans (genai_chat.py, shared with the SQL agent).

Task (JSON on stdin, or as the first argument): {"id": ..., "letter": "a"}. Prints one JSON line:
{"letter": ..., "writer": <writer's reply>, "final": <rewriter's reply>}.
"""

import json

from genai_chat import invoke_agent, read_task, tracer


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


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
        draft = invoke_agent("writer", user(writer_prompt(letter)))
        final = invoke_agent("rewriter", user(rewriter_prompt(letter, draft)))
    print(json.dumps({"letter": letter, "writer": draft, "final": final}))


if __name__ == "__main__":
    main()
