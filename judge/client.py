"""Asking an OpenAI-compatible judge: one request per group, concurrent up to a limit, one retry.

Each request asks for structured output (``response_format`` with the answer's JSON schema; vLLM
enforces it by guided decoding). A request refused with HTTP 400 is sent again without it; when that
one is answered, the endpoint refused ``response_format`` and the client remembers, so the rest of the
pass asks in plain text (a request refused both ways, e.g. too long for the context, changes nothing). An answer that cannot be parsed gets one retry that quotes the parse error; a second
bad answer fails the group (no reward). An endpoint that cannot be reached, times out, or answers 429 /
5xx / 401 / 403 / 404 is *unavailable*: the group's rollouts wait for the next pass, nothing is written.

The HTTP client is injected (``httpx.AsyncClient``), as the publisher's is (STYLE.md, 11).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from judge.parse import Parsed, parse_answer, response_format
from judge.prompts import JudgeRequest, retry_messages

FRAME_TOKENS = 64
"""Answer tokens for the JSON around the per-trajectory entries."""
WAIT_STATUSES = {401, 403, 404, 408, 409, 425, 429}
"""Statuses that say "not now" or "not configured" rather than "this request is bad": the group waits."""


class Unavailable(Exception):
    """The judge could not answer (down, slow, overloaded, misconfigured): try again on a later pass."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Rejected(Exception):
    """The endpoint refused this request for good (HTTP 400/413/422 without structured output)."""


@dataclass
class Outcome:
    """What became of one request: ``ok`` (scores for every rollout), ``failed`` (answered, unusable, or
    rejected: recorded, not paid for again) or ``unavailable`` (its rollouts wait)."""

    request: JudgeRequest
    status: str
    parsed: Parsed | None = None
    kind: str | None = None  # why it failed or waits, to count by
    reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    calls: int = 0
    seconds: float = 0.0


@dataclass
class JudgeClient:
    """An OpenAI-compatible chat endpoint, as the judge uses it."""

    http: httpx.AsyncClient
    base_url: str
    model: str
    api_key: str | None = None
    max_tokens_per_trajectory: int = 200
    structured: bool = True  # cleared when the endpoint refuses response_format
    fallbacks: int = 0  # times it refused it
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    async def _post(self, body: dict[str, Any]) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            return await self.http.post(
                f"{self.base_url.rstrip('/')}/chat/completions", json=body, headers=headers
            )
        except httpx.TimeoutException as e:
            raise Unavailable("timeout", f"the judge did not answer in time ({type(e).__name__})") from None
        except httpx.TransportError as e:
            raise Unavailable(
                "unreachable", f"cannot reach the judge at {self.base_url}: {type(e).__name__}: {e}"
            ) from None

    async def complete(self, messages: list[dict[str, Any]], ids: list[str]) -> tuple[str, int, int]:
        """One chat completion: (answer text, prompt tokens, completion tokens)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": 0.0,
            "max_tokens": FRAME_TOKENS + self.max_tokens_per_trajectory * len(ids),
        }
        structured = self.structured
        if structured:
            body["response_format"] = response_format(ids)
        resp = await self._post(body)
        if resp.status_code == 400 and structured:
            body.pop("response_format")
            resp = await self._post(body)
            if resp.status_code == 200:  # it was response_format the endpoint refused: plain text from now on
                async with self._lock:
                    if self.structured:
                        self.structured = False
                        self.fallbacks += 1
        if resp.status_code in WAIT_STATUSES or resp.status_code >= 500:
            raise Unavailable(
                f"http_{resp.status_code}", f"the judge answered HTTP {resp.status_code}: {resp.text[:300]}"
            )
        if resp.status_code != 200:
            raise Rejected(f"the judge refused the request with HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            data = resp.json()
            text = data["choices"][0]["message"].get("content") or ""
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise Unavailable(
                "bad_response", f"the judge's reply is not a chat completion: {resp.text[:200]}"
            ) from None
        usage = data.get("usage") or {}
        return text, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)

    async def judge(self, request: JudgeRequest) -> Outcome:
        """Ask, parse, and on a bad answer ask once more quoting the error (module docstring)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out = Outcome(request, "unavailable")
        messages: list[dict[str, Any]] = list(request.messages)
        try:
            for attempt in range(2):
                text, p, c = await self.complete(messages, request.ids)
                out.prompt_tokens, out.completion_tokens, out.calls = (
                    out.prompt_tokens + p,
                    out.completion_tokens + c,
                    out.calls + 1,
                )
                out.parsed = parse_answer(text, request.ids)
                if out.parsed.ok:
                    out.status, out.kind, out.reason = "ok", None, None
                    break
                out.status, out.kind = "failed", out.parsed.kind
                out.reason = f"{out.parsed.error} (after {attempt + 1} answer{'s' if attempt else ''})"
                messages = retry_messages(request, text, out.parsed.error or "")
        except Unavailable as e:
            out.status, out.kind, out.reason = "unavailable", e.kind, str(e)
        except Rejected as e:
            out.status, out.kind, out.reason = "failed", "rejected", str(e)
        out.seconds = loop.time() - t0
        return out


async def judge_all(client: JudgeClient, requests: Iterable[JudgeRequest], concurrency: int) -> list[Outcome]:
    """Every request judged, at most ``concurrency`` in flight; outcomes in the requests' order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(r: JudgeRequest) -> Outcome:
        async with gate:
            return await client.judge(r)

    return list(await asyncio.gather(*(one(r) for r in requests)))
