"""Fixtures shared by every package's tests; plain helpers live in tracerl_testing.py."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tracerl_testing import tracerl

FAST_LANE = os.environ.get("TRACERL_FAST_LANE") == "1"
"""Set by ``make test-fast`` (``-m "not slow"``): a test in it that starts a process or builds a model fails
and names the fix, so the lane stays what it says it is (a test that needs either is marked ``slow``)."""


class SlowInFastLane(RuntimeError):
    """A test outside the ``slow`` mark started a process or built a model under ``make test-fast``."""


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise SlowInFastLane(f"the fast lane runs no {what}: mark this test @pytest.mark.slow "
                             f"(or its module: pytestmark = pytest.mark.slow)")
    return refuse


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under ``make test-fast`` no process starts and no model is built, in any test or fixture (collection,
    which imports every test module and with them libraries that probe their platform, is done by now)."""
    if not FAST_LANE:
        return
    subprocess.Popen._execute_child = _refuse("process")
    from transformers import modeling_utils  # every construction (from_pretrained, from_config, a tiny build)

    modeling_utils.PreTrainedModel.post_init = _refuse("model")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests that need something built first (``@pytest.mark.prebuilt``: an example's virtualenv, the real
    model) run last, and what they need is built in the background from the start (``tests/prebuild.py``)."""
    if FAST_LANE:
        return
    marked = [item for item in items if item.get_closest_marker("prebuilt")]
    if not marked:
        return
    items[:] = [item for item in items if not item.get_closest_marker("prebuilt")] + marked  # order kept
    if config.option.collectonly:
        return
    from prebuild import start_detached

    names = dict.fromkeys(name for item in marked for name in item.get_closest_marker("prebuilt").args)
    start_detached(list(names))


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture(scope="session")
def real_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real round's store, shared by the ui tests and the ui-on-a-bucket test (``tracerl demo``
    itself, about 30 s: 2 letters x 2 samples, 1 round trained and published, then policy@1 evaluated).

    Spans, transitions with exact token ids and logprobs, a rounds manifest, a selection file and a
    checkpoint: the tiny model behind `tracerl serve`, the gateway, the collector and the unmodified
    demo agent, so the store holds two policy versions.
    """
    work = tmp_path_factory.mktemp("ui-demo")
    proc = tracerl("demo", "--tiny", "--rounds", "1", "--rollouts-per-round", "4", "--letters", "ae", "--workdir", str(work),
                   timeout=240)
    (work / "demo.out").write_text(proc.stdout)  # for the test of the demo's last lines
    return work / "store"


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
