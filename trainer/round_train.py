"""Train one round into a staged checkpoint: pack the selected calls, train here or in ``--nproc`` ranks,
stage the checkpoint (whole, publishable, not yet durable) with its manifest; or adopt the checkpoint an
earlier run of the round wrote whole before it stopped. The round protocol (``trainer.rounds``) decides
when, records the round and publishes it."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schemas.attributes import version_name
from trainer import kept_model
from trainer.backends.base import StepCallback, TrainMetrics
from trainer.checkpoint import (
    BackgroundWrite,
    complete_checkpoint,
    git_sha,
    is_complete,
    read_manifest,
    stage_checkpoint,
)
from trainer.config import TrainSettings
from trainer.dataset_step import DatasetStep
from trainer.manifest import now_utc
from trainer.packing import Batch, make_batches


@dataclass
class Trained:
    """A round's training result: its metrics, whether it wrote an adapter, its ranks, and what is still being
    written beside the publish (the checkpoint's completion, then the resume state; None when adopted)."""

    metrics: TrainMetrics
    adapter: bool
    nproc: int
    pending: BackgroundWrite | None = None


def _adopt(final: Path, log: Callable[[str], None], k: int) -> Trained:
    """A checkpoint an earlier run of round k wrote whole before it stopped: taken as the round's result."""
    log(f"round {k}: adopting checkpoint {final} written before the previous run stopped")
    man = read_manifest(final)
    metrics = TrainMetrics(
        **{
            f.name: man["metrics"].get(f.name, 0)
            for f in dataclasses.fields(TrainMetrics)
            if f.name != "extra"
        }
    )
    return Trained(metrics, bool(man["adapter"]), int(man["settings"].get("nproc", 1)))


@dataclass
class RoundJob:
    """Everything round k's training phase takes: what it trains on, from which weights, into which directory,
    and how it reports (``timings`` is filled in by the phase)."""

    settings: TrainSettings
    base_model: Path
    step: DatasetStep  # the selected calls (samples), their counts (stats) and the tokenizer
    k: int  # the round; it publishes policy@k+1
    v: int  # the version its rollouts started on (k, or the serving version after a rollback)
    selection: dict[str, Any]  # the recorded selection (checkpoints/round-<k>.json)
    parent: Path | None  # policy@v's checkpoint; None: the base model
    final: Path  # where policy@k+1 is staged
    timings: dict[str, float]
    on_step: StepCallback | None = None
    threads_now: Callable[[], int] | None = None
    log: Callable[[str], None] = print


def adopt_or_train(job: RoundJob) -> Trained:
    """Round k's checkpoint: the one an earlier run of round k wrote whole before it stopped, adopted; else
    trained now (``_train_round``). A failed rank raises ``trainer.launcher.RankError``."""
    if is_complete(job.final) and read_manifest(job.final).get("round") == job.k:
        return _adopt(job.final, job.log, job.k)
    return _train_round(job)


def _train_round(job: RoundJob) -> Trained:
    """Pack, train (here or in ranks) and stage the checkpoint (``stage_checkpoint``: whole, publishable, not
    yet durable); its completion (fsync, manifest) and then the resume state follow in the background."""
    s, step, k, final = job.settings, job.step, job.k, job.final
    pad_id = step.tokenizer.pad_token_id if step.tokenizer.pad_token_id is not None else 0
    # OpenRLHF's model takes one sample per row: a shared prefix is the torch backend's alone
    batches = make_batches(
        step.samples, s.pack_tokens, pad_id, share_prefix=s.share_prefix and s.backend == "torch"
    )
    ranks = f" in {s.nproc} ranks" if s.nproc > 1 else " in 1 rank" if s.backend == "openrlhf" else ""
    job.log(
        f"round {k}: training on {len(job.selection['rollout_ids'])} rollouts, {len(step.samples)} calls, "
        f"{len(batches)} packed micro-batches{ranks}" + (" (resumed)" if step.selection is not None else "")
    )
    with contextlib.ExitStack() as stack:
        metrics, adapter, save, resume, backend = _train(job, batches, stack)
        t = time.perf_counter()
        manifest = _manifest(job, adapter, metrics)
        stage_checkpoint(final, save, manifest)
        job.timings["save"] = time.perf_counter() - t
    if backend is not None and s.keep_model and hasattr(backend, "renew"):
        kept_model.keep(backend, final, manifest["created_at"], s)
    after = [functools.partial(resume, final)] if resume else []
    return Trained(
        metrics, adapter, s.nproc, BackgroundWrite(functools.partial(complete_checkpoint, final), *after)
    )


def _manifest(job: RoundJob, adapter: bool, metrics: TrainMetrics) -> dict[str, Any]:
    """What the checkpoint says about itself (``tracerl_checkpoint.json``): its round and versions, what it
    was trained from and on, with which settings and code, and how the training went."""
    s, k = job.settings, job.k
    return {
        "round": k,
        "trained_on_version": job.v,
        "publishes": version_name(s.served_name, k + 1),
        "version": k + 1,
        "base_model": str(job.base_model),
        "parent": str(job.parent) if job.parent else None,
        "adapter": adapter,
        "backend": s.backend,
        "settings": dataclasses.asdict(s),
        "git_sha": git_sha(),
        "selection": job.selection,
        "dataset": dataclasses.asdict(job.step.stats),
        "metrics": dataclasses.asdict(metrics),
        "created_at": now_utc().isoformat(),
    }


def _train(
    job: RoundJob, batches: list[Batch], stack: contextlib.ExitStack
) -> tuple[TrainMetrics, bool, Callable[[Path], None], Callable[[Path], None] | None, Any]:
    """Train here, or in ``--nproc`` ranks (trainer/launcher.py; the openrlhf backend always, so DeepSpeed's
    process state never lives in this process); returns metrics, adapter flag, the ``save`` for
    ``stage_checkpoint`` and, in process, the deferred resume-state writer (None: ``save`` wrote it) and the
    backend (``keep_model``: the next round may continue with it, ``trainer/kept_model.py``).
    ``stack`` keeps the ranks' work dir until the checkpoint is written."""
    settings, base_model, parent, timings = job.settings, job.base_model, job.parent, job.timings
    if settings.nproc > 1 or settings.backend == "openrlhf":
        from trainer.launcher import train_ranks, work_dir

        work = stack.enter_context(work_dir(job.final))
        run = train_ranks(settings, base_model, parent, batches, work, job.on_step)
        timings["model_load"] = run.load_seconds
        timings["train"] = run.metrics.seconds
        return run.metrics, run.adapter, run.save, None, None
    from trainer.backends import load_backend

    t = time.perf_counter()
    backend = kept_model.take(settings, parent) if settings.keep_model else None
    if backend is None:
        backend = load_backend(settings.backend, settings, base_model, parent)
    timings["model_load"] = time.perf_counter() - t
    metrics = backend.train(batches, job.on_step, job.threads_now)
    timings["train"] = metrics.seconds
    resume = getattr(backend, "write_resume_state", None)
    if resume is not None:
        backend.defer_resume_state = True
    return metrics, bool(backend.adapter), backend.save, resume, backend
