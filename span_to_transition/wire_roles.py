"""Prompts as they went over the wire: a framework's internal roles mapped to the roles the model received.

smolagents keeps tool turns in its memory as ``tool-call`` and ``tool-response`` messages, and OpenInference's
smolagents instrumentation records the memory as it is. What the model receives is different: smolagents'
``get_clean_message_list`` (``smolagents/models.py``, with ``tool_role_conversions``) sends ``tool-call`` as
``assistant`` and ``tool-response`` as ``user``, and then merges consecutive messages of the same role into one,
appending each text part to the previous message's last text part after a newline. A chat template would
reject or mis-render the internal roles, and a merged prompt tokenizes differently from two messages, so the
converter applies the same two steps (``to_wire_roles``) to any prompt that holds these roles.

Also here: the provider's response id of an OpenInference LLM span, which some instrumentations record only
inside ``output.value`` (``openinference_response_id``), for the gateway join by ``gen_ai.response.id``.
"""

from __future__ import annotations

import re
from typing import Any

FRAMEWORK_ROLES = {"tool-call": "assistant", "tool-response": "user"}
"""smolagents' ``MessageRole.TOOL_CALL`` / ``TOOL_RESPONSE`` -> the role it sends (``tool_role_conversions``)."""

_REPR_ID = re.compile(r"^ChatCompletion(?:Chunk)?\(id='([^']+)'")


def _parts(content: Any) -> list[Any]:
    if content is None:
        return []
    if isinstance(content, list):
        return [dict(p) if isinstance(p, dict) else p for p in content]
    return [{"type": "text", "text": content}]


def _content(parts: list[Any]) -> Any:
    """Back to the canonical content: one text part is its text (``chat_messages._join_text``)."""
    if len(parts) == 1 and isinstance(parts[0], dict) and parts[0].get("type") == "text":
        return parts[0].get("text")
    return parts or None


def to_wire_roles(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as smolagents sends them when they hold its internal roles (see the module docstring);
    any other prompt is returned as it is."""
    if not any(m.get("role") in FRAMEWORK_ROLES for m in messages):
        return messages
    out: list[dict[str, Any]] = []
    for m in messages:
        role = FRAMEWORK_ROLES.get(m.get("role"), m.get("role"))
        if out and out[-1]["role"] == role and not m.get("tool_calls") and not out[-1].get("tool_calls"):
            # (an empty text is not recorded at all by OpenInference; smolagents still joins after it)
            merged = _parts(out[-1]["content"]) or [{"type": "text", "text": ""}]
            for p in _parts(m.get("content")):
                last = merged[-1] if merged else None
                if isinstance(p, dict) and p.get("type") == "text" and isinstance(last, dict) \
                        and last.get("type") == "text":
                    last["text"] = f"{last.get('text') or ''}\n{p.get('text') or ''}"
                else:
                    merged.append(p)
            out[-1] = {**out[-1], "content": _content(merged)}
            continue
        out.append({**m, "role": role})
    return out


def openinference_response_id(output_value: Any) -> str | None:
    """The response id an OpenInference LLM span records only in its decoded ``output.value``: the OpenAI
    response itself (``{"id": ...}``), LlamaIndex's ``{"raw": {"id": ...}}``, or smolagents'
    ``{"raw": "ChatCompletion(id='...', ...)"}`` (the ``repr`` of the openai response). None when absent
    (smolagents' streamed calls keep no raw response)."""
    if not isinstance(output_value, dict):
        return None
    if isinstance(output_value.get("id"), str):
        return output_value["id"]
    raw = output_value.get("raw")
    if isinstance(raw, dict) and isinstance(raw.get("id"), str):
        return raw["id"]
    if isinstance(raw, str):
        m = _REPR_ID.match(raw)
        return m.group(1) if m else None
    return None
