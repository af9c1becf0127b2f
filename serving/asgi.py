"""What the gateway and the embedded server share on top of ``httpshell``: OpenAI-style errors, JSON
in and out, a server-sent-event stream that notices a client leaving, and the listen address.

``httpshell`` (uvicorn) owns the socket, TLS, the bearer token, body limits, connection cap and
timeouts; the two servers here are plain ASGI callables that dispatch on (method, path) themselves,
so every unknown route and method keeps the answer it had before (no framework router in between).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from httpshell import RunningServer, ServerOptions, start
from serving.protocol import error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
# Error types of the answers the shell gives before the app runs (OpenAI's names where it has one).
_SHELL_ERROR_TYPES = {401: "AuthenticationError", 413: "RequestTooLarge"}


class HTTPError(Exception):
    """Raised inside a handler to answer with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, err_type: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type or HTTPStatus(status).phrase.replace(" ", "")
        self.param = param


def parse_listen(value: str, default_port: int) -> tuple[str, int]:
    """``HOST:PORT`` or ``:PORT`` or ``PORT`` -> (host, port); the host defaults to 127.0.0.1."""
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "", value
    try:
        return host.strip("[]") or "127.0.0.1", int(port) if port else default_port
    except ValueError:
        raise ValueError(
            f"bad listen address {value!r}; use HOST:PORT, e.g. 127.0.0.1:{default_port}"
        ) from None


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def json_response(status: int, obj: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status, headers, media_type="application/json")


def error_response(err: HTTPError) -> Response:
    return json_response(err.status, error_body(err.message, err.err_type, err.status, err.param))


def openai_error(scope: Scope, status: int, message: str) -> tuple[str, bytes]:
    """The shell's ``ErrorRenderer`` for both servers: OpenAI's error object, which clients parse."""
    err_type = _SHELL_ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")
    if status == 413:
        message += "; the request body exceeds the limit that --max-body-mb sets"
    return "application/json", dumps(error_body(message, err_type, status))


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body that must be one JSON object; anything else is a 400 saying what is wrong."""
    try:
        obj = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HTTPError(400, f"request body is not valid JSON: {e}", "BadRequestError") from None
    except RecursionError:
        raise HTTPError(400, "request body is nested too deeply", "BadRequestError") from None
    if not isinstance(obj, dict):
        raise HTTPError(400, "request body must be a JSON object", "BadRequestError")
    return obj


async def read_json(request: Request) -> dict[str, Any]:
    return parse_json(await request.body())


async def client_gone(receive: Receive) -> None:
    """Returns when the client has gone (uvicorn's ``http.disconnect``). uvicorn drops writes to a closed
    connection silently, so a streamed response watches for this on ``receive`` beside its writes."""
    while (await receive())["type"] != "http.disconnect":
        pass


def stream_start(status: int = 200, content_type: str = "text/event-stream") -> dict[str, Any]:
    """The ASGI message that starts a streamed (chunked, uncached) response."""
    return {
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", content_type.encode()), (b"cache-control", b"no-cache")],
    }


async def stream_out(
    receive: Receive,
    send: Send,
    chunks: AsyncIterator[bytes],
    status: int = 200,
    content_type: str = "text/event-stream",
) -> bool:
    """Send ``chunks`` as one chunked response; False when the client left before the end.

    uvicorn drops writes to a closed connection silently, so a disconnect is watched for on
    ``receive`` and checked before each chunk (what a broken pipe on write used to tell us).
    ``chunks`` is closed either way, so its ``finally`` runs (span end, upstream close).
    """

    watcher = asyncio.ensure_future(client_gone(receive))
    try:
        await send(stream_start(status, content_type))
        async for data in chunks:
            if watcher.done():
                return False
            if data:
                await send({"type": "http.response.body", "body": data, "more_body": True})
        if watcher.done():
            return False
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True
    finally:
        watcher.cancel()
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()


class ShellServer:
    """An ASGI app served by ``httpshell`` from a background thread: ``start_background()``, ``url``,
    ``server_address``, ``stop()`` (what tests, benches and the CLI use)."""

    def __init__(self, options: ServerOptions):
        self.shell_options = options
        self._running: RunningServer | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError

    def start_background(self) -> ShellServer:
        self._running = start(self, self.shell_options, openai_error)
        return self

    @property
    def running(self) -> RunningServer:
        if self._running is None:
            raise RuntimeError(f"{type(self).__name__} is not started; call start_background() first")
        return self._running

    @property
    def url(self) -> str:
        return self.running.url

    @property
    def server_address(self) -> tuple[str, int]:
        return self.running.host, self.running.port

    def stop(self) -> None:
        if self._running is not None:
            with contextlib.suppress(RuntimeError):
                self._running.stop()
