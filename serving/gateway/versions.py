"""Exact policy versions for calls served across a full-weight reload (asynchronous rounds).

A full reload keeps the served name (``policy``), so the version of a call's weights is the server's
weight version (``GET /weight_info``), which the publisher sets (``/update_weight_version``) inside
the same pause as the reload (``serving/vllm/publish.py``). vLLM's chat endpoint does not say which
weights served a request (only its token-in-token-out endpoint reports ``weight_versions``), so the
gateway brackets each call with two reads of that version:

* ``before``: an observation whose read *completed before the call was sent* (shared with other
  calls, at most ``max_age_s`` old; a paused upstream is waited out first, bounded by the call's
  deadline, so a call that would queue in vLLM during a swap is sent after it, to the new weights);
* ``after``: a read that *started after the call's last chunk arrived*.

Why equal reads are exact: the publisher changes weights and then the version only while vLLM is
paused, and vLLM generates no token while paused after draining (``pause?mode=wait``), so every
token generated between the two reads came from the weights the version named at both; a swap
between them changes the version (each publish tags a new one). Unequal reads mean the call
straddled a swap: it is labelled ambiguous with both candidates, never guessed. The converse is
not exact (a call sent inside the reload-then-tag window, or whose ``after`` read lost the race
with the tag, is ambiguous though one weight set served it): ambiguity costs a training sample,
never a wrong label.

Reads are shared (``Watch.read_since``): one read serves every call that asks for one in the same
turn of the event loop, so calls ending together cost one read, not one each; under load the
``after`` reads keep ``before`` fresh, so calls are sent without waiting for a read. At a few calls
at a time they do not (one stream's next call arrived while its last call's ``after`` read was still
on its way, and waited for it: 0.3 ms at p50 of a 1-stream bench call), so while calls are being sent
the watch reads again shortly before its latest observation ages out (``renew_s``), off every call's path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Observation:
    """One read of an upstream: its weight version (None: not reported) and whether it was paused."""

    version: str | None
    paused: bool
    at: float  # time.monotonic() when the read completed


@dataclass(frozen=True)
class VersionLabel:
    """What a call's span says about its weights: ``version`` when exact; else ``candidates`` (ambiguous)."""

    version: str | None = None
    candidates: tuple[str, ...] = ()

    @property
    def ambiguous(self) -> bool:
        return bool(self.candidates)


def label(before: str | None, after: str | None) -> VersionLabel:
    """The two reads around a call -> its label: equal reads are exact, unequal ones ambiguous."""
    if before == after:
        return VersionLabel(before)
    return VersionLabel(None, tuple(v for v in (before, after) if v is not None))


class Watch:
    """One upstream's weight version and pause state, read on behalf of many calls."""

    def __init__(
        self,
        read: Callable[[], Awaitable[tuple[bool, str | None]]],
        max_age_s: float = 0.25,
        poll_s: float = 0.05,
        active_s: float = 2.0,
    ):
        self._read = read  # -> (paused, version); never raises
        self.max_age_s = max_age_s
        self.poll_s = poll_s
        self.renew_s = 0.8 * max_age_s  # an observation this old is read again while calls are being sent ...
        self.active_s = active_s  # ... that is, while the last call was sent at most this long ago
        self._sending = float("-inf")  # when a call last asked for an observation to be sent on
        self._renewal: asyncio.TimerHandle | None = None
        self.latest: Observation | None = None  # of the read that completed last
        self._last: asyncio.Future[Observation] | None = None  # the read that started last ...
        self._last_started = float("-inf")  # ... and when
        self._next: asyncio.Future[Observation] | None = None  # the read that starts on the loop's next turn
        self._running: set[asyncio.Task[None]] = set()

    async def read_since(self, t: float) -> Observation:
        """An observation from a read that started at or after monotonic time ``t``, shared by every
        caller it satisfies: the last read if it started late enough, else the one that starts on
        the event loop's next turn (all calls that ask before then share it). A new read never waits
        for an older one, which may be stuck behind a reload in the engine."""
        if self._last is not None and self._last_started >= t:
            return await asyncio.shield(self._last)  # a caller that leaves does not cancel the others' read
        if self._next is None:
            loop = asyncio.get_running_loop()
            self._next = loop.create_future()
            loop.call_soon(self._start)
        return await asyncio.shield(self._next)

    def _start(self) -> None:
        self._last, self._next = self._next, None
        self._last_started = time.monotonic()
        task = asyncio.ensure_future(self._observe(self._last))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _observe(self, into: asyncio.Future[Observation]) -> None:
        paused, version = await self._read()
        obs = Observation(version, paused, time.monotonic())
        if self.latest is None or obs.at >= self.latest.at:
            self.latest = obs
        into.set_result(obs)
        self._renew_later()

    def _renew_later(self) -> None:
        """Read again when the latest observation turns ``renew_s`` old, if calls are still being sent then."""
        if self._renewal is not None or self.latest is None:
            return
        if time.monotonic() - self._sending > self.active_s:
            return  # no traffic: no reads
        due = max(0.0, self.latest.at + self.renew_s - time.monotonic())
        self._renewal = asyncio.get_running_loop().call_later(due, self._renew)

    def _renew(self) -> None:
        self._renewal = None
        latest = self.latest
        if latest is not None and time.monotonic() - latest.at < self.renew_s:
            self._renew_later()  # a call's own read renewed it meanwhile
        elif self._next is None and (self._last is None or self._last.done()):
            self._next = asyncio.get_running_loop().create_future()
            self._start()  # its end schedules the next renewal

    async def before(self, deadline: float) -> Observation:
        """The observation to send a call on: fresh (``max_age_s``) and not paused, unless the
        upstream stays paused past ``deadline`` (then the call is sent anyway; vLLM queues it).
        After a pause, the version is read once more, after a read that said it had ended."""
        now = self._sending = time.monotonic()
        obs = self.latest
        if obs is None or obs.paused or now - obs.at > self.max_age_s:
            obs = await self.read_since(now - self.max_age_s)
        if not obs.paused:
            return obs
        while obs.paused and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(self.poll_s, left))
            obs = await self.read_since(time.monotonic())
        return await self.read_since(time.monotonic()) if not obs.paused else obs

    async def after(self) -> Observation:
        """An observation read after everything the call received so far."""
        return await self.read_since(time.monotonic())
