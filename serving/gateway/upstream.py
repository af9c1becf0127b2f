"""The gateway's upstream HTTP client: one ``aiohttp.ClientSession`` per gateway process.

Why aiohttp and not httpx: profiled under 64 concurrent streams (``bench/gateway.py``), httpx's
stack (httpcore's pure-Python h11 parser, an anyio cancel scope and a sniffio lookup per read, and a
pool that walks all of its connections whenever a request starts or ends) cost the gateway more CPU
than everything else it does per call. aiohttp parses responses in C (``_http_parser``) and hands
over each network read as it is, from one pool of ``max_connections``. httpx stays the project's
client where a test injects a transport (the publish client); nothing injects one here.

The gateway records errors under the names its spans have always used (httpx's): ``ConnectError``
(refused, reset, TLS; nothing ran upstream), ``ConnectTimeout``, ``ReadTimeout``.

A call sent on a kept-alive connection that the server closes as the call arrives fails before any
answer (``ServerDisconnectedError``): the race every keep-alive client has (RFC 9112 sec. 9.3.1).
Keeping idle connections below the server's keep-alive narrows it, but a server whose event loop is
stalled (vLLM's API server on a loaded machine, during a weight reload) still closes late; so ``post``
sends such a call once more, on a new connection. aiohttp resends only idempotent methods by itself;
the gateway POSTs nothing but chat and completion calls, which change nothing upstream but its compute.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

import aiohttp

# Failures before the request reached the upstream: the next upstream may be tried.
CONNECT_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientConnectorError,
    aiohttp.ConnectionTimeoutError,
)
# Everything the upstream connection can raise (aiohttp's read timeouts are asyncio.TimeoutError).
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, asyncio.TimeoutError)
KEEPALIVE_S = 4.0  # below uvicorn's (and so vLLM's) 5 s keep-alive: never reuse a connection it is closing


def error_name(e: BaseException) -> str:
    """The ``error.type`` a span records for an upstream failure (httpx's names, as before)."""
    if isinstance(e, aiohttp.ConnectionTimeoutError):
        return "ConnectTimeout"
    if isinstance(e, aiohttp.ClientConnectorError):
        return "ConnectError"
    if isinstance(e, asyncio.TimeoutError):
        return "ReadTimeout"
    return type(e).__name__


def is_timeout(e: BaseException) -> bool:
    return isinstance(e, asyncio.TimeoutError)


class UpstreamClient:
    """Up to ``max_connections`` kept-alive upstream connections, made on the server's event loop on
    first use and closed when that loop ends."""

    def __init__(self, timeout_s: float, connect_timeout_s: float, max_connections: int):
        # sock_read bounds each wait for the upstream (as httpx's read timeout did), not a whole generation.
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=timeout_s)
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
        self._owners: list[asyncio.Future] = []
        self._tls: ssl.SSLContext | None = None

    def tls(self, url: str) -> ssl.SSLContext | bool:
        """The TLS context of a request to ``url``: certifi's trust store (the one httpx used) for https,
        built on the first https request; True (aiohttp's default, unused) for plain http. Building it
        reads the whole CA bundle (about 20 ms of CPU), which a gateway in front of a local http engine
        never needs, and which its first call used to pay."""
        if not url.startswith("https:"):
            return True
        if self._tls is None:
            import certifi

            self._tls = ssl.create_default_context(cafile=certifi.where())
        return self._tls

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # reuse an idle connection for 4 s at most: vLLM's server (uvicorn) closes one after 5 s
            # (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), and aiohttp's default of 15 s let a call reuse a connection
            # the server was closing: ServerDisconnectedError, a 502 for a call held through a reload
            self._session = self._open(keepalive_timeout=KEEPALIVE_S)
        return self._session

    @property
    def fresh(self) -> aiohttp.ClientSession:
        """A session whose every request gets a new connection (for the one resend of ``post``)."""
        if self._fresh is None:
            self._fresh = self._open(force_close=True)
        return self._fresh

    def _open(self, **connector: object) -> aiohttp.ClientSession:
        conn = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0, **connector)
        # no cookie jar: a cookie the upstream sets answers one client, and a shared jar would send it with
        # every other client's calls (and filter the jar on each request)
        session = aiohttp.ClientSession(
            connector=conn, timeout=self.timeout, cookie_jar=aiohttp.DummyCookieJar()
        )
        self._owners.append(asyncio.ensure_future(self._close_at_loop_end(session)))
        return session

    async def get(self, url: str, headers: dict[str, str]) -> tuple[int, str, bytes]:
        """A short GET read whole: (status, content type, body)."""
        async with self.session.get(url, headers=headers, ssl=self.tls(url)) as r:
            return r.status, r.headers.get("Content-Type", "application/json"), await r.read()

    async def post(self, url: str, payload: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        """A POST whose answer is not yet read: the caller reads it and calls ``release()`` (read to
        the end: the connection is kept) or ``close()`` (abandoned). Sent once more, on a new connection,
        when the upstream closed the connection before answering (module docstring)."""
        tls = self.tls(url)
        try:
            return await self.session.post(url, data=payload, headers=headers, ssl=tls)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            if isinstance(e, CONNECT_ERRORS):  # nothing was sent: the caller's failover decides
                raise
            return await self.fresh.post(url, data=payload, headers=headers, ssl=tls)

    @staticmethod
    async def _close_at_loop_end(session: aiohttp.ClientSession) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await session.close()


class ReadDeadlines:
    """The read timeout of streamed answers (``--timeout-s`` without a token), kept by one timer for all.

    aiohttp's ``sock_read`` re-arms a timer on every network read: a timer made and cancelled per token
    of every stream (about 3 % of the gateway's CPU under 256 streams). Once a stream's head has arrived
    its connection's timer is switched off (``read_timeout = None``) and the stream says when it starts
    and stops waiting for the upstream; one task looks every ``min(1 s, timeout / 4)`` and fails a read
    that waited past the timeout with ``asyncio.TimeoutError`` (a ``ReadTimeout`` on the span, a 504 for
    the client), as ``sock_read`` would, within that period. Only waits for the upstream count: a stream
    held back by a slow client is not timed out, as aiohttp pauses ``sock_read`` while it holds reading.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.period = min(1.0, timeout_s / 4)
        self.waiting: dict[aiohttp.ClientResponse, float] = {}  # stream -> loop time its wait began
        self._task: asyncio.Task[None] | None = None
        # the serving loop's clock, kept: get_running_loop() makes a getpid() system call on Python 3.11,
        # and wait() runs once per chunk of every stream
        self._clock: Callable[[], float] | None = None

    def take_over(self, resp: aiohttp.ClientResponse) -> bool:
        """Switch the connection's per-read timer off; False when there is none (the body is all in)."""
        conn = resp.connection
        if conn is None or conn.protocol is None:
            return False
        conn.protocol.read_timeout = None
        return True

    def wait(self, resp: aiohttp.ClientResponse) -> None:
        """The stream waits for the upstream from now."""
        clock = self._clock
        if clock is None or self._task is None:  # (a new task may run on a new loop: tests start several)
            clock = self._clock = asyncio.get_running_loop().time
        self.waiting[resp] = clock()
        if self._task is None:
            self._task = asyncio.ensure_future(self._watch())

    def done(self, resp: aiohttp.ClientResponse) -> None:
        """The stream's wait ended (data, its end, or an error)."""
        self.waiting.pop(resp, None)

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.waiting:
                await asyncio.sleep(self.period)
                now = loop.time()
                for resp, since in list(self.waiting.items()):
                    if now - since > self.timeout_s:
                        del self.waiting[resp]
                        resp.content.set_exception(asyncio.TimeoutError())
        finally:
            self._task = None
