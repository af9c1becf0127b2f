"""What the slow tests need built, built in the background while the tests before them run.

On a fresh clone the suite builds five example virtualenvs (pip resolving and unpacking about 1 GB of
wheels) and converts SmolLM2 (about a minute). Built in line, by the first test that needs each, they held
a 2-core machine's suite for about 5 minutes on one core while the other stood mostly idle. A test that
needs one says so (``@pytest.mark.prebuilt(name, ...)``); ``tests/conftest.py`` runs those tests last and,
at the start of the session, starts this file as a detached process that builds them all, niced, on that
idle core. Detached: its processes are not the suite's children, so a test that accounts for its own
children's CPU (``bench/_cpu.py``'s sampler) does not count pip's. Each builder takes a lock file, so a test
that reaches one still being built waits for it, and a build that failed in the background is done again
by the test that needs it, which then fails with the builder's own error. A suite stopped early leaves the
builder to finish (the next run finds its work done); its output is in ``LOG``.

    python tests/prebuild.py NAME...   # build these, in this order, in the foreground
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOG = Path(tempfile.gettempdir()) / "tracerl-prebuild.log"


def builders() -> dict[str, Callable[[], Path]]:
    from example_rig import VENV_REQUIREMENTS, example_venv
    from real_model import SMOLLM2, real_model_dir

    return {**{name: functools.partial(example_venv, name) for name in VENV_REQUIREMENTS}, SMOLLM2: real_model_dir}


def start_detached(names: list[str]) -> None:
    """Build these in a process of its own, one after another, in this order; returns at once."""
    unknown = sorted(set(names) - set(builders()))
    if unknown:
        raise ValueError(f"@pytest.mark.prebuilt names nothing tests/prebuild.py builds: {unknown}")
    with open(LOG, "w") as log:
        launcher = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--detach", *names],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    launcher.wait()  # it forks the builder and exits: the builder is nobody's child in the suite


def build(names: list[str]) -> int:
    failed, table = 0, builders()
    for name in names:
        try:
            print(f"prebuild {name}: {table[name]()}", flush=True)
        except (OSError, AssertionError, subprocess.SubprocessError) as e:
            failed += 1
            print(f"prebuild {name}: failed ({e}); the test that needs it builds it again", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    args = sys.argv[1:]
    if args[:1] == ["--detach"]:
        args = args[1:]
        if os.fork():
            os._exit(0)
        os.nice(10)  # the core the running tests leave, not theirs
    sys.exit(build(args))
