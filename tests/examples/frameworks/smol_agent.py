"""A smolagents ``ToolCallingAgent`` named ``calculator`` on an OpenAI-compatible endpoint.

``openinference-instrumentation-smolagents`` records it under ``opentelemetry-instrument``. smolagents keeps
the tool turns in its memory as ``tool-call`` / ``tool-response`` messages and sends them as ``assistant`` /
``user`` messages; the agent ends by calling its ``final_answer`` tool. ``AGENT_STREAM=1`` streams.
"""

from __future__ import annotations

import os

from common import MODEL, STREAM, get_weather, question
from smolagents import OpenAIServerModel, ToolCallingAgent, tool

model = OpenAIServerModel(model_id=MODEL, api_base=os.environ.get("OPENAI_BASE_URL"),
                          api_key=os.environ.get("OPENAI_API_KEY", "sk-local"), temperature=0.0)
agent = ToolCallingAgent(tools=[tool(get_weather)], model=model, name="calculator", max_steps=4,
                         stream_outputs=STREAM, verbosity_level=0)
print(agent.run(question()))
