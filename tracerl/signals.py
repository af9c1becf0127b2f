"""How long-running commands (collect, serve, gateway) wait to be stopped."""

from __future__ import annotations

import signal
import threading


def wait_for_stop() -> None:
    """Block until SIGINT or SIGTERM; the caller then shuts down gracefully (flush, close)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
