"""Token ids on a span with no messages (``tokens.TOKEN_KEYS``: Agent Lightning, LiteLLM's vLLM passthrough):
a call whose row carries the ids only, or its messages from events (``semconv_events.py``) when it has them."""

from __future__ import annotations

from collections.abc import Iterable

from span_to_transition.dialects.dialect import ANY, Dialect
from span_to_transition.dialects.semconv_events import call_from_events
from span_to_transition.records import LLMCall, LogEvent, Span
from span_to_transition.tokens import TOKEN_KEYS


def _parse(span: Span, events: Iterable[LogEvent]) -> LLMCall:
    return call_from_events(span, events, "token_ids")


DIALECT = Dialect("token_ids", _parse, marks=dict.fromkeys(sorted(TOKEN_KEYS), ANY))
