"""A Strands Agents weather agent on an OpenAI-compatible endpoint (``strands.models.openai.OpenAIModel``).

Strands traces itself on the global tracer provider, which ``opentelemetry-instrument`` sets up: its
``chat`` spans carry the messages as span events (``OTEL_SEMCONV_STABILITY_OPT_IN`` picks the style).
Strands always streams its model calls.
"""

from __future__ import annotations

import os

from common import MODEL, SYSTEM, base_url, get_weather, question
from strands import Agent, tool
from strands.models.openai import OpenAIModel

model = OpenAIModel(client_args={"base_url": base_url(), "api_key": os.environ.get("OPENAI_API_KEY", "sk-local")},
                    model_id=MODEL, params={"temperature": 0.0})
agent = Agent(name="weather", model=model, system_prompt=SYSTEM, tools=[tool(get_weather)], callback_handler=None)
print(agent(question()))
