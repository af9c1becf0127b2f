"""The compactor's columnar path (ptars + Arrow compute) gives exactly the rows of the Python decoder
(``trace_request_to_table``, the one definition), and declines what it does not cover."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList

from collector_exporter import otlp_columnar
from collector_exporter.otlp_arrow import trace_request_to_table
from collector_exporter.otlp_columnar import hex_ids, trace_payload_to_table, trace_payloads_to_table
from collector_exporter.records import DedupeWindow, StagedKeys

pytest.importorskip("ptars", reason="the columnar path needs ptars (a dependency: pip install -e .)")

FIXTURES = Path(__file__).resolve().parents[1] / "span_to_transition" / "fixtures"
RECORDED = sorted(p.name.removesuffix(".traces.pb") for p in FIXTURES.glob("*.traces.pb"))
AT = 1_700_000_000_000_000_000  # received_at (ns), whole microseconds so rows read back as datetimes


def _both(req: ExportTraceServiceRequest, **kw) -> tuple[pa.Table, pa.Table]:
    """(columnar, Python) tables of one request, each with its own dedupe window when ``seen`` is asked."""
    fast = trace_payload_to_table(req.SerializeToString(), AT, DedupeWindow() if kw.get("seen") else None)
    assert fast is not None, "the columnar path declined a request it covers"
    slow = trace_request_to_table(req, AT, DedupeWindow() if kw.get("seen") else None)
    return fast[0], slow


def _assert_same(fast: pa.Table, slow: pa.Table) -> None:
    for name in slow.column_names:  # column by column first, so a failure names the column and row
        assert fast[name].to_pylist() == slow[name].to_pylist(), name
    assert fast.equals(slow)


def _value(**member) -> AnyValue:
    return AnyValue(**member)


def _request(values: dict[str, AnyValue], *, n: int = 2) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for i in range(n):
        sp = ss.spans.add(trace_id=bytes([i + 1]) * 16, span_id=bytes([i + 1]) * 8, name=f"s{i}")
        for k, v in values.items():
            sp.attributes.add(key=k, value=v)
    return req


@pytest.mark.parametrize("name", RECORDED)
def test_every_recorded_fixture_converts_to_the_same_rows(name):
    req = ExportTraceServiceRequest.FromString((FIXTURES / f"{name}.traces.pb").read_bytes())
    _assert_same(*_both(req))


def test_values_the_store_spells_as_json_match_the_python_decoder():
    strings = ArrayValue(
        values=[_value(string_value=s) for s in ("stop", 'é "q"\n\\', "\x00\x7f", "", "x" * 200)]
    )
    values = {
        "s": _value(string_value="plain"),
        "empty": _value(string_value=""),
        "unset": AnyValue(),
        "i": _value(int_value=-(2**63)),
        "b": _value(bool_value=False),
        "d": _value(double_value=0.7),
        "big": _value(double_value=1e16),
        "nan": _value(double_value=float("nan")),
        "inf": _value(double_value=float("-inf")),
        "negzero": _value(double_value=-0.0),
        "strings": _value(array_value=strings),
        "simple": _value(array_value=ArrayValue(values=[_value(string_value="stop")])),
        "mixed": _value(
            array_value=ArrayValue(values=[_value(int_value=1), _value(string_value="a"), AnyValue()])
        ),
        "no items": _value(array_value=ArrayValue()),
        "kv": _value(
            kvlist_value=KeyValueList(
                values=[KeyValue(key="k", value=_value(double_value=2.0)), KeyValue(key="e")]
            )
        ),
        "bytes": _value(bytes_value=b"\x00\xff"),
    }
    fast, slow = _both(_request(values))
    _assert_same(fast, slow)
    assert dict(fast["attributes"][0].as_py())["strings"].startswith('["stop","é \\"q\\"\\n\\\\"')


def test_a_key_value_without_its_value_stores_null():
    req = _request({})
    req.resource_spans[0].scope_spans[0].spans[0].attributes.add(key="bare")
    _assert_same(*_both(req))


def test_ids_become_hex_root_parents_null_and_odd_lengths_kept():
    ids = pa.array([b"", b"\x00\x01\xab", bytes(range(256)), b"\xff"], pa.binary())
    assert hex_ids(ids).to_pylist() == [b.hex() for b in ids.to_pylist()]
    assert hex_ids(ids.slice(1, 2), empty_is_null=True).to_pylist() == ["0001ab", bytes(range(256)).hex()]
    assert hex_ids(ids, empty_is_null=True).to_pylist()[0] is None
    assert hex_ids(pa.array([], pa.binary())).to_pylist() == []

    req = _request({"k": _value(string_value="v")}, n=3)
    spans = req.resource_spans[0].scope_spans[0].spans
    spans[1].parent_span_id = spans[0].span_id
    spans[2].trace_id, spans[2].span_id = (
        b"",
        b"\x01\x02",
    )  # invalid: kept as hex, refused by the storable check
    fast, slow = _both(req)
    _assert_same(fast, slow)
    assert fast["parent_span_id"].to_pylist()[:2] == [None, "01" * 8]


def test_events_links_status_kind_and_several_resources_and_scopes():
    req = ExportTraceServiceRequest()
    for r in range(3):
        rs = req.resource_spans.add()
        if r:  # the first has no resource at all
            rs.resource.attributes.add(key="service.name", value=_value(string_value=f"svc{r}"))
        if r == 2:
            rs.resource.attributes.add(key="tracerl.rollout_id", value=_value(string_value="res"))
        for s in range(2):
            ss = rs.scope_spans.add()
            if s:
                ss.scope.name, ss.scope.version = f"scope{r}", "1.0"
            for i in range(3):
                sp = ss.spans.add(
                    trace_id=bytes([r + 1]) * 16, span_id=bytes([r * 16 + s * 4 + i + 1]) * 8, kind=i + s
                )
                sp.name, sp.trace_state = f"{r}{s}{i}", "k=v" if i else ""
                sp.status.code, sp.status.message = i % 3, "boom" if i == 2 else ""
                sp.start_time_unix_nano, sp.end_time_unix_nano = 10 + i, 20 + i
                sp.dropped_attributes_count = i
                if i == 1:
                    ev = sp.events.add(name="ev", time_unix_nano=5)
                    ev.attributes.add(key="score", value=_value(double_value=0.75))
                    sp.events.add(name="bare")
                    ln = sp.links.add(trace_id=bytes(16), span_id=b"\x09" * 8, trace_state="t")
                    ln.attributes.add(key="why", value=_value(string_value="retry"))
                    sp.attributes.add(key="tracerl.rollout_id", value=_value(string_value=f"span-{r}{s}"))
                if i == 2:  # an empty first occurrence counts: the span falls back to its resource or trace
                    sp.attributes.add(key="tracerl.rollout_id", value=_value(string_value=""))
                    sp.attributes.add(key="tracerl.rollout_id", value=_value(string_value="second"))
    fast, slow = _both(req)
    _assert_same(fast, slow)
    rows = {row["name"]: row for row in fast.to_pylist()}
    assert rows["211"]["rollout_id"] == "span-21" and rows["212"]["rollout_id"] == "res"
    assert [e["name"] for e in rows["101"]["events"]] == ["ev", "bare"] and rows["100"]["events"] == []


def test_an_empty_request_gives_an_empty_table():
    fast, slow = _both(ExportTraceServiceRequest())
    assert fast.num_rows == 0
    _assert_same(fast, slow)


def test_dedupe_window_drops_spans_seen_before_and_repeats_within_a_request():
    req = _request({"k": _value(string_value="v")}, n=4)
    window = DedupeWindow()
    table, n = trace_payload_to_table(req.SerializeToString(), AT, window)
    assert (table.num_rows, n) == (4, 4)
    spans = req.resource_spans[0].scope_spans[0].spans
    spans.add().CopyFrom(spans[0])  # the same span twice in one request, then a new one
    spans.add(trace_id=b"\x09" * 16, span_id=b"\x09" * 8, name="new")
    table, n = trace_payload_to_table(req.SerializeToString(), AT, window)
    assert (table["name"].to_pylist(), n) == (["new"], 6)
    fast, slow = _both(req, seen=True)
    _assert_same(fast, slow)
    assert fast.num_rows == 5


@pytest.mark.parametrize(
    "spoil",
    [
        lambda sp: setattr(sp, "kind", 9),
        lambda sp: setattr(sp.status, "code", 7),
        lambda sp: setattr(sp, "start_time_unix_nano", 2**63),
        lambda sp: sp.attributes.add(key="x", value=AnyValue(string_value_strindex=3)),
    ],
    ids=["unknown kind", "unknown status", "time past int64", "string index"],
)
def test_what_the_path_does_not_cover_is_declined_and_leaves_the_window_alone(spoil):
    req = _request({"k": _value(string_value="v")})
    spoil(req.resource_spans[0].scope_spans[0].spans[1])
    window = DedupeWindow()
    assert trace_payload_to_table(req.SerializeToString(), AT, window) is None
    assert len(window) == 0


def test_bytes_that_are_not_a_request_are_declined():
    assert trace_payload_to_table(b"\xff\xff\xff", AT) is None


def test_staged_keys_take_a_whole_request_at_once_and_roll_it_back():
    window = DedupeWindow()
    window.update([("t", "a")])
    staged = StagedKeys(window)
    assert staged.add_new([("t", "b"), ("t", "c")]) is None  # all new: taken in one go
    mark = staged.mark()
    assert staged.add_new([("t", "a"), ("t", "d"), ("t", "d"), ("t", "b")]) == [1]
    staged.roll_back(mark)
    assert ("t", "d") not in staged and ("t", "c") in staged and ("t", "d") not in window
    staged.commit()
    assert (("t", "c") in window, len(window)) == (True, 3)


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 30], ids=["a ptars call per request", "one call"])
def test_several_requests_at_once_give_the_rows_of_each_in_order_with_its_own_receive_time(
    chunk_bytes, monkeypatch
):
    monkeypatch.setattr(otlp_columnar, "_CHUNK_BYTES", chunk_bytes)
    reqs = [_request({"k": _value(int_value=i)}, n=i + 1) for i in range(3)]
    reqs[2].resource_spans[0].resource.attributes.add(
        key="tracerl.rollout_id", value=_value(string_value="r")
    )
    times = [AT, AT + 1_000, AT + 2_000_000]
    window = DedupeWindow()
    table, n = trace_payloads_to_table([r.SerializeToString() for r in reqs], times, window)
    slow_window = DedupeWindow()  # the Python decoder, one request after another, one window
    slow = pa.concat_tables(trace_request_to_table(r, t, slow_window) for r, t in zip(reqs, times))
    _assert_same(table, slow)
    assert (n, table.num_rows) == (6, 3)  # the requests repeat the first spans' ids: later copies dropped
    assert table["rollout_id"].to_pylist()[2] == "r"


def test_chunks_cover_every_request_once_in_order_each_near_the_limit():
    assert otlp_columnar._chunks([3, 3, 3], 5) == [(0, 1), (1, 2), (2, 3)]
    assert otlp_columnar._chunks([1, 2, 2, 9, 1], 5) == [
        (0, 3),
        (3, 4),
        (4, 5),
    ]  # one over the limit goes alone
    assert otlp_columnar._chunks([], 5) == [(0, 0)]


def _random_value(rng: random.Random, depth: int = 0) -> AnyValue:
    pick = rng.randrange(9 if depth < 2 else 6)
    if pick == 0:
        return AnyValue(string_value=rng.choice(["", "stop", 'q"\\', "é\U0001f600", "\x01\n", "x" * 300]))
    if pick == 1:
        return AnyValue(int_value=rng.choice([0, -1, 2**63 - 1, -(2**63), rng.randrange(10**6)]))
    if pick == 2:
        return AnyValue(double_value=rng.choice([0.0, -0.0, 0.1, 1e16, 5e-324, float("nan"), float("inf")]))
    if pick == 3:
        return AnyValue(bool_value=rng.random() < 0.5)
    if pick == 4:
        return AnyValue(bytes_value=rng.randbytes(rng.randrange(4)))
    if pick == 5:
        return AnyValue()
    if pick in (6, 7):
        return AnyValue(
            array_value=ArrayValue(values=[_random_value(rng, depth + 1) for _ in range(rng.randrange(4))])
        )
    kvs = [KeyValue(key=f"k{i}", value=_random_value(rng, depth + 1)) for i in range(rng.randrange(3))]
    return AnyValue(kvlist_value=KeyValueList(values=kvs))


def _random_request(rng: random.Random) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    for _ in range(rng.randrange(1, 3)):
        rs = req.resource_spans.add()
        for i in range(rng.randrange(3)):
            rs.resource.attributes.add(key=f"r{i}", value=_random_value(rng))
        for _ in range(rng.randrange(1, 3)):
            ss = rs.scope_spans.add()
            ss.scope.name, ss.scope.version = rng.choice([("", ""), ("s", "1")])
            for _ in range(rng.randrange(4)):
                sp = ss.spans.add(
                    trace_id=rng.randbytes(16), span_id=rng.randbytes(8), name=rng.choice(["", "a"])
                )
                sp.parent_span_id = rng.choice([b"", rng.randbytes(8)])
                sp.kind, sp.status.code = rng.randrange(6), rng.randrange(3)
                sp.status.message, sp.trace_state = rng.choice(["", "m"]), rng.choice(["", "t=1"])
                for i in range(rng.randrange(5)):
                    sp.attributes.add(
                        key=rng.choice([f"a{i}", "tracerl.rollout_id"]), value=_random_value(rng)
                    )
                for _ in range(rng.randrange(2)):
                    ev = sp.events.add(name="e", time_unix_nano=rng.randrange(2**62))
                    ev.attributes.add(key="v", value=_random_value(rng))
                for _ in range(rng.randrange(2)):
                    ln = sp.links.add(trace_id=rng.randbytes(16), span_id=rng.randbytes(8))
                    ln.attributes.add(key="v", value=_random_value(rng))
    return req


@pytest.mark.parametrize("seed", range(40))
def test_random_requests_convert_to_the_same_rows(seed):
    _assert_same(*_both(_random_request(random.Random(seed)), seen=True))
