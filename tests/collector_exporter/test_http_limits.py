"""OTLP/HTTP receiver under hostile or odd clients: chunked bodies, the token before the body,
bad Content-Length, slow heads and bodies, the connection cap, and fsyncs shared by concurrent
requests. Each is a failure the stdlib server had (issue 12)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from collector_exporter.http_server import start_http
from collector_exporter.receive import Ingest
from collector_exporter.testing import running_collector
from collector_exporter.wal import WriteAheadLog
from httpshell import RunningServer
from store.layout import StoreLayout
from store.location import parse_store
from store.views import connect_readonly

from .helpers import trace_request

PROTOBUF = {"Content-Type": "application/x-protobuf"}
TOKEN = "t0k"
AUTH = f"Authorization: Bearer {TOKEN}\r\n".encode()


@contextmanager
def receiver(store, **limits) -> Iterator[RunningServer]:
    """The OTLP/HTTP receiver alone (with a token), on a real WAL, with test-sized limits."""
    wal = WriteAheadLog(StoreLayout.at(store).wal / "test")
    server = start_http(Ingest(wal), "127.0.0.1", 0, token=TOKEN, **limits)
    try:
        yield server
    finally:
        server.stop()
        wal.close()


def head(path: str = "/v1/traces", extra: bytes = b"") -> bytes:
    return b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n" + extra


def read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or 30 s pass)."""
    s.settimeout(30)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def wait_until(cond, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def stored(store) -> int:
    return connect_readonly(parse_store(store)).execute("SELECT count(*) FROM spans").fetchone()[0]


def test_chunked_bodies_are_accepted_protobuf_and_json(store):
    body = trace_request(4).SerializeToString()

    def chunks(data: bytes):  # an iterator body: httpx sends it with Transfer-Encoding: chunked
        yield from (data[i:i + 100] for i in range(0, len(data), 100))

    with running_collector(store) as c:
        r = httpx.post(c.http_endpoint + "/v1/traces", content=chunks(body), headers=PROTOBUF)
        assert r.status_code == 200 and r.request.headers.get("transfer-encoding") == "chunked"
        assert not ExportTraceServiceResponse.FromString(r.content).HasField("partial_success")
        r = httpx.post(c.http_endpoint + "/v1/metrics", content=chunks(b"{}"), headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and r.json() == {}
        c.flush()
    assert stored(store) == 4


def test_lower_case_bearer_scheme_is_accepted_on_both_protocols(store):
    body = trace_request(1).SerializeToString()
    with running_collector(store, token=TOKEN) as c:
        r = httpx.post(c.http_endpoint + "/v1/traces", content=body, headers={**PROTOBUF, "Authorization": f"bearer {TOKEN}"})
        assert r.status_code == 200
        with grpc.insecure_channel(c.grpc_endpoint.removeprefix("http://")) as ch:
            export = ch.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
            export(trace_request(1).SerializeToString(), metadata=(("authorization", f"BEARER {TOKEN}"),), timeout=30)
        r = httpx.post(c.http_endpoint + "/v1/traces", content=body, headers={**PROTOBUF, "Authorization": "Basic dDBr"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        c.flush()
    assert stored(store) == 2


def test_token_is_checked_before_the_body_is_read(store):
    with receiver(store) as server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(head(extra=b"Content-Length: 1000000\r\n\r\n"))  # no token, and the body never comes
        answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b"Bearer" in answer and b"connection: close" in answer.lower()


def rss_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("length", [b"-1", b"abc", b"1e3"])
def test_bad_content_length_is_400_and_the_body_is_never_read(store, length):
    with receiver(store) as server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(30)
        s.sendall(head(extra=b"Content-Length: " + length + b"\r\n\r\n"))
        assert s.recv(4096).startswith(b"HTTP/1.1 400")
        before, pushed, chunk = rss_bytes(), 0, b"x" * (1 << 20)
        with pytest.raises(OSError):  # the server closed the connection instead of reading
            while pushed < 256 << 20:
                s.sendall(chunk)
                pushed += len(chunk)
        grown = rss_bytes() - before
    assert pushed < 64 << 20 and grown < 64 << 20, (pushed, grown)


def test_an_oversized_request_head_is_refused(store):
    with receiver(store, max_header_bytes=4096) as server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(head(extra=AUTH + b"X-Padding: " + b"p" * 8192 + b"\r\nContent-Length: 0\r\n\r\n"))
        assert read_all(s).startswith(b"HTTP/1.1 400")


def test_slow_heads_and_bodies_time_out(store):
    with receiver(store, header_timeout_s=1, body_timeout_s=1) as server:
        addr = ("127.0.0.1", server.port)
        with socket.create_connection(addr) as s:  # a body that stops after 10 of 100 bytes
            s.sendall(head(extra=AUTH + b"Content-Length: 100\r\n\r\n" + b"x" * 10))
            answer = read_all(s)
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer
        with socket.create_connection(addr) as s:  # a chunked body that never ends
            s.sendall(head(extra=AUTH + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"))
            assert read_all(s).startswith(b"HTTP/1.1 408")
        with socket.create_connection(addr) as s:  # a head that never ends
            s.sendall(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\n")
            assert read_all(s).startswith(b"HTTP/1.1 408")
        with socket.create_connection(addr) as s:  # a connection that never sends anything
            assert read_all(s) == b""
        wait_until(lambda: server.connections == 0)


def test_clients_that_leave_or_stall_mid_body_log_no_error(store, caplog):
    with receiver(store, body_timeout_s=1) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as s:  # leaves mid-body
            s.sendall(head(extra=AUTH + b"Content-Length: 1000\r\n\r\n" + b"x" * 10))
        with socket.create_connection(("127.0.0.1", server.port)) as s:  # stalls until the 408
            s.sendall(head(extra=AUTH + b"Content-Length: 1000\r\n\r\n" + b"x" * 10))
            assert read_all(s).startswith(b"HTTP/1.1 408")
        wait_until(lambda: server.connections == 0)
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text


def test_connections_beyond_the_cap_are_refused_with_503(store):
    with receiver(store, max_connections=3, header_timeout_s=60) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
        try:
            wait_until(lambda: server.connections == 3)
            with socket.create_connection(("127.0.0.1", server.port)) as extra:
                answer = read_all(extra)
            assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer
            idle.pop().close()
            wait_until(lambda: server.connections == 2)
            r = httpx.post(server.url + "/v1/traces", content=trace_request(1).SerializeToString(),
                           headers={**PROTOBUF, "Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200
        finally:
            for s in idle:
                s.close()


def test_concurrent_requests_share_one_fsync(store, monkeypatch):
    """The WAL append blocks until its group's fdatasync; requests run it off the event loop, so
    while one fsync is held, the other requests reach the WAL and all share the next one."""
    n = 8
    real_fdatasync = os.fdatasync
    fsyncs = []
    arrived = threading.Semaphore(0)

    def counting_fdatasync(fd: int) -> None:
        if threading.current_thread().name == "tracerl-wal":
            if not fsyncs:  # hold the first fsync until every request is waiting in the WAL
                for _ in range(n):
                    assert arrived.acquire(timeout=60), "requests did not reach the WAL concurrently"
            fsyncs.append(fd)
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", counting_fdatasync)
    with running_collector(store, grpc=None) as c:
        real_append = c.wal.append

        def append(*args, **kw):
            arrived.release()
            return real_append(*args, **kw)

        monkeypatch.setattr(c.wal, "append", append)
        bodies = [trace_request(3).SerializeToString() for _ in range(n)]
        with ThreadPoolExecutor(n) as pool:
            codes = list(pool.map(lambda b: httpx.post(c.http_endpoint + "/v1/traces", content=b, headers=PROTOBUF,
                                                       timeout=120).status_code, bodies))
        assert codes == [200] * n
        assert len(fsyncs) <= 2, f"{n} concurrent requests took {len(fsyncs)} fsyncs"
        c.flush()
    assert stored(store) == 3 * n
