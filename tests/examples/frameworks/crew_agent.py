"""A CrewAI crew of one agent whose role is ``calculator``, on an OpenAI-compatible endpoint.

``openinference-instrumentation-crewai`` records the crew, its agent and task under ``opentelemetry-instrument``,
``openinference-instrumentation-openai`` each chat call. CrewAI's own telemetry is off
(``CREWAI_DISABLE_TELEMETRY=true``): nothing leaves the machine.
"""

from __future__ import annotations

import os

from common import MODEL, SYSTEM, TOOL_RESULT, base_url, question
from crewai import LLM, Agent, Crew, Task
from crewai.tools import tool


@tool("get_weather")
def get_weather(city: str) -> str:
    """Current weather for a city."""
    return TOOL_RESULT


llm = LLM(model=f"openai/{MODEL}", base_url=base_url(), api_key=os.environ.get("OPENAI_API_KEY", "sk-local"),
          temperature=0.0)
agent = Agent(role="calculator", goal=SYSTEM, backstory="You look things up.", tools=[get_weather], llm=llm,
              verbose=False)
task = Task(description=question(), expected_output="The weather in one sentence.", agent=agent)
print(Crew(agents=[agent], tasks=[task], verbose=False).kickoff())
