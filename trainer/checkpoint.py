"""Self-describing checkpoints: whole or absent on the publish path, durable beside it.

A checkpoint directory ``STORE/checkpoints/policy-<v>`` holds what vLLM loads (HF weights: a LoRA
adapter or the full model, in bf16 when training in bf16, plus the tokenizer), the state the next
round resumes from (``optimizer.pt``, and ``master/``: the fp32 weights when the served ones are
bf16), and ``tracerl_checkpoint.json``: round, versions, base model, parent, settings, git SHA, and
the exact rollouts and transitions it was trained on.

What is durable when (a round, ``trainer/rounds.py``):

1. ``stage_checkpoint`` (on the round's critical path): the served files are written in a temp
   sibling directory with the manifest to be (``.tracerl_checkpoint.pending.json``, which also
   names the files and the boot they were written in), and the directory is renamed into place,
   with no fsync. Its files are whole (the rename follows the writes) and in the page cache, which
   is where the engine reads them from, so the round publishes now; but the checkpoint is not yet
   *complete*: ``is_complete`` (the manifest exists) is false, so every reader that needs a
   checkpoint which survives a power loss (the next round's parent, the bucket mirror, pruning,
   adoption) still treats it as absent.
2. ``complete_checkpoint`` (in a ``BackgroundWrite`` beside the publish): the listed files and
   their directories are fsynced, then the directory's name in its parent, and only then is the
   manifest written (atomically: temp file, fsync, rename, fsync). A manifest on disk therefore
   means every file is on disk. The round records ``published`` only after this has returned.
3. The resume state, after it in the same background write (``TorchBackend.write_resume_state``),
   each file by rename: a kill midway leaves a complete checkpoint without it, and the next round
   starts with fresh Adam moments.

A process killed between 1 and 2 leaves a renamed directory with the pending manifest.
``recover_checkpoints`` (at the start of every locked run) completes it when the machine has not
rebooted since (same ``boot_id``: the killed process's writes are in the page cache, whole, and
reach the disk through the fsync), and removes it otherwise (after a power loss its files may be
torn), so the round is trained again from its recorded selection. ``write_checkpoint`` is 1 and 2
in line, for writers with no publish to overlap (``trainer/merge.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from store.atomic import atomic_dir, fsync_dir, fsync_file, write_atomic

MANIFEST = "tracerl_checkpoint.json"
PENDING = ".tracerl_checkpoint.pending.json"
"""The manifest to be, beside the files it waits for: ``{"boot_id", "files", "manifest"}``. Hidden (a
leading dot), so the bucket mirror never uploads it and no loader takes it for a model file."""
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def checkpoint_dir(checkpoints: Path, version: int) -> Path:
    """Where the weights published as ``policy@<version>`` live."""
    return checkpoints / f"policy-{version:06d}"


def git_sha() -> str | None:
    """Commit of the tracerl source that trained this checkpoint (None outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def boot_id() -> str | None:
    """This boot of the kernel (Linux); None elsewhere, where a pending checkpoint is never adopted.
    Files written since this boot by a process that died are in the page cache, whole."""
    try:
        return BOOT_ID.read_text().strip() or None
    except OSError:
        return None


def is_complete(path: Path) -> bool:
    """A checkpoint is complete when its manifest exists: written last, once every file is on disk."""
    return (path / MANIFEST).is_file()


def read_manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text())


def stage_checkpoint(final: Path, save: Callable[[Path], None], manifest: dict[str, Any]) -> Path:
    """Run ``save(tmp_dir)``, add the pending manifest and rename ``tmp_dir`` to ``final``, without fsync:
    the files are whole and readable (the engine can load them), not yet durable nor complete
    (``complete_checkpoint`` makes them both). A ``save`` that raises leaves nothing.

    An incomplete directory at ``final`` (a stage whose process died before completing it, on an older
    boot) is replaced; a complete one is an error, because checkpoints are immutable once published.
    """
    if final.exists():
        if is_complete(final):
            raise FileExistsError(f"checkpoint {final} already exists; checkpoints are never overwritten")
        shutil.rmtree(final)
    with atomic_dir(final, durable=False) as tmp:
        save(tmp)
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        pending = {"boot_id": boot_id(), "files": files, "manifest": manifest}
        (tmp / PENDING).write_text(json.dumps(pending, sort_keys=True, default=str))
    return final


def complete_checkpoint(path: Path) -> None:
    """Make a staged checkpoint durable, then complete: fsync the files it was staged with (not what was
    added since: the resume state, a merged copy, each durable by its own writer) and their directories,
    then ``path``'s name in its parent, then write the manifest atomically. Idempotent: a complete
    checkpoint is left as it is; a pending manifest that is missing or unreadable is an error."""
    if is_complete(path):
        (path / PENDING).unlink(missing_ok=True)
        return
    try:
        pending = json.loads((path / PENDING).read_text())
    except (OSError, ValueError) as e:
        raise FileNotFoundError(
            f"checkpoint {path} has no readable {PENDING} ({e}); it cannot be completed, "
            "remove it and train the round again"
        ) from e
    dirs = {path}
    for rel in pending["files"]:
        fsync_file(path / rel)
        dirs.update(path / d for d in Path(rel).parents)  # "a/b.json": path/a, and path itself
    for d in sorted(dirs, reverse=True):  # deepest first: a directory's entries, then its own name
        fsync_dir(d)
    fsync_dir(path.parent)
    data = json.dumps(pending["manifest"], indent=2, sort_keys=True, default=str) + "\n"
    write_atomic(path / MANIFEST, data.encode())
    (path / PENDING).unlink(missing_ok=True)


def write_checkpoint(final: Path, save: Callable[[Path], None], manifest: dict[str, Any]) -> Path:
    """``stage_checkpoint`` and ``complete_checkpoint`` in line: durable and complete on return."""
    stage_checkpoint(final, save, manifest)
    complete_checkpoint(final)
    return final


@dataclass
class Recovered:
    """What ``recover_checkpoints`` did with the staged checkpoints a killed process left."""

    completed: list[Path] = field(default_factory=list)  # same boot: made durable and complete
    removed: list[Path] = field(default_factory=list)  # an older boot (or unreadable): its round is redone


def recover_checkpoints(checkpoints: Path, boot: str | None = None) -> Recovered:
    """Finish or drop every staged, never-completed ``policy-*`` in ``checkpoints`` (run under the training
    lock, before anything reads them). Staged in this boot (``boot``, default ``boot_id()``): its files
    are whole in the page cache, so it is completed, and the round adopts it. Staged in an older boot,
    or with no readable pending manifest, or missing a staged file: its files may be torn, so it is
    removed and the round is trained again. A directory with neither manifest is left to ``stage_checkpoint``'s replace rule."""
    out = Recovered()
    boot = boot if boot is not None else boot_id()
    for d in sorted(checkpoints.glob("policy-*")) if checkpoints.is_dir() else []:
        if not d.is_dir() or is_complete(d) or not (d / PENDING).exists():
            continue
        try:
            staged_in = json.loads((d / PENDING).read_text()).get("boot_id")
        except (OSError, ValueError):
            staged_in = None
        if boot is not None and staged_in == boot:
            try:
                complete_checkpoint(d)
                out.completed.append(d)
                continue
            except FileNotFoundError:  # a staged file was deleted since: nothing whole to complete
                pass
        shutil.rmtree(d)
        out.removed.append(d)
    return out


def write_json_atomic(
    path: str | os.PathLike[str], data: dict[str, Any], fs: pafs.FileSystem | None = None
) -> None:
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
    """Writes that run in order in one thread beside the round's publish: the checkpoint's completion
    (``complete_checkpoint``), then the resume state (which only the next round reads). ``wait(1)``
    blocks until the first step is done (before the round records ``published``), ``wait()`` until all
    are (before anything else reads or copies the checkpoint); a step's error is raised by the wait
    that covers it, and the steps after it do not run. A resume-state file appears by rename, so a
    process killed midway leaves a checkpoint without it, never with half of it: the next round then
    starts with fresh Adam moments (``TorchBackend.load``)."""

    def __init__(self, *steps: Callable[[], None]) -> None:
        self.seconds: list[float] = [0.0] * len(steps)  # each step's, once it has run
        self._error: tuple[int, BaseException] | None = None
        self._done = [threading.Event() for _ in steps]

        def run() -> None:
            for i, step in enumerate(steps):
                t = time.perf_counter()
                try:
                    step()
                except BaseException as e:  # re-raised by wait(), in the caller's thread
                    self._error = (i, e)
                    break
                finally:
                    self.seconds[i] = time.perf_counter() - t
                    self._done[i].set()
            for done in self._done:  # the steps after a failed one never run: nobody waits for them
                done.set()

        self._thread = threading.Thread(target=run, name="tracerl-checkpoint-write")
        self._thread.start()

    def wait(self, steps: int | None = None) -> float:
        """Block until the first ``steps`` steps (all when None) are done; returns the seconds they took."""
        n = len(self._done) if steps is None else steps
        if n >= len(self._done):
            self._thread.join()
        for done in self._done[:n]:
            done.wait()
        if self._error is not None and self._error[0] < n:
            raise self._error[1]
        return sum(self.seconds[:n])
