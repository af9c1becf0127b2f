"""A call span that says it is one (``gen_ai.operation.name = chat``, ``llm.request.type = chat``) and keeps its
messages elsewhere: in log events or span events (``semconv_events.py``), or nowhere (content capture off)."""

from __future__ import annotations

from collections.abc import Iterable

from span_to_transition.dialects.dialect import Dialect
from span_to_transition.dialects.semconv_events import call_from_events
from span_to_transition.records import LLMCall, LogEvent, Span

CALL_OPERATIONS = frozenset({"chat", "text_completion", "generate_content"})
"""``gen_ai.operation.name`` values of a model call (not ``execute_tool``, ``invoke_agent``, ``embeddings``)."""


def _parse(span: Span, events: Iterable[LogEvent]) -> LLMCall:
    return call_from_events(span, events, "attributes_only")


DIALECT = Dialect(
    "attributes_only",
    _parse,
    marks={"gen_ai.operation.name": CALL_OPERATIONS, "llm.request.type": frozenset({"chat", "completion"})},
)
