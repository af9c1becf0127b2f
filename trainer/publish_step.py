"""The round protocol's last step: announce a trained round's checkpoint to the engine and record the outcome.

The trainer knows only ``Publisher = Callable[[PublishRequest], GateVerdict | None]`` (``trainer/publish.py``
builds the one ``tracerl train --server`` uses; tests inject a recording callable). It raises when the engine
did not take the new policy: the round then stays ``trained`` and the next run publishes it again. A gated
canary publisher returns a verdict: a failed gate records the round ``rolled_back``.

The checkpoint a round publishes is staged, not yet complete (``trainer/checkpoint.py``): its files are
whole in the page cache, where the engine reads them, and its manifest comes with the fsync that runs
beside the publish. ``publish_round`` waits for that (``durable``) after the engine took the policy and
before it records the round: a round is never ``published`` with a checkpoint a power loss could take.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from schemas.attributes import version_name
from store.lease import Held
from store.location import StoreLocation
from trainer.checkpoint_store import CheckpointStore
from trainer.manifest import now_utc, read_rounds, write_round
from trainer.merge import served_weights


@dataclass(frozen=True)
class PublishRequest:
    """What a publisher needs to make ``name`` servable: vLLM ``load_lora_adapter`` or a weight reload."""

    name: str  # policy@<version>
    version: int
    checkpoint_path: Path
    adapter: bool
    base_model: Path
    previous: Path | None = None  # the full weights serving now (restored if a reload fails)
    serving_version: int | None = None  # the version this round trained from (a canary's serving arm)


class GateVerdict(Protocol):
    """What a gated canary publisher returns (``loop.gate.GateResult``): a failed gate rolls the round back."""

    passed: bool

    def record(self) -> dict[str, Any]: ...
    def describe(self) -> str: ...


Publisher = Callable[[PublishRequest], "GateVerdict | None"]  # None: published, no gate


def publish_round(
    loc: StoreLocation,
    ckpts: CheckpointStore,
    held: Held,
    row: dict[str, Any],
    base_model: Path,
    publisher: Publisher,
    log: Callable[[str], None],
    served_name: str = "policy",
    keep_checkpoints: int = 0,
    canary: bool = False,
    durable: Callable[[], object] | None = None,
) -> dict[str, Any]:
    """Publish round ``row``'s checkpoint as ``policy@k+1`` (the weights serving now named as the fallback of a
    full reload), wait for ``durable`` (the checkpoint's completion, when it runs beside the publish; its
    error leaves the round ``trained``), then record it ``published`` (``canary`` under ``--canary``,
    ``rolled_back`` when the gate failed) under the lease; prune old checkpoints to ``keep_checkpoints``.
    Returns the written row."""
    k = row["round"]
    req = _publish_request(loc, ckpts, row, base_model, served_name)
    t = time.perf_counter()
    verdict = publisher(req)  # raises on failure: the round stays 'trained' and the next run retries
    timings = json.loads(row["timings"] or "{}")
    timings["publish"] = time.perf_counter() - t
    if durable is not None:  # what the engine now serves is on disk, and the checkpoint complete
        t = time.perf_counter()
        durable()
        timings["durable_wait"] = time.perf_counter() - t
    if verdict is not None:
        log(f"round {k}: {req.name}: {verdict.describe()}")
    row = _published_row(row, verdict, canary, timings)
    held.confirm()
    write_round(loc, row)
    what = "rolled back" if row["status"] == "rolled_back" else "published"
    log(f"round {k}: {what} {req.name} from {req.checkpoint_path}")
    if keep_checkpoints:
        for gone in ckpts.prune(keep_checkpoints, protect=frozenset({req.serving_version})):
            log(
                f"round {k}: removed old checkpoint {ckpts.name(gone)} (--keep-checkpoints {keep_checkpoints})"
            )
    return row


def _publish_request(
    loc: StoreLocation, ckpts: CheckpointStore, row: dict[str, Any], base_model: Path, served_name: str
) -> PublishRequest:
    """What round ``row`` publishes: its checkpoint as ``policy@k+1``, beside the full weights serving its
    parent version now (``previous``, restored if a reload fails; the base model for version 0)."""
    k = row["round"]
    v = row["parent_version"] if row.get("parent_version") is not None else k
    prev = read_rounds(loc).get(v - 1) if v > 0 else None
    previous = served_weights(
        ckpts.ensure_local(v) if prev and prev["checkpoint_path"] else None,
        bool(prev and prev["adapter"]),
        base_model,
    )
    return PublishRequest(
        name=version_name(served_name, k + 1),
        version=k + 1,
        checkpoint_path=ckpts.ensure_local(k + 1),
        adapter=bool(row["adapter"]),
        base_model=base_model,
        previous=previous,
        serving_version=v,
    )


def _published_row(
    row: dict[str, Any], verdict: GateVerdict | None, canary: bool, timings: dict[str, float]
) -> dict[str, Any]:
    """The round's manifest row once the engine took the policy. A canary serves beside its parent until
    `tracerl promote` decides (loop/canary.py); one that fails the eval gate (loop/gate.py) never reaches
    live traffic: ``rolled_back``, and the next round trains from its parent."""
    status = "canary" if canary else "published"
    if verdict is not None:
        status = status if verdict.passed else "rolled_back"
        row = {**row, "canary": json.dumps(verdict.record())}
    return {**row, "status": status, "published_at": now_utc(), "timings": json.dumps(timings)}
