"""The OpenAI Responses API shape read into chat messages (pure): input items, output items, ``output_text``.

An agent on ``client.responses.create`` (the OpenAI Agents SDK, or any app) sends ``input`` items instead of chat
messages and gets ``output`` items back, and some instrumentations record them as they are: the request body in
OpenInference's ``input.value`` and the ``Response`` object in ``output.value`` (streamed: the ``response`` of the
``response.completed`` event), or the items in ``gen_ai.input.messages`` / ``gen_ai.output.messages``; OpenLLMetry
(``opentelemetry-instrumentation-openai`` ``v1/responses_wrappers.py``) flattens message items into
``gen_ai.prompt.{i}.content`` with their ``input_text`` / ``output_text`` parts as JSON text. Item types
(openai-python ``types/responses``): ``message`` (``role``, ``content``: a string or ``input_text`` /
``output_text`` parts; an item with a role and no type is a message), ``function_call`` (``call_id``, ``name``,
``arguments``), ``function_call_output`` (``call_id``, ``output``), ``reasoning`` (not part of the prompt a chat
template renders: dropped).

The chat form: a ``function_call`` becomes a tool call of the assistant message it follows (or of a new one), a
``function_call_output`` a ``tool`` message answering its ``call_id``, text parts plain text.
"""

from __future__ import annotations

import json
from typing import Any

from span_to_transition.chat_messages import message, tool_call

TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
ITEM_TYPES = frozenset({"message", "function_call", "function_call_output", "reasoning"})


def text_of_parts(content: Any) -> Any:
    """``input_text`` / ``output_text`` parts as chat text parts (one text part reads as its text); other content
    as it is."""
    if not isinstance(content, list) or not content:
        return content
    if not any(isinstance(p, dict) and p.get("type") in ("input_text", "output_text") for p in content):
        return content
    parts = [{"type": "text", "text": p.get("text") or ""} if isinstance(p, dict) and p.get("type") in TEXT_PARTS
             else p for p in content]
    return parts[0]["text"] if len(parts) == 1 and isinstance(parts[0], dict) and parts[0].get("type") == "text" \
        else parts


def is_items(value: Any) -> bool:
    """Whether a list is Responses API items (some item has a Responses type, or ``input_text`` /
    ``output_text`` parts), not chat or semconv messages."""
    if not isinstance(value, list):
        return False
    for item in value:
        if not isinstance(item, dict) or "parts" in item:
            continue
        if item.get("type") in ITEM_TYPES:
            return True
        content = item.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                             for p in content):
            return True
    return False


def _output_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def messages_from_items(items: Any, instructions: Any = None) -> list[dict[str, Any]]:
    """A Responses request's ``input`` (a string or items) and ``instructions`` as chat messages."""
    out: list[dict[str, Any]] = []
    if isinstance(instructions, str) and instructions:
        out.append(message("system", instructions))
    if isinstance(items, str):
        return [*out, message("user", items)]
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role") or "user"
            out.append(message("system" if role == "developer" else role, text_of_parts(item.get("content"))))
        elif kind == "function_call":
            call = tool_call(item.get("call_id") or item.get("id"), item.get("name"), item.get("arguments"))
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*(last.get("tool_calls") or []), call]
            else:
                out.append(message("assistant", None, tool_calls=[call]))
        elif kind == "function_call_output":
            out.append(message("tool", _output_text(item.get("output")), tool_call_id=item.get("call_id")))
    return out


def response_from_output(response: Any) -> dict[str, Any] | None:
    """The assistant message of a ``Response`` (``output`` items, else ``output_text``); streamed, the
    ``response.completed`` event's ``response``. None when it holds neither."""
    if isinstance(response, dict) and isinstance(response.get("response"), dict) and "output" not in response:
        response = response["response"]
    if not isinstance(response, dict):
        return None
    output = response.get("output")
    if isinstance(output, list):
        messages = messages_from_items([i for i in output if isinstance(i, dict) and i.get("type") != "reasoning"])
        texts = [m["content"] for m in messages if m["role"] == "assistant" and isinstance(m.get("content"), str)]
        calls = [c for m in messages for c in m.get("tool_calls") or []]
        if texts or calls:
            return message("assistant", "".join(texts) or None, tool_calls=calls or None)
    if isinstance(response.get("output_text"), str):
        return message("assistant", response["output_text"])
    return None
