"""The semconv messages as events: log records joined to the span by span id, or events on the span itself.

Either one event per message (``gen_ai.{system,user,assistant,tool}.message``, ``gen_ai.choice``) or one
``gen_ai.client.inference.operation.details`` event carrying the semconv attributes; Strands Agents records
the same events on the span (``span_events.py``). Such a span is claimed by the attributes that say it is a
call (``attributes_only``) or by its token ids (``token_ids``): both read its messages here, and a call whose
content was captured nowhere comes back with no messages and no response, for the converter to report.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from span_to_transition.chat_messages import _common, _openai_message, _text, message
from span_to_transition.dialects.semconv import parse_semconv
from span_to_transition.records import LLMCall, LogEvent, Span, load_json
from span_to_transition.span_events import DETAILS_EVENT, MESSAGE_EVENTS, has_genai_events, span_event_logs
from span_to_transition.tokens import response_id_of


def _event_name(e: LogEvent) -> str:
    return e.event_name or e.attributes.get("event.name", "")


def parse_events(span: Span, events: Iterable[LogEvent]) -> LLMCall | None:
    """Messages from the log events of one span (already joined by span id), in time order."""
    events = sorted(events, key=lambda e: e.time_ns)
    for e in events:
        if _event_name(e) == DETAILS_EVENT:
            return parse_semconv(span, {**span.attributes, **e.attributes}, dialect="semconv_events")
    messages: list[dict[str, Any]] = []
    response = None
    finish = None
    for e in events:
        name = _event_name(e)
        if name not in MESSAGE_EVENTS:
            continue
        body = load_json(e.body)
        body = body if isinstance(body, dict) else {"content": body}
        if name == "gen_ai.choice":
            if response is None and int(body.get("index") or 0) == 0:
                msg = body.get("message") or {}
                response = _openai_message({"role": "assistant", **msg})
                finish = body.get("finish_reason")
            continue
        role = name.split(".")[1]
        if role == "tool":
            messages.append(message("tool", _text(body.get("content")), tool_call_id=body.get("id")))
        else:
            messages.append(_openai_message({"role": role, **body}))
    if not messages and response is None:
        return None
    return _common(span, span.attributes, "semconv_events", messages, response, finish, None)


def call_from_events(span: Span, events: Iterable[LogEvent], dialect: str) -> LLMCall:
    """The call's messages from its log events, else from its span events (Strands), else a call with no
    content recorded as ``dialect`` (content capture is off: the caller reports it instead of inventing one)."""
    from_events = parse_events(span, events) if events else None
    if from_events is None and span.events and has_genai_events(span):  # Strands: the events are on the span
        from_events = parse_events(span, span_event_logs(span))
    if from_events is not None:
        return from_events
    call = _common(span, span.attributes, dialect, [], None, None, None)
    call.response_id = call.response_id or response_id_of(span.attributes)
    return call
