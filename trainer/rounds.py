"""The round protocol: on-policy, idempotent, resumable (DESIGN.md "Training", issue #5).

Versions: the base model is ``policy@0``. Round k trains on rollouts that started on
``policy_version`` k and publishes ``policy@k+1`` from ``STORE/checkpoints/policy-<k+1>``. So rounds
are numbered from 0, and the n-th round trains on the data of the policy the (n-1)-th round published.

Asynchronous rounds (``--max-staleness K``): rollouts keep running while a round trains, so round k
also takes not-yet-used rollouts that started on versions k-K..k-1. A rollout's version is its
first call's; unused rollouts older than the window are dropped and counted
(``n_rollouts_too_stale``). The group rule: a task's group is every selected rollout of that task,
whatever version it started on (one baseline; each call's importance weight, pi_old/pi_behaviour
from the engine's recorded logprobs, corrects for the policy that sampled it: the decoupled PPO
objective of AReaL, Fu et al. 2025, sec. 5.2, with the truncation of TIS, Yao et al. 2025).

One call of ``run_once`` does at most one round, under an exclusive lock (cron-safe):

1. finish what a killed run left: publish a ``trained`` round that was not announced; resume a
   ``started``/``failed`` round from its recorded selection (if its checkpoint was already
   renamed into place, adopt it instead of training again);
2. otherwise count complete, rewarded, unused rollouts of version k; below ``--min-rollouts``
   (and ``--every`` not due) it writes nothing and returns ``waiting``: a rerun is a no-op;
3. record the selection (``checkpoints/round-<k>.json``: which rollouts and calls) and a
   ``started`` row in ``rounds``, train (here, or in ``--nproc`` ranks: ``trainer/launcher.py``),
   stage the checkpoint (whole and renamed into place, not yet durable: ``trainer/checkpoint.py``; on a
   bucket store: completed locally, then copied into the bucket, ``trainer/checkpoint_store.py``), mark
   ``trained``, publish while the checkpoint is made durable and complete beside, mark ``published``
   once it is. A ``trained`` round whose checkpoint a restart left incomplete is trained again.

The store may be a bucket (``s3://bucket/prefix``): the manifest, the selections and the lock (a
lease object, ``store/lease.py``, confirmed before every state write) live there, so a trainer on
another host resumes exactly where a dead one stopped, fetching the checkpoints it needs.

The selection file is what makes reruns safe: a rollout listed in an earlier round's selection
is never trained on again, and a resumed round trains on exactly the rollouts it started with.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from schemas.attributes import version_name
from store.lease import Held, LeaseLost
from store.location import StoreLocation, parse_store
from trainer.backends.base import StepCallback
from trainer.checkpoint import (
    clean_temp_dirs,
    is_complete,
    recover_checkpoints,
    write_json_atomic,
)
from trainer.checkpoint_store import CheckpointStore
from trainer.config import TrainSettings
from trainer.dataset_step import DatasetStep, dataset_step, usable_rollouts
from trainer.feedback_window import parse_duration
from trainer.manifest import (
    DONE,
    now_utc,
    read_rounds,
    read_selection,
    selection_path,
    start_version,
    train_lock,
    write_round,
)
from trainer.publish_step import GateVerdict, Publisher, PublishRequest, publish_round  # noqa: F401 (re-exported)
from trainer.round_metrics import metrics_json, metrics_line
from trainer.round_train import RoundJob, Trained, adopt_or_train


class TrainError(Exception):
    """A round cannot run as configured; the message names the cause and the fix."""


@dataclass
class RoundOutcome:
    """What one ``run_once`` did: ``published``, ``trained``, ``waiting`` or ``locked``."""

    status: str
    round: int | None = None
    trained: bool = False  # a new checkpoint was written (or adopted) by this call
    message: str = ""
    row: dict[str, Any] = field(default_factory=dict)


def run_once(
    settings: TrainSettings,
    *,
    publisher: Publisher | None = None,
    on_step: StepCallback | None = None,
    log: Callable[[str], None] = print,
    threads_now: Callable[[], int] | None = None,
) -> RoundOutcome:
    """Do the next step of the round protocol (module docstring); safe to call from cron.

    ``threads_now`` (in-process torch backend only): asked before each micro-batch for the torch
    threads to use, so a trainer sharing the machine with rollouts takes the cores they leave (the
    demo's asynchronous rounds: one beside the agents, all once they are done)."""
    if settings.nproc < 1:
        raise TrainError(f"--nproc must be >= 1, got {settings.nproc}")
    try:
        parse_duration(settings.feedback_window)
    except ValueError as e:
        raise TrainError(str(e)) from None
    if not settings.model:
        raise TrainError("no base model: pass --model DIR (make a tiny one with 'tracerl init-model DIR')")
    base_model = Path(settings.model).expanduser().resolve()
    if not (base_model / "config.json").exists():
        raise TrainError(f"--model {base_model} has no config.json; point it at a HF model directory")
    loc = _store(settings)
    if not loc.files("transitions") and not loc.files("checkpoints", suffix=".json"):
        msg = f"no transitions in {loc.uri} yet (run `tracerl convert`, or `collect --convert`); nothing written"
        log(msg)
        return RoundOutcome("waiting", message=msg)
    ckpts = CheckpointStore.of(loc, settings.checkpoints)
    with train_lock(loc) as held:
        if held is None:
            msg = "another 'tracerl train' holds the lock on this store; nothing done"
            log(msg)
            return RoundOutcome("locked", message=msg)
        clean_temp_dirs(ckpts.local)
        recovered = recover_checkpoints(ckpts.local)
        for d in recovered.completed:
            log(f"{d.name}: staged by a run that stopped before completing it; made durable and complete")
        for d in recovered.removed:
            log(
                f"{d.name}: staged before the machine restarted (its files may be torn); removed, its round "
                "is trained again"
            )
        try:
            return _run_locked(settings, loc, ckpts, held, base_model, publisher, on_step, log, threads_now)
        except LeaseLost as e:
            raise TrainError(
                f"{e}: this run stopped before committing; the holder now goes on from the store"
            ) from e


def _store(settings: TrainSettings) -> StoreLocation:
    """``--store`` as a location, refused with the fix when nothing is there."""
    try:
        loc = parse_store(settings.store)
    except (OSError, ValueError) as e:
        raise TrainError(f"--store {settings.store}: {e}") from e
    if loc.is_local and not Path(loc.root).is_dir():
        raise TrainError(
            f"no store at {loc.root}; pass --store DIR (or TRACERL_STORE), the directory "
            "`tracerl collect` writes"
        )
    if not loc.is_local and not loc.exists():
        raise TrainError(
            f"nothing stored at {loc.uri}; pass the s3://bucket/prefix `tracerl collect --store` writes"
        )
    return loc


@dataclass
class _Round:
    """What one run of ``tracerl train --once`` works with: the store, its lock, where checkpoints go, how to
    publish and report. The phases below take it instead of a long argument list."""

    settings: TrainSettings
    loc: StoreLocation
    ckpts: CheckpointStore
    held: Held
    base_model: Path
    publisher: Publisher | None
    log: Callable[[str], None]

    def publish(self, row: dict[str, Any], durable: Callable[[], object] | None = None) -> dict[str, Any]:
        s = self.settings
        return publish_round(
            self.loc,
            self.ckpts,
            self.held,
            row,
            self.base_model,
            self.publisher,
            self.log,
            s.served_name,
            s.keep_checkpoints,
            s.canary,
            durable,
        )

    def write(self, row: dict[str, Any]) -> None:
        self.held.confirm()  # a trainer that lost its lease writes nothing more
        write_round(self.loc, row)


def _unfinished(r: _Round, rounds: dict[int, dict[str, Any]], last: int | None) -> RoundOutcome | None:
    """An earlier run's round left trained but unannounced is published now; an undecided canary waits."""
    name = version_name(r.settings.served_name, (last or 0) + 1)
    if last is not None and rounds[last]["status"] == "trained" and r.publisher is not None:
        row = r.publish(rounds[last])
        return RoundOutcome(
            "published", last, row=row, message=f"published {name} (left unannounced by an earlier run)"
        )
    if last is not None and rounds[last]["status"] == "canary":
        msg = (
            f"round {last + 1}: waiting: {name} is a canary not yet decided; "
            "`tracerl promote --once` promotes or rolls it back"
        )
        r.log(msg)
        return RoundOutcome("waiting", last + 1, message=msg)
    return None


def _parent(r: _Round, rounds: dict[int, dict[str, Any]], k: int, v: int) -> Path | None:
    """Round k's starting weights (policy@v's checkpoint; the base model for v = 0), checked whole, and every
    earlier round trained from the same base model."""
    parent = r.ckpts.ensure_local(v) if v > 0 else None
    if parent is not None and not is_complete(parent):
        where = f" or {r.ckpts.name(k)}" if r.ckpts.mirror is not None else ""
        raise TrainError(
            f"round {k} starts from {parent}{where}, which is missing or incomplete; restore it, "
            "or start a new --store"
        )
    for row in rounds.values():
        if row["base_model"] and Path(row["base_model"]) != r.base_model:
            raise TrainError(
                f"round {row['round']} was trained from base model {row['base_model']}, not "
                f"{r.base_model}; use the same --model for every round of a store, or a new --store"
            )
    return parent


def _select(r: _Round, step: DatasetStep, k: int, v: int, last: int | None) -> RoundOutcome | dict[str, Any]:
    """Round k's selection: an interrupted run's (redone on the same calls), else a new one once enough
    rewarded rollouts with signal exist, written before training; a RoundOutcome "waiting" when not yet."""
    s, stats, window = r.settings, step.stats, step.window
    if step.selection is not None:
        trained_ids = set(step.selection["transition_ids"])
        step.samples = [x for x in step.samples if x.transition_id in trained_ids]
        return step.selection
    usable = stats.n_rollouts - stats.n_rollouts_incomplete - stats.n_rollouts_no_reward
    due = usable >= s.min_rollouts or _every_due(s, r.loc, last, usable)
    if not due or not step.samples:
        why = (
            f"{usable} complete rewarded rollouts of policy@{v} (need --min-rollouts {s.min_rollouts})"
            if not due
            else f"all {usable} rollouts of policy@{v} are in zero-reward-variance groups "
            f"(estimator {stats.estimator}; {stats.estimator_reason})"
        )
        msg = (
            f"round {k}: waiting: {why}"
            + (f"; {window.note()}" if window.note() else "")
            + "; nothing written"
        )
        r.log(msg)
        return RoundOutcome("waiting", k, message=msg)
    # consumed: the trained, those whose group had no signal, and those closed without feedback
    rollout_ids = sorted(
        {x.rollout_id for x in step.samples} | usable_rollouts(step.rows, step.exclude) | window.unrewarded
    )
    selection = {
        "round": k,
        "versions": [step.lo, v],
        "rollout_ids": rollout_ids,
        "transition_ids": sorted(x.transition_id for x in step.samples),
        "created_at": now_utc().isoformat(),
    }
    r.held.confirm()
    write_json_atomic(selection_path(r.loc, k), selection, r.loc.fs)
    return selection


def _run_locked(
    settings: TrainSettings,
    loc: StoreLocation,
    ckpts: CheckpointStore,
    held: Held,
    base_model: Path,
    publisher: Publisher | None,
    on_step: StepCallback | None,
    log: Callable[[str], None],
    threads_now: Callable[[], int] | None = None,
) -> RoundOutcome:
    r = _Round(settings, loc, ckpts, held, base_model, publisher, log)
    rounds = _redo_lost(r, read_rounds(loc))
    done = [k for k, row in rounds.items() if row["status"] in DONE]
    last = max(done) if done else None
    earlier = _unfinished(r, rounds, last)
    if earlier is not None:
        return earlier
    k = 0 if last is None else last + 1
    v = start_version(rounds, k)  # k, or the serving version after a rollback
    parent = _parent(r, rounds, k, v)
    timings: dict[str, float] = {}
    t = time.perf_counter()
    step = dataset_step(settings, loc, k, v, base_model)
    timings["dataset"] = time.perf_counter() - t
    selection = _select(r, step, k, v, last)
    if isinstance(selection, RoundOutcome):
        return selection
    row = _started_row(k, v, base_model, step, timings)
    r.write(row)
    final = ckpts.ensure_local(k + 1)
    job = RoundJob(
        settings, base_model, step, k, v, selection, parent, final, timings, on_step, threads_now, log
    )
    trained = _checkpoint(r, job, row)
    m = trained.metrics
    row.update(
        checkpoint_path=ckpts.name(k + 1),
        adapter=trained.adapter,
        loss=m.loss,
        kl=m.kl,
        clip_fraction=m.clip_fraction,
        timings=json.dumps(timings),
        status="trained",
        metrics=metrics_json(m, step.stats, trained.nproc),
    )
    row = _record_and_publish(r, row, trained)
    log(metrics_line(row, step.stats, m))
    return RoundOutcome(row["status"], k, message=f"round {k} {row['status']}", row=row, trained=True)


def _started_row(
    k: int, v: int, base_model: Path, step: DatasetStep, timings: dict[str, float]
) -> dict[str, Any]:
    """Round k's ``started`` row of the rounds manifest, written before training: what it trains on."""
    samples, stats = step.samples, step.stats
    return {
        "round": k,
        "policy_version": v,
        "parent_version": v,
        "base_model": str(base_model),
        "checkpoint_path": None,
        "adapter": None,
        "n_rollouts": len({s.rollout_id for s in samples}),
        "n_transitions": len(samples),
        "mean_reward": stats.mean_reward,
        "loss": None,
        "kl": None,
        "clip_fraction": None,
        "timings": json.dumps(timings),
        "published_at": None,
        "status": "started",
        "metrics": None,
        "estimator": stats.estimator,
        "estimator_reason": stats.estimator_reason,
    }


def _checkpoint(r: _Round, job: RoundJob, row: dict[str, Any]) -> Trained:
    """Round k's checkpoint, adopted or trained and staged, then (on a bucket store) uploaded. On a failure
    the background write settles first, then the round is recorded ``failed`` (unless the lease was lost:
    the store is another trainer's then, and nothing more is written)."""
    timings, trained = job.timings, None
    try:
        trained = _adopt_or_train(job)
        t = time.perf_counter()
        r.held.confirm()
        # on a bucket store the bucket's copy is whole before the publish, the resume state too
        if trained.pending is not None and r.ckpts.mirror is not None:
            timings["resume_state"], trained.pending = trained.pending.wait(), None
        if r.ckpts.upload(job.k + 1):
            timings["upload"] = time.perf_counter() - t
    except LeaseLost:
        _settle(trained)
        raise  # the store is another trainer's now: write nothing more
    except BaseException:
        _settle(trained)
        with contextlib.suppress(LeaseLost):
            r.write({**row, "status": "failed", "timings": json.dumps(timings)})
        raise
    return trained


def _adopt_or_train(job: RoundJob) -> Trained:
    """``adopt_or_train``, where a failed rank is a ``TrainError`` naming its error (the message the command
    prints)."""
    from trainer.launcher import RankError

    try:
        return adopt_or_train(job)
    except RankError as e:
        raise TrainError(str(e)) from e


def _record_and_publish(r: _Round, row: dict[str, Any], trained: Trained) -> dict[str, Any]:
    """Record the round ``trained`` (its checkpoint staged: a run that finds it incomplete redoes the round,
    ``_redo_lost``), publish it while the checkpoint is made durable beside, record it ``published`` once it
    is, and wait for the resume state. Returns the last row written."""
    k, pending = row["round"], trained.pending
    try:
        r.write(row)
        if r.publisher is not None:
            row = r.publish(row, functools.partial(pending.wait, 1) if pending is not None else None)
        if pending is not None:
            pending.wait()
            resume = (
                f", resume state (optimizer) written in {sum(pending.seconds[1:]):.1f}s"
                if len(pending.seconds) > 1
                else ""
            )
            r.log(
                f"round {k}: checkpoint made durable in {pending.seconds[0]:.2f}s{resume}, beside the publish"
            )
    except BaseException:
        _settle(trained)
        raise
    return row


def _settle(trained: Trained | None) -> None:
    """On the way out of a failed round: the background write finishes while the lock is still held (its
    own error aside: the caller's is raised), so no other run sees a checkpoint still being completed."""
    if trained is not None and trained.pending is not None:
        with contextlib.suppress(BaseException):
            trained.pending.wait()


def _redo_lost(r: _Round, rounds: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """A round recorded ``trained`` whose checkpoint is not complete (staged, then the machine stopped before
    the fsync: ``recover_checkpoints`` removed it) is recorded ``failed``, so it is trained again from its
    selection; never published from files a power loss may have torn. Only the newest round can be one (a
    round starts once the previous one is complete), so only its checkpoint is looked at (or fetched)."""
    k = max(rounds, default=None)
    if k is None or rounds[k]["status"] != "trained" or is_complete(r.ckpts.ensure_local(k + 1)):
        return rounds
    r.log(
        f"round {k}: its checkpoint {r.ckpts.name(k + 1)} is missing or incomplete (staged before the machine "
        f"stopped); training round {k} again from its recorded selection"
    )
    row = {**rounds[k], "status": "failed"}
    r.write(row)
    return {**rounds, k: row}


def _every_due(settings: TrainSettings, loc: StoreLocation, last: int | None, usable: int) -> bool:
    """``--every S``: S seconds after the previous round started, train with whatever (>= 2) rollouts exist."""
    if settings.every <= 0 or usable < 2:
        return False
    sel = read_selection(loc, last) if last is not None else None
    if sel is None:
        return True
    started = datetime.fromisoformat(sel["created_at"])
    return (now_utc() - started).total_seconds() >= settings.every


def watch(
    settings: TrainSettings,
    *,
    publisher: Publisher | None = None,
    log: Callable[[str], None] = print,
    sleep: Callable[[float], None] = time.sleep,
    between: Callable[[], None] | None = None,
) -> int:
    """``tracerl train --watch``: run rounds as data arrives until ``max_rounds`` (0: forever).
    ``between`` runs once per poll that trained nothing, outside the lock: the canary decision
    (``loop.promote.promote_once``), so an undecided canary is decided by the trainer that waits on it."""
    n = 0
    last_wait = ""

    def quiet_log(msg: str) -> None:  # the same "waiting" line every poll is noise: print it once
        nonlocal last_wait
        if "waiting" in msg or "holds the lock" in msg:
            if msg == last_wait:
                return
            last_wait = msg
        log(msg)

    while settings.max_rounds <= 0 or n < settings.max_rounds:
        out = run_once(settings, publisher=publisher, log=quiet_log)
        if out.trained:
            n += 1
        if out.status in DONE:
            continue
        if between is not None:
            between()
        sleep(settings.poll_s)
    return n
