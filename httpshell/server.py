"""One HTTP server shell for every tracerl server: uvicorn (httptools parser, uvloop event loop)
running an ASGI app, plus the limits uvicorn leaves to the application.

Why uvicorn: it is the ASGI server vLLM (FastAPI on ``uvicorn[standard]``) and most of the Python
serving ecosystem run on, is actively kept, runs TLS inside the event loop (a socket idling in its
handshake costs a file descriptor, not the accept loop: the loop drops it after 60 s), and is
embeddable (a ``Server`` on our own socket, in a background thread, on its own loop). Why
httptools + uvloop (``uvicorn[standard]``, vLLM's choice) rather than h11 + asyncio: measured
here on 2 cores, the fixed server CPU per small request is about 190 µs against 930 µs (and
440 µs for the old stdlib server); both parse chunked bodies and refuse a negative or non-numeric
Content-Length. h11 bounds the request head itself; with httptools the bound is counted here.
Hypercorn (read timeouts, but slower and less used) and Granian (a Rust server that wants its own
process) were the alternatives. Large bodies cost uvicorn more than the stdlib server (it copies
each body a few times on its way to the app: about 1 ms per 700 KB), which is small next to
decoding and storing the spans in them.

What uvicorn does not do, and this module adds:

* **Connection cap.** uvicorn's ``limit_concurrency`` answers 503 to every request once the number
  of open connections reaches the limit, including requests on connections already accepted; here a
  connection beyond ``max_connections`` gets a 503 with ``Retry-After`` and is closed at once.
* **Header read timeout.** uvicorn arms its keep-alive timer only after a response, so a
  connection that never sends (or trickles) a request head is kept forever; here the head must
  arrive within ``header_timeout_s`` (idle connections are closed, partial heads get 408).
* **Body limits and body read timeout.** A Content-Length over ``max_body_bytes`` is a 413 before
  a byte of the body is read; a chunked body is counted as it is read and cut at the limit; the
  whole body must arrive within ``body_timeout_s`` of the app asking for it (408 otherwise).
  A non-numeric or negative Content-Length is a 400 (the parser refuses it first; checked again here).
* **Authenticate before the body.** With a ``token``, every request except ``public_paths`` must
  carry ``Authorization: Bearer <token>`` (scheme case-insensitive, RFC 7235 §2.1; constant-time
  compare) and is answered 401 before the app runs, so no unauthenticated body is ever read.
* **Quiet disconnects.** A client that goes away mid-request ends the request without a traceback.
  Any answer given while the request body is unread carries ``Connection: close`` (otherwise
  uvicorn would keep reading and discarding it).

The per-request items (authentication, body limits and deadline, quiet disconnects) are ``guard.py``, the ASGI
middleware ``start`` wraps every app in; the connection cap and the request-head bound and deadline are here.

Error answers are rendered by the server's own ``ErrorRenderer`` so each keeps its protocol's
shape (``google.rpc.Status`` for OTLP, OpenAI's error object for the gateway and server).

Using it::

    app = Starlette(routes=[...], exception_handlers=exception_handlers(render))
    server = start(app, ServerOptions(port=4318, token=token, max_body_bytes=64 << 20), render)
    ...  # server.url, server.port
    server.stop()

Handlers read bodies the ordinary way (``await request.body()``); the limits above apply to it.
Blocking work (an fsync, an engine call) belongs off the event loop: ``await run_blocking(fn, ...)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvicorn
from starlette.requests import Request
from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from httpshell.guard import Guard, RequestError, Scope

T = TypeVar("T")
ErrorRenderer = Callable[[Scope, int, str], tuple[str, bytes]]
"""``(scope, status, message) -> (content_type, body)``: how a server spells an error answer."""


@dataclass(frozen=True)
class ServerOptions:
    """How one server listens and what it refuses. Defaults are safe on a laptop."""

    host: str = "127.0.0.1"
    """Bind address: loopback unless the user asks for more (``0.0.0.0``, ``::``)."""
    port: int = 0
    """0 picks a free port (tests); ``RunningServer.port`` says which."""
    tls_cert: str | None = None
    """PEM certificate chain; with ``tls_key`` the server speaks only HTTPS."""
    tls_key: str | None = None
    token: str | None = None
    """Bearer token every request must carry (except ``public_paths``); None: no authentication."""
    public_paths: frozenset[str] = field(default_factory=frozenset)
    """Paths served without the token, e.g. ``{"/healthz"}``."""
    auth_hint: str = ""
    """Appended to 401 messages, e.g. how this server's clients set the header."""
    max_body_bytes: int = 8 << 20
    """Largest request body, as sent (before any Content-Encoding is undone)."""
    max_connections: int = 1024
    """Open connections beyond this are answered 503 and closed."""
    max_header_bytes: int = 64 << 10
    """Largest request line + headers (answered 400 past it)."""
    header_timeout_s: float = 10.0
    """A connection must send a complete request head this soon after opening or after a response."""
    body_timeout_s: float = 60.0
    """The whole request body must arrive this soon after the app starts reading it."""
    keep_alive_s: float = 5.0
    """Idle keep-alive connections are closed after this long."""
    graceful_s: float = 10.0
    """On ``stop()``, in-flight requests get this long to finish before they are cancelled."""
    reuse_port: bool = False
    """Bind with ``SO_REUSEPORT``: several processes serve one port and the kernel spreads the
    connections over them (``tracerl gateway --workers``). Only processes of the same user can join."""
    blocking_threads: int = 64
    """Threads of the loop's default executor, where ``run_blocking`` runs work (an fsync, an engine
    call); concurrent blocking calls beyond this wait for a thread."""
    name: str = "tracerl"
    """Server header and thread name."""


async def run_blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run blocking ``fn(*args, **kwargs)`` in the server's thread pool and await its result.

    Plain ``loop.run_in_executor`` on the executor ``start`` gives each server's loop: a few µs,
    where Starlette's ``run_in_threadpool`` (anyio) costs about 150 µs a call on this machine.
    """
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))


def plain_error(scope: Scope, status: int, message: str) -> tuple[str, bytes]:
    """The default ``ErrorRenderer``: the message as text."""
    return "text/plain; charset=utf-8", message.encode()


def header(scope: Scope, name: str) -> str | None:
    """The first value of request header ``name`` (lower case), or None."""
    key = name.encode()
    for k, v in scope["headers"]:
        if k == key:
            return v.decode("latin-1")
    return None


def inflate(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """Undo ``Content-Encoding`` (identity or gzip) without letting a small bomb grow past ``limit``."""
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "gzip":
        raise RequestError(400, f"Content-Encoding {content_encoding!r} is not supported; use gzip or none")
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as e:
        raise RequestError(400, f"Content-Encoding is gzip but the body is not valid gzip: {e}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise RequestError(413, f"gzip body inflates past the {limit}-byte limit")
    return out


def exception_handlers(render: ErrorRenderer) -> dict[Any, Callable]:
    """Starlette ``exception_handlers`` that answer ``RequestError`` in the server's error shape.

    Needed in a Starlette app: its error middleware would otherwise turn the exception into a 500
    before the shell sees it.
    """

    async def on_request_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)
        content_type, body = render(request.scope, exc.status, exc.message)
        return Response(body, exc.status, {**exc.headers, "connection": "close"}, media_type=content_type)

    return {RequestError: on_request_error}


# -- the connection layer: cap, request-head size and deadline ----------------------------------------

_FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 21\r\n"
    b"retry-after: 1\r\nconnection: close\r\n\r\ntoo many connections\n"
)
_HEAD_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: 38\r\n"
    b"connection: close\r\n\r\nthe request head did not arrive in time"
)


class _GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a connection cap, a request-head size bound and a
    request-head deadline (armed when a connection opens and after each response)."""

    limits: ServerOptions  # set on the per-server subclass made by ``start``

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._bytes_since_arm = False
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            transport.write(_FULL)
            transport.close()
            return
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        self._bytes_since_arm = True
        super().data_received(data)

    # Parser callbacks: count the head; raising here makes httptools fail the parse, and uvicorn
    # answers 400 and closes.
    def on_message_begin(self) -> None:
        self._head_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.limits.max_header_bytes:
            raise ValueError(f"request head over {self.limits.max_header_bytes} bytes")

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # its head is already in: no deadline for it
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._bytes_since_arm = False
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._bytes_since_arm:  # a partial head: say why; an idle connection is just closed
            self.transport.write(_HEAD_TIMEOUT)
        self.transport.close()


# -- running ------------------------------------------------------------------------------------------


def _bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The listening socket, with Nagle's algorithm off: accepted connections inherit TCP_NODELAY
    (Linux), which asyncio would not set itself (``create_server`` gives ``proto`` 0), and without it
    an answer written as head + body waits for the client's delayed ACK (40 ms per call, measured)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    sock = socket.create_server((host, port), family=family, backlog=2048, reuse_port=reuse_port)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, with the loop's default executor sized for ``run_blocking``."""

    def __init__(self, config: uvicorn.Config, options: ServerOptions):
        super().__init__(config)
        self.options = options

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        threads = ThreadPoolExecutor(
            self.options.blocking_threads, thread_name_prefix=f"{self.options.name}-work"
        )
        asyncio.get_running_loop().set_default_executor(threads)  # shut down with the loop
        await super().startup(sockets)


class RunningServer:
    """A server running in a background thread, on its own event loop."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket, thread: threading.Thread, tls: bool):
        self._server, self._thread = server, thread
        self.host, self.port = sock.getsockname()[:2]
        self.scheme = "https" if tls else "http"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def connections(self) -> int:
        """Open connections now (for tests and status)."""
        return len(self._server.server_state.connections)

    def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting, let in-flight requests finish (up to ``grace_s``), close every connection."""
        if grace_s is not None:
            self._server.config.timeout_graceful_shutdown = grace_s  # type: ignore[assignment]
        self._server.should_exit = True
        self._thread.join(timeout=(self._server.config.timeout_graceful_shutdown or 10) + 10)


def start(app: Callable, options: ServerOptions, render: ErrorRenderer = plain_error) -> RunningServer:
    """Bind ``options.host:options.port`` and serve the ASGI ``app`` from a background thread.

    Returns once the server accepts connections. Bind and TLS errors (a taken port, an unreadable
    certificate) raise here, in the caller's thread.
    """
    protocol = type("GuardedHttpTools", (_GuardedHttpTools,), {"limits": options})
    config = uvicorn.Config(
        Guard(app, options, render),
        http=protocol,
        ws="none",
        loop="uvloop",
        interface="asgi3",
        lifespan="off",
        log_config=None,
        access_log=False,
        proxy_headers=False,
        server_header=False,
        headers=[("server", options.name)],
        timeout_keep_alive=options.keep_alive_s,  # type: ignore[arg-type]  # a float works
        timeout_graceful_shutdown=options.graceful_s,  # type: ignore[arg-type]
        ssl_certfile=options.tls_cert,
        ssl_keyfile=options.tls_key,
    )
    config.load()
    sock = _bind(options.host, options.port, options.reuse_port)
    server = _Server(config, options)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"{options.name}-http", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            with contextlib.suppress(OSError):
                sock.close()
            raise RuntimeError(
                f"{options.name}: the HTTP server on {options.host}:{options.port} did not start"
            )
        time.sleep(0.005)
    return RunningServer(server, sock, thread, tls=bool(options.tls_cert))
