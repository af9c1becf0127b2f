"""The eval gate before a canary (``tracerl train --canary --gate-tasks FILE``): a held-out task set
runs against the candidate and the serving version, and the candidate reaches live traffic only when
its success is no worse than serving's, within a margin.

Why: the canary (``loop.canary``) risks a share of real users until its sequential test decides; a
candidate that already fails held-out tasks it used to pass need not risk any. The gate runs after the
trainer loaded the candidate into its own server (the canary publisher's server not serving; the
gateway routes live traffic to it only once ``tracerl promote`` names the pair) and before the round
is written ``canary``. A candidate that fails is written ``rolled_back`` with the gate's numbers in the
manifest's ``canary`` column, so the next round trains from the serving version (``start_version``).

``gate_decision`` is the pure rule. ``arm_servers`` finds which server serves which arm from their
``/weight_info`` tags. ``server_gate`` is the thin shell: the rollout driver (as ``tracerl rollout``)
runs the agent per task against each arm's server directly (``OPENAI_BASE_URL``), with the agent's
tracing off (``OTEL_SDK_DISABLED``), so held-out rollouts never become training data, and its records
in a scratch store.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from serving.gateway.canary import serves

GATE_ENV = {
    "OTEL_SDK_DISABLED": "true",
    "OTEL_TRACES_EXPORTER": "none",
}  # held-out runs stay out of the store


@dataclass(frozen=True)
class GateResult:
    """The gate's numbers: each arm's held-out success (mean reward; a run with no reward counts 0)."""

    passed: bool
    n_serving: int
    n_candidate: int
    success_serving: float
    success_candidate: float
    unscored_serving: int  # runs that failed or got no reward (counted as 0)
    unscored_candidate: int
    margin: float
    reason: str
    serving_version: int | None = None
    candidate_version: int | None = None

    def record(self) -> dict[str, Any]:
        """The manifest's ``canary`` column for a candidate the gate stopped (``tracerl report`` reads it)."""
        return {
            "gate": asdict(self),
            "serving_version": self.serving_version,
            "candidate_version": self.candidate_version,
            "action": "rollback" if not self.passed else "gate",
        }

    def describe(self) -> str:
        head = "passed" if self.passed else "failed"
        return (
            f"gate {head}: candidate {self.success_candidate:.3f} (n={self.n_candidate}) vs serving "
            f"{self.success_serving:.3f} (n={self.n_serving}); {self.reason}"
        )


def success(rewards: Sequence[float | None]) -> tuple[float, int]:
    """Mean reward with a missing one (agent failed, timed out, unscored) as 0; and how many were missing."""
    missing = sum(r is None for r in rewards)
    return sum(r for r in rewards if r is not None) / len(rewards), missing


def gate_decision(
    serving: Sequence[float | None], candidate: Sequence[float | None], margin: float
) -> GateResult:
    """Pass when the candidate's held-out success >= serving's - ``margin`` (both over the same tasks)."""
    if margin < 0:
        raise ValueError(
            f"gate margin {margin} must be >= 0 (the loss of held-out success a release may cost)"
        )
    if not serving or not candidate:
        raise ValueError("the gate ran no held-out rollout on an arm; give --gate-tasks a file with tasks")
    s, s_missing = success(serving)
    c, c_missing = success(candidate)
    passed = c >= s - margin - 1e-12
    reason = (
        f"{c:.3f} >= {s:.3f} - margin {margin:g}"
        if passed
        else f"{c:.3f} < {s:.3f} - margin {margin:g}: the candidate is worse on the held-out tasks"
    )
    return GateResult(passed, len(serving), len(candidate), s, c, s_missing, c_missing, margin, reason)


def arm_servers(
    tags: Mapping[str, str | None], serving: int, candidate: int, served_name: str = "policy"
) -> tuple[str, str]:
    """(serving arm's URL, candidate's URL) among full-weight servers, by their ``/weight_info`` tags."""

    def first(version: int, avoid: str | None = None) -> str:
        for url, tag in tags.items():
            if url != avoid and serves(f"{served_name}@{version}", [], tag):
                return url
        raise ValueError(
            f"no server serves {served_name}@{version} (weight tags {dict(tags)}); the gate "
            "needs the candidate and the serving version each on its own server (--server A,B)"
        )

    cand = first(candidate)
    return first(serving, avoid=cand), cand


@dataclass
class GatePlan:
    """What the gate runs: the held-out tasks, the agent and its reward function, as ``tracerl rollout``."""

    tasks: list[Any]  # rollout.tasks.Task
    command: list[str]
    reward_fn: Callable[..., Any]
    n: int = 1
    margin: float = 0.05
    concurrency: int = 4
    timeout_s: float = 120.0
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))


def run_arm(plan: GatePlan, url: str) -> list[float | None]:
    """Every held-out (task, sample) against the server at ``url``; one reward (or None) per run."""
    from rollout.driver import Driver, run_rollouts
    from store.location import parse_store

    with tempfile.TemporaryDirectory(prefix="tracerl-gate-") as scratch:
        d = Driver(
            command=plan.command,
            tasks=plan.tasks,
            n=plan.n,
            concurrency=plan.concurrency,
            collector="",
            gateway=url.rstrip("/") + "/v1",
            reward_fn=plan.reward_fn,
            timeout_s=plan.timeout_s,
            store=parse_store(scratch),
            progress=False,
            base_env={**plan.base_env, **GATE_ENV},
        )
        records, _ = run_rollouts(d, out=io.StringIO())
    return [r.reward if r.status == "ok" else None for r in records]


def server_gate(
    urls: Sequence[str], plan: GatePlan, read_tag: Callable[[str], str | None], served_name: str = "policy"
) -> Callable[[Any], GateResult]:
    """The trainer's gate over the canary's two servers: ``gate(req)`` after ``req`` was published."""

    def gate(req: Any) -> GateResult:
        serving = req.serving_version if req.serving_version is not None else req.version - 1
        s_url, c_url = arm_servers({u: read_tag(u) for u in urls}, serving, req.version, served_name)
        result = gate_decision(run_arm(plan, s_url), run_arm(plan, c_url), plan.margin)
        return GateResult(**{**asdict(result), "serving_version": serving, "candidate_version": req.version})

    return gate


def gate_json(result: GateResult) -> str:
    return json.dumps(result.record())
