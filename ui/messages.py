"""Turn a transition's stored JSON (prompt messages, tools, response) into what the call view shows.

Pure. The converter stores OpenAI-style chat messages whatever dialect recorded them, but content
may be a string, a list of parts, or absent (a tool call), so this is the one place that knows the
shapes. Nothing here escapes HTML: the templates do, for every string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class MessageView:
    role: str
    text: str
    name: str | None = None  # a tool message's tool name, or a named participant
    tool_call_id: str | None = None  # the call a tool result answers
    tool_calls: list[ToolCall] = field(default_factory=list)


def load(text: str | None, default: Any) -> Any:
    """JSON from the store, or ``default`` when absent or not JSON (shown raw by the caller)."""
    if text is None:
        return default
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return default


def content_text(content: Any) -> str:
    """The text of a message's content: a string, or the text of its parts (other parts named)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for p in content:
            if isinstance(p, dict):
                kind = p.get("type", "text")
                text = p.get("text", p.get("content"))
                out.append(text if isinstance(text, str) else f"[{kind} part]")
            else:
                out.append(str(p))
        return "\n".join(out)
    return json.dumps(content, ensure_ascii=False)


def message_view(m: Any) -> MessageView:
    """One chat message as the view shows it; anything that is not a dict is shown as text."""
    if not isinstance(m, dict):
        return MessageView("unknown", json.dumps(m, ensure_ascii=False))
    calls = []
    for c in m.get("tool_calls") or []:
        if isinstance(c, dict):
            fn = c.get("function") or {}
            args = fn.get("arguments", "")
            calls.append(ToolCall(str(c.get("id", "")), str(fn.get("name", "")),
                                  args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    return MessageView(
        role=str(m.get("role", "unknown")),
        text=content_text(m.get("content")),
        name=m.get("name"),
        tool_call_id=m.get("tool_call_id"),
        tool_calls=calls,
    )


def messages(text: str | None) -> list[MessageView]:
    """The prompt messages of a transition (an unparseable value becomes one message holding it)."""
    data = load(text, None)
    if data is None:
        return [MessageView("unparsed", text)] if text else []
    return [message_view(m) for m in (data if isinstance(data, list) else [data])]


def tool_names(text: str | None) -> list[str]:
    """Names of the tools offered to the model in this call (OpenAI ``tools`` JSON)."""
    out = []
    for t in load(text, []) or []:
        if isinstance(t, dict):
            fn = t.get("function") if isinstance(t.get("function"), dict) else t
            out.append(str(fn.get("name", "?")))
    return out
