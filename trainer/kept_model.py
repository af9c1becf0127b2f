"""The trained model kept in memory from one round to the next in one process (``keep_model``).

Why: a round that starts from the checkpoint this same process just wrote would read it back: the base
model, the adapter on it, the optimizer's moments. That took 0.9-1.0 s of every demo round on 2 cores
(SmolLM2-135M LoRA; ``model_load`` in the rounds manifest), time in which nothing trains. What was
written is what is in memory (the adapter and the moments are saved as held; full weights keep an fp32
``master/`` copy when served in a lower precision), so the next round takes the model as it is.

Taken only when the round's parent is exactly the checkpoint this process staged last (the same directory,
and its manifest's ``created_at``: a checkpoint trained again or restored from a bucket is another one) and
the settings are the same but for the torch threads; anything else loads from disk as before. Off by
default: a ``--watch`` trainer waiting hours for data would hold the model's memory (a GPU's) meanwhile.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.checkpoint import is_complete, read_manifest
from trainer.config import TrainSettings


@dataclass(frozen=True)
class Kept:
    """A backend after its round, and the checkpoint it was staged as."""

    backend: Any
    checkpoint: Path
    created_at: str  # the checkpoint's manifest stamp
    settings: TrainSettings


_kept: Kept | None = None


def same_run(a: TrainSettings, b: TrainSettings) -> bool:
    """The settings agree on everything that shapes the model and its training (all but the threads, which
    the loop sets per round)."""
    return dataclasses.replace(a, threads=0) == dataclasses.replace(b, threads=0)


def reusable(kept: Kept, settings: TrainSettings, parent: Path | None, parent_stamp: str | None) -> bool:
    """Whether ``kept`` is the model a round starting from ``parent`` (its manifest's ``created_at``:
    ``parent_stamp``) would load."""
    return (
        parent is not None
        and parent_stamp == kept.created_at
        and Path(parent).resolve() == kept.checkpoint.resolve()
        and same_run(kept.settings, settings)
    )


def keep(backend: Any, checkpoint: Path, created_at: str, settings: TrainSettings) -> None:
    """Hold ``backend`` for the next round (replacing whatever was held)."""
    global _kept
    _kept = Kept(backend, Path(checkpoint), created_at, settings)


def take(settings: TrainSettings, parent: Path | None) -> Any | None:
    """The held backend when the round starting from ``parent`` can continue with it, else None; either
    way nothing stays held (a round that fails midway must not leave half-trained weights behind)."""
    global _kept
    kept, _kept = _kept, None
    if kept is None or parent is None or not is_complete(parent):
        return None
    stamp = read_manifest(parent).get("created_at")
    if not reusable(kept, settings, parent, stamp):
        return None
    kept.backend.renew(settings)
    return kept.backend


def drop() -> None:
    """Forget the held backend (tests; a caller done with rounds)."""
    global _kept
    _kept = None
