"""The ASGI guard every tracerl server's app runs inside: the per-request limits of ``ServerOptions`` that
uvicorn leaves to the application (authentication before the body, Content-Length and body limits, the body's
read deadline, quiet disconnects). ``httpshell.server`` says why each exists; the connection layer (cap, request-
head size and deadline) stays there, on uvicorn's protocol.

Split from ``server.py`` so each module stays readable; ``server.start`` wraps every app in ``Guard``.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect

if TYPE_CHECKING:
    from httpshell.server import ErrorRenderer, ServerOptions

Scope = dict[str, Any]


class RequestError(Exception):
    """Raise in a handler (or from ``inflate``) to answer ``status`` with the server's error shape."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


def bearer_error(authorization: str | None, token: str | None) -> str | None:
    """Why ``authorization`` does not pass for ``token`` (None when it does, or when there is no token).

    RFC 7235 §2.1: the auth scheme is case-insensitive, so ``bearer x`` is ``Bearer x``.
    """
    if not token:
        return None
    if not authorization:
        return "missing 'Authorization: Bearer <token>' header"
    scheme, _, credentials = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return f"Authorization scheme {scheme[:20]!r} is not Bearer"
    if not hmac.compare_digest(credentials.strip().encode(), token.encode()):
        return "bearer token does not match the server's token"
    return None


_DISCONNECT = {"type": "http.disconnect"}


async def _before(deadline: float, waiting: Awaitable[dict]) -> dict:
    """``await waiting``, or TimeoutError at loop time ``deadline``. One timer, no extra task where
    ``asyncio.timeout_at`` exists (3.11+); ``wait_for`` makes a task per call, per body chunk."""
    if hasattr(asyncio, "timeout_at"):
        async with asyncio.timeout_at(deadline):
            return await waiting
    return await asyncio.wait_for(waiting, max(0.0, deadline - asyncio.get_running_loop().time()))


def _request_head(scope: Scope) -> tuple[bytes | None, bool, str | None]:
    """The request-head fields the guard decides on: Content-Length (raw), chunked or not, Authorization."""
    length = authorization = None
    chunked = False
    for k, v in scope["headers"]:
        if k == b"content-length":
            length = v
        elif k == b"transfer-encoding":
            chunked = b"chunked" in v.lower()
        elif k == b"authorization":
            authorization = v.decode("latin-1")
    return length, chunked, authorization


def _refusal(
    scope: Scope, opts: ServerOptions, length: bytes | None, authorization: str | None
) -> tuple[int, str, dict[str, str] | None] | None:
    """Why a request is answered before the app runs (no token, a bad or too large Content-Length), or None.

    Decided on the head alone, so no unauthenticated or oversized body is ever read."""
    if opts.token and scope["path"] not in opts.public_paths:
        why = bearer_error(authorization, opts.token)
        if why:
            return 401, why + opts.auth_hint, {"www-authenticate": "Bearer"}
    if length is not None:
        if not length.isdigit():
            return (
                400,
                f"Content-Length {length.decode('latin-1')[:40]!r} is not a non-negative integer",
                None,
            )
        if int(length) > opts.max_body_bytes:
            return 413, f"body of {int(length)} bytes exceeds the {opts.max_body_bytes}-byte limit", None
    return None


class _Exchange:
    """One request/response through the guard: what it has seen so far, and the ``receive``/``send`` the app
    is given in place of the server's (body limits and deadline, ``Connection: close`` over an unread body,
    nothing sent after the guard's own answer)."""

    __slots__ = (
        "_receive",
        "_send",
        "answered",
        "body_done",
        "client_gone",
        "deadline",
        "has_body",
        "opts",
        "received",
        "render",
        "scope",
        "started",
    )

    def __init__(
        self,
        scope: Scope,
        receive: Callable,
        send: Callable,
        guard: Guard,
        has_body: bool,
    ):
        self.scope, self._receive, self._send = scope, receive, send
        self.opts, self.render = guard.options, guard.render
        self.has_body = has_body
        self.body_done = not has_body
        self.received = 0
        self.deadline: float | None = None
        self.started = self.answered = self.client_gone = False

    async def answer(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        """The guard's own answer (rendered in the server's error shape), once, and only before the app's."""
        if self.started or self.answered:
            return  # too late for a clean answer: the app sees a disconnect and stops
        self.answered = True
        content_type, body = self.render(self.scope, status, message)
        head = [
            (b"content-type", content_type.encode()),
            (b"content-length", b"%d" % len(body)),
            (b"connection", b"close"),
        ]
        head += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        await self._send({"type": "http.response.start", "status": status, "headers": head})
        await self._send({"type": "http.response.body", "body": body})

    async def receive(self) -> dict:
        """The server's ``receive``, with the body counted against the limit and read within its deadline."""
        if self.answered:
            return _DISCONNECT
        if self.body_done or self.started:  # after the body (or once answering): only a disconnect can come
            return await self._receive()
        opts = self.opts
        if self.deadline is None:
            self.deadline = asyncio.get_running_loop().time() + opts.body_timeout_s
        try:
            message = await _before(self.deadline, self._receive())
        except asyncio.TimeoutError:
            await self.answer(408, f"the request body did not arrive within {opts.body_timeout_s:g} s")
            return _DISCONNECT
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > opts.max_body_bytes:
                await self.answer(413, f"body exceeds the {opts.max_body_bytes}-byte limit")
                return _DISCONNECT
            self.body_done = not message.get("more_body", False)
        else:
            self.client_gone = True
        return message

    async def send(self, message: dict) -> None:
        """The server's ``send``, silent after the guard answered; closes the connection over an unread body."""
        if self.answered:
            return
        if message["type"] == "http.response.start":
            self.started = True
            if not self.body_done:  # an unread body would be read and discarded: close instead
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        await self._send(message)

    async def handled(self, exc: Exception) -> bool:
        """Whether the app's exception is dealt with here: a request that already ended (our answer, or the
        client left) needs no report, and a ``RequestError`` becomes its answer. False: let it propagate."""
        if self.answered or self.client_gone or isinstance(exc, (ClientDisconnect, ConnectionError)):
            return True
        if isinstance(exc, RequestError):
            await self.answer(exc.status, exc.message, exc.headers)
            return True
        return False


class Guard:
    """The ASGI middleware that applies ``ServerOptions``' per-request limits around the app."""

    def __init__(self, app: Callable, options: ServerOptions, render: ErrorRenderer):
        self.app, self.options, self.render = app, options, render

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length, chunked, authorization = _request_head(scope)
        has_body = chunked or (length is not None and length.strip(b"0") != b"")
        ex = _Exchange(scope, receive, send, self, has_body)
        refusal = _refusal(scope, self.options, length, authorization)
        if refusal is not None:
            await ex.answer(*refusal)
            return
        try:
            await self.app(scope, ex.receive, ex.send)
        except Exception as exc:
            if not await ex.handled(exc):
                raise
