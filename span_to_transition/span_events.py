"""GenAI messages recorded as span events (Strands Agents), read as the log events ``dialects/semconv_events.py`` reads.

Some instrumentations put a call's messages on the span itself, as span events, instead of emitting log
records. Strands Agents (``strands.telemetry.tracer``) does so in both semconv event styles:

- default: one event per message, ``gen_ai.{system,user,assistant,tool}.message`` with a ``content``
  attribute and ``gen_ai.choice`` with ``message`` and ``finish_reason``; the content is a JSON list of
  Strands (Bedrock Converse) content blocks: ``{"text"}``, ``{"toolUse": {toolUseId, name, input}}``,
  ``{"toolResult": {toolUseId, status, content: [blocks]}}``;
- ``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental``: ``gen_ai.client.inference.operation.details``
  events carrying ``gen_ai.system_instructions`` / ``gen_ai.input.messages`` / ``gen_ai.output.messages``
  (one attribute per event), in parts format, a tool result's ``response`` still a list of content blocks.

``span_event_logs`` turns them into ``LogEvent`` records shaped like the log-record styles (an OpenAI-shaped
body per message; one details record with every attribute merged), so one parser reads both sources and the
same call gives the same transition whichever way it was recorded. Content blocks become what Strands'
OpenAI model sends (``strands/models/openai.py``): text blocks of one message joined as parts, a tool
call's ``input`` as ``json.dumps`` of it, a tool result's text and JSON blocks joined with newlines.
"""

from __future__ import annotations

import json
from typing import Any

from span_to_transition.records import LogEvent, Span, SpanEvent, load_json

DETAILS_EVENT = "gen_ai.client.inference.operation.details"
MESSAGE_EVENTS = frozenset(
    {"gen_ai.system.message", "gen_ai.user.message", "gen_ai.assistant.message", "gen_ai.tool.message",
     "gen_ai.choice"}
)
GENAI_EVENTS = MESSAGE_EVENTS | {DETAILS_EVENT}
DETAILS_KEYS = ("gen_ai.system_instructions", "gen_ai.input.messages", "gen_ai.output.messages")


def has_genai_events(span: Span) -> bool:
    """Whether any of the span's events is a GenAI message event (cheap: most spans have none)."""
    return any(e.name in GENAI_EVENTS for e in span.events)


def block_text(blocks: Any) -> str | None:
    """A tool result's content as the text a model receives: text blocks, and JSON blocks dumped, joined
    with newlines (Strands' ``format_request_tool_message``); a plain value as its text."""
    if blocks is None or isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        return json.dumps(blocks, ensure_ascii=False)
    texts = []
    for b in blocks:
        if isinstance(b, dict) and "text" in b:
            texts.append(str(b["text"]))
        elif isinstance(b, dict) and "json" in b:
            texts.append(json.dumps(b["json"], ensure_ascii=False))
        else:
            texts.append(b if isinstance(b, str) else json.dumps(b, ensure_ascii=False))
    return "\n".join(texts)


def _tool_call(use: dict[str, Any]) -> dict[str, Any]:
    args = use.get("input")
    arguments = args if isinstance(args, str) else json.dumps(args if args is not None else {}, ensure_ascii=False)
    return {"id": use.get("toolUseId"), "type": "function", "function": {"name": use.get("name"), "arguments": arguments}}


def blocks_to_bodies(role: str, content: Any) -> list[tuple[str, dict[str, Any]]]:
    """One Strands message (role + content blocks) as (role, OpenAI-shaped body) pairs: the message itself,
    and one ``tool`` body per ``toolResult`` block (OpenAI has one message per tool result)."""
    if not isinstance(content, list):
        return [(role, {"content": content})]
    texts: list[str] = []
    others: list[dict[str, Any]] = []  # image / document blocks, kept as they were recorded
    calls: list[dict[str, Any]] = []
    results: list[tuple[str, dict[str, Any]]] = []
    for b in content:
        if not isinstance(b, dict):
            texts.append(str(b))
        elif "text" in b:
            texts.append(b["text"])
        elif isinstance(b.get("toolUse"), dict):
            calls.append(_tool_call(b["toolUse"]))
        elif isinstance(b.get("toolResult"), dict):
            r = b["toolResult"]
            results.append(("tool", {"content": block_text(r.get("content")), "id": r.get("toolUseId")}))
        else:
            others.append(b)
    out: list[tuple[str, dict[str, Any]]] = []
    if texts or calls or others or not results:
        parts = [{"type": "text", "text": t} for t in texts] + others
        body: dict[str, Any] = {"content": texts[0] if len(parts) == 1 and texts else (parts or None)}
        if calls:
            body["tool_calls"] = calls
        out.append((role, body))
    return out + results


def _details(events: list[SpanEvent]) -> LogEvent:
    """Every details event's attributes in one record (Strands writes one attribute per event), with each tool
    result's content blocks as the text the model received."""
    attrs: dict[str, str] = {}
    for e in events:
        attrs.update(e.attributes)
    raw = load_json(attrs.get("gen_ai.input.messages"))
    if isinstance(raw, list):
        changed = False
        for m in raw:
            for p in (m.get("parts") or []) if isinstance(m, dict) else ():
                if isinstance(p, dict) and p.get("type") == "tool_call_response" and isinstance(p.get("response"), list):
                    p["response"] = block_text(p["response"])
                    changed = True
        if changed:
            attrs["gen_ai.input.messages"] = json.dumps(raw, ensure_ascii=False)
    return LogEvent(None, None, events[0].time_ns, DETAILS_EVENT, None, attrs)


def span_event_logs(span: Span) -> list[LogEvent]:
    """The span's GenAI message events as ``LogEvent`` records (see the module docstring), in event order."""
    details = [e for e in span.events if e.name == DETAILS_EVENT and any(k in e.attributes for k in DETAILS_KEYS)]
    if details:
        return [_details(details)]
    out: list[LogEvent] = []
    for e in span.events:
        if e.name not in MESSAGE_EVENTS:
            continue
        a = e.attributes
        if e.name == "gen_ai.choice":
            body = blocks_to_bodies("assistant", load_json(a.get("message")))[0][1]
            choice = {"index": 0, "message": body, "finish_reason": a.get("finish_reason")}
            out.append(LogEvent(None, None, e.time_ns, e.name, json.dumps(choice, ensure_ascii=False)))
            continue
        role = e.name.split(".")[1]
        for r, body in blocks_to_bodies(role, load_json(a.get("content"))):
            if r == "tool" and role == "tool" and "id" not in body and a.get("id"):
                body["id"] = a["id"]
            out.append(LogEvent(None, None, e.time_ns, f"gen_ai.{r}.message", json.dumps(body, ensure_ascii=False)))
    return out
