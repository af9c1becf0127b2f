"""The gateway's event reading and framing on whole network reads (serving/gateway/sse.py)."""

from __future__ import annotations

import json

import pytest

from serving.gateway.sse import sse_event, sse_payloads
from serving.protocol import iter_sse_data

STREAMS = {
    "engine": 'data: {"a":1}\n\ndata: {"b":"x y"}\n\ndata: [DONE]\n\n',
    "crlf": 'data: {"a":1}\r\n\r\ndata:{"b":2}\r\n\r\ndata: [DONE]\r\n\r\n',
    "multi-line, comment, other fields": (
        ': keep-alive\n\nevent: delta\ndata: {"a":\ndata:  1}\nid: 7\n\n\n\ndata: [DONE]\n\n'
    ),
    "no blank line at the end": 'data: {"a":1}\n\ndata: {"b"',
    "one event": 'data:  {"a":1}\n\n',
}


def read_in_pieces(text: str, cuts: list[int]) -> list[str]:
    """What the gateway takes from a stream that arrives in reads ending at ``cuts``."""
    raw, rest, got, start = text.encode(), b"", [], 0
    for end in [*cuts, len(raw)]:
        payloads, rest = sse_payloads(rest + raw[start:end])
        got += [p.decode() for p in payloads]
        start = end
    return got


@pytest.mark.parametrize("name", list(STREAMS))
def test_every_way_a_stream_is_cut_into_reads_gives_the_events_a_line_reader_gives(name):
    text = STREAMS[name]
    lf = text.replace("\r\n", "\n")
    expected = list(iter_sse_data(lf.split("\n")[:-1]))  # an unterminated last line is not an event yet
    if not lf.endswith("\n\n"):
        expected = expected[: lf.count("\n\n")]
    assert expected, "the stream must hold events"
    n = len(text.encode())
    for cut in range(n + 1):  # one cut anywhere, then two
        assert read_in_pieces(text, [cut]) == expected, (name, cut)
    for first in range(0, n, 3):
        for second in range(first, n, 5):
            assert read_in_pieces(text, [first, second]) == expected, (name, first, second)


def test_a_lone_cr_ends_a_line_and_a_cr_at_the_end_of_a_read_waits_for_the_next():
    assert sse_payloads(b'data: {"a":1}\r\rdata: 2\r\n\r\n')[0] == [b'{"a":1}', b"2"]
    assert sse_payloads(b"data: x\rdata: y\n\n") == ([b"x\ny"], b"")  # one read, one event: two lines
    payloads, rest = sse_payloads(b'data: {"a":1}\r\n\r')
    assert payloads == [] and rest.endswith(b"\r")
    assert sse_payloads(rest + b"\ndata: 2\r\n\r\n")[0] == [b'{"a":1}', b"2"]


def test_an_event_is_framed_as_the_openai_api_frames_it():
    obj = {"choices": [{"delta": {"content": 'é "q"\n'}, "index": 0}], "n": 1.5, "x": None}
    out = sse_event(obj)
    assert out.startswith(b"data: ") and out.endswith(b"\n\n")
    assert out[6:-2].decode() == json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
