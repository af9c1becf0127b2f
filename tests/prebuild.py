"""What the slow tests need built, built in the background while the tests before them run.

On a fresh clone the suite builds five example virtualenvs (pip resolving and unpacking about 1 GB of
wheels) and converts SmolLM2 (about a minute). Built in line, by the first test that needs each, they held
a 2-core machine's suite for about 5 minutes on one core while the other stood mostly idle. A test that
needs one says so (``@pytest.mark.prebuilt(name, ...)``); ``tests/conftest.py`` runs those tests last and
starts ``build_in_background`` at the start of the session, on that idle core (every build is niced). Each
builder takes a lock, so a test that reaches one still being built waits for it, and a build that failed in
the background is done again by the test that needs it, which then fails with the builder's own error.
"""

from __future__ import annotations

import functools
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from example_rig import VENV_REQUIREMENTS, example_venv
from real_model import SMOLLM2, convert_niced

BUILDERS: dict[str, Callable[[], Path]] = {
    **{name: functools.partial(example_venv, name) for name in VENV_REQUIREMENTS},
    SMOLLM2: convert_niced,
}


def build_in_background(names: list[str]) -> threading.Thread:
    """Build these one after another, in this order, in a daemon thread."""
    unknown = sorted(set(names) - set(BUILDERS))
    if unknown:
        raise ValueError(f"@pytest.mark.prebuilt names nothing tests/prebuild.py builds: {unknown}")

    def build_all() -> None:
        for name in names:
            try:
                BUILDERS[name]()
            except (OSError, subprocess.SubprocessError) as e:
                print(f"prebuild {name}: the background build failed ({e}); the test that needs it builds it again")

    thread = threading.Thread(target=build_all, name="prebuild", daemon=True)
    thread.start()
    return thread
