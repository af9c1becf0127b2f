"""``collect --convert``: conversion passes (``store.convert_store``) in a background thread of the collector."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from span_to_transition.convert import ConvertConfig
from span_to_transition.stats import ConvertStats
from span_to_transition.store import convert_store
from store.location import StoreLocation

logger = logging.getLogger("tracerl.convert")


class ConvertLoop:
    """``collect --convert``: run ``convert_store`` every ``every_s`` seconds in a background thread.

    ``poke()`` (e.g. from the collector's after-compaction hook) runs a pass now instead of at the
    next tick. A failing pass is logged and retried on the next tick, never raised into the
    collector. ``stop()`` runs one final pass so nothing complete is left behind, then joins.
    """

    def __init__(
        self,
        store: StoreLocation,
        config: ConvertConfig,
        every_s: float = 5.0,
        on_stats: Callable[[ConvertStats], None] | None = None,
    ):
        config.validate()
        self.store, self.config, self.every_s = store, config, every_s
        self.on_stats = on_stats or _log_stats
        self.passes = 0
        self.last: ConvertStats | None = None
        self.last_error: str | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tracerl-convert", daemon=True)

    def start(self) -> ConvertLoop:
        self._thread.start()
        return self

    def poke(self) -> None:
        self._wake.set()

    def stop(self, final_pass: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=300)
        if final_pass:
            self._pass()

    def _pass(self) -> None:
        try:
            self.last = convert_store(self.store, self.config)
            self.last_error = None
            self.passes += 1
            self.on_stats(self.last)
        except Exception as e:  # keep the collector alive; the next tick retries
            self.last_error = f"{type(e).__name__}: {e}"
            logger.exception("conversion pass failed (will retry in %.0fs)", self.every_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.every_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            self._pass()


def _log_stats(stats: ConvertStats) -> None:
    if stats.transitions_written or stats.late_spans or stats.rollouts_excluded_no_reward or stats.problems:
        logger.info("convert: %s", stats.summary().replace("\n", "; "))
