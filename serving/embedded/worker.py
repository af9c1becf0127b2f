"""The single thread that runs the embedded engine (``engine.ModelEngine`` is not thread-safe).

HTTP threads submit generations and control operations (adapter load/unload, weight reload,
pause/resume) to a priority queue; control jobs jump the queue and run between two batches,
never during one.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from serving.embedded.engine import GenerationJob, ModelEngine
from serving.embedded.sampling import EngineError


class EngineWorker:
    """The one thread that runs the engine. Control jobs go before queued generations.

    Generations that are waiting together (same adapter) run as one batch of up to
    ``max_batch`` requests (vLLM's ``--max-num-seqs``); a batch runs to completion before the
    next control job, so a weight reload never happens in the middle of a sequence.

    Batches are static (no request joins a running batch, unlike vLLM's continuous batching), so
    a request that arrives just after a batch started waits for all of it. ``batch_wait_s`` gives
    the first request of a batch a short window to collect the ones right behind it: agents of a
    round start within milliseconds of each other, and on CPU a lone first call followed by a batch
    of the rest costs about two batches where one would do (measured with bench/round.py).
    """

    CONTROL, GENERATE = 0, 1

    def __init__(self, engine: ModelEngine, max_batch: int = 8, batch_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.max_batch = max(1, max_batch)
        self.batch_wait_s = max(0.0, batch_wait_s)
        self._q: queue.PriorityQueue[tuple[int, int, Any, Future | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._held: list[tuple[int, int, Any, Future]] = []
        self.paused = False
        self.batches: deque[int] = deque(maxlen=1000)  # sizes of recent generation batches (observability)
        self._thread = threading.Thread(target=self._loop, name="tracerl-engine", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], *, control: bool = False) -> Future:
        fut: Future = Future()
        self._q.put((self.CONTROL if control else self.GENERATE, next(self._seq), fn, fut))
        return fut

    def generate(self, job: GenerationJob) -> Future:
        """Queue a generation; the future's result is its list of ``Completion``."""
        fut: Future = Future()
        self._q.put((self.GENERATE, next(self._seq), job, fut))
        return fut

    def call(self, fn: Callable[[], Any], *, control: bool = False, timeout: float | None = None) -> Any:
        return self.submit(fn, control=control).result(timeout)

    def pause(self, mode: str = "abort") -> None:
        """vLLM's ``/pause``: stop starting generations; ``abort`` fails the queued ones."""
        if mode not in ("abort", "wait", "keep"):
            raise EngineError(f"mode must be one of abort, wait, keep; got {mode!r}")

        def do() -> None:
            self.paused = True
            if mode == "abort":
                self._abort_queued()

        self.call(do, control=True)

    def resume(self) -> None:
        def do() -> None:
            self.paused = False
            for item in self._held:
                self._q.put(item)
            self._held.clear()

        self.call(do, control=True)

    def _abort_queued(self) -> None:
        pending = list(self._held)
        self._held.clear()
        keep = []
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            (pending if item[0] == self.GENERATE and item[2] is not None else keep).append(item)
        for item in keep:
            self._q.put(item)
        for *_, fut in pending:
            if fut is not None:
                fut.set_exception(
                    EngineError(
                        "request aborted: the server was paused (/pause?mode=abort) "
                        "for a weight update; retry",
                        503,
                        "ServiceUnavailable",
                    )
                )

    def close(self) -> None:
        self._q.put((-1, next(self._seq), None, None))
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            prio, _seq, work, fut = item
            if work is None or fut is None:
                return
            if prio == self.GENERATE and self.paused:
                self._held.append(item)  # type: ignore[arg-type]
                continue
            if isinstance(work, GenerationJob):
                self._run_batch(self._gather(item))
                continue
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(work())
            except BaseException as e:
                fut.set_exception(e)

    def _gather(self, first: tuple) -> list[tuple]:
        """``first`` plus the generations queued right behind it with the same adapter."""
        batch = [first]
        deadline = time.monotonic() + self.batch_wait_s
        while len(batch) < self.max_batch:
            try:
                item = (
                    self._q.get(timeout=max(0.0, deadline - time.monotonic()))
                    if self.batch_wait_s
                    else self._q.get_nowait()
                )
            except queue.Empty:
                break
            if (
                item[0] != self.GENERATE
                or not isinstance(item[2], GenerationJob)
                or item[2].adapter != first[2].adapter
            ):
                self._q.put(item)  # a control job, or another adapter: it runs next
                break
            batch.append(item)
        return batch

    def _run_batch(self, batch: list[tuple]) -> None:
        ready: list[tuple[GenerationJob, Future]] = []
        for _prio, _seq, job, fut in batch:
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                self.engine.check(job)
            except EngineError as e:
                fut.set_exception(e)
                continue
            ready.append((job, fut))
        if not ready:
            return
        self.batches.append(len(ready))
        try:
            results = self.engine.generate_batch([job for job, _ in ready])
        except BaseException as e:  # the shared forward pass failed: every job of the batch did
            for _, fut in ready:
                fut.set_exception(e)
            return
        for (_, fut), res in zip(ready, results, strict=True):
            if isinstance(res, EngineError):
                fut.set_exception(res)
            else:
                fut.set_result(res)
