"""The rollouts table's filters, sort and page: parsed from the query string, turned into SQL.

Pure and strict: every value a user can type is checked here and becomes a SQL *parameter*; the
only text spliced into the SQL is chosen from the fixed tables below (column names, ASC/DESC), so
no filter value can change the query. A bad value raises ``FilterError``, which the app answers
with a 400 page that names the field and what it accepts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from typing import Any

TOKEN_SOURCES = ("gateway", "span", "retokenized")
SORTS: dict[str, str] = {
    "started": "started_at",
    "reward": "reward",
    "calls": "n_calls",
    "task": "task_id",
    "version": "version",
    "rollout": "rollout_id",
}
"""Sort key (as in the URL) -> column of the filtered rollouts."""
PAGE_SIZES = (25, 50, 100, 200)
MAX_PAGE = 100_000


class FilterError(ValueError):
    """A query-string value the rollouts table cannot use; the message names the field and the fix."""


@dataclass(frozen=True)
class RolloutQuery:
    """One view of the rollouts table: what to keep, how to sort it, which page."""

    task: str | None = None
    agent: str | None = None
    version: int | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    token_source: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    sort: str = "started"
    desc: bool = True
    page: int = 1
    page_size: int = 50

    def params(self, **change: Any) -> dict[str, str]:
        """This query as URL parameters (defaults left out), with ``change`` applied: for links."""
        out: dict[str, str] = {}
        base = RolloutQuery()
        for f in fields(self):
            v = change.get(f.name, getattr(self, f.name))
            if v == getattr(base, f.name) or v is None:
                continue
            if isinstance(v, datetime):
                v = v.strftime("%Y-%m-%dT%H:%M:%S")
            elif isinstance(v, bool):
                v = "desc" if v else "asc"
            out["order" if f.name == "desc" else f.name] = str(v)
        return out


def _number(name: str, text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise FilterError(f"{name} must be a number, e.g. {name}=0.5; got {text[:40]!r}") from None
    if not math.isfinite(v):
        raise FilterError(f"{name} must be a finite number; got {text[:40]!r}")
    return v


def _integer(name: str, text: str, lo: int, hi: int) -> int:
    if not text.strip().lstrip("-").isdigit():
        raise FilterError(f"{name} must be a whole number from {lo} to {hi}; got {text[:40]!r}")
    v = int(text)
    if not lo <= v <= hi:
        raise FilterError(f"{name} must be from {lo} to {hi}; got {v}")
    return v


def _time(name: str, text: str) -> datetime:
    try:
        t = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise FilterError(
            f"{name} must be a date or time like 2026-11-24T13:05 (UTC unless it says +HH:MM); got {text[:40]!r}"
        ) from None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def parse_query(params: Mapping[str, str]) -> RolloutQuery:
    """The rollouts query in ``params`` (empty values mean "no filter"); ``FilterError`` when a value is bad."""
    p = {k: v for k, v in params.items() if v is not None and v.strip() != ""}
    known = {"task", "agent", "version", "reward_min", "reward_max", "token_source", "since", "until",
             "sort", "order", "page", "page_size", "token"}
    unknown = sorted(set(p) - known)
    if unknown:
        raise FilterError(f"unknown filter {unknown[0]!r}; the filters are: {', '.join(sorted(known - {'token'}))}")
    q: dict[str, Any] = {}
    for name in ("task", "agent"):
        if name in p:
            if len(p[name]) > 500:
                raise FilterError(f"{name} is longer than 500 characters")
            q[name] = p[name]
    if "version" in p:
        q["version"] = _integer("version", p["version"], 0, 2**62)
    for name in ("reward_min", "reward_max"):
        if name in p:
            q[name] = _number(name, p[name])
    if "reward_min" in q and "reward_max" in q and q["reward_min"] > q["reward_max"]:
        raise FilterError(f"reward_min {q['reward_min']:g} is above reward_max {q['reward_max']:g}")
    if "token_source" in p:
        if p["token_source"] not in TOKEN_SOURCES:
            raise FilterError(f"token_source must be one of {', '.join(TOKEN_SOURCES)}; got {p['token_source'][:40]!r}")
        q["token_source"] = p["token_source"]
    for name in ("since", "until"):
        if name in p:
            q[name] = _time(name, p[name])
    if "sort" in p:
        if p["sort"] not in SORTS:
            raise FilterError(f"sort must be one of {', '.join(SORTS)}; got {p['sort'][:40]!r}")
        q["sort"] = p["sort"]
    if "order" in p:
        if p["order"] not in ("asc", "desc"):
            raise FilterError(f"order must be asc or desc; got {p['order'][:40]!r}")
        q["desc"] = p["order"] == "desc"
    if "page" in p:
        q["page"] = _integer("page", p["page"], 1, MAX_PAGE)
    if "page_size" in p:
        q["page_size"] = _integer("page_size", p["page_size"], 1, max(PAGE_SIZES))
    return RolloutQuery(**q)


FILTERED = """
SELECT rollout_id, task_id, reward, n_calls, n_trainable, agents, version, token_coverage, started_at, ended_at
FROM ui_rollouts
WHERE ($task IS NULL OR task_id = $task)
  AND ($agent IS NULL OR list_contains(agents, $agent))
  AND ($version IS NULL OR version = $version)
  AND ($reward_min IS NULL OR reward >= $reward_min)
  AND ($reward_max IS NULL OR reward <= $reward_max)
  AND ($since IS NULL OR started_at >= $since)
  AND ($until IS NULL OR started_at < $until)
  AND ($token_source IS NULL OR list_contains(token_sources, $token_source))
"""
"""The filtered rollouts, from the reader's per-rollout table (``ui.store.ROLLOUT_INDEX_SQL``).
Unversioned calls (the base model served under its plain name) count as version 0, as the trainer's
default ``--unversioned-as 0`` does."""


def rollouts_sql(q: RolloutQuery) -> tuple[str, dict[str, Any]]:
    """One statement: the page of rollouts, each row also carrying the totals of the whole filtered set
    (count, and what doctor would flag: no reward, calls without exact tokens, calls with no agent)."""
    order = f"{SORTS[q.sort]} {'DESC' if q.desc else 'ASC'} NULLS LAST, rollout_id"
    sql = f"""
WITH f AS MATERIALIZED ({FILTERED}),
totals AS (
    SELECT count(*) AS total,
           count(*) FILTER (WHERE reward IS NULL) AS no_reward,
           count(*) FILTER (WHERE token_coverage < 1) AS inexact_tokens,
           count(*) FILTER (WHERE len(agents) = 0) AS no_agent,
           count(*) FILTER (WHERE n_trainable = 0) AS untrainable
    FROM f
),
page AS (SELECT * FROM f ORDER BY {order} LIMIT $limit OFFSET $offset)
SELECT totals.*, page.* FROM totals LEFT JOIN page ON true ORDER BY {order.replace("rollout_id", "page.rollout_id")}
"""
    params: dict[str, Any] = {
        "task": q.task,
        "agent": q.agent,
        "version": q.version,
        "reward_min": q.reward_min,
        "reward_max": q.reward_max,
        "since": q.since,
        "until": q.until,
        "token_source": q.token_source,
        "limit": q.page_size,
        "offset": (q.page - 1) * q.page_size,
    }
    return sql, params
