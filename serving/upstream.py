"""The gateway's upstream HTTP clients: ``httpx.AsyncClient`` s, sharded so thousands of concurrent
calls stay cheap.

httpcore 1.0's connection pool walks all of its connections, and polls each idle one's socket,
whenever a request starts or ends (``AsyncConnectionPool._assign_requests_to_connections``, with an
``is_idle`` count inside the walk): O(n²) per call for n connections. Profiled at 32 concurrent
streams it cost the gateway more CPU than relaying the streams. So the connections are spread over
clients of ``per_client`` connections each, made when the others are busy, and each call takes the
least busy client; one CA bundle is loaded for all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator

import httpx


class UpstreamClients:
    """Up to ``max_connections`` upstream connections in clients of ``per_client`` each."""

    def __init__(
        self,
        timeout: httpx.Timeout,
        max_connections: int,
        per_client: int = 8,
        client: httpx.AsyncClient | None = None,
    ):
        self.timeout = timeout
        self.per_client = per_client
        self.max_clients = max(1, -(-max_connections // per_client))
        self.clients: list[httpx.AsyncClient] = [client] if client is not None else []
        self.busy: list[int] = [0] * len(self.clients)
        self._fixed = client is not None  # an injected client (tests: a MockTransport) is the only one
        self._ssl: ssl.SSLContext | None = None
        self._owner: asyncio.Future | None = None

    def acquire(self) -> int:
        """The index of the least busy client (a new one when all are full), now counted busy."""
        if self._owner is None:  # first call, on the server's event loop: close the clients with it
            self._owner = asyncio.ensure_future(self._close_at_loop_end())
        i = min(range(len(self.clients)), key=self.busy.__getitem__) if self.clients else -1
        if (
            not self._fixed
            and (i < 0 or self.busy[i] >= self.per_client)
            and len(self.clients) < self.max_clients
        ):
            self.clients.append(self._new_client())
            self.busy.append(0)
            i = len(self.clients) - 1
        self.busy[i] += 1
        return i

    def release(self, i: int) -> None:
        self.busy[i] -= 1

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[httpx.AsyncClient]:
        """A client for one short call (a GET), given back afterwards."""
        i = self.acquire()
        try:
            yield self.clients[i]
        finally:
            self.release(i)

    def _new_client(self) -> httpx.AsyncClient:
        if self._ssl is None:
            import certifi

            self._ssl = ssl.create_default_context(cafile=certifi.where())  # httpx's default trust store
        return httpx.AsyncClient(
            timeout=self.timeout,
            verify=self._ssl,
            limits=httpx.Limits(max_connections=self.per_client, max_keepalive_connections=self.per_client),
        )

    async def _close_at_loop_end(self) -> None:
        """Hold the clients until the server's event loop shuts down, then close their connections."""
        try:
            await asyncio.Event().wait()
        finally:
            for c in self.clients:
                await c.aclose()
