"""The direct replay ``bench/round.py`` sets the gateway against: a round's recorded chat calls sent straight
to the engine (no gateway, no spans), with the same max_tokens, temperature and concurrency as the round.

Imported by ``bench/round.py`` with ``bench/`` on ``sys.path`` (the scripts are plain files, not a package).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

CAPTURE = {"return_token_ids": True, "logprobs": True}
"""What the gateway adds to each request; a replay with it tells the engine's cost of token capture from the proxy's."""


def served_name(server: str) -> str:
    """What the engine serves the newest policy as: ``policy@k`` for the newest loaded adapter, else ``policy``
    (what the gateway's latest-version alias resolves ``policy`` to)."""
    import httpx

    ids = [m["id"] for m in httpx.get(f"{server}/v1/models", timeout=10).json().get("data", [])]
    versions = [(int(m.group(1)), i) for i in ids if (m := re.fullmatch(r"policy@(\d+)", i))]
    return max(versions)[1] if versions else "policy"


def reset_prefix_cache(server: str) -> None:
    """Empty the engine's prefix cache, so a replay of prompts it has seen gains nothing from them."""
    import httpx

    with contextlib.suppress(httpx.HTTPError):
        httpx.post(f"{server}/reset_prefix_cache", timeout=30)


def replay(
    server: str, calls: list[list[list]], max_tokens: int, temperature: float, capture: bool = False
) -> tuple[float, int]:
    """The recorded chat calls straight to the engine: one thread per rollout, its calls in order, as in the
    round, each over its own connection with urllib as the demo agent's calls are; (seconds, completion
    tokens). ``capture``: with ``CAPTURE`` in each request."""
    import urllib.request

    model = served_name(server)
    extra = CAPTURE if capture else {}

    def one(messages_in_order: list[list]) -> int:
        n = 0
        for messages in messages_in_order:
            body = {
                "model": model,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "messages": messages,
                **extra,
            }
            req = urllib.request.Request(
                f"{server}/v1/chat/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=600) as r:
                n += int((json.load(r).get("usage") or {}).get("completion_tokens") or 0)
        return n

    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        t = time.perf_counter()
        tokens = sum(pool.map(one, calls))
        return time.perf_counter() - t, tokens


def direct_replays(server: str, calls: list[list[list]], max_tokens: int) -> dict[str, float]:
    """A round's calls replayed twice at temperature 1, plain then with ``CAPTURE``, the prefix cache reset
    before each (the round's prompts are cached: a replay must not gain by it)."""
    r: dict[str, float] = {}
    reset_prefix_cache(server)
    r["direct_s"], r["direct_tokens"] = replay(server, calls, max_tokens, 1.0)
    r["direct_tokens_per_s"] = r["direct_tokens"] / r["direct_s"]
    reset_prefix_cache(server)
    r["direct_capture_s"], r["direct_capture_tokens"] = replay(server, calls, max_tokens, 1.0, True)
    r["direct_capture_tokens_per_s"] = r["direct_capture_tokens"] / r["direct_capture_s"]
    return r
