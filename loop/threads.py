"""The trainer's CPU threads, chosen by what each count measured on this machine, now.

On a quiet 2-core machine a 135M LoRA step on 640 tokens took 2.8 s on 2 torch threads and 3.9 s on
1; on the same machine busy with other work (load 7-10) 2 threads trained at 38 tokens/s and 1 at
192 (bench/async_round.py, round 1 against round 0): each torch thread waits at every parallel
region for the other, and a thread the scheduler took away holds both. Neither count is right
everywhere, so the loop measures: the torch backend asks for its threads before every micro-batch
(``threads_now``), and the time between two asks is the previous micro-batch's compute under the
count then in force. Each count up to the current limit is tried, the fastest is kept, and the
others are tried again now and then, since the machine's load changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

ALPHA = 0.5  # weight of the newest micro-batch in a count's running mean: the load moves within minutes


def candidates(limit: int) -> list[int]:
    """The thread counts worth trying up to ``limit``: 1, the powers of two, and ``limit`` itself."""
    limit = max(1, limit)
    out, n = {1, limit}, 2
    while n < limit:
        out.add(n)
        n *= 2
    return sorted(out)


def pick_threads(means: dict[int, float], limit: int, asked: int, reprobe_every: int) -> int:
    """The threads for the next micro-batch: an untried candidate first (largest first: the count a
    quiet machine wants), then the one with the lowest mean seconds per micro-batch. The runner-up
    is tried again every ``reprobe_every`` x (its mean / the best mean) asks, so a count that lost
    under a load that has since gone gets another chance, and a retry costs at most about
    1/``reprobe_every`` of the training time however badly that count lost (2 threads on a busy
    machine: 5x)."""
    cands = candidates(limit)
    untried = [n for n in cands if n not in means]
    if untried:
        return untried[-1]
    ranked = sorted(cands, key=lambda n: means[n])
    if len(ranked) > 1 and reprobe_every > 0:
        ratio = means[ranked[1]] / means[ranked[0]] if means[ranked[0]] > 0 else 1.0
        every = max(2, round(reprobe_every * ratio))
        if asked % every == every - 1:
            return ranked[1]
    return ranked[0]


@dataclass
class ThreadChooser:
    """``choose(limit)`` before each micro-batch (the ``threads_now`` hook); ``begin()`` at the start of
    each trainer call, so the time between calls is not taken for a micro-batch."""

    reprobe_every: int = 16
    clock: Callable[[], float] = time.monotonic
    # limit -> threads -> running mean seconds per micro-batch; kept per limit, since a limit stands
    # for what runs beside (1 beside a batch's agents, the cores alone): one count, two machines
    means: dict[int, dict[int, float]] = field(default_factory=dict)
    _last: tuple[int, int, float] | None = None  # the limit and count of the previous ask, and when
    _asked: int = 0

    def begin(self) -> None:
        self._last = None

    def observe(self, limit: int, threads: int, seconds: float) -> None:
        means = self.means.setdefault(limit, {})
        old = means.get(threads)
        means[threads] = seconds if old is None else (1 - ALPHA) * old + ALPHA * seconds

    def choose(self, limit: int) -> int:
        now = self.clock()
        if self._last is not None:
            self.observe(self._last[0], self._last[1], now - self._last[2])
        n = pick_threads(self.means.get(limit, {}), limit, self._asked, self.reprobe_every)
        self._asked += 1
        self._last = (limit, n, now)
        return n
