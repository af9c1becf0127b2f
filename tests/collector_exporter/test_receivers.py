"""Every bad input gets the OTLP-specified answer, and the collector keeps serving."""

from __future__ import annotations

import gzip
import json
import socket

import grpc
import httpx
import pytest
from google.protobuf import json_format
from google.rpc.error_details_pb2 import RetryInfo
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from collector_exporter.testing import running_collector
from store.location import parse_store
from store.views import connect_readonly

from .helpers import trace_request

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def grpc_export(endpoint: str, body: bytes, metadata=()) -> ExportTraceServiceResponse:
    with grpc.insecure_channel(endpoint.removeprefix("http://"),
                               options=[("grpc.max_send_message_length", 128 << 20)]) as ch:
        call = ch.unary_unary(EXPORT, request_serializer=None, response_deserializer=ExportTraceServiceResponse.FromString)
        return call(body, metadata=metadata, timeout=10)


def stored(store) -> int:
    return connect_readonly(parse_store(store)).execute("SELECT count(*) FROM spans").fetchone()[0]


@pytest.fixture
def collector(store):
    with running_collector(store) as c:
        yield c


def test_grpc_malformed_protobuf_is_invalid_argument_and_server_keeps_serving(collector, store):
    with pytest.raises(grpc.RpcError) as e:
        grpc_export(collector.grpc_endpoint, b"\xff\xff\xff not protobuf")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid protobuf ExportTraceServiceRequest" in e.value.details()
    grpc_export(collector.grpc_endpoint, trace_request(3).SerializeToString())
    collector.flush()
    assert stored(store) == 3


def test_grpc_bad_ids_give_partial_success_and_keep_the_good_spans(collector, store):
    req = trace_request(4)
    spans = req.resource_spans[0].scope_spans[0].spans
    spans[0].span_id = b"\x00" * 8
    spans[1].trace_id = b"\x01\x02"
    resp = grpc_export(collector.grpc_endpoint, req.SerializeToString())
    assert resp.partial_success.rejected_spans == 2
    assert "span_id must be 8 non-zero bytes" in resp.partial_success.error_message
    collector.flush()
    assert stored(store) == 2


def test_grpc_oversize_request_is_refused_by_the_64_mib_limit(collector):
    req = trace_request(1, attrs={"blob": "x" * (65 << 20)})
    with pytest.raises(grpc.RpcError) as e:
        grpc_export(collector.grpc_endpoint, req.SerializeToString())
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    grpc_export(collector.grpc_endpoint, trace_request(1).SerializeToString())


def test_token_is_required_on_both_protocols(store):
    with running_collector(store, token="s3cret") as c:
        body = trace_request(2).SerializeToString()
        with pytest.raises(grpc.RpcError) as e:
            grpc_export(c.grpc_endpoint, body)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            grpc_export(c.grpc_endpoint, body, metadata=(("authorization", "Bearer wrong"),))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        grpc_export(c.grpc_endpoint, body, metadata=(("authorization", "Bearer s3cret"),))
        r = httpx.post(c.http_endpoint + "/v1/traces", content=body, headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 401
        assert "Bearer" in Status.FromString(r.content).message
        r = httpx.post(c.http_endpoint + "/v1/traces", content=body,
                       headers={"Content-Type": "application/x-protobuf", "Authorization": "Bearer s3cret"})
        assert r.status_code == 200


def test_http_errors_carry_a_status_body_in_the_request_content_type(collector, store):
    url = collector.http_endpoint
    r = httpx.post(url + "/v1/traces", content=b"\x0a\xff\xff", headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 400 and r.headers["content-type"] == "application/x-protobuf"
    assert "not a valid protobuf" in Status.FromString(r.content).message
    r = httpx.post(url + "/v1/traces", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["message"]
    r = httpx.post(url + "/v1/traces", content=b"x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and "application/x-protobuf or application/json" in r.json()["message"]
    r = httpx.post(url + "/v1/nope", content=b"x", headers={"Content-Type": "application/json"})
    assert r.status_code == 404
    bomb = gzip.compress(b"\0" * (65 << 20))
    r = httpx.post(url + "/v1/traces", content=bomb,
                   headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"})
    assert r.status_code == 413
    ok = httpx.post(url + "/v1/traces", content=gzip.compress(trace_request(5).SerializeToString()),
                    headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "gzip"})
    assert ok.status_code == 200 and not ExportTraceServiceResponse.FromString(ok.content).HasField("partial_success")
    collector.flush()
    assert stored(store) == 5


def test_http_oversize_body_is_refused_before_it_is_read(collector):
    host, port = collector.http_endpoint.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                  b"Content-Length: 100000000\r\n\r\npartial")
        head = s.recv(4096).decode(errors="replace")
    assert head.startswith("HTTP/1.1 413")


def test_otlp_json_with_hex_ids_is_stored_with_the_same_ids(collector, store):
    req = trace_request(2)
    doc = json_format.MessageToDict(req)
    for sp in doc["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        for k in ("traceId", "spanId"):
            sp[k] = __import__("base64").b64decode(sp[k]).hex()  # OTLP/JSON spells ids in hex
    r = httpx.post(collector.http_endpoint + "/v1/traces", content=json.dumps(doc), headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    collector.flush()
    want = {(s.trace_id.hex(), s.span_id.hex()) for s in req.resource_spans[0].scope_spans[0].spans}
    got = set(connect_readonly(parse_store(store)).execute("SELECT trace_id, span_id FROM spans").fetchall())
    assert got == want


def test_overload_is_retryable_on_both_protocols(store):
    with running_collector(store, min_free_disk_bytes=1 << 60) as c:  # no disk is that large
        with pytest.raises(grpc.RpcError) as e:
            grpc_export(c.grpc_endpoint, trace_request(1).SerializeToString())
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        trailer = dict(e.value.trailing_metadata())["google.rpc.retryinfo-bin"]
        assert RetryInfo.FromString(trailer).retry_delay.seconds >= 1
        r = httpx.post(c.http_endpoint + "/v1/traces", content=trace_request(1).SerializeToString(),
                       headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert "free on the store's disk" in Status.FromString(r.content).message


def test_rewards_side_channel_validates_and_stores_idempotently(collector, store):
    url = collector.http_endpoint + "/v1/rewards"
    body = [{"rollout_id": "r-1", "value": 1.0}, {"trace_id": "ab" * 16, "value": -0.5, "name": "judge"}]
    first = httpx.post(url, json=body)
    assert first.status_code == 200 and first.json()["accepted"] == 2
    assert httpx.post(url, json=body).json()["reward_ids"] == first.json()["reward_ids"]  # a retry
    bad = httpx.post(url, json={"value": 1.0})
    assert bad.status_code == 400 and "rollout_id" in bad.json()["message"]
    assert httpx.post(url, json={"rollout_id": "r", "value": "high"}).status_code == 400
    assert httpx.post(url, content=b"x", headers={"Content-Type": "text/plain"}).status_code == 415
    collector.flush()
    rows = connect_readonly(parse_store(store)).execute("SELECT rollout_id, trace_id, name, value FROM rewards ORDER BY value").fetchall()
    assert rows == [(None, "ab" * 16, "judge", -0.5), ("r-1", None, "reward", 1.0)]
