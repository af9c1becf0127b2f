"""Training backends behind one interface (``trainer.backends.base.Backend``).

``torch`` (default) runs in this process on CPU or one GPU, or data parallel in ``--nproc`` ranks.
``openrlhf`` uses OpenRLHF's Actor and DeepSpeed across GPUs (``--nproc`` ranks); it is imported
only when selected, so the default install never needs it. Ranks: ``trainer/launcher.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.backends.base import Backend
    from trainer.config import TrainSettings

BACKENDS = ("torch", "openrlhf")


def load_backend(name: str, settings: TrainSettings, base_model: Path, parent: Path | None) -> Backend:
    """Build the named backend from the base model and, after round 0, the previous checkpoint."""
    if name == "torch":
        from trainer.backends.torch_backend import TorchBackend

        return TorchBackend.load(settings, base_model, parent)
    if name == "openrlhf":
        from trainer.backends.openrlhf import OpenRLHFBackend

        return OpenRLHFBackend.load(settings, base_model, parent)
    raise ValueError(f"unknown backend {name!r}; must be one of {', '.join(BACKENDS)}")
