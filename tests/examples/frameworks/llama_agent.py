"""A LlamaIndex ``FunctionAgent`` named ``weather`` on an OpenAI-compatible endpoint (``OpenAILike``).

``openinference-instrumentation-llama-index`` records it under ``opentelemetry-instrument`` (its dependency
check needs the ``[instruments]`` extra's packages, see requirements.txt). ``AGENT_STREAM=1`` streams.
"""

from __future__ import annotations

import asyncio
import os

from common import MODEL, STREAM, SYSTEM, get_weather, question
from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike

llm = OpenAILike(model=MODEL, api_base=os.environ.get("OPENAI_BASE_URL"), api_key=os.environ.get("OPENAI_API_KEY", "sk"),
                 is_chat_model=True, is_function_calling_model=True, temperature=0.0)
agent = FunctionAgent(name="weather", description="Answers weather questions.", system_prompt=SYSTEM, llm=llm,
                      tools=[FunctionTool.from_defaults(get_weather)], streaming=STREAM)


async def main() -> None:
    print(await agent.run(question()))


asyncio.run(main())
