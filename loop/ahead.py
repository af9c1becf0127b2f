"""Batches of rollouts run ahead of training by a bounded number of batches (asynchronous rounds).

With ``lead`` 0 a batch starts only after the trainer is done with the previous one: the strict
on-policy loop, agents waiting while the trainer trains. With ``lead`` K the next K batches run while
the trainer trains, so their calls come from policies up to K versions behind the one trained on,
the bound ``tracerl train --max-staleness K`` enforces. This is the single-machine form of the
bounded-staleness controller of AReaL (Fu et al. 2025, sec. 4) and the one-step overlap of verl.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class BatchesAhead(Generic[T]):
    """Run ``run(b)`` for b = 0, 1, 2, ... in one background thread, batch b starting once
    ``b - lead`` batches were released and ``wanted(b)`` says it is needed.

    ``get(b)`` waits for batch b (and re-raises its error); ``release()`` says the consumer is done
    with one more batch; ``spans`` holds each batch's (start, end) monotonic times, for idle fractions.
    """

    def __init__(self, run: Callable[[int], T], lead: int, wanted: Callable[[int], bool]) -> None:
        if lead < 0:
            raise ValueError(f"lead must be 0 or more, got {lead}")
        self._run, self._lead, self._wanted = run, lead, wanted
        self._cond = threading.Condition()
        self._released = 0
        self._results: dict[int, tuple[T | None, BaseException | None]] = {}
        self._closed = False
        self.running = False  # a batch's agents are running now (the demo's trainer then leaves them a core)
        self.spans: list[tuple[float, float]] = []
        self._thread = threading.Thread(target=self._loop, name="batches-ahead", daemon=True)
        self._thread.start()

    def _may_start(self, b: int) -> bool:
        return self._closed or (b - self._lead <= self._released and self._wanted(b))

    def _loop(self) -> None:
        b = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda b=b: self._may_start(b))
                if self._closed:
                    return
            t0 = time.monotonic()
            self.running = True
            try:
                result: tuple[T | None, BaseException | None] = (self._run(b), None)
            except BaseException as e:  # handed to the consumer by get(); this thread stops
                result = (None, e)
            self.running = False
            with self._cond:
                self.spans.append((t0, time.monotonic()))
                self._results[b] = result
                self._cond.notify_all()
            if result[1] is not None:
                return
            b += 1

    def get(self, b: int) -> T:
        """Batch ``b``'s result, once it finished; its error if it failed."""
        with self._cond:
            self._cond.wait_for(lambda: b in self._results or self._closed)
            if b not in self._results:
                raise RuntimeError("the rollout batches were stopped")
            value, error = self._results.pop(b)
        if error is not None:
            raise error
        return value  # type: ignore[return-value]

    def release(self) -> None:
        """The consumer is done with one more batch: another may start."""
        with self._cond:
            self._released += 1
            self._cond.notify_all()

    def changed(self) -> None:
        """``wanted`` may answer differently now (the consumer wants another batch)."""
        with self._cond:
            self._cond.notify_all()

    def close(self, timeout_s: float | None = None) -> None:
        """Start no further batch; wait up to ``timeout_s`` for a running one to end."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
