"""The one atomic writer: a file of the store either exists whole or not at all.

Every file a stage persists (Parquet tables, the converter's ledger, quarantine files, the trainer's
JSON state) goes through ``write_atomic``, so there is one set of guarantees to reason about:

- local disk: a temp file in the same directory (``.<name>.<32 hex>.tmp``, which readers and the
  compactor's sweep know to skip or delete), fsync, ``os.replace``, then fsync of the directory,
  so after a crash the path holds the old bytes or the new ones, and the rename itself is durable;
- object storage: a single upload through ``pyarrow.fs`` (``open_output_stream``); S3 makes an
  object visible only when its PUT (or multipart completion) succeeds, so no reader sees a partial
  object. The bytes are complete in memory before the upload starts, so a failure while producing
  them can never complete an upload of a prefix of them.

A directory that must appear whole (a checkpoint: what torch saves and vLLM loads) goes through
``atomic_dir``, the same rule for a tree on local disk: filled in a temp sibling, fsynced, renamed.
With ``durable=False`` it appears whole but is not yet on disk: the caller makes it durable later
(a round's checkpoint, ``trainer/checkpoint.py``, which says it is complete only once it has).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import pyarrow.fs as pafs

Payload = bytes | Callable[[BinaryIO], None]
"""What to write: the bytes, or a function that writes them to a binary file (streamed locally)."""


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a file written earlier (by this process or a killed one) to disk."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or unlink in ``path`` durable (the directory entry itself is fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    """The temp sibling a local write goes through; unique, and hidden from ``*.parquet`` globs."""
    return path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"


def write_atomic(path: str | os.PathLike[str], data: Payload, fs: pafs.FileSystem | None = None) -> None:
    """Write ``data`` to ``path`` (on ``fs``; local disk when None) so readers see all of it or none.

    Writing the same path again replaces it, which keeps replays idempotent.
    """
    if fs is None or isinstance(fs, pafs.LocalFileSystem):
        _write_local(Path(path), data)
        return
    if callable(data):
        buf = io.BytesIO()
        data(buf)
        data = buf.getvalue()
    with fs.open_output_stream(os.fspath(path)) as out:
        out.write(data)


def _write_local(path: Path, data: Payload) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_dir(final: Path, durable: bool = True) -> Iterator[Path]:
    """A temp sibling of ``final`` (``.<name>.<8 hex>.<random>``) to fill; when the block ends cleanly its files
    are fsynced, it is renamed to ``final`` and the parent is fsynced; when it raises, it is removed.
    ``durable=False``: renamed with no fsync (whole to every reader, not yet safe from a power loss).

    ``final`` must not exist (a rename does not replace a non-empty directory); a killed process leaves
    only the temp sibling, which its owner's sweep removes by that prefix.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{uuid.uuid4().hex[:8]}.", dir=final.parent))
    try:
        yield tmp
        if durable:
            for f in tmp.rglob("*"):
                if f.is_file():
                    fsync_file(f)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if durable:
        fsync_dir(final.parent)
