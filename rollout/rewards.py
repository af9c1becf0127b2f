"""Scoring a finished run and posting the score to the collector's reward side channel.

A reward function error or a POST the collector could not take is recorded on the rollout, never
raised: a driver run is never lost to one bad score.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from options import UsageError

RewardFn = Callable[[dict, str], float]


def reward_post_delays(attempts: int = 6, base_s: float = 0.2, cap_s: float = 5.0) -> list[float]:
    """Waits before each re-POST of a reward (exponential backoff): 0.2, 0.4, 0.8, ... capped."""
    return [min(cap_s, base_s * 2**i) for i in range(attempts - 1)]


def is_retryable_status(code: int) -> bool:
    """The collector answers 503 (WAL backlog, low disk) or 429 when it wants the client to retry."""
    return code in (429, 502, 503, 504)


def load_reward_fn(spec: str) -> RewardFn:
    """``pkg.module:fn`` or ``path/to/file.py:fn`` → the callable; a usage error names what is wrong."""
    mod_name, sep, fn_name = spec.rpartition(":")
    if not sep or not mod_name or not fn_name:
        raise UsageError(f"--reward {spec!r} must be MODULE:FUNCTION or FILE.py:FUNCTION, e.g. "
                         f"examples/demo/reward.py:score")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            if not path.is_file():
                raise UsageError(f"--reward: no file {mod_name}")
            spec_obj = importlib.util.spec_from_file_location(f"tracerl_reward_{path.stem}", path)
            assert spec_obj and spec_obj.loader
            module = importlib.util.module_from_spec(spec_obj)
            spec_obj.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"--reward: cannot import {mod_name}: {type(e).__name__}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UsageError(f"--reward: {mod_name} has no function {fn_name!r}")
    return fn


def compute_reward(fn: RewardFn, task: dict, stdout: str) -> tuple[float | None, str | None]:
    """Call the user's reward function; a raise or a non-finite value is an error, not a crash."""
    try:
        value = fn(task, stdout)
    except Exception as e:
        return None, f"reward function raised {type(e).__name__}: {e}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None, f"reward function returned {value!r}; it must return a finite float"
    return float(value), None


def post_reward(client: Any, collector: str, rollout_id: str, value: float, name: str,
                delays: list[float] | None = None) -> str | None:
    """POST one reward to the collector; retry on 503/429/connection errors. Returns an error or None.

    ``reward_id`` is fixed per (rollout, name), so a retry after a lost ack is deduplicated.
    """
    import httpx

    url = collector.rstrip("/") + "/v1/rewards"
    body = {"rollout_id": rollout_id, "value": value, "name": name, "reward_id": f"{rollout_id}:{name}"}
    delays = reward_post_delays() if delays is None else delays
    last = ""
    for attempt in range(len(delays) + 1):
        wait = delays[attempt] if attempt < len(delays) else 0.0
        try:
            resp = client.post(url, json=body)
        except httpx.TransportError as e:
            last = f"{type(e).__name__}: {e}"
        else:
            if resp.status_code == 200:
                return None
            last = f"HTTP {resp.status_code}: {resp.text[:200]}"
            if not is_retryable_status(resp.status_code):
                return f"collector refused the reward ({last})"
            retry_after = resp.headers.get("Retry-After")
            if retry_after and retry_after.replace(".", "", 1).isdigit():
                wait = max(wait, min(float(retry_after), 10.0))
        if attempt < len(delays):
            time.sleep(wait)
    return f"could not post reward to {url} after {len(delays) + 1} attempts ({last})"

