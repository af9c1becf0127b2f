"""Poison records: every one is refused at the door (400 / partial_success naming the field) or,
if an older version already acknowledged it, quarantined with its reason; none is lost and none
stops compaction. Good data sent around them is stored exactly once."""

from __future__ import annotations

import json
import random
import signal
import struct
import subprocess

import httpx
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from tracerl_testing import BIN, free_port

from collector_exporter.compactor import Compactor
from collector_exporter.testing import running_collector
from collector_exporter.wal import Kind, WriteAheadLog, sealed_segments
from store.layout import StoreLayout
from store.location import parse_store
from store.views import connect_readonly
from tracerl.commands.status import collect_status

from .helpers import trace_request

U64_MAX = (1 << 64) - 1
PROTOBUF = {"Content-Type": "application/x-protobuf"}


def _spans(req) -> list:
    return [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]


def _keys(req) -> set[tuple[str, str]]:
    return {(s.trace_id.hex(), s.span_id.hex()) for s in _spans(req)}


def _hex_ids(doc: dict) -> dict:
    """OTLP/JSON spells ids in hex, not the protobuf JSON mapping's base64."""
    import base64

    for rs in doc.get("resourceSpans", []):
        for ss in rs["scopeSpans"]:
            for sp in ss["spans"]:
                for k in ("traceId", "spanId", "parentSpanId"):
                    if k in sp:
                        sp[k] = base64.b64decode(sp[k]).hex()
    return doc


def logs_request(n: int, **fields) -> ExportLogsServiceRequest:
    req = ExportLogsServiceRequest()
    sl = req.resource_logs.add().scope_logs.add()
    for i in range(n):
        rec = sl.log_records.add(time_unix_nano=1_700_000_000_000_000_000 + i, severity_text="INFO")
        rec.body.string_value = f"log {i} {random.random()}"
    for k, v in fields.items():
        setattr(sl.log_records[0], k, v)
    return req


def poisoned_traces(setter) -> tuple[object, set]:
    """A request of three good spans and one poisoned by ``setter``; returns it and the good keys."""
    req = trace_request(4)
    bad = _spans(req)[1]
    setter(bad)
    good = _keys(req) - {(bad.trace_id.hex(), bad.span_id.hex())}
    return req, good


SPAN_POISON = {
    "start_time_unix_nano = 2^64-1": lambda s: setattr(s, "start_time_unix_nano", U64_MAX),
    "end_time_unix_nano = 2^63": lambda s: setattr(s, "end_time_unix_nano", 1 << 63),
    "dropped_attributes_count = 2^31": lambda s: setattr(s, "dropped_attributes_count", 1 << 31),
    "dropped_links_count = 2^32-1": lambda s: setattr(s, "dropped_links_count", (1 << 32) - 1),
    "time_unix_nano": lambda s: s.events.add(name="e", time_unix_nano=U64_MAX),
}
LOG_POISON = {
    "time_unix_nano": U64_MAX,
    "observed_time_unix_nano": 1 << 63,
    "flags": 1 << 31,
    "dropped_attributes_count": 1 << 31,
}
REWARD_POISON = [
    {"rollout_id": "r", "value": 1, "response_id": {"a": 1}},
    {"rollout_id": "r", "value": 1, "source": 7},
    {"rollout_id": "r", "value": int("9" * 400)},
    {"rollout_id": ["r"], "value": 1},
    {"rollout_id": "r", "value": 1, "name": None},
    {"rollout_id": "r", "value": 1, "reward_id": 12},
]
BAD_JSON_BODIES = {
    "traces": [
        b'{"resourceSpans": {"a": 1}}',
        b'{"resourceSpans": [1]}',
        b'{"resourceSpans": [{"scopeSpans": "x"}]}',
        b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": 5}]}]}]}',
        b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "\\ud800"}]}]}]}',
        b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"startTimeUnixNano": "18446744073709551616"}]}]}]}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a": ' * 5000 + b"1" + b"}" * 5000,
        b'{"resourceSpans": [], "x": ' + b"9" * 5000 + b"}",
    ],
    "logs": [b'{"resourceLogs": [{"scopeLogs": [{"logRecords": [1]}]}]}', b'{"resourceLogs": "x"}'],
    "rewards": [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"rollout_id": "\\ud800", "value": 1}',
        b'{"rollout_id": "r", "value": ' + b"9" * 5000 + b"}",
    ],
}


def test_every_poison_payload_is_refused_and_the_good_data_around_it_is_stored_once(store):
    good: set[tuple[str, str]] = set()
    good_logs = good_rewards = 0
    with running_collector(store) as c:
        http = httpx.Client(base_url=c.http_endpoint, timeout=30)

        def send_good() -> None:
            nonlocal good_logs, good_rewards
            req = trace_request(3)
            assert (
                http.post("/v1/traces", content=req.SerializeToString(), headers=PROTOBUF).status_code == 200
            )
            good.update(_keys(req))
            assert (
                http.post(
                    "/v1/logs", content=logs_request(2).SerializeToString(), headers=PROTOBUF
                ).status_code
                == 200
            )
            good_logs += 2
            assert (
                http.post("/v1/rewards", json={"rollout_id": f"ok-{good_rewards}", "value": 0.5}).status_code
                == 200
            )
            good_rewards += 1

        for field, setter in SPAN_POISON.items():
            send_good()
            req, keys = poisoned_traces(setter)
            for body, headers in (
                (req.SerializeToString(), PROTOBUF),
                (json.dumps(_hex_ids(json_format.MessageToDict(req))), {"Content-Type": "application/json"}),
            ):
                r = http.post("/v1/traces", content=body, headers=headers)
                assert r.status_code == 200, r.text
                ps = (
                    ExportTraceServiceResponse.FromString(r.content)
                    if headers is PROTOBUF
                    else json_format.Parse(r.text, ExportTraceServiceResponse())
                ).partial_success
                assert ps.rejected_spans == 1 and field.split(" ")[0] in ps.error_message, ps.error_message
            good.update(keys)
        for field, value in LOG_POISON.items():
            send_good()
            r = http.post(
                "/v1/logs", content=logs_request(3, **{field: value}).SerializeToString(), headers=PROTOBUF
            )
            ps = ExportLogsServiceResponse.FromString(r.content).partial_success
            assert r.status_code == 200 and ps.rejected_log_records == 1 and field in ps.error_message, ps
            good_logs += 2
        for reward in REWARD_POISON:
            send_good()
            r = http.post("/v1/rewards", json=[{"rollout_id": "fine", "value": 1.0}, reward])
            assert r.status_code == 400, (reward, r.text)
            assert "reward 1" in r.json()["message"]
        for route, bodies in BAD_JSON_BODIES.items():
            for body in bodies:
                send_good()
                r = http.post(f"/v1/{route}", content=body, headers={"Content-Type": "application/json"})
                assert r.status_code == 400, (route, body[:80], r.status_code, r.text[:300])
        send_good()
        c.flush()
        stats = c.compactor.stats
        assert stats.quarantined == 0 and stats.failures == 0 and stats.last_error is None
    con = connect_readonly(parse_store(store))
    stored = con.execute("SELECT trace_id, span_id, count(*) FROM spans GROUP BY ALL").fetchall()
    assert {(t, s) for t, s, _ in stored} == good and {n for *_, n in stored} == {1}
    assert con.execute("SELECT count(*) FROM logs").fetchone()[0] == good_logs
    assert con.execute("SELECT count(*) FROM rewards").fetchone()[0] == good_rewards
    assert not list((store / "wal").glob("*/seg-*"))


def _raw_wal(store, name: str, records: list[tuple[Kind | int, bytes]]) -> None:
    """Records appended without the receiver's checks, as an older version acknowledged them."""
    wal = WriteAheadLog(StoreLayout.at(store).wal / name)
    for kind, payload in records:
        wal.append(kind, payload)
    wal.close()


def test_records_an_older_version_acknowledged_are_quarantined_with_their_reason_not_lost(store):
    traces, good_spans = poisoned_traces(SPAN_POISON["start_time_unix_nano = 2^64-1"])
    logs = logs_request(3, flags=1 << 31)
    rewards = [
        {"reward_id": "ok", "rollout_id": "r", "value": 1.0},
        {"reward_id": "bad", "rollout_id": "r", "value": 1.0, "response_id": {"a": 1}},
    ]
    _raw_wal(
        store,
        "collector-old",
        [
            (Kind.TRACES, traces.SerializeToString()),
            (Kind.LOGS, logs.SerializeToString()),
            (Kind.REWARDS, json.dumps(rewards).encode()),
            (9, b"from the future"),
            (Kind.TRACES, b"\x0a\x05garbage"),
        ],
    )
    layout = StoreLayout.at(store)
    (segment,) = sealed_segments(layout.wal / "collector-old")
    saved = segment.read_bytes()
    compactor = Compactor(layout)
    assert compactor.run_once() == 1
    assert compactor.stats.quarantined == 5
    status = collect_status(parse_store(store))
    assert status["quarantined"] == {"spans": 2, "logs": 1, "rewards": 1, "unknown": 1}
    assert status["rows"]["spans"] == 3 and status["rows"]["logs"] == 2 and status["rows"]["rewards"] == 1
    assert status["wal"]["segments"] == 0
    lines = [
        json.loads(x) for f in (store / "quarantine").glob("*.jsonl") for x in f.read_text().splitlines()
    ]
    reasons = " | ".join(x["reason"] for x in lines)
    assert "start_time_unix_nano" in reasons and "flags" in reasons and "unknown WAL record kind 9" in reasons
    assert "does not parse" in reasons and "conversion failed" in reasons
    spans_rows = connect_readonly(parse_store(store)).execute("SELECT trace_id, span_id FROM spans").fetchall()
    assert set(spans_rows) == good_spans
    # a replay of the same segment (a crash before its deletion) counts nothing twice
    segment.parent.mkdir(parents=True, exist_ok=True)
    segment.write_bytes(saved)
    Compactor(layout).run_once()
    assert collect_status(parse_store(store))["quarantined"] == {"spans": 2, "logs": 1, "rewards": 1, "unknown": 1}
    assert collect_status(parse_store(store))["rows"]["spans"] == 3


def _hot_offsets(body: bytes, times: list[int], is_json: bool) -> list[int]:
    """Where a flip makes a time overflow the store's int64: the most significant byte of each
    fixed64 (protobuf), or the first digit of each time string (JSON)."""
    out = []
    for t in times:
        needle = str(t).encode() if is_json else struct.pack("<Q", t)
        at = body.find(needle)
        while at >= 0:
            out.append(at if is_json else at + 7)
            at = body.find(needle, at + 1)
    return out


def _mutate(rng: random.Random, body: bytes, hot: list[int]) -> bytes:
    """1-4 byte flips; half the time one of them lands on a hot offset (uniform flips over a
    1 KB body would almost never reach the 8 bytes of a timestamp that matter)."""
    b = bytearray(body)
    for _ in range(rng.randint(1, 4)):
        if hot and rng.random() < 0.5:
            i = rng.choice(hot)
            b[i] = ord("9") if b[i] in b"0123456789" else rng.choice((0x80, 0xFF, b[i] | 0x80))
        else:
            i = rng.randrange(len(b))
            b[i] = rng.choice((b[i] ^ (1 << rng.randrange(8)), rng.randrange(256), 0xFF, 0x00))
    return bytes(b)


def test_byte_flipped_requests_are_refused_or_stored_and_never_stop_compaction(store):
    rng = random.Random(11)
    bases = []
    for i in range(6):
        req = trace_request(4, attrs={"gen_ai.prompt": "x" * 40})
        if i % 2:
            _spans(req)[0].events.add(name="e", time_unix_nano=1_700_000_000_000_000_000 + i)
        times = [t for sp in _spans(req) for t in (sp.start_time_unix_nano, sp.end_time_unix_nano)]
        body = req.SerializeToString()
        bases.append(("/v1/traces", body, PROTOBUF, _hot_offsets(body, times, False)))
        body = json.dumps(_hex_ids(json_format.MessageToDict(req))).encode()
        bases.append(
            ("/v1/traces", body, {"Content-Type": "application/json"}, _hot_offsets(body, times, True))
        )
        logs = logs_request(3)
        body = logs.SerializeToString()
        times = [r.time_unix_nano for r in logs.resource_logs[0].scope_logs[0].log_records]
        bases.append(("/v1/logs", body, PROTOBUF, _hot_offsets(body, times, False)))
        bases.append(
            (
                "/v1/rewards",
                json.dumps([{"rollout_id": f"r{i}", "value": 0.25, "response_id": "resp"}]).encode(),
                {"Content-Type": "application/json"},
                [],
            )
        )
    assert all(hot for route, _, _, hot in bases if route != "/v1/rewards")
    good: set[tuple[str, str]] = set()
    codes: dict[int, int] = {}
    rejected_items = 0
    with running_collector(store) as c:
        http = httpx.Client(base_url=c.http_endpoint, timeout=30)
        for n in range(300):
            route, body, headers, hot = rng.choice(bases)
            r = http.post(route, content=_mutate(rng, body, hot), headers=headers)
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
            assert r.status_code in (200, 400), (route, r.status_code, r.text[:300])
            rejected_items += r.status_code == 200 and b"rejected" in r.content.lower()
            if n % 5 == 0:
                req = trace_request(2)
                assert (
                    http.post("/v1/traces", content=req.SerializeToString(), headers=PROTOBUF).status_code
                    == 200
                )
                good.update(_keys(req))
        c.flush()
        stats = c.compactor.stats
        assert stats.failures == 0 and stats.last_error is None
        assert stats.quarantined == 0, (
            "an acknowledged request failed conversion: the receiver's checks missed it"
        )
    # all three answers were exercised: accepted, refused, accepted with items dropped (partial success)
    assert codes.get(200, 0) > 30 and codes.get(400, 0) > 30 and rejected_items > 5, (codes, rejected_items)
    stored = dict(
        ((t, s), n)
        for t, s, n in connect_readonly(parse_store(store))
        .execute("SELECT trace_id, span_id, count(*) FROM spans GROUP BY ALL")
        .fetchall()
    )
    assert good <= set(stored) and max(stored.values()) == 1
    assert not list((store / "wal").glob("*/seg-*"))


def _collect(store, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            str(BIN / "tracerl"),
            "collect",
            "--store",
            str(store),
            "--grpc",
            "off",
            "--http",
            f"127.0.0.1:{port}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert "OTLP/HTTP" in proc.stdout.readline(), proc.stderr.read()
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("poison", ["span", "reward"])
def test_sigterm_exits_0_after_poison_and_a_restart_leaves_no_backlog(store, poison):
    port = free_port()
    proc = _collect(store, port)
    url = f"http://127.0.0.1:{port}"
    good = trace_request(5)
    assert (
        httpx.post(url + "/v1/traces", content=good.SerializeToString(), headers=PROTOBUF).status_code == 200
    )
    if poison == "span":  # the repro: a valid span, then one with an out-of-range start time, in JSON
        doc = {
            "resourceSpans": [
                {
                    "scopeSpans": [
                        {
                            "spans": [
                                {
                                    "traceId": "ab" * 16,
                                    "spanId": "cd" * 8,
                                    "name": "bad",
                                    "startTimeUnixNano": str(U64_MAX),
                                }
                            ]
                        }
                    ]
                }
            ]
        }
        r = httpx.post(url + "/v1/traces", json=doc)
        assert r.status_code == 200 and r.json()["partialSuccess"]["rejectedSpans"] == "1"
    else:
        r = httpx.post(url + "/v1/rewards", json={"rollout_id": "r", "value": 1, "response_id": {"a": 1}})
        assert r.status_code == 400
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    proc = _collect(store, port)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    status = json.loads(
        subprocess.run(
            [str(BIN / "tracerl"), "status", "--store", str(store), "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert status["rows"]["spans"] == 5 and status["wal"]["segments"] == 0 and status["quarantined"] == {}
