"""The interface every backend implements: train on a round's batches, then save a checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from trainer.packing import Batch


@dataclass
class TrainMetrics:
    """What one round's optimisation did (means are weighted like the loss)."""

    loss: float = 0.0
    policy_loss: float = 0.0
    kl: float = 0.0
    clip_fraction: float = 0.0
    ppo_kl: float = 0.0
    is_filtered_fraction: float = 0.0
    # the raw importance ratio pi_old / pi_behaviour over response tokens the engine scored: how far
    # the serving policy (an older version, when rounds run asynchronously) was from the trained one
    is_tokens: int = 0
    is_weight_mean: float = 0.0  # a running sum until finish_metrics divides it by is_tokens
    is_weight_max: float = 0.0
    is_weight_min: float = 0.0
    grad_norm: float = 0.0
    optimizer_steps: int = 0
    micro_batches: int = 0
    tokens: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


StepCallback = Callable[[int, TrainMetrics], None]
"""Called after every optimizer step with the step number (from 1) and the running metrics."""


class Backend(Protocol):
    tokenizer: Any
    adapter: bool

    def train(self, batches: Sequence[Batch], on_step: StepCallback | None = None,
              threads_now: Callable[[], int] | None = None) -> TrainMetrics:
        """Run the round's optimizer steps over ``batches`` (weights over all batches sum to 1)."""
        ...

    def save(self, out_dir: Path) -> None:
        """Write HF weights (adapter or full), tokenizer and optimizer state into ``out_dir``."""
        ...
