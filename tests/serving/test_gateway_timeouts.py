"""The gateway's read timeout (``--timeout-s``) on streamed answers: a quiet upstream ends the stream with a
504 event and a ``ReadTimeout`` span; the bound is on each wait for the upstream, never on the whole stream
(one timer keeps it for every stream: serving/gateway/upstream.py ``ReadDeadlines``)."""

from __future__ import annotations

import json
import time

import openai
import pytest

from .helpers import scripted_upstream
from .test_gateway import MSGS, client_for, gateway, one_span


def stalling_stream(pauses: list[float]):
    """An upstream streaming one chunk after each pause (seconds), then ``[DONE]``."""

    def handle(h, body):
        h.start_stream()
        for i, pause in enumerate(pauses):
            time.sleep(pause)
            last = i == len(pauses) - 1
            chunk = {
                "id": "chatcmpl-s",
                "object": "chat.completion.chunk",
                "model": "policy",
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": f"w{i}"},
                        "token_ids": [i],
                        "finish_reason": "stop" if last else None,
                    }
                ],
            }
            h.write_chunk(f"data: {json.dumps(chunk)}\n\n".encode())
        h.write_chunk(b"data: [DONE]\n\n")
        h.end_stream()

    return scripted_upstream(handle)


def test_a_stream_whose_upstream_goes_quiet_past_the_timeout_ends_with_a_504_event(spans):
    up = stalling_stream([0.0, 1.5, 0.0])
    try:
        with gateway(spans, up.url, timeout_s=0.3) as gw:
            t = time.monotonic()
            stream = client_for(gw).chat.completions.create(model="policy", messages=MSGS, stream=True)
            with pytest.raises(openai.APIError, match="did not answer within"):
                list(stream)
            assert time.monotonic() - t < 1.2, "timed out by the gateway, not by the upstream's end"
    finally:
        up.stop()
    span = one_span(spans)
    assert span.attributes["error.type"] == "ReadTimeout"
    assert json.loads(span.attributes["tracerl.response_token_ids"]) == [0]


def test_the_read_timeout_bounds_each_wait_not_the_whole_stream(spans):
    up = stalling_stream([0.1] * 8)  # 0.8 s in all, never 0.6 s without a chunk (room for a loaded machine)
    try:
        with gateway(spans, up.url, timeout_s=0.6) as gw:
            stream = client_for(gw).chat.completions.create(model="policy", messages=MSGS, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    finally:
        up.stop()
    assert text == "w0w1w2w3w4w5w6w7"
    span = one_span(spans)
    assert "error.type" not in span.attributes
    assert json.loads(span.attributes["tracerl.response_token_ids"]) == list(range(8))
