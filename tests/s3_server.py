"""A real S3 API on 127.0.0.1 for the store's object-storage tests: moto's standalone server.

moto (``moto[server]``, from PyPI) stands in for S3: it answers the S3 REST API over HTTP, and the
tests reach it through the real ``pyarrow.fs.S3FileSystem`` client (and ``tracerl`` subprocesses),
configured only by the standard AWS variables, exactly as a user points tracerl at a bucket.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
from tracerl_testing import free_port


def s3_env(endpoint: str) -> dict[str, str]:
    """The variables a user sets for an S3-compatible endpoint (pyarrow reads them itself)."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata probe for credentials or region
    }


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """Run ``moto_server`` on a free port; yields its endpoint URL; stops it (and waits) on exit."""
    port = free_port()
    exe = Path(sys.executable).parent / "moto_server"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
    # moto logs a line per request: to a file, so a full pipe can never stall the server
    with tempfile.TemporaryFile(mode="w+") as log:
        yield from _serve(cmd, port, log)


def _serve(cmd: list[str], port: int, log: IO[str]) -> Iterator[str]:
    proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=log, text=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"moto_server exited with {proc.returncode}: {log.read()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{endpoint}/moto-api/", timeout=1).status_code < 500:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("moto_server did not answer within 30 s")
            time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_bucket(endpoint: str, bucket: str) -> None:
    """Create a bucket through pyarrow (tracerl itself never creates buckets)."""
    import pyarrow.fs as pafs

    env = s3_env(endpoint)
    fs = pafs.S3FileSystem(access_key=env["AWS_ACCESS_KEY_ID"], secret_key=env["AWS_SECRET_ACCESS_KEY"],
                           region=env["AWS_DEFAULT_REGION"], endpoint_override=endpoint,
                           allow_bucket_creation=True)
    fs.create_dir(bucket)

