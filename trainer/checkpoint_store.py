"""Where a round's checkpoints live: a local directory, mirrored into the store when the store is a bucket.

Torch saves to a directory and vLLM loads from one, so a checkpoint is always written on local disk
first (``trainer/checkpoint.py``: temp directory renamed into place, then fsynced and completed by its
manifest; a round uploads it only once complete). On a local store that directory is
``STORE/checkpoints`` and nothing more happens. On an ``s3://`` store the local directory is a cache
(``--checkpoints DIR``) and each complete checkpoint is also uploaded to
``STORE/checkpoints/policy-<v>/``, its manifest last: an object store has no rename, so the manifest's
presence is what says "complete" there too, as it does locally. A trainer on another host (or after
its disk was lost) fetches a checkpoint it needs (the next round's parent, the one to publish) back
into its cache, through a temp directory renamed into place.

A LoRA checkpoint's ``merged/`` copy (``trainer/merge.py``) is derived at publish time and not
uploaded: it is rebuilt from the adapter where it is missing.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from store.atomic import atomic_dir, write_atomic
from store.location import StoreLocation
from trainer.checkpoint import MANIFEST, checkpoint_dir, is_complete
from trainer.merge import MERGED

DEFAULT_CACHE = "./tracerl-checkpoints"
"""The local checkpoint directory when the store is a bucket and ``--checkpoints`` is not given."""


@dataclass(frozen=True)
class CheckpointStore:
    """Checkpoints on local disk (``local``), and their copies in a bucket (``mirror``) when the store is one."""

    local: Path
    mirror: StoreLocation | None = None

    @classmethod
    def of(cls, loc: StoreLocation, local: str | os.PathLike[str] = "") -> CheckpointStore:
        """``STORE/checkpoints`` for a local store (or ``local`` when given); ``local`` plus a mirror for a bucket."""
        if loc.is_local:
            return cls(Path(local).expanduser().resolve() if local else Path(loc.path("checkpoints")))
        return cls(Path(local or DEFAULT_CACHE).expanduser().resolve(), loc)

    def dir(self, version: int) -> Path:
        """The local directory of ``policy@version`` (what the publisher hands vLLM)."""
        return checkpoint_dir(self.local, version)

    def name(self, version: int) -> str:
        """What the manifest row records: the local path, or the checkpoint's URI in the bucket."""
        if self.mirror is None:
            return str(self.dir(version))
        scheme = self.mirror.uri.split("://", 1)[0]
        return f"{scheme}://{self._remote(version)}"

    def _remote(self, version: int, *parts: str) -> str:
        assert self.mirror is not None
        return self.mirror.path("checkpoints", self.dir(version).name, *parts)

    def in_mirror(self, version: int) -> bool:
        """Whether the bucket holds a complete copy (its manifest, written last, exists)."""
        assert self.mirror is not None
        return self.mirror.is_file(self._remote(version, MANIFEST))

    def upload(self, version: int) -> bool:
        """Copy a complete local checkpoint to the bucket, manifest last; idempotent. True if it copied."""
        if self.mirror is None or self.in_mirror(version):
            return False
        src = self.dir(version)
        if not is_complete(src):
            raise FileNotFoundError(f"checkpoint {src} is incomplete; nothing to upload")
        local_fs = pafs.LocalFileSystem()
        for f in sorted(src.rglob("*")):
            rel = f.relative_to(src)
            if (
                not f.is_file()
                or rel.parts[0] == MERGED
                or rel.parts[0].startswith(".")
                or rel.name == MANIFEST
            ):
                continue
            pafs.copy_files(
                str(f),
                self._remote(version, rel.as_posix()),
                source_filesystem=local_fs,
                destination_filesystem=self.mirror.fs,
            )
        write_atomic(self._remote(version, MANIFEST), (src / MANIFEST).read_bytes(), self.mirror.fs)
        return True

    def ensure_local(self, version: int) -> Path:
        """The local directory of ``policy@version``, fetched from the bucket first when only the bucket has it."""
        final = self.dir(version)
        if is_complete(final) or self.mirror is None or not self.in_mirror(version):
            return final
        if final.exists():  # an incomplete leftover (a rename is never partial): replaced
            shutil.rmtree(final)
        with atomic_dir(final) as tmp:
            pafs.copy_files(
                self._remote(version),
                str(tmp),
                source_filesystem=self.mirror.fs,
                destination_filesystem=pafs.LocalFileSystem(),
            )
            if not is_complete(tmp):
                raise FileNotFoundError(f"{self.name(version)} lost its manifest while it was fetched")
        return final

    def remove(self, version: int) -> None:
        """Delete ``policy@version`` here and in the bucket (``--keep-checkpoints``); the manifest goes first
        in the bucket, so a half-deleted copy reads as incomplete, never as complete."""
        shutil.rmtree(self.dir(version), ignore_errors=True)
        if self.mirror is not None and self.in_mirror(version):
            self.mirror.fs.delete_file(self._remote(version, MANIFEST))
            self.mirror.fs.delete_dir(self._remote(version))

    def versions(self) -> list[int]:
        """Versions with a complete checkpoint here or in the bucket, oldest first."""
        found = {
            int(p.name.split("-", 1)[1]) for p in self.local.glob("policy-*") if p.is_dir() and is_complete(p)
        }
        if self.mirror is not None:
            sel = pafs.FileSelector(self.mirror.path("checkpoints"), allow_not_found=True)
            for info in self.mirror.fs.get_file_info(sel):
                if info.type == pafs.FileType.Directory and info.base_name.startswith("policy-"):
                    v = int(info.base_name.split("-", 1)[1])
                    if self.in_mirror(v):
                        found.add(v)
        return sorted(found)

    def prune(self, keep: int, protect: frozenset[int] = frozenset()) -> list[int]:
        """Remove complete checkpoints older than the ``keep`` newest, here and in the bucket; returns their versions.

        A 50-round run of SmolLM2 would otherwise hold 50 adapters and 50 merged models (270 MB each).
        The newest is the next round's parent and the serving policy; the one before it is what a
        failed reload restores; so ``keep`` is at least 2. Incomplete ones are the temp-dir sweep's.
        ``protect``: versions kept whatever their age (a canary's parent, which serves beside it and is
        the next round's parent if the canary is rolled back, however many rollbacks came since).
        """
        if keep < 2:
            raise ValueError(
                f"keep must be >= 2 (the serving policy and the one a failed reload restores), got {keep}"
            )
        gone = [v for v in self.versions()[:-keep] if v not in protect]
        for v in gone:
            self.remove(v)
        return gone
