"""An unmodified OpenAI agent: plain ``openai`` client code, no OpenTelemetry, no tracerl.

``opentelemetry-instrument`` (with the OpenLLMetry openai instrumentation installed) traces its
calls; ``OPENAI_BASE_URL`` points it at the server. It asks for the weather, runs the tool the
model asked for, and answers. Prints the answer.
"""

import json

import openai

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def get_weather(city: str) -> str:
    return "18C and sunny"


client = openai.OpenAI()
messages = [{"role": "system", "content": "You are a weather assistant. Use the tools."},
            {"role": "user", "content": "What is the weather in Paris?"}]
first = client.chat.completions.create(model="policy@3", messages=messages, tools=TOOLS)
call = first.choices[0].message.tool_calls[0]
messages.append({"role": "assistant", "content": None, "tool_calls": [
    {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
messages.append({"role": "tool", "tool_call_id": call.id, "content": get_weather(**json.loads(call.function.arguments))})
second = client.chat.completions.create(model="policy@3", messages=messages, tools=TOOLS)
print(second.choices[0].message.content)
