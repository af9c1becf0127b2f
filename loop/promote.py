"""``tracerl promote --once``: decide the newest canary round from the store, record it, tell the gateway.

A round published with ``tracerl train --canary`` has status ``canary``: its ``policy@k+1`` serves the
gateway's ``--canary`` share beside ``policy@v`` (the version the round trained from). Each run:

1. takes the store's training lock once (the manifest's one writer at a time; cron-safe: a held lock
   is "nothing done", not a wait);
2. reads both arms' rollouts *over the same window*, in the order they began: rollouts of ``policy@v``
   or ``policy@k+1`` whose first call started at or after the canary was published, one reward per
   rollout (``rollout_reward``), each with its arm (DuckDB over the transitions view);
3. decides (``loop.canary.decide``: an exact always-valid test, so running it every minute is sound) and
   writes the round's row: ``promoted`` or ``rolled_back`` with the numbers in its ``canary`` column,
   or still ``canary`` with the latest look's numbers;
4. then, with a gateway, tells it the pair and its share (``GatewayOrder``): ``policy@v`` serving and
   ``policy@k+1`` the candidate, at share 1 on promote, 0 on rollback, the gateway's own ``--canary``
   share while undecided. Naming the pair on every look is what lets one gateway follow round after
   round with no restart: it finds each version on its servers (``serving/gateway/canary.py``). The
   manifest is written first, so a run killed after it is finished by the next run, which pushes the
   recorded decision again.

An arm is the version that served the rollout (``policy_version``), not the transitions' ``canary_arm``:
the gateway's arm label is relative to the pair it held at that moment (after a promote, the old
candidate keeps the label ``candidate`` while it serves as the next round's ``policy@v``, until the
gateway hears the next pair), so the label would misfile such rollouts, and the version needs no join.

Everything it decides is a function of the store, so a trainer or cron job killed between canary and
decision resumes by running this again.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np

from loop.canary import PROMOTE, ROLL_BACK, WAIT, CanaryDecision, CanaryRule, decide
from store.location import StoreLocation
from store.views import connect_readonly
from trainer.manifest import read_rounds, start_version, train_lock, write_round

DECIDED = {PROMOTE: "promoted", ROLL_BACK: "rolled_back"}
SHARE = {"promoted": 1.0, "rolled_back": 0.0}  # the gateway's candidate share once decided


@dataclass(frozen=True)
class GatewayOrder:
    """What the gateway is told: the pair of versions and the candidate's share (None: the gateway's
    ``--canary`` share for a new candidate, its current one for the same candidate)."""

    serving: str  # "policy@5"
    candidate: str  # "policy@6"
    fraction: float | None


@dataclass
class PromoteOutcome:
    """What one run did: ``status`` is the round's status after it (or locked / nothing)."""

    status: str
    round: int | None = None
    decision: CanaryDecision | None = None
    message: str = ""


_WINDOW = """
WITH r AS (
    SELECT policy_version AS v, rollout_id, max(rollout_reward) AS reward, min(started_at) AS began
    FROM transitions
    WHERE policy_version IN (?, ?) AND rollout_reward IS NOT NULL
    GROUP BY 1, 2
)
"""
"""The two arms' rewarded rollouts, one row each (``r``), filtered to the window by the query's ``?``."""


def _window_rows(
    loc: StoreLocation, select: str, serving: int, candidate: int, since: datetime
) -> list[tuple]:
    """``select`` over the window's rollouts ``r`` (``_WINDOW``), on a read-only view of the store."""
    con = connect_readonly(loc)
    try:
        return con.execute(_WINDOW + select, [serving, candidate, since]).fetchall()
    finally:
        con.close()


def arm_sequence(
    loc: StoreLocation, serving: int, candidate: int, since: datetime
) -> tuple[np.ndarray, np.ndarray]:
    """The window's rewarded rollouts in the order they began: (is the candidate's, reward); the
    sequential test (``loop.canary``) pairs them in this order."""
    rows = _window_rows(
        loc,
        "SELECT v, reward FROM r WHERE CAST(began AS TIMESTAMPTZ) >= ? ORDER BY began, rollout_id",
        serving,
        candidate,
        since,
    )
    return np.array([int(v) == candidate for v, _ in rows], dtype=bool), np.array([float(x) for _, x in rows])


def newest_canary(rounds: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The newest round that was published as a canary (decided or not), or None."""
    for k in sorted(rounds, reverse=True):
        r = rounds[k]
        if r["status"] in ("canary", *DECIDED.values()):
            return r
        if r["status"] in ("published", "trained"):
            return None  # a newer round was published without a canary
    return None


def canary_json(
    d: CanaryDecision,
    rule: CanaryRule,
    serving: int,
    candidate: int,
    gate: dict[str, Any] | None = None,
) -> str:
    """The ``canary`` column: the decision, its rule, and the eval gate's numbers (``loop.gate``) when the
    round passed one before its canary (kept from the row the trainer wrote)."""
    return json.dumps(
        {
            **({"gate": gate} if gate else {}),
            **asdict(d),
            "serving_version": serving,
            "candidate_version": candidate,
            "alpha": rule.alpha,
            "margin": rule.margin,
            "min_per_arm": rule.min_per_arm,
            "test": "paired-blocks",
            "at": datetime.now(timezone.utc).isoformat(),
        }
    )


def promote_once(
    loc: StoreLocation,
    rule: CanaryRule | None = None,
    *,
    served_name: str = "policy",
    tell: Callable[[GatewayOrder], None] | None = None,
    log: Callable[[str], None] = print,
) -> PromoteOutcome:
    """One cron-safe look at the newest canary (module docstring). ``tell(order)`` tells the gateway."""
    rule = rule or CanaryRule()
    with train_lock(loc) as held:
        if held is None:
            msg = "another 'tracerl train' or 'tracerl promote' holds the lock on this store; nothing done"
            log(msg)
            return PromoteOutcome("locked", message=msg)
        rounds = read_rounds(loc)
        row = newest_canary(rounds)
        if row is None:
            msg = "no canary round in the store (publish with `tracerl train --canary`); nothing to decide"
            log(msg)
            return PromoteOutcome("nothing", message=msg)
        k = row["round"]
        serving, candidate = start_version(rounds, k), k + 1
        if row["status"] == "canary":
            d = decide(*arm_sequence(loc, serving, candidate, row["published_at"]), rule)
            status = DECIDED.get(d.action, "canary")
            gate = json.loads(row["canary"]).get("gate") if row.get("canary") else None
            row = {**row, "status": status, "canary": canary_json(d, rule, serving, candidate, gate)}
            held.confirm()
            write_round(loc, row)
            log(f"round {k}: {served_name}@{candidate} vs {served_name}@{serving}: {describe(d)}")
        else:
            d = None
            log(
                f"round {k}: {served_name}@{candidate} was {row['status']} earlier; the gateway is told again"
            )
    status = row["status"]
    if tell is not None:
        names = (f"{served_name}@{serving}", f"{served_name}@{candidate}")
        tell(GatewayOrder(*names, SHARE.get(status)))
    return PromoteOutcome(status, k, d, message=f"round {k} {status}")


def describe(d: CanaryDecision) -> str:
    """One line with the decision's numbers (for logs and ``tracerl report``)."""
    head = {PROMOTE: "promoted", ROLL_BACK: "rolled back", WAIT: "waiting"}[d.action]
    return (
        f"{head}: candidate {d.mean_candidate:.3f} (n={d.n_candidate}) vs serving {d.mean_serving:.3f} "
        f"(n={d.n_serving}), difference {d.diff:+.3f}; {d.reason}"
    )


def gateway_orders(
    url: str, token: str | None = None, timeout_s: float = 10.0
) -> Callable[[GatewayOrder], None]:
    """``tell`` for a running ``tracerl gateway --canary``: ``POST /v1/canary`` with the pair and share."""
    import httpx

    def tell(order: GatewayOrder) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        body = {k: v for k, v in asdict(order).items() if v is not None}
        try:
            with contextlib.closing(httpx.Client(timeout=timeout_s)) as c:
                r = c.post(url.rstrip("/").removesuffix("/v1") + "/v1/canary", json=body, headers=headers)
        except httpx.HTTPError as e:
            raise RuntimeError(f"gateway {url} unreachable ({type(e).__name__}: {e})") from e
        if r.status_code != 200:
            raise RuntimeError(f"gateway {url} answered {r.status_code} to POST /v1/canary: {r.text[:200]}")

    return tell
