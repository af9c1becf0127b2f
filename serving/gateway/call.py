"""One proxied call: its span (opened by the gateway), the upstream's answer relayed to the client whole or
streamed, and the record of exact ids, logprobs and version written onto the span as the call ends.

Split from ``proxy.py``, which routes and forwards; this module holds what happens to one call after it
was sent. ``Gateway`` is only a type here (its version watch, tracer and counters are read through it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

import aiohttp
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode
from starlette.responses import Response

from schemas.attributes import POLICY_VERSION_AMBIGUOUS, POLICY_VERSION_CANDIDATES, parse_policy_version
from serving.asgi import Receive, Scope, Send, client_gone, json_response, stream_start
from serving.gateway.canary import (
    ARM_ATTRIBUTE,
    Arm,
)
from serving.gateway.record import CallRecord, StreamAccumulator, record_from_response, span_attributes
from serving.gateway.sse import sse_event, sse_payloads
from serving.gateway.upstream import TRANSPORT_ERRORS, error_name, is_timeout
from serving.gateway.versions import VersionLabel, Watch, label
from serving.protocol import (
    SSE_DONE,
    ClientWants,
    error_body,
    error_message,
    strip_chunk,
    strip_response,
)

if TYPE_CHECKING:
    from serving.gateway.proxy import Gateway

log = logging.getLogger("tracerl.gateway")


class Call:
    """One proxied call: its span, what the client wants, and the record the span gets at the end."""

    def __init__(self, gw: Gateway, span: trace.Span, body: dict, op: str):
        self.gw, self.span, self.body, self.op = gw, span, body, op
        self.upstream = gw.upstreams[0]
        self.wants: ClientWants | None = None
        self.record: CallRecord | None = None
        self.streaming = False  # an ASGI answer (Stream, Answered) ends the span, not _proxy
        self.deadline = float("inf")
        self.watch: Watch | None = None  # set when the call's version is the upstream's weight version
        self.before: str | None = None
        self.version = VersionLabel()
        self.arm: Arm | None = None  # the canary arm, when the canary routed the call

    async def read_version(self) -> None:
        """Read the upstream's version again, now that the call's last chunk has arrived, and label the call."""
        if self.watch is not None:
            self.version = label(self.before, (await self.watch.after()).version)

    def fail(self, f: UpstreamFailure) -> None:
        self.record = f.record or self.record
        self.fail_with(f.error_type, f.message)

    def fail_with(self, error_type: str, message: str) -> None:
        self.span.set_attribute("error.type", error_type)
        self.span.set_status(Status(StatusCode.ERROR, message))

    def end(self) -> None:
        """Record the call on its span and end it (the version only as ``read_version`` labelled it)."""
        rec = self.record or CallRecord(operation=self.op, request_model=self.body.get("model"))
        attrs = span_attributes(rec, self.upstream, self.version.version, self.gw.config.record_content)
        if self.arm is not None:
            attrs[ARM_ATTRIBUTE] = self.arm.name
            if "tracerl.policy_version" not in attrs and not self.version.ambiguous:
                # the upstream named no version: the one the operator mapped it to (--upstream-for)
                attrs["tracerl.policy_version"] = parse_policy_version(self.arm.version)
        self.span.set_attributes(attrs)
        if self.version.ambiguous:
            self.span.set_attribute(POLICY_VERSION_AMBIGUOUS, True)
            self.span.set_attribute(POLICY_VERSION_CANDIDATES, list(self.version.candidates))
        self.span.end()

    async def whole(self, resp: aiohttp.ClientResponse) -> Response:
        """A non-streamed answer (or any error answer): read it all, record it, answer the client."""
        try:
            raw = await resp.read()
        except TRANSPORT_ERRORS as e:
            raise transport_failure(self.upstream, e, "failed") from e
        if resp.status != 200:
            try:
                err = json.loads(raw)
            except json.JSONDecodeError:
                err = None
            msg = error_message(err) if err is not None else raw.decode("utf-8", "replace")[:500]
            out = (
                err
                if isinstance(err, dict) and isinstance(err.get("error"), dict)
                else error_body(msg or f"upstream answered HTTP {resp.status}", "upstream_error", resp.status)
            )
            raise UpstreamFailure(
                resp.status,
                "upstream_error",
                str(resp.status),
                f"upstream {self.upstream} answered {resp.status}: {msg}",
                response=json_response(resp.status, out),
            )
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UpstreamFailure(
                502,
                "upstream_error",
                "invalid_response",
                f"upstream {self.upstream} answered 200 with a body that is not JSON ({e})",
            ) from e
        self.record = record_from_response(self.body, data, self.op)
        self.gw.warn_if_no_ids(self.record, self.upstream)
        return json_response(200, strip_response(data, self.wants))

    def stream(self, resp: aiohttp.ClientResponse) -> Stream:
        self.streaming = True
        return Stream(self, resp)


class Answered:
    """The ASGI answer of a whole call: sent to the client first, then the version is read and the span ends."""

    def __init__(self, call: Call, response: Response):
        self.call, self.response = call, response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
            await self.call.read_version()
        finally:
            self.call.end()


class Stream:
    """The ASGI answer of a streamed call: relays the upstream's events as they come, cleaned for the
    client, and ends the call's span when the stream ends, however it ends."""

    def __init__(self, call: Call, resp: aiohttp.ClientResponse):
        self.call, self.resp = call, resp
        self.acc = StreamAccumulator(call.body, call.op)
        self.failure: UpstreamFailure | None = None
        self.read_all = False  # the upstream's answer was read to its end: its connection can be kept
        n = call.body.get("n")
        self.unfinished = set(
            range(n if isinstance(n, int) and n > 0 else 1)
        )  # choices without a finish_reason
        self.version_read: asyncio.Task[None] | None = (
            None  # started at the last token, before usage and [DONE]
        )
        deadlines = call.gw.read_deadlines  # the read timeout, kept for every stream by one timer
        self.deadlines = deadlines if deadlines.take_over(resp) else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = self.call
        completed = False
        try:
            completed = await self._relay_all(receive, send)
        finally:
            if self.deadlines is not None:
                self.deadlines.done(self.resp)
            if self.read_all:
                self.resp.release()  # the connection goes back to the pool
            else:
                self.resp.close()  # abandoned mid-answer: the upstream sees the connection close
            call.record = self.acc.finish()
            call.gw.warn_if_no_ids(call.record, call.upstream)
            if self.failure is not None:
                call.fail(self.failure)
            elif not completed:
                call.fail_with("client_disconnected", "the client closed the connection mid-stream")
            try:
                # after the last token: the weights that served it were live before this read
                await (self.version_read or call.read_version())
            finally:
                call.end()

    async def _relay_all(self, receive: Receive, send: Send) -> bool:
        """Relay the upstream's events to the client as they come; False when the client left first.

        Every event that has arrived is cleaned and sent on in one write: reading whole network reads
        (not line by line) batches the events that queued up while the gateway was busy, so under load it
        makes fewer, larger writes instead of falling behind. The stream's end (``[DONE]`` with whatever
        arrived with it) goes out in the same write as the end of the response, once the upstream's answer
        was read to its end; so do the last token's events, once every choice has its ``finish_reason``
        (what follows, the usage chunk and ``[DONE]``, comes at once): one write (a system call that wakes
        the client, ~15 us here) per call fewer.

        One loop, sending through ``send`` itself: every chunk of every stream passes here, and the async
        generator and ``stream_out`` layers it went through before cost a few microseconds
        per chunk. uvicorn drops writes to a closed connection silently, so a disconnect is watched for on
        ``receive`` and checked before each write.
        """
        watcher = asyncio.ensure_future(client_gone(receive))
        try:
            await send(_STREAM_START)
            tail = b""
            held = b""  # events after every choice's finish_reason: they go out with the end of the stream
            rest = b""
            resp, read, deadlines = self.resp, self.resp.content.readany, self.deadlines
            try:
                while True:
                    if deadlines is not None:
                        deadlines.wait(resp)
                    data = await read()
                    if deadlines is not None:
                        deadlines.done(resp)
                    if not data:
                        self.read_all = True
                        break
                    payloads, rest = sse_payloads(rest + data if rest else data)
                    out = [held]
                    for raw in payloads:
                        if raw == b"[DONE]":
                            await self._drain()
                            held = b"".join(out)
                            break
                        out.append(self._relay(raw))
                    else:
                        body = b"".join(out)
                        if not self.unfinished:  # the answer is complete: only usage and [DONE] are to come
                            held = body
                        elif body:
                            if watcher.done():
                                return False
                            held = b""
                            await send({"type": "http.response.body", "body": body, "more_body": True})
                        continue
                    break
            except TRANSPORT_ERRORS as e:
                self.failure = transport_failure(self.call.upstream, e, "broke the stream")
                tail = sse_event(error_body(self.failure.message, self.failure.err_type, self.failure.status))
            if watcher.done():
                return False
            await send({"type": "http.response.body", "body": held + tail + SSE_DONE, "more_body": False})
            return True
        finally:
            watcher.cancel()

    async def _drain(self) -> None:
        """Read the upstream's answer to its end after ``[DONE]``, so its connection goes back to the pool
        (one that fails now is closed instead: the client has its whole answer already)."""
        resp, read, deadlines = self.resp, self.resp.content.readany, self.deadlines
        try:
            while True:
                if deadlines is not None:
                    deadlines.wait(resp)
                if not await read():
                    break
        except TRANSPORT_ERRORS:
            return
        self.read_all = True

    def _relay(self, raw: bytes) -> bytes:
        """One upstream event -> what the client gets (b"" for the usage chunk it did not ask for)."""
        upstream = self.call.upstream
        payload = raw.decode("utf-8", "replace")
        try:
            chunk = loads(payload)
        except json.JSONDecodeError:
            chunk = error_body(
                f"upstream {upstream} sent a stream event that is not JSON: {payload[:200]!r}",
                "upstream_error",
                502,
            )
        if not isinstance(chunk, dict) or ("error" in chunk and "choices" not in chunk):
            # vLLM reports mid-stream errors this way
            self.failure = UpstreamFailure(
                500,
                "upstream_error",
                "stream_error",
                f"upstream {upstream} failed mid-stream: {error_message(chunk)}",
            )
            return sse_event(chunk)
        self.acc.add(chunk)
        if self.unfinished:
            for ch in chunk.get("choices") or ():
                if ch.get("finish_reason") is not None:
                    self.unfinished.discard(ch.get("index"))
            if not self.unfinished and self.version_read is None:
                self.version_read = asyncio.ensure_future(self.call.read_version())
        out = strip_chunk(chunk, self.call.wants)
        return sse_event(out) if out is not None else b""


_STREAM_START = stream_start()  # built once: every relayed stream starts with it
_scan = json.JSONDecoder().scan_once


def loads(text: str) -> Any:
    """``json.loads(text)``, taking the event's one JSON value straight from the C scanner: the decoder's
    Python layers around it (``loads``, ``decode``, ``raw_decode``, two whitespace matches) are a fifth of
    the parse of a token's chunk. Anything but one bare value (whitespace, extra data, an error) goes
    through ``json.loads``, which says what is wrong as before."""
    try:
        obj, end = _scan(text, 0)
    except StopIteration:
        return json.loads(text)
    return obj if end == len(text) else json.loads(text)


def transport_failure(upstream: str, e: BaseException, doing: str) -> UpstreamFailure:
    """A 504 for an upstream that went quiet past ``--timeout-s``, else a 502 naming what broke."""
    name = error_name(e)
    if is_timeout(e):
        return UpstreamFailure(
            504,
            "upstream_timeout",
            name,
            f"upstream {upstream} did not answer within its "
            f"timeout ({name}); raise --timeout-s if generations are long",
        )
    return UpstreamFailure(502, "upstream_error", name, f"upstream {upstream} {doing}: {name}: {e}")


class UpstreamFailure(Exception):
    def __init__(
        self, status: int, err_type: str, error_type: str, message: str, response: Response | None = None
    ):
        super().__init__(message)
        self.status = status
        self.err_type = err_type
        self.error_type = error_type
        self.message = message
        self.response = response  # the answer already made for the client (an upstream error passed through)
        self.record: CallRecord | None = None
