"""The compactor's fast path converts a whole request and checks its rows at once; a request with
one span that cannot be stored (written by an older version that did not check) still goes item by
item, so exactly that span is quarantined with the reason the receiver would give, and the rest is stored."""

from __future__ import annotations

import json

import pytest

from collector_exporter.compactor import Compactor
from collector_exporter.wal import Kind, WriteAheadLog
from store.layout import StoreLayout
from store.location import parse_store
from store.views import connect_readonly

from .helpers import trace_request
from .test_poison import SPAN_POISON, poisoned_traces

BAD_IDS = {  # name: (how to poison a span, what the quarantine reason names)
    "zero trace_id": (lambda s: setattr(s, "trace_id", bytes(16)), "trace_id must be 16 non-zero bytes"),
    "4-byte span_id": (lambda s: setattr(s, "span_id", b"\x01" * 4), "span_id must be 8 non-zero bytes"),
    "3-byte parent": (
        lambda s: setattr(s, "parent_span_id", b"\x02" * 3),
        "parent_span_id must be empty or 8",
    ),
}
POISON = {**{k: (f, k.split(" = ")[0]) for k, f in SPAN_POISON.items()}, **BAD_IDS}


def _compact(store, records: list[tuple[Kind, bytes]]) -> Compactor:
    wal = WriteAheadLog(StoreLayout.at(store).wal / "collector-old")
    for kind, payload in records:
        wal.append(kind, payload)
    wal.close()
    compactor = Compactor(StoreLayout.at(store))
    assert compactor.run_once() == 1
    return compactor


@pytest.mark.parametrize("poison", POISON)
def test_one_unstorable_span_is_quarantined_by_name_and_its_neighbours_stored(store, poison):
    setter, reason = POISON[poison]
    traces, good = poisoned_traces(setter)
    compactor = _compact(store, [(Kind.TRACES, traces.SerializeToString())])
    assert (compactor.stats.quarantined, compactor.stats.spans) == (1, 3)
    (line,) = [
        json.loads(x) for f in (store / "quarantine").glob("*.jsonl") for x in f.read_text().splitlines()
    ]
    assert reason in line["reason"]
    rows = connect_readonly(parse_store(store)).execute("SELECT trace_id, span_id FROM spans").fetchall()
    assert set(rows) == good


def test_a_storable_request_takes_the_fast_path_and_a_retry_of_it_is_dropped(store):
    req = trace_request(5)
    compactor = _compact(
        store, [(Kind.TRACES, req.SerializeToString()), (Kind.TRACES, req.SerializeToString())]
    )
    assert (compactor.stats.spans, compactor.stats.duplicates, compactor.stats.quarantined) == (5, 5, 0)
    assert not (store / "quarantine").exists()
