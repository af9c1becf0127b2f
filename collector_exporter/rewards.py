"""The reward side channel: ``POST /v1/rewards`` bodies → rows of REWARDS_SCHEMA.

Validation is a pure function so the HTTP handler stays a shell: it parses, validates, appends
the normalized rows to the WAL, and acks. ``reward_id`` makes a retried POST idempotent: the
client may send its own; otherwise it is a hash of the reward's identity (target, name, value).
A later row with the same ``reward_id`` is a correction: the converter keeps only the latest one
(by received ``at``), so a client that wants to correct feedback sends its own ``reward_id``.

Feedback is keyed by whatever the client holds (at least one of): ``rollout_id``
(``tracerl.rollout_id``), ``trace_id`` (the trace the request ran in) or ``response_id`` (the
OpenAI id the app got back, ``chatcmpl-...``; it joins the rollout whose call span or gateway span
recorded that ``gen_ai.response.id``). The verdict is ``value`` (a finite number; ``true`` /
``false`` are 1.0 / 0.0) or ``thumbs`` (``"up"`` = 1.0, ``"down"`` = 0.0), never both.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import pyarrow as pa

from schemas.tables import REWARDS_SCHEMA, TS

MAX_REWARDS_PER_REQUEST = 10_000
_TEXT_FIELDS = ("rollout_id", "name", "response_id", "source", "reward_id")
_FIELDS = (
    "reward_id",
    "rollout_id",
    "trace_id",
    "span_id",
    "response_id",
    "name",
    "value",
    "thumbs",
    "source",
)
THUMBS = {"up": 1.0, "down": 0.0}
"""``"thumbs"`` spellings and the value each stands for (the same as ``"value": true`` / ``false``)."""


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


def _is_text(value: Any, *, allow_empty: bool) -> bool:
    """A string the store can hold: at most 256 characters and encodable as UTF-8 (JSON lets a
    client send a lone surrogate such as ``"\\ud800"``, which Arrow would refuse at compaction)."""
    if not isinstance(value, str) or len(value) > 256 or (not value and not allow_empty):
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _finite(value: Any) -> float | None:
    """``value`` as a finite float (``true`` / ``false``: 1.0 / 0.0, a thumbs up or down), or None
    (strings, NaN, ±inf, ints too large for a float)."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _verdict(item: dict[str, Any], i: int) -> float:
    """The reward a body item gives: its ``value`` or its ``thumbs`` (exactly one of them)."""
    if "thumbs" in item:
        if "value" in item:
            raise RewardError(f"reward {i}: give 'value' or 'thumbs', not both")
        thumbs = item["thumbs"]
        if not isinstance(thumbs, str) or thumbs.lower() not in THUMBS:
            raise RewardError(f'reward {i}: \'thumbs\' must be "up" or "down", got {str(thumbs)[:60]!r}')
        return THUMBS[thumbs.lower()]
    if "value" not in item:
        raise RewardError(
            f"reward {i}: 'value' is missing: give a number, true/false, or 'thumbs': \"up\"/\"down\""
        )
    value = _finite(item["value"])
    if value is None:
        raise RewardError(
            f"reward {i}: 'value' must be a finite number or true/false, got {str(item['value'])[:60]!r}"
        )
    return value


def parse_rewards(body: bytes) -> list[dict[str, Any]]:
    """Validate a side-channel body: one JSON object or a list of them.

    Each needs a verdict, ``value`` (finite number or bool) or ``thumbs`` (``up`` / ``down``), and a
    key, ``rollout_id``, ``trace_id`` or ``response_id``; ``name`` (default ``"reward"``),
    ``span_id`` and ``reward_id`` are optional. A bad field is named in the error (HTTP 400).
    """
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, an int past Python's digit limit, too deep
        raise RewardError(f"body is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
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
        value = _verdict(item, i)
        text = {key: item.get(key) for key in _TEXT_FIELDS}
        text["name"] = item.get("name", "reward")
        for key, v in text.items():
            if (v is not None or key == "name") and not _is_text(
                v, allow_empty=key in ("name", "source", "response_id")
            ):
                raise RewardError(
                    f"reward {i}: {key!r} must be a string of at most 256 characters in valid UTF-8 "
                    f"(rollout_id and reward_id non-empty), got {type(v).__name__} {str(v)[:60]!r}"
                )
        trace_id = _hex_id(item.get("trace_id"), 16, "trace_id", i)
        if text["rollout_id"] is None and trace_id is None and not text["response_id"]:
            raise RewardError(
                f"reward {i}: give 'rollout_id', 'trace_id' or 'response_id' (the id of the OpenAI "
                "response the app got back) so the reward can be joined to a rollout"
            )
        row = {
            "rollout_id": text["rollout_id"],
            "trace_id": trace_id,
            "span_id": _hex_id(item.get("span_id"), 8, "span_id", i),
            "response_id": text["response_id"],
            "name": text["name"],
            "value": value,
            "source": text["source"] or "side_channel",
        }
        reward_id = text["reward_id"]
        if reward_id is None:
            reward_id = hashlib.blake2b(json.dumps(row, sort_keys=True).encode(), digest_size=16).hexdigest()
        row["reward_id"] = reward_id
        rows.append(row)
    return rows


def rewards_to_table(rows: list[dict[str, Any]], received_at_ns: int) -> pa.Table:
    cols = {name: [r.get(name) for r in rows] for name in REWARDS_SCHEMA.names if name != "at"}
    cols["at"] = pa.array([received_at_ns] * len(rows), type=pa.int64()).cast(TS)
    return pa.table(cols, schema=REWARDS_SCHEMA)


DEDUPE_COLUMNS = ("reward_id", "rollout_id", "trace_id", "span_id", "response_id", "name", "value", "source")
"""What makes two stored rows the same reward row: a retried POST repeats all of it; a correction keeps the
``reward_id`` and changes the value, so it is stored beside the original (the converter keeps the latest)."""


def dedupe_keys(table: pa.Table) -> list[str]:
    """The compactor's dedupe key of each rewards row: its ``reward_id`` and content (``DEDUPE_COLUMNS``).
    A correction back to a value already posted under the same ``reward_id`` (1, then 0, then 1 again)
    within the dedupe window reads as a retry of the first row; send such a change with a new ``reward_id``."""
    cols = [table.column(c).to_pylist() for c in DEDUPE_COLUMNS]
    return [json.dumps(values) for values in zip(*cols)]
