"""The GenAI dialects the converter reads, in classification order: the one list of them and of their keys.

A dialect is one module in this package whose ``DIALECT`` states the attribute keys that mark a span as its
call and how to read that call (``dialect.py``); it is read once it has its one line in ``DIALECTS``. Everything
else is derived from that line: ``classify`` and ``parse_call`` look at no key a dialect did not declare, the
store pass keeps the attributes of every span carrying one (``KEPT_KEYS``, ``KEPT_VALUES``, ``KEPT_PREFIXES``,
read by ``columnar``), and ``tracerl doctor`` groups spans by the keys whose values decide (``VALUE_KEYS``).

Spans are classified by attributes, never by span name. Every dialect returns the same shape (``LLMCall``),
so the same call recorded by any instrumentation yields the same transition.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from importlib import import_module

from span_to_transition.dialects.dialect import ANY, Dialect
from span_to_transition.records import LLMCall, LogEvent, Span


def _dialect(module: str) -> Dialect:
    """The ``DIALECT`` of ``span_to_transition/dialects/<module>.py``. Naming each module here, once, makes a
    new dialect one file plus one line below (an import list beside the tuple would be a second line to
    forget); ``test_dialect_registry`` fails for a module that is not named."""
    return import_module(f"{__package__}.{module}").DIALECT


DIALECTS: tuple[Dialect, ...] = (
    _dialect("semconv"),  # first: LiteLLM's hybrid carries flattened OpenLLMetry keys beside the semconv messages
    _dialect("openinference"),
    _dialect("openllmetry"),
    _dialect("vercel_ai"),
    _dialect("attributes_only"),  # a span that says it is a call; its messages in events, or not captured
    _dialect("token_ids"),  # last: token ids on a span with no messages
)
"""The first dialect that claims a span (``Dialect.claims``) records it."""
BY_NAME = {d.name: d for d in DIALECTS}


def _kept_values() -> dict[str, frozenset[str]]:
    values: dict[str, frozenset[str]] = {}
    for d in DIALECTS:
        for key, accepts in d.marks.items():
            if isinstance(accepts, frozenset):
                values[key] = values.get(key, frozenset()) | accepts
    return values


KEPT_KEYS = frozenset(
    {key for d in DIALECTS for key, accepts in d.marks.items() if not isinstance(accepts, frozenset)}
    | {key for d in DIALECTS for key in d.keeps if not key.endswith(".")}
)
"""Keys whose presence alone makes the store pass keep a span's attributes (a value test, if any, runs later)."""
KEPT_VALUES = _kept_values()
"""Keys that matter only with some values (``gen_ai.operation.name = chat``, not ``execute_tool``)."""
KEPT_PREFIXES = tuple(key for d in DIALECTS for key in d.keeps if key.endswith("."))
"""Key prefixes whose spans the store keeps."""
VALUE_KEYS = tuple(dict.fromkeys(key for d in DIALECTS for key, accepts in d.marks.items() if accepts is not ANY))
"""Keys whose value, not only presence, decides whether a span is a call."""


_MARKS = frozenset(key for d in DIALECTS for key in d.marks)


def classify(attrs: Mapping[str, str]) -> str | None:
    """Which dialect recorded this span as an LLM call, from attributes alone; None if not a call."""
    if _MARKS.isdisjoint(attrs):  # (one C-speed test: most spans carry no mark at all)
        return None
    for dialect in DIALECTS:
        if dialect.claims(attrs):
            return dialect.name
    return None


def parse_call(span: Span, events: Iterable[LogEvent] = ()) -> LLMCall | None:
    """The LLM call recorded by ``span`` (plus its joined log events), or None if it is not one.

    A call span whose content was not captured returns an ``LLMCall`` with no messages and no
    response: the caller reports it (content capture is off) instead of inventing a prompt.
    """
    kind = classify(span.attributes)
    return None if kind is None else BY_NAME[kind].parse(span, events)
