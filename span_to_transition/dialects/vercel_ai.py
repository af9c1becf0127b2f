"""The Vercel AI SDK: ``ai.prompt.messages`` / ``ai.response.text`` / ``ai.response.toolCalls`` / ``ai.prompt.tools``.

Recorded on its ``ai.*.doGenerate`` / ``ai.*.doStream`` spans (``@ai-sdk/otel`` ``LegacyOpenTelemetry``, and the
SDK's built-in telemetry before v7); the content parts are those of its LanguageModelV2 prompt. The SDK's
``OpenTelemetry`` integration writes semconv instead (``semconv.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from span_to_transition.chat_messages import _common, _join_text, _text, _usage, message, tool_call
from span_to_transition.dialects.dialect import ANY, Dialect
from span_to_transition.records import LLMCall, LogEvent, Span, load_json

VERCEL_MESSAGES = "ai.prompt.messages"
"""The SDK's provider-level prompt on each ``ai.*.doGenerate`` / ``ai.*.doStream`` span."""


def _vercel_part(p: dict[str, Any]) -> dict[str, Any] | None:
    """A user content part in OpenAI form (text, image as ``image_url``, file); None for parts the chat
    template does not see (reasoning)."""
    kind = p.get("type")
    if kind == "text":
        return {"type": "text", "text": p.get("text") or ""}
    if kind in ("image", "file"):
        data = p.get("image", p.get("data"))
        media = p.get("mediaType") or p.get("mimeType") or ("image/*" if kind == "image" else "")
        url = data if isinstance(data, str) and (":" in data[:12]) else f"data:{media};base64,{data}"
        if kind == "image" or media.startswith("image/"):
            return {"type": "image_url", "image_url": {"url": url}}
        return {"type": "file", "file": {"file_data": url}}
    return None


def _vercel_output(output: Any) -> str | None:
    """A tool result: ``{"type": "text" | "json" | "error-text" | ..., "value"}`` (v5+) or the raw result (v4)."""
    if isinstance(output, dict) and "type" in output and "value" in output:
        output = output["value"]
    return _text(output)


def vercel_messages(items: Any) -> list[dict[str, Any]]:
    """``ai.prompt.messages`` (the SDK's provider-level prompt) to OpenAI messages."""
    out: list[dict[str, Any]] = []
    for m in items if isinstance(items, list) else ():
        if not isinstance(m, dict):
            continue
        role, content = m.get("role") or "user", m.get("content")
        if not isinstance(content, list):
            out.append(message(role, content))
            continue
        if role == "tool":
            out.extend(message("tool", _vercel_output(p.get("output", p.get("result"))), tool_call_id=p.get("toolCallId"))
                       for p in content if isinstance(p, dict) and p.get("type") == "tool-result")
            continue
        calls = [tool_call(p.get("toolCallId"), p.get("toolName"), p.get("input", p.get("args")))
                 for p in content if isinstance(p, dict) and p.get("type") == "tool-call"]
        parts = [q for q in (_vercel_part(p) for p in content if isinstance(p, dict)) if q is not None]
        if all(q["type"] == "text" for q in parts):
            body: Any = _join_text([q["text"] for q in parts])
        else:
            body = parts
        out.append(message(role, body, tool_calls=calls or None))
    return out


def parse_vercel(span: Span, events: Iterable[LogEvent] = ()) -> LLMCall:
    attrs = span.attributes
    get = attrs.get
    messages = vercel_messages(load_json(get(VERCEL_MESSAGES)))
    raw_calls = load_json(get("ai.response.toolCalls"))
    calls = [tool_call(c.get("toolCallId"), c.get("toolName"), c.get("input", c.get("args")))
             for c in raw_calls if isinstance(c, dict)] if isinstance(raw_calls, list) else []
    text = get("ai.response.text")
    response = message("assistant", text, tool_calls=calls or None) if text is not None or calls else None
    tools = load_json(get("ai.prompt.tools"))
    if isinstance(tools, list):
        tools = [load_json(t) if isinstance(t, str) else t for t in tools]  # a string array of JSON tool specs
    call = _common(span, attrs, "vercel_ai", messages, response, get("ai.response.finishReason"), tools)
    call.request_model = call.request_model or get("ai.model.id")
    call.response_model = call.response_model or get("ai.response.model")
    call.response_id = call.response_id or get("ai.response.id")
    if call.input_tokens is None:
        call.input_tokens = _usage(attrs, "ai.usage.inputTokens", "ai.usage.promptTokens")
    if call.output_tokens is None:
        call.output_tokens = _usage(attrs, "ai.usage.outputTokens", "ai.usage.completionTokens")
    return call


DIALECT = Dialect("vercel_ai", parse_vercel, marks={VERCEL_MESSAGES: ANY})
