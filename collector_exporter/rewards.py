"""The reward side channel: ``POST /v1/rewards`` bodies → rows of REWARDS_SCHEMA.

Validation is a pure function so the HTTP handler stays a shell: it parses, validates, appends
the normalized rows to the WAL, and acks. ``reward_id`` makes a retried POST idempotent: the
client may send its own; otherwise it is a hash of the reward's identity (target, name, value).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import pyarrow as pa

from schemas.tables import REWARDS_SCHEMA, TS

MAX_REWARDS_PER_REQUEST = 10_000
_FIELDS = ("reward_id", "rollout_id", "trace_id", "span_id", "response_id", "name", "value", "source")


class RewardError(ValueError):
    """A reward body that can never be accepted (HTTP 400)."""


def _hex_id(value: Any, n: int, what: str, i: int) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != 2 * n:
        raise RewardError(f"reward {i}: {what} must be {2 * n} hex characters, got {value!r}")
    try:
        bytes.fromhex(value)
    except ValueError:
        raise RewardError(f"reward {i}: {what} must be hex, got {value!r}") from None
    return value.lower()


def parse_rewards(body: bytes) -> list[dict[str, Any]]:
    """Validate a side-channel body: one JSON object or a list of them.

    Each needs ``value`` (finite number) and ``rollout_id`` or ``trace_id``; ``name``
    (default ``"reward"``), ``span_id``, ``response_id`` and ``reward_id`` are optional.
    """
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RewardError(f"body is not valid JSON: {e}") from None
    items = data if isinstance(data, list) else [data]
    if not items:
        raise RewardError("no rewards in body: send an object or a non-empty list of objects")
    if len(items) > MAX_REWARDS_PER_REQUEST:
        raise RewardError(f"{len(items)} rewards in one request; the limit is {MAX_REWARDS_PER_REQUEST}")
    rows = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise RewardError(f"reward {i}: expected a JSON object, got {type(item).__name__}")
        unknown = set(item) - set(_FIELDS)
        if unknown:
            raise RewardError(f"reward {i}: unknown field(s) {sorted(unknown)}; allowed: {list(_FIELDS)}")
        value = item.get("value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RewardError(f"reward {i}: 'value' must be a finite number, got {value!r}")
        rollout_id = item.get("rollout_id")
        if rollout_id is not None and (not isinstance(rollout_id, str) or not rollout_id or len(rollout_id) > 256):
            raise RewardError(f"reward {i}: 'rollout_id' must be a non-empty string of at most 256 characters")
        trace_id = _hex_id(item.get("trace_id"), 16, "trace_id", i)
        if rollout_id is None and trace_id is None:
            raise RewardError(f"reward {i}: give 'rollout_id' or 'trace_id' so the reward can be joined to a rollout")
        name = item.get("name", "reward")
        if not isinstance(name, str) or len(name) > 256:
            raise RewardError(f"reward {i}: 'name' must be a string of at most 256 characters")
        row = {
            "rollout_id": rollout_id,
            "trace_id": trace_id,
            "span_id": _hex_id(item.get("span_id"), 8, "span_id", i),
            "response_id": item.get("response_id"),
            "name": name,
            "value": float(value),
            "source": item.get("source") or "side_channel",
        }
        reward_id = item.get("reward_id")
        if reward_id is None:
            reward_id = hashlib.blake2b(json.dumps(row, sort_keys=True).encode(), digest_size=16).hexdigest()
        elif not isinstance(reward_id, str) or not reward_id or len(reward_id) > 256:
            raise RewardError(f"reward {i}: 'reward_id' must be a non-empty string of at most 256 characters")
        row["reward_id"] = reward_id
        rows.append(row)
    return rows


def rewards_to_table(rows: list[dict[str, Any]], received_at_ns: int) -> pa.Table:
    cols = {name: [r.get(name) for r in rows] for name in REWARDS_SCHEMA.names if name != "at"}
    cols["at"] = pa.array([received_at_ns] * len(rows), type=pa.int64()).cast(TS)
    return pa.table(cols, schema=REWARDS_SCHEMA)
