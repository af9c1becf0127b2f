"""The gateway on the async stack: many concurrent streams, clients that leave, auth before the body."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
from opentelemetry.trace import StatusCode
from tracerl_testing import free_port, start_tracerl, stop_tracerl

from collector_exporter.testing import running_collector
from serving.gateway.proxy import Gateway, GatewayConfig
from store.location import parse_store
from store.views import connect_readonly

from .helpers import wait_for

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gateway.py"
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("tracerl_bench_gateway_async", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def streaming_upstream(bench):
    """An upstream that streams 10 chunks 20 ms apart (the bench's scripted engine, on httpshell)."""
    up = bench.streaming_upstream(tokens=10, token_ms=20).start_background()
    yield up
    up.stop()


def test_hundreds_of_concurrent_streams_complete_on_a_few_threads(spans, bench, streaming_upstream):
    gw = Gateway(("127.0.0.1", 0), GatewayConfig(upstreams=[streaming_upstream.url]), spans.provider)
    gw.start_background()
    threads: list[int] = []

    async def sample_threads() -> None:
        while True:
            threads.append(threading.active_count())
            await asyncio.sleep(0.05)

    async def one(host: str, port: int, request: bytes) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            await bench.stream_call(reader, writer, request)
        finally:
            writer.close()

    async def load() -> list:
        sampler = asyncio.ensure_future(sample_threads())
        try:
            return await asyncio.gather(
                *(one(*bench.stream_request(gw.url)) for _ in range(300)), return_exceptions=True
            )
        finally:
            sampler.cancel()

    try:
        results = asyncio.run(load())
    finally:
        gw.stop()
    assert [r for r in results if r is not None] == []
    got = wait_for(lambda: len(spans.get_finished_spans()) >= 300 and spans.get_finished_spans())
    assert all(len(json.loads(s.attributes["tracerl.response_token_ids"])) == 10 for s in got)
    assert max(threads) < 40, f"a thread per connection would be 300+, got {max(threads)}"


@pytest.mark.slow
def test_a_client_leaving_mid_stream_ends_the_upstream_call_and_marks_the_span(spans, embedded):
    gw = Gateway(("127.0.0.1", 0), GatewayConfig(upstreams=[embedded.url]), spans.provider).start_background()
    try:
        body = httpx.Request(
            "POST",
            gw.url + "/v1/chat/completions",
            # ignore_eos (vLLM's, which the embedded engine follows): the random model must not end the
            # stream on its own before the client leaves (it sampled EOS after 6 tokens in 1 run of 3)
            json={"model": "policy", "messages": MSGS, "max_tokens": 400, "stream": True, "ignore_eos": True},
        ).read()
        with socket.create_connection(gw.server_address) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            assert s.recv(64).startswith(b"HTTP/1.1 200")
        span = wait_for(lambda: spans.get_finished_spans() and spans.get_finished_spans()[0], timeout=60)
        assert span.attributes["error.type"] == "client_disconnected"
        assert span.status.status_code == StatusCode.ERROR
        assert 0 < len(json.loads(span.attributes.get("tracerl.response_token_ids", "[]"))) < 400, (
            "the upstream call was cut short"
        )
        ok = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model="policy", messages=MSGS, max_tokens=2
        )
        assert ok.choices[0].finish_reason == "length"
    finally:
        gw.stop()


def test_the_gateway_token_is_checked_before_the_body_is_read(spans, streaming_upstream):
    gw = Gateway(
        ("127.0.0.1", 0), GatewayConfig(upstreams=[streaming_upstream.url], token="gw"), spans.provider
    )
    gw.start_background()
    try:
        with socket.create_connection(gw.server_address, timeout=30) as s:  # 1 MiB announced, none sent
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1048576\r\n\r\n"
            )
            head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 401"), head[:200]
        r = httpx.get(gw.url + "/health", headers={"Authorization": "bearer gw"})  # RFC 7235: any case
        assert r.status_code == 200
    finally:
        gw.stop()


@pytest.mark.slow
def test_the_sweep_runs_every_level_without_errors(bench, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gateway.py"])
    args = bench.argparse.Namespace(tokens=3, token_ms=5.0, seconds=0.3, gateway_root="", workers=1)
    rows = bench.sweep([1, 16], args)
    for r in rows:
        assert r["direct"].errors == [] and r["gateway"].errors == []
        assert r["direct"].calls > 0 and r["gateway"].calls > 0
    for r in rows:  # and interleaved with direct calls: the same calls as each path's phase, at once
        direct, via = r["ab_direct"]
        assert direct.errors == [] and via.errors == [] and direct.latencies and via.latencies
    assert int(rows[0]["spans"]["gateway"]) == sum(r["gateway"].calls + r["ab_direct"][1].calls for r in rows)


def listening_sockets(port: int) -> int:
    """How many sockets listen on 127.0.0.1:``port`` (/proc/net/tcp: local address, state 0A = LISTEN)."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return sum(1 for r in rows if r[1] == f"0100007F:{port:04X}" and r[3] == "0A")


@pytest.mark.slow
def test_workers_serve_one_port_and_each_exports_its_spans(streaming_upstream, store):
    """``tracerl gateway --workers 2``: two processes listen on the port (SO_REUSEPORT), calls on
    fresh connections are spread over both, each records its calls' spans, and both exit on SIGTERM."""
    port = free_port()
    with running_collector(store) as collector:
        gw = start_tracerl(
            "gateway",
            "--workers",
            "2",
            "--listen",
            f"127.0.0.1:{port}",
            "--upstream",
            streaming_upstream.url,
            "--otlp",
            collector.grpc_endpoint,
            health=f"http://127.0.0.1:{port}/health",
        )
        try:
            children = [int(p) for p in Path(f"/proc/{gw.pid}/task/{gw.pid}/children").read_text().split()]
            assert len(children) == 1
            wait_for(lambda: listening_sockets(port) == 2)
            for _ in range(24):  # a new connection each: the kernel picks a process per connection
                with openai.OpenAI(
                    base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0
                ) as client:
                    stream = client.chat.completions.create(model="policy", messages=MSGS, stream=True)
                    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        finally:
            stop_tracerl(gw)
        assert not Path(f"/proc/{children[0]}").exists()  # stopped and reaped with the parent
        collector.flush()
    con = connect_readonly(parse_store(store))
    pids = con.execute(
        "SELECT resource_attributes['process.pid'], count(*) FROM spans "
        "WHERE name LIKE 'tracerl.gateway%' GROUP BY 1"
    ).fetchall()
    assert sum(n for _, n in pids) == 24
    assert {int(p) for p, _ in pids} == {gw.pid, children[0]}


def test_streamed_calls_end_with_done_and_reuse_one_upstream_connection(spans):
    """The relayed stream ends as soon as ``[DONE]`` arrives (with the end of the response), and the
    upstream's answer is still read to its end, so every call goes out on the same kept-alive connection."""
    from httpshell import ServerOptions
    from serving.asgi import ShellServer, dumps

    ports: list[int] = []

    class Upstream(ShellServer):
        async def __call__(self, scope, receive, send) -> None:
            if scope["method"] != "POST":  # no models list, no weight version: the call goes as asked
                await send({"type": "http.response.start", "status": 404, "headers": []})
                await send({"type": "http.response.body", "body": b"{}"})
                return
            ports.append(scope["client"][1])
            while (await receive()).get("more_body"):
                pass
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            for i, reason in enumerate([None, None, "stop"]):
                chunk = {
                    "id": "c1",
                    "object": "chat.completion.chunk",
                    "model": "policy",
                    "choices": [
                        {"index": 0, "delta": {"content": f"w{i}"}, "token_ids": [i], "finish_reason": reason}
                    ],
                }
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"data: " + dumps(chunk) + b"\n\n",
                        "more_body": True,
                    }
                )
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
            await asyncio.sleep(0.05)  # the end of the answer comes apart from [DONE]: it must be waited for
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    up = Upstream(ServerOptions(name="reuse-upstream")).start_background()
    gw = Gateway(("127.0.0.1", 0), GatewayConfig(upstreams=[up.url]), spans.provider).start_background()
    try:
        with httpx.Client(timeout=30) as client:
            for _ in range(5):
                body = {"model": "policy", "messages": MSGS, "stream": True}
                r = client.post(gw.url + "/v1/chat/completions", json=body)
                assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n"), r.text[-200:]
                assert r.text.count("data: ") == 4 and "token_ids" not in r.text
    finally:
        gw.stop()
        up.stop()
    assert len(ports) == 5 and len(set(ports)) == 1, ports
    got = wait_for(lambda: len(spans.get_finished_spans()) == 5 and spans.get_finished_spans())
    assert all(json.loads(s.attributes["tracerl.response_token_ids"]) == [0, 1, 2] for s in got)
