"""How long-running commands wait to be stopped: servers (collect, serve, gateway) on an event,
drivers (demo, rollout) by unwinding as from Ctrl-C.

Every one installs its own handlers rather than trusting Python's default Ctrl-C handling: a
process started in the background by a shell (``cmd &`` without job control) inherits SIGINT as
*ignored*, and Python then never raises KeyboardInterrupt, so such a demo could not be stopped
and left its servers and agents running."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any


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


_interrupted = threading.Event()
_shield = threading.Event()  # set while a driver stops what it started: a second Ctrl-C must not cut that short


def was_interrupted() -> bool:
    """Whether a signal raised KeyboardInterrupt inside ``interrupt_on_signals`` in this process.

    The CLI asks this about any exception that ends a command: a KeyboardInterrupt raised while a
    native library was calling back into Python (DuckDB reading an Arrow table, for one) comes out
    wrapped in that library's own error, yet the command stopped because it was asked to."""
    return _interrupted.is_set()


def _interrupt() -> None:
    """Remember the stop and, unless cleanup is ``shielded``, unwind the main thread."""
    _interrupted.set()
    if not _shield.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def _handling(handler: Callable[..., None]) -> Iterator[None]:
    """``handler`` for SIGINT and SIGTERM while inside, the previous handlers restored after."""
    _interrupted.clear()
    try:
        old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread (tests calling a driver from a thread)
        yield
        return
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread while inside, even where SIGINT
    was inherited as ignored, so a driver unwinds and stops everything it started."""
    with _handling(lambda *_: _interrupt()):
        yield


@contextlib.contextmanager
def drain_then_interrupt(stop: threading.Event, on_first: Callable[[], None] | None = None) -> Iterator[None]:
    """The first SIGINT/SIGTERM sets ``stop`` (finish what runs, start nothing new); a second one
    raises KeyboardInterrupt like ``interrupt_on_signals`` (stop everything now)."""
    def handler(*_: Any) -> None:
        if stop.is_set():
            _interrupt()
            return
        stop.set()
        if on_first is not None:
            on_first()

    with _handling(handler):
        yield


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Stop and clean up without being cut short: a SIGINT/SIGTERM arriving inside (a second Ctrl-C, or
    ``timeout`` forwarding one) is remembered, not raised, so every child still gets stopped; the
    command then exits 130 as ``was_interrupted`` says."""
    _shield.set()
    try:
        yield
    finally:
        _shield.clear()
