"""Server-sent events on the gateway's hot path: the upstream's bytes split into event payloads, and each
cleaned chunk framed for the client.

Every token of every stream passes through here twice, so both work on whole network reads in bytes:
``sse_payloads`` splits a read at blank lines and takes the one-line ``data: {...}`` events engines send
without a per-line decode (about a third of the gateway's relay CPU went to reading events line by line
as text), and ``sse_event`` encodes with the prebuilt C encoder of ``schemas.compact_json`` (the text
``json.dumps(..., ensure_ascii=False, separators=(",", ":"))`` gives, without building an encoder per
chunk). The reading is SSEData's (``serving/protocol.py``): an event ends at a blank line, its ``data:``
lines are joined with newlines (leading spaces after the colon dropped), other fields and comments are
ignored, and CRLF or CR line ends are read as LF.
"""

from __future__ import annotations

from typing import Any

from schemas.compact_json import compact_json


def sse_payloads(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The ``data`` payloads of the complete events in ``buffer``, and the incomplete rest, which the
    caller keeps and puts before the next read."""
    if (
        buffer.startswith(b"data:")
        and buffer.find(b"\n") == len(buffer) - 2
        and buffer.endswith(b"\n\n")
        and b"\r" not in buffer
    ):  # one engine event, the whole read (most reads under load): no split
        return [buffer[5:-2].lstrip(b" ")], b""
    if b"\r" in buffer:
        # a CR that ends the read may be the first half of a CRLF: left for the next read to decide
        keep = buffer.endswith(b"\r")
        head = buffer[:-1] if keep else buffer
        buffer = head.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + (b"\r" if keep else b"")
    *events, rest = buffer.split(b"\n\n")
    payloads = []
    for event in events:
        if event.startswith(b"data:") and b"\n" not in event:  # the engines' one-line event
            payloads.append(event[5:].lstrip(b" "))
            continue
        data = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if data:
            payloads.append(b"\n".join(data))
    return payloads, rest


def sse_event(obj: Any) -> bytes:
    """One event as the OpenAI API frames it: ``data: <compact json>\\n\\n``."""
    return b"data: " + compact_json(obj).encode() + b"\n\n"
