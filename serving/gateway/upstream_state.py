"""What the gateway knows of each upstream between calls: the names it serves and its weight version
(cached ``models_ttl_s``, renewed in the background before it expires), and its weight-version watch
(versions.py), which brackets each call the base name serves. One read at a time per gateway; the
callers are the proxy (every call) and the canary admin (a new pair's arms)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from serving.gateway.upstream import TRANSPORT_ERRORS, UpstreamClient
from serving.gateway.versions import Watch


@dataclass
class UpstreamState:
    """What the gateway last learned from an upstream: served names and its weight version."""

    at: float
    names: list[str]
    weight_version: str | None


class UpstreamStates:
    """Each upstream's ``UpstreamState`` and ``Watch``, read through ``client``."""

    def __init__(self, client: UpstreamClient, models_ttl_s: float, version_max_age_s: float):
        self.client = client
        self.models_ttl_s = models_ttl_s
        self.version_max_age_s = version_max_age_s
        self.cached: dict[str, UpstreamState] = {}
        self._lock: asyncio.Lock | None = None
        self._renewing: dict[str, asyncio.Future[None]] = {}  # upstream -> its state's background read
        self._watches: dict[str, Watch] = {}

    async def get(self, upstream: str, headers: dict[str, str], refresh: bool = False) -> UpstreamState:
        """The upstream's served names and weight version, cached ``models_ttl_s`` (stale on errors).

        A state past 80 % of its time is read again in the background while it is still served, so under
        steady traffic no call waits for the two reads (at one stream, every fifth call did: 2 s / 0.4 s)."""
        got = self.cached.get(upstream)
        if got is not None and not refresh:
            age = time.monotonic() - got.at
            if age < self.models_ttl_s:
                if age > 0.8 * self.models_ttl_s and upstream not in self._renewing:
                    self._renewing[upstream] = asyncio.ensure_future(self._renew(upstream, headers))
                return got
        return await self._read(upstream, headers)

    async def _renew(self, upstream: str, headers: dict[str, str]) -> None:
        try:
            await self._read(upstream, headers)
        except RuntimeError:  # aiohttp's "Session is closed": the server is stopping
            pass
        finally:
            self._renewing.pop(upstream, None)

    async def _read(self, upstream: str, headers: dict[str, str]) -> UpstreamState:
        """Read the upstream's served names and weight version (one read at a time, shared by the waiters)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        asked = time.monotonic()
        async with self._lock:
            got = self.cached.get(upstream)
            if got is not None and got.at >= asked:
                return got  # another call refreshed it while this one waited
            try:
                status, _, raw = await self.client.get(upstream + "/v1/models", headers)
                names = [m["id"] for m in json.loads(raw).get("data", [])] if status == 200 else []
                status, _, raw = await self.client.get(
                    upstream + "/weight_info", headers
                )  # vLLM dev mode, main > 0.12
                version = json.loads(raw).get("weight_version") if status == 200 else None
            except (*TRANSPORT_ERRORS, ValueError, KeyError, TypeError, AttributeError):
                return got or UpstreamState(0.0, [], None)
            state = UpstreamState(time.monotonic(), names, str(version) if version is not None else None)
            self.cached[upstream] = state
            return state

    def watch(self, upstream: str, headers: dict[str, str]) -> Watch:
        """The upstream's weight-version watch (versions.py), reading with the first caller's headers."""
        w = self._watches.get(upstream)
        if w is None:
            auth = {k: v for k, v in headers.items() if k == "Authorization"}

            async def read() -> tuple[bool, str | None]:
                paused, version = await asyncio.gather(
                    self._get_field(upstream + "/is_paused", auth, "is_paused"),
                    self._get_field(upstream + "/weight_info", auth, "weight_version"),
                )
                return paused is True, None if version is None else str(version)

            w = self._watches[upstream] = Watch(read, self.version_max_age_s)
        return w

    async def _get_field(self, url: str, headers: dict[str, str], key: str) -> object:
        """One field of a JSON GET; None when the route, the field or the upstream is missing."""
        try:
            status, _, raw = await self.client.get(url, headers)
            return json.loads(raw).get(key) if status == 200 else None
        except (*TRANSPORT_ERRORS, ValueError, AttributeError):
            return None
        except RuntimeError:  # aiohttp's "Session is closed": the server is stopping (a watch's renewal read)
            return None
