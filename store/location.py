"""Where a store lives: a ``--store`` argument turned into a ``pyarrow.fs`` file system and a root.

A plain path is local disk; anything with a scheme (``s3://bucket/prefix``, ``file:///…``) goes to
``pyarrow.fs.FileSystem.from_uri``. Endpoint and credentials are not options of ours: pyarrow's
``S3FileSystem`` already reads the standard AWS variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``,
``~/.aws/config``) and URI query options (``?endpoint_override=…&scheme=http``), so a store URI
means the same to tracerl as to any other Arrow program.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True)
class StoreLocation:
    """A store's file system and its root inside it (``bucket/prefix`` on S3, an absolute path locally)."""

    fs: pafs.FileSystem
    root: str
    uri: str  # as the user gave it, for messages

    @property
    def is_local(self) -> bool:
        """Local disk gets temp-file + rename + fsync; object storage gets a single PUT (store/atomic.py)."""
        return isinstance(self.fs, pafs.LocalFileSystem)

    def path(self, *parts: str) -> str:
        """A path below the root, ``/``-separated as every ``pyarrow.fs`` file system wants it."""
        return "/".join([self.root, *(p.strip("/") for p in parts if p)])

    def table(self, name: str) -> str:
        """Directory (prefix) of a hive-partitioned table; the same names as ``StoreLayout.table``."""
        return self.path(name)

    def files(self, *parts: str, suffix: str = ".parquet", since: float | None = None) -> list[str]:
        """Committed files below ``parts`` (recursive, sorted); temp files start with '.' and are skipped.
        ``since`` (epoch seconds): only files written then or later (a file is written once, whole, and
        renamed into place, so its modification time is when its rows were stored)."""
        selector = pafs.FileSelector(self.path(*parts), recursive=True, allow_not_found=True)
        return sorted(i.path for i in self.fs.get_file_info(selector) if i.type == pafs.FileType.File
                      and i.base_name.endswith(suffix) and not i.base_name.startswith(".")
                      and (since is None or i.mtime is None or i.mtime.timestamp() >= since))

    def read_bytes(self, path: str) -> bytes:
        """A whole file (``path`` as ``files`` returns it)."""
        with self.fs.open_input_stream(path) as f:
            return f.read()

    def is_file(self, path: str) -> bool:
        """Whether ``path`` (as ``path()`` builds it) is a stored file."""
        return self.fs.get_file_info(path).type == pafs.FileType.File

    def exists(self) -> bool:
        """Whether anything is stored at the root (an S3 prefix exists once an object is under it)."""
        return self.fs.get_file_info(self.root).type != pafs.FileType.NotFound


def is_uri(store: str | os.PathLike[str]) -> bool:
    """Whether ``store`` names a location by URI rather than as a local path."""
    return bool(_SCHEME.match(os.fspath(store)))


def parse_store(store: str | os.PathLike[str]) -> StoreLocation:
    """``--store`` as given (a path or a URI) -> its file system and root.

    A local path is resolved as ``StoreLayout.at`` resolves it, so both name the same directory.
    """
    text = os.fspath(store)
    if is_uri(text):
        fs, root = pafs.FileSystem.from_uri(text)
        return StoreLocation(fs, root.rstrip("/"), text)
    return StoreLocation(pafs.LocalFileSystem(), str(Path(text).expanduser().resolve()), text)
