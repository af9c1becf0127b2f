"""The dialect registry is the one list of dialect keys: nothing recognises a call by a key it does not declare,
and the store pass keeps every span a dialect can claim or read."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from span_to_transition import dialects
from span_to_transition.columnar import relevant_mask, spans_from_table
from span_to_transition.dialects.registry import DIALECTS, classify

from .factory import FIXTURES, TraceBuilder, fixture_tables, spans_table

RECORDINGS = sorted(p.name.removesuffix(".traces.pb") for p in FIXTURES.glob("*.traces.pb"))
DECLARED = frozenset(key for d in DIALECTS for key in d.marks)


@pytest.mark.parametrize("name", RECORDINGS)
def test_a_span_is_classified_by_the_keys_its_dialect_declares_and_kept_by_the_store(name: str) -> None:
    """Every span of every recording: stripped to its declared keys, it is classified the same (no dialect reads
    an undeclared key to decide), and a span any dialect claims or reads keeps its attributes in the store pass."""
    table, _ = fixture_tables(name)
    spans = spans_from_table(table, all_attributes=True)
    kept = relevant_mask(table).to_pylist()
    needed = tuple(key for d in DIALECTS for key in d.keeps)
    claimed = 0
    for span, is_kept in zip(spans, kept, strict=True):
        kind = classify(span.attributes)
        assert kind == classify({k: v for k, v in span.attributes.items() if k in DECLARED}), span.name
        claimed += kind is not None
        if kind is not None or any(k == n or (n.endswith(".") and k.startswith(n)) for k in span.attributes
                                   for n in needed):
            assert is_kept, (span.name, kind)
    assert claimed, "a recording with no call in it"


def test_each_declared_key_alone_is_kept_and_claims_its_span() -> None:
    """A span carrying one mark (with a value the dialect accepts) or one key a dialect reads on other spans
    survives the store's pruning; one carrying a mark of a set of values, or of any value, is claimed by that
    dialect or one listed before it."""
    t = TraceBuilder()
    root = t.span("root")
    expect: dict[str, tuple[str, ...]] = {}
    for i, d in enumerate(DIALECTS):
        earlier = tuple(e.name for e in DIALECTS[: i + 1])
        for key, accepts in d.marks.items():
            if callable(accepts):  # a test of the value: the store keeps every value, the test decides
                expect[t.span(f"{d.name} {key}", root, {key: "x"}).span_id] = ()
                continue
            for value in sorted(accepts) if isinstance(accepts, frozenset) else ["x"]:
                expect[t.span(f"{d.name} {key}={value}", root, {key: value}).span_id] = earlier
        for key in d.keeps:
            expect[t.span(f"{d.name} keeps {key}", root, {key + "0" if key.endswith(".") else key: "x"}).span_id] = ()
    kept = dict(zip((s.span_id for s in t.spans), relevant_mask(spans_table(t.spans)).to_pylist()))
    for span in t.spans[1:]:
        assert kept[span.span_id], span.name
        if expect[span.span_id]:
            assert classify(span.attributes) in expect[span.span_id], span.name


def test_every_dialect_module_is_registered() -> None:
    """A dialect file without its registry line would be read by nothing: say so."""
    modules = [importlib.import_module(f"{dialects.__name__}.{m.name}") for m in pkgutil.iter_modules(dialects.__path__)]
    written = {m.DIALECT.name for m in modules if hasattr(m, "DIALECT")}
    assert written == {d.name for d in DIALECTS}
