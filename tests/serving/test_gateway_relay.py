"""The gateway's stream relay (serving/gateway/call.py ``Stream``): one write per arrival of events, the last
token's events in the same write as the end of the stream, and the event parse it does per chunk."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
from pathlib import Path

import pytest

from serving.gateway.call import loads
from serving.gateway.proxy import Gateway, GatewayConfig
from serving.gateway.record import StreamAccumulator

from .helpers import wait_for

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gateway.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("tracerl_bench_gateway_relay", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def http_chunks(url: str, body: dict) -> list[bytes]:
    """POST ``body`` over a raw socket and return the response's HTTP chunks as framed on the wire (each
    is one ``http.response.body`` message the gateway sent), without the terminating empty chunk."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
        )
        f = sock.makefile("rb")
        assert f.readline().startswith(b"HTTP/1.1 200")
        while f.readline() != b"\r\n":
            pass
        chunks = []
        while size := int(f.readline().strip(), 16):
            chunks.append(f.read(size))
            assert f.read(2) == b"\r\n"
        return chunks


def test_each_token_is_one_write_and_the_last_goes_out_with_done(bench, spans):
    """The engine stand-in sends a role chunk, then 4 tokens 30 ms apart, then usage and [DONE] at once:
    the client gets the role and the first 3 tokens as they come (one HTTP chunk each), and the last token
    in the same write as [DONE]; the usage chunk it did not ask for, and the ids, are gone."""
    up = bench.streaming_upstream(tokens=4, token_ms=30).start_background()
    gw = Gateway(("127.0.0.1", 0), GatewayConfig(upstreams=[up.url]), spans.provider).start_background()
    try:
        body = {"model": "policy", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        chunks = http_chunks(gw.url, body)
    finally:
        gw.stop()
        up.stop()
    events = [c.split(b"\n\n")[:-1] for c in chunks]
    assert [len(e) for e in events] == [1, 1, 1, 1, 2], chunks
    assert events[-1][-1] == b"data: [DONE]"
    last = json.loads(events[-1][0].removeprefix(b"data: "))
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["delta"]["content"] == "t3 "
    text = b"".join(chunks)
    assert b"token_ids" not in text and b"usage" not in text and b'"logprobs":null' in text
    (span,) = wait_for(lambda: spans.get_finished_spans())
    assert json.loads(span.attributes["tracerl.response_token_ids"]) == [100, 101, 102, 103]
    assert span.attributes["gen_ai.usage.output_tokens"] == 4


def test_the_last_token_waits_for_done_when_the_engine_sends_it_apart(spans):
    """An engine that sends the finishing chunk, then (50 ms later) usage and [DONE]: the client gets the
    finishing chunk in the same write as [DONE], not in a write of its own."""
    from httpshell import ServerOptions
    from serving.asgi import ShellServer, dumps

    def event(obj: dict) -> dict:
        return {"type": "http.response.body", "body": b"data: " + dumps(obj) + b"\n\n", "more_body": True}

    class Upstream(ShellServer):
        async def __call__(self, scope, receive, send) -> None:
            if scope["method"] != "POST":
                await send({"type": "http.response.start", "status": 404, "headers": []})
                await send({"type": "http.response.body", "body": b"{}"})
                return
            while (await receive()).get("more_body"):
                pass
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for i, reason in enumerate([None, None, "stop"]):
                await asyncio.sleep(0.03)
                ch = {"index": 0, "delta": {"content": f"w{i}"}, "token_ids": [i], "finish_reason": reason}
                await send(event({"id": "c1", "model": "policy", "choices": [ch]}))
            await asyncio.sleep(0.05)
            await send(
                event({"id": "c1", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 3}})
            )
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    up = Upstream(ServerOptions(name="apart-upstream")).start_background()
    gw = Gateway(("127.0.0.1", 0), GatewayConfig(upstreams=[up.url]), spans.provider).start_background()
    try:
        chunks = http_chunks(gw.url, {"model": "policy", "stream": True, "messages": []})
    finally:
        gw.stop()
        up.stop()
    assert [c.count(b"data: ") for c in chunks] == [1, 1, 2], chunks
    assert b'"finish_reason":"stop"' in chunks[-1] and chunks[-1].endswith(b"data: [DONE]\n\n")
    (span,) = wait_for(lambda: spans.get_finished_spans())
    assert json.loads(span.attributes["tracerl.response_token_ids"]) == [0, 1, 2]


@pytest.mark.parametrize(
    "text",
    ['{"a":[1,2.5,"é"],"b":null}', "[1]", '"s"', "7", ' {"a":1}', '{"a":1} ', '{"a":1}\n'],
)
def test_loads_gives_what_json_loads_gives(text):
    assert loads(text) == json.loads(text)


@pytest.mark.parametrize("text", ["", "{", '{"a":1}{"b":2}', '{"a":1} x', "nope"])
def test_loads_refuses_what_json_loads_refuses_with_the_same_error(text):
    with pytest.raises(json.JSONDecodeError) as want:
        json.loads(text)
    with pytest.raises(json.JSONDecodeError) as got:
        loads(text)
    assert str(got.value) == str(want.value)


def test_streamed_text_is_joined_per_choice_once_and_finish_can_be_asked_again():
    acc = StreamAccumulator({"model": "m", "n": 2, "messages": []}, "chat")
    pieces = [(0, "Hel"), (1, "Bon"), (0, None), (0, "lo"), (1, "jour"), (0, "")]
    for i, text in pieces:
        acc.add({"id": "x", "choices": [{"index": i, "delta": {"content": text}, "token_ids": [i]}]})
    acc.add(
        {"choices": [{"index": 1, "delta": {}, "finish_reason": "stop"}], "usage": {"completion_tokens": 6}}
    )
    rec = acc.finish()
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in rec.choices] == [
        (0, "Hello", [0, 0, 0, 0], None),
        (1, "Bonjour", [1, 1], "stop"),
    ]
    assert acc.finish().choices[1].text == "Bonjour" and rec.output_tokens == 6 and rec.response_id == "x"
