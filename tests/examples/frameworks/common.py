"""What the three framework agents share: the weather task, its tool and how they read it.

Each agent is an ordinary program of its framework that knows nothing of tracerl or OpenTelemetry;
``opentelemetry-instrument`` (or the framework's own tracing on the global tracer provider) records it,
and ``OPENAI_BASE_URL`` says where the model is.
"""

from __future__ import annotations

import json
import os
import sys

SYSTEM = "You are a weather assistant. Use the tools."
QUESTION = "What is the weather in Paris?"
TOOL_RESULT = "18C and sunny"
ANSWER = "It is 18C and sunny in Paris."
MODEL = os.environ.get("AGENT_MODEL", "policy@3")
STREAM = os.environ.get("AGENT_STREAM", "0") == "1"


def get_weather(city: str) -> str:
    """Current weather for a city.

    Args:
        city: the city to look up.
    """
    return TOOL_RESULT


def question() -> str:
    """The task's question: JSON ``{"question": ...}`` as the first argument or on stdin (``tracerl rollout``),
    else the default question."""
    raw = sys.argv[1] if len(sys.argv) > 1 else ("" if sys.stdin.isatty() else sys.stdin.read())
    try:
        return json.loads(raw).get("question") or QUESTION
    except (ValueError, AttributeError):
        return QUESTION


def base_url() -> str:
    return os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8100/v1")
