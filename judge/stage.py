"""``tracerl judge``: one pass (``run_once``) over the store, like the converter's.

1. take the judge's lock (``store/lease.py``: flock on disk, a lease on S3); a pass that finds it held
   does nothing (cron-safe);
2. read the converted rollouts that have no reward of the judge's name (the ``transitions`` view, each
   rollout's latest conversion) and the judge's record of groups that failed under this rubric hash;
3. plan the calls (``groups.py``), ask the judge concurrently (``client.py``);
4. write one rewards file with a row per scored rollout (``source = judge``), through the store's one
   atomic Parquet writer, and save the failure record; the lease is confirmed right before.

The converter converts a rollout again when a reward row for it arrives, so the judge's rows reach the
transitions (and training) on its next pass, with ``reward_source`` naming ``judge``. Rollouts are read
from the transitions, so a store whose agent posts no reward must be converted with
``--missing-reward keep`` (or ``fill``): the default excludes reward-less rollouts from the transitions.
An unavailable judge writes nothing and records nothing: its rollouts are found again next pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import threading
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa

from judge.client import JudgeClient, Outcome, judge_all
from judge.config import JudgeSettings, api_key
from judge.groups import plan
from judge.prompts import default_rubric, rubric_hash
from judge.rows import reward_rows
from judge.trajectories import rollouts_from_rows
from schemas.tables import REWARDS_SCHEMA
from store.atomic import write_atomic
from store.lease import JUDGE_LOCK, hold
from store.location import StoreLocation, parse_store
from store.parquet import write_table_atomic
from store.views import connect_readonly

logger = logging.getLogger("tracerl.judge")

CANDIDATES_SQL = """
WITH judged AS (
    SELECT rollout_id FROM rewards WHERE name = $name AND rollout_id IS NOT NULL
    UNION
    SELECT t.rollout_id FROM transitions t JOIN rewards r ON r.trace_id = t.trace_id
    WHERE r.name = $name AND r.rollout_id IS NULL
)
SELECT rollout_id, task_id, step, prompt_messages, response_message, tools, agent_name,
       epoch_ns(ended_at) AS ended_at
FROM transitions
WHERE rollout_id NOT IN (SELECT rollout_id FROM judged)
  AND (NOT $unrewarded_only OR rollout_id IN (
      SELECT rollout_id FROM transitions GROUP BY 1 HAVING max(rollout_reward) IS NULL))
ORDER BY rollout_id, step
"""
"""Converted rollouts with no reward of the judge's name, by rollout id or by any of their traces (and, with
``unrewarded_only``, no reward on any channel: converted with ``--missing-reward keep``, reward null)."""


@dataclass
class JudgeStats:
    """What one pass did; ``failures`` and ``unavailable`` count groups by reason."""

    rubric_hash: str = ""
    locked: bool = False  # another judge held the lock: this pass did nothing
    candidates: int = 0  # rollouts without a reward of this name
    waiting: int = 0  # group mode: their task may still grow
    skipped_failed: int = 0
    requests: int = 0
    calls: int = 0  # HTTP calls, retries included
    groups_scored: int = 0
    rows_written: int = 0
    file: str | None = None
    failures: dict[str, int] = field(default_factory=dict)
    unavailable: dict[str, int] = field(default_factory=dict)
    rollouts_waiting_for_judge: int = 0  # their group's call could not be made: found again next pass
    structured_fallbacks: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    last_error: str | None = None  # one unavailable reason in words, for the summary

    def summary(self) -> str:
        if self.locked:
            return "another `tracerl judge` holds the store's judge lock; this pass did nothing"
        lines = [
            f"judge {self.rubric_hash}: {self.candidates} rollouts without a judge reward; "
            f"{self.requests} judge requests ({self.calls} calls), {self.groups_scored} scored, "
            f"{self.rows_written} reward rows written in {self.seconds:.1f}s"
        ]
        if self.prompt_tokens or self.completion_tokens:
            lines.append(f"judge tokens: {self.prompt_tokens} prompt, {self.completion_tokens} completion")
        if self.waiting:
            lines.append(f"waiting for their task's group to settle (--group-wait-s): {self.waiting}")
        if self.failures:
            lines.append(
                f"groups failed (no reward, not asked again; --retry-failed asks again): {self.failures}"
            )
        if self.skipped_failed:
            lines.append(f"rollouts skipped, their group failed before: {self.skipped_failed}")
        if self.unavailable:
            lines.append(
                f"judge unavailable for {sum(self.unavailable.values())} groups {self.unavailable}; their "
                f"{self.rollouts_waiting_for_judge} rollouts wait for the next pass ({self.last_error})"
            )
        if self.structured_fallbacks:
            lines.append(
                "the endpoint refused response_format (structured output); answers were parsed as text"
            )
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The failure record: judge/<name>.json


def state_path(loc: StoreLocation, name: str) -> str:
    return loc.path("judge", f"{name}.json")


def load_state(loc: StoreLocation, name: str) -> dict[str, Any]:
    """``{"failed": {rubric_hash: {rollout_id: reason}}, "failures": {kind: count}}`` (empty when new)."""
    p = state_path(loc, name)
    if not loc.is_file(p):
        return {"failed": {}, "failures": {}}
    return json.loads(loc.read_bytes(p))


def _save_state(loc: StoreLocation, name: str, state: dict[str, Any]) -> None:
    p = state_path(loc, name)
    if loc.is_local:
        Path(p).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(p, json.dumps(state, sort_keys=True).encode(), loc.fs)


# ---------------------------------------------------------------------------------------------
# One pass


def candidate_rows(loc: StoreLocation, name: str, unrewarded_only: bool = False) -> list[dict[str, Any]]:
    """The transition rows of every converted rollout with no reward named ``name`` (``CANDIDATES_SQL``)."""
    con = connect_readonly(loc)
    try:
        params = {"name": name, "unrewarded_only": unrewarded_only}
        return con.sql(CANDIDATES_SQL, params=params).to_arrow_table().to_pylist()
    finally:
        con.close()


def _rewards_file(loc: StoreLocation, rows: list[dict[str, Any]], name: str, at_ns: int) -> str:
    """Write ``rows`` as one rewards file; its name follows from its reward ids (a rewrite replaces it)."""
    digest = hashlib.sha256("".join(sorted(r["reward_id"] for r in rows)).encode()).hexdigest()[:16]
    date = datetime.fromtimestamp(at_ns / 1e9, tz=timezone.utc).strftime("%Y-%m-%d")
    path = loc.path("rewards", f"date={date}", f"judge-{name}-{digest}.parquet")
    cols = {n: [r[n] for r in rows] for n in REWARDS_SCHEMA.names if n != "at"}
    cols["at"] = pa.array([r["at"] for r in rows], pa.int64()).cast(REWARDS_SCHEMA.field("at").type)
    if loc.is_local:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_table_atomic(pa.table(cols, schema=REWARDS_SCHEMA), path, "rewards", fs=loc.fs)
    return path


def _tally(stats: JudgeStats, outcomes: list[Outcome]) -> None:
    for o in outcomes:
        stats.calls += o.calls
        stats.prompt_tokens += o.prompt_tokens
        stats.completion_tokens += o.completion_tokens
        if o.status == "ok":
            stats.groups_scored += 1
        elif o.status == "failed":
            stats.failures[o.kind or "failed"] = stats.failures.get(o.kind or "failed", 0) + 1
        else:
            stats.unavailable[o.kind or "unavailable"] = stats.unavailable.get(o.kind or "unavailable", 0) + 1
            stats.rollouts_waiting_for_judge += len(o.request.rollout_ids)
            stats.last_error = o.reason


def run_once(
    settings: JudgeSettings,
    *,
    now_ns: int | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    only: Collection[str] | None = None,
) -> JudgeStats:
    """Judge every ready rollout of ``settings.store`` that has no reward of ``settings.name`` (module
    docstring), or only those of them in ``only`` (``tracerl demo --reward judge``: the round's rollouts,
    never the held-out evaluation's). Safe to run from cron: a held lock, an unreachable judge or a crash
    leaves nothing half done."""
    settings.validate()
    t0 = time.perf_counter()
    loc = parse_store(settings.store)
    rubric = Path(settings.rubric).read_text(encoding="utf-8") if settings.rubric else default_rubric()
    assert settings.judge_model is not None  # validate() said so
    rhash = rubric_hash(rubric, settings.mode, settings.judge_model)
    stats = JudgeStats(rubric_hash=rhash)
    with contextlib.ExitStack() as stack:
        try:  # only taking the lock may raise TimeoutError here: another judge holds it
            held = stack.enter_context(hold(loc, JUDGE_LOCK, wait_s=0))
        except TimeoutError:
            stats.locked = True
        else:
            _pass(loc, settings, rubric, rhash, stats, now_ns, transport, held.confirm, only)
    stats.seconds = time.perf_counter() - t0
    return stats


def _pass(
    loc: StoreLocation,
    settings: JudgeSettings,
    rubric: str,
    rhash: str,
    stats: JudgeStats,
    now_ns: int | None,
    transport: httpx.AsyncBaseTransport | None,
    confirm: Any,
    only: Collection[str] | None = None,
) -> None:
    state = load_state(loc, settings.name)
    failed = state["failed"].setdefault(rhash, {})
    rows = candidate_rows(loc, settings.name, settings.unrewarded_only)
    if only is not None:
        wanted = set(only)
        rows = [r for r in rows if r["rollout_id"] in wanted]
    rollouts = rollouts_from_rows(rows)
    stats.candidates = len(rollouts)
    now_ns = time.time_ns() if now_ns is None else now_ns
    todo = plan(
        rollouts,
        mode=settings.mode,
        rubric=rubric,
        now_ns=now_ns,
        group_wait_s=settings.group_wait_s,
        max_group=settings.max_group,
        failed=frozenset() if settings.retry_failed else frozenset(failed),
    )
    stats.waiting, stats.skipped_failed, stats.requests = (
        todo.waiting,
        todo.skipped_failed,
        len(todo.requests),
    )
    if not todo.requests:
        return
    outcomes, fallbacks = asyncio.run(_ask(settings, todo.requests, transport))
    stats.structured_fallbacks = fallbacks
    _tally(stats, outcomes)
    at_ns = time.time_ns()
    rows = [
        row
        for o in outcomes
        for row in reward_rows(
            o, name=settings.name, model=settings.judge_model or "", rubric_hash=rhash, at_ns=at_ns
        )
    ]
    changed = _record_failures(state, failed, outcomes, stats)
    confirm()
    if rows:
        stats.file = _rewards_file(loc, rows, settings.name, at_ns)
        stats.rows_written = len(rows)
    if changed:
        _save_state(loc, settings.name, state)


def _record_failures(
    state: dict[str, Any], failed: dict[str, str], outcomes: list[Outcome], stats: JudgeStats
) -> bool:
    """Failed groups' rollouts into the record (with the reason), scored ones out of it, the counts added;
    whether the record changed. Unavailable groups are not recorded: they are asked again next pass."""
    for o in outcomes:
        for rid in o.request.rollout_ids:
            if o.status == "failed":
                failed[rid] = f"{o.kind}: {o.reason}"[:300]
            elif o.status == "ok":
                failed.pop(rid, None)
    for kind, n in stats.failures.items():
        state["failures"][kind] = state["failures"].get(kind, 0) + n
    return bool(stats.failures) or any(o.status == "ok" for o in outcomes)


async def _ask(
    settings: JudgeSettings, requests: list[Any], transport: httpx.AsyncBaseTransport | None
) -> tuple[list[Outcome], int]:
    timeout = httpx.Timeout(settings.judge_timeout_s, connect=min(10.0, settings.judge_timeout_s))
    limits = httpx.Limits(max_connections=settings.judge_concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as http:
        client = JudgeClient(
            http, settings.judge_url, settings.judge_model or "", api_key(), settings.max_tokens
        )
        outcomes = await judge_all(client, requests, settings.judge_concurrency)
        return outcomes, client.fallbacks


def watch(settings: JudgeSettings, stop: threading.Event) -> None:
    """Run a pass every ``settings.every_s`` seconds until ``stop`` is set; a failing pass is logged and
    retried on the next tick, never raised (the judge must not die with a flaky store or endpoint)."""
    while not stop.is_set():
        try:
            stats = run_once(settings)
            if stats.requests or stats.unavailable:
                logger.info("judge: %s", stats.summary().replace("\n", "; "))
        except Exception:
            logger.exception("judge pass failed (will retry in %.0fs)", settings.every_s)
        stop.wait(settings.every_s)


def stats_dict(stats: JudgeStats) -> dict[str, Any]:
    return asdict(stats)
