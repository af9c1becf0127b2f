"""Self-describing checkpoints, written whole or not at all.

A checkpoint directory ``STORE/checkpoints/policy-<v>`` holds what vLLM loads (HF weights: a LoRA
adapter or the full model, in bf16 when training in bf16, plus the tokenizer), the state the next
round resumes from (``optimizer.pt``, and ``master/``: the fp32 weights when the served ones are
bf16), written beside the round's publish (``BackgroundWrite``), and
``tracerl_checkpoint.json``: round, versions, base model, parent, settings, git SHA, and the
exact rollouts and transitions it was trained on. It is built in a temp sibling directory and
renamed into place, so a crash leaves either nothing or a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from store.atomic import atomic_dir, write_atomic

MANIFEST = "tracerl_checkpoint.json"


def checkpoint_dir(checkpoints: Path, version: int) -> Path:
    """Where the weights published as ``policy@<version>`` live."""
    return checkpoints / f"policy-{version:06d}"


def git_sha() -> str | None:
    """Commit of the tracerl source that trained this checkpoint (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def is_complete(path: Path) -> bool:
    """A checkpoint is complete when its manifest exists (it is written last, before the rename)."""
    return (path / MANIFEST).is_file()


def read_manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text())


def write_checkpoint(final: Path, save: Callable[[Path], None], manifest: dict[str, Any]) -> Path:
    """Run ``save(tmp_dir)``, add the manifest, fsync and rename ``tmp_dir`` to ``final``.

    An incomplete directory at ``final`` (impossible with rename, but left by hand-copied files)
    is replaced; a complete one is an error, because checkpoints are immutable once published.
    """
    if final.exists():
        if is_complete(final):
            raise FileExistsError(f"checkpoint {final} already exists; checkpoints are never overwritten")
        shutil.rmtree(final)
    with atomic_dir(final) as tmp:
        save(tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
    return final


def write_json_atomic(path: str | os.PathLike[str], data: dict[str, Any], fs: pafs.FileSystem | None = None) -> None:
    """Small state files (the round's selection) as readable JSON, through the store's atomic writer
    (``fs``: the store's file system when it is a bucket)."""
    write_atomic(path, (json.dumps(data, indent=2, sort_keys=True, default=str) + "\n").encode(), fs)


def clean_temp_dirs(checkpoints: Path) -> int:
    """Remove temp directories left by a process killed mid-save; returns how many."""
    n = 0
    if checkpoints.exists():
        for p in checkpoints.glob(".policy-*"):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
                n += 1
    return n


def save_weights(state: dict[str, Any], path: Path, dtype: Any = None) -> None:
    """A state dict as one safetensors file, the format vLLM and transformers load, with safetensors'
    own writer: ``save_pretrained`` took 3.0 s for 270 MB where this took 0.4 s (SmolLM2, 2 cores;
    ``bench/checkpoint_save.py`` measures ours against a bare ``save_file``). Tied tensors (lm_head =
    embed_tokens) are written once, under the first name, as ``save_pretrained`` writes them; floating
    tensors are cast to ``dtype`` when given (bf16 when training in bf16: what the engine serves)."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors = {}
    for name, t in state.items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t.detach().contiguous().cpu()
    save_file(tensors, str(path), metadata={"format": "pt"})


class BackgroundWrite:
    """One write that runs beside the round (the optimizer state, which only the next round reads) and
    is waited for before anything reads or copies the checkpoint; an error in it is raised by ``wait``.
    Its files appear by rename, so a process killed midway leaves a checkpoint without them, never
    with half of them: the next round then starts with fresh Adam moments (``TorchBackend.load``)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        import threading
        import time

        self.seconds = 0.0
        self._error: BaseException | None = None

        def run() -> None:
            t = time.perf_counter()
            try:
                fn()
            except BaseException as e:  # re-raised by wait(), in the caller's thread
                self._error = e
            self.seconds = time.perf_counter() - t

        self._thread = threading.Thread(target=run, name="tracerl-resume-state")
        self._thread.start()

    def wait(self) -> float:
        """Block until written; returns the seconds the write took."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.seconds
