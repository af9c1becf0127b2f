"""The scripted model every framework agent talks to: call the tool, then answer once its result is in.

Shared by the fixture recorder (``tests/span_to_transition/fixtures/record_frameworks.py``) and the
end-to-end tests (``tests/examples/test_frameworks.py``), so both see the same conversations. Plain
Python, no imports beyond the standard library: it runs in any virtualenv.
"""

from __future__ import annotations

import json

TOOL_RESULT = "18C and sunny"
ANSWER = "It is 18C and sunny in Paris."


def call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def reply(body: dict) -> dict:
    """The assistant message for one chat request: ``get_weather`` first; with the tool result in the
    prompt, ``final_answer`` when the agent offers that tool (smolagents ends that way), else the answer."""
    prompt = json.dumps(body.get("messages"))
    if TOOL_RESULT not in prompt:
        return {"tool_calls": [call("call_w1", "get_weather", {"city": "Paris"})]}
    names = {(t.get("function") or {}).get("name") for t in body.get("tools") or []}
    if "final_answer" in names:
        return {"tool_calls": [call("call_f1", "final_answer", {"answer": ANSWER})]}
    return {"content": ANSWER}
