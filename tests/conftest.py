"""Fixtures shared by every package's tests; plain helpers live in tracerl_testing.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server (a stand-in for S3, see s3_server.py), one per test module."""
    from s3_server import moto_server

    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_store(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://<fresh bucket>/store`` with the AWS variables set for this process and its children."""
    import uuid

    from s3_server import make_bucket, s3_env

    for k, v in s3_env(s3_endpoint).items():
        monkeypatch.setenv(k, v)
    bucket = f"tracerl-{uuid.uuid4().hex[:12]}"
    make_bucket(s3_endpoint, bucket)
    return f"s3://{bucket}/store"
