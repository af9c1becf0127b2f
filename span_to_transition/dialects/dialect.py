"""What a GenAI dialect is: the attribute keys that mark a span as its LLM call, and the reader of that call.

A dialect states its keys here, once. ``registry.classify`` looks at nothing else, and the store pass keeps
the attributes of every span that carries one of them (``registry.KEPT_*``, read by ``columnar``), so a
dialect can never be recognised by a key that the store pruned on the way in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from span_to_transition.records import LLMCall, LogEvent, Span

ANY = None
"""A mark whose every value counts: the key's presence alone makes the span a call."""

Accepts = frozenset[str] | Callable[[str], bool] | None
"""Which values of a marking key count: ``ANY``, one of a set (the store filters on it, vectorised), or a test
of the value alone (the store keeps every span with the key, and the test decides)."""


@dataclass(frozen=True)
class Dialect:
    """One way instrumentations record an LLM call (the registry lists them in classification order)."""

    name: str
    """What ``LLMCall.dialect`` says."""
    parse: Callable[[Span, Iterable[LogEvent]], LLMCall | None]
    """The call a span this dialect claims records (with the log events joined to it by span id), or None when
    the span turns out not to be a model call after all."""
    marks: Mapping[str, Accepts]
    """Attribute key -> which of its values make a span this dialect's call. A span carrying any one is claimed."""
    keeps: tuple[str, ...] = ()
    """Keys of *other* spans the converter reads for this dialect's calls (AgentOps' tool-call child spans); a
    key ending in "." is a prefix. The store keeps those spans' attributes too."""
    _present: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _tests: tuple[tuple[str, Callable[[str], bool]], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:  # (split once: ``claims`` runs for every span the converter reads)
        present = tuple(key for key, accepts in self.marks.items() if accepts is ANY)
        tests = tuple((key, accepts.__contains__ if isinstance(accepts, frozenset) else accepts)
                      for key, accepts in self.marks.items() if accepts is not ANY)
        object.__setattr__(self, "_present", present)
        object.__setattr__(self, "_tests", tests)

    def claims(self, attrs: Mapping[str, str]) -> bool:
        """Whether ``attrs`` carry one of this dialect's marks with a value it accepts."""
        for key in self._present:
            if key in attrs:
                return True
        for key, test in self._tests:
            value = attrs.get(key)
            if value is not None and test(value):
                return True
        return False
