"""A model directory's weights as one dict: every tensor of its ``*.safetensors`` files (one file, or the
shards of a large model), for code that works on the tensors themselves (the embedded engine's reload, the
merge of a LoRA round into its base)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def read_weights(path: str | Path) -> dict[str, Any]:
    """Every tensor in ``path``'s ``*.safetensors`` files, by name; empty when it holds none."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors
