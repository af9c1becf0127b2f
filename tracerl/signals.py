"""How long-running commands (collect, serve, gateway) wait to be stopped."""

from __future__ import annotations

import signal
import threading


def stop_requested() -> threading.Event:
    """Install the SIGINT/SIGTERM handlers now and return the event they set.

    Call it before announcing readiness: a stop sent right after the announcement would
    otherwise meet the default handler, which kills the process without the graceful flush."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_for_stop(stop: threading.Event | None = None) -> None:
    """Block until SIGINT or SIGTERM; the caller then shuts down gracefully (flush, close)."""
    (stop or stop_requested()).wait()
