"""The compactor's fast path converts a whole request and checks its rows at once; a request with
one span that cannot be stored (written by an older version that did not check) still goes item by
item, so exactly that span is quarantined with the reason the receiver would give, and the rest is stored."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from collector_exporter.compactor import Compactor
from collector_exporter.records import convert_record
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


def _spy_on_one_by_one(monkeypatch) -> list:
    """The trace records ``compact_segment`` hands to ``convert_record`` (those not converted at once)."""
    import collector_exporter.compactor as compactor_module

    one_by_one = []

    def spy(rec, staged):
        if rec.kind == Kind.TRACES:
            one_by_one.append(rec)
        return convert_record(rec, staged)

    monkeypatch.setattr(compactor_module, "convert_record", spy)
    return one_by_one


def test_a_segment_of_storable_requests_is_converted_at_once_and_retries_in_it_dropped(store, monkeypatch):
    pytest.importorskip("ptars", reason="the at-once conversion is the columnar path's (ptars)")
    one_by_one = _spy_on_one_by_one(monkeypatch)
    a, b = trace_request(3), trace_request(4)
    records = [(Kind.TRACES, p.SerializeToString()) for p in (a, b, a)]
    compactor = _compact(store, records)
    assert (compactor.stats.spans, compactor.stats.duplicates, compactor.stats.quarantined) == (7, 3, 0)
    assert one_by_one == []
    rows = connect_readonly(parse_store(store)).execute(
        "SELECT count(DISTINCT (trace_id, span_id)) FROM spans"
    )
    assert rows.fetchone() == (7,)


def test_a_poisoned_request_in_a_segment_sends_it_one_by_one_and_costs_only_its_span(store, monkeypatch):
    one_by_one = _spy_on_one_by_one(monkeypatch)
    setter, reason = BAD_IDS["zero trace_id"]
    poisoned, good = poisoned_traces(setter)
    clean = trace_request(2)
    compactor = _compact(
        store, [(Kind.TRACES, clean.SerializeToString()), (Kind.TRACES, poisoned.SerializeToString())]
    )
    assert (compactor.stats.quarantined, compactor.stats.spans, len(one_by_one)) == (1, 5, 2)
    (line,) = [
        json.loads(x) for f in (store / "quarantine").glob("*.jsonl") for x in f.read_text().splitlines()
    ]
    assert reason in line["reason"]
    rows = set(connect_readonly(parse_store(store)).execute("SELECT trace_id, span_id FROM spans").fetchall())
    assert good < rows and len(rows) == 5


def test_requests_received_on_two_days_land_in_their_own_date_partitions(store):
    day = 86_400 * 10**9
    first = 1_767_225_600 * 10**9 + day - 1_000  # 2026-01-01 23:59:59.999999
    wal = WriteAheadLog(StoreLayout.at(store).wal / "collector-old")
    wal.append(Kind.TRACES, trace_request(2).SerializeToString(), first)
    wal.append(Kind.TRACES, trace_request(3).SerializeToString(), first + 2_000)
    wal.close()
    assert Compactor(StoreLayout.at(store)).run_once() == 1
    counts = {p.parent.name: pq.read_metadata(p).num_rows for p in (store / "spans").rglob("*.parquet")}
    assert counts == {"date=2026-01-01": 2, "date=2026-01-02": 3}


def test_without_ptars_the_python_decoder_stores_the_same_files(tmp_path, monkeypatch):
    import collector_exporter.otlp_columnar as columnar

    pytest.importorskip("ptars", reason="compares the columnar path (ptars) with the Python decoder")
    fixtures = Path(__file__).resolve().parents[1] / "span_to_transition" / "fixtures"
    payloads = [p.read_bytes() for p in sorted(fixtures.glob("openai-v2*.traces.pb"))]
    payloads.append(trace_request(5).SerializeToString())

    def stored(store, handler) -> pa.Table:
        monkeypatch.setattr(columnar, "_handler", handler)
        wal = WriteAheadLog(StoreLayout.at(store).wal / "collector-old")
        for i, payload in enumerate(payloads + payloads[:1]):  # and a retry
            wal.append(Kind.TRACES, payload, 1_767_225_600 * 10**9 + i * 1_000)
        wal.close()
        assert Compactor(StoreLayout.at(store)).run_once() == 1
        (path,) = (store / "spans").rglob("*.parquet")
        return pq.read_table(path)

    with_ptars = stored(tmp_path / "a", columnar._handler)
    without = stored(tmp_path / "b", lambda: None)
    assert with_ptars.num_rows > 5
    assert with_ptars.equals(without)


def test_a_segment_of_nothing_but_retries_writes_no_file(store):
    req = trace_request(3).SerializeToString()
    first = _compact(store, [(Kind.TRACES, req)])
    wal = WriteAheadLog(StoreLayout.at(store).wal / "collector-new")  # another writer: its own file names
    wal.append(Kind.TRACES, req)
    wal.append(Kind.TRACES, req)
    wal.close()
    again = Compactor(StoreLayout.at(store))  # its window is refilled from the stored file
    assert again.run_once() == 1
    assert (first.stats.files, again.stats.files, again.stats.duplicates, again.stats.spans) == (1, 0, 6, 0)
    assert len(list((store / "spans").rglob("*.parquet"))) == 1
