"""The rounds: get a batch of rollouts, convert it, train on it, record the round; again.

Round k trains on the rollouts of policy@k and publishes policy@k+1. With ``lead`` 0 (on-policy) the
agents wait while the trainer trains; with ``lead`` K the next K batches run meanwhile, so their calls
come from policies up to K versions old (``BatchesAhead``; the trainer's ``--max-staleness K`` bounds
what it takes). A batch in which every task's rollouts scored alike has no signal: the trainer waits
for more, the loop samples the same policy again, and it stops after ``max_no_signal`` such batches
in a row. Optionally policy@0's held-out evaluation runs beside round 0 (the engine would idle while
round 0 trains); policy@1 is published only once that evaluation is done, so every one of its calls
is served by policy@0. With ``heldout_first`` it runs before round 0's batch instead, so the rounds'
wall time holds training alone (bench/async_round.py compares schedules over it).

The stages come in as plain callables (``Stages``): the CLI builds them from its processes and
settings, a test from Python functions. Nothing here prints; the caller hears of each round through
``on_round`` and of each batch without signal through ``on_no_signal``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from loop.ahead import BatchesAhead
from loop.threads import ThreadChooser

BATCH_STOP_S = 30.0  # how long a stopped loop waits for its running batch's agents to be killed


# ------------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class LoopPlan:
    """How the rounds run; the CLI resolves its settings into this."""

    rounds: int  # rounds to train: round k trains on policy@k's rollouts and publishes policy@k+1
    lead: int = 0  # batches that run while a round trains (the trainer's --max-staleness); 0: on-policy
    alone_threads: int = 1  # torch threads of training with the machine to itself
    shared_threads: int = 1  # torch threads of training beside agents (held-out evaluation, next batch)
    # wait after a publish before the round is recorded: the gateway caches the server's model list
    # (its --models-ttl-s), so a new name is routed to only after that cache expired
    settle_s: float = 0.0
    max_no_signal: int = 3  # batches in a row without signal after which the loop stops
    # choose the trainer's threads per micro-batch, up to the budget, by what each count measured
    # (loop/threads.py): on a busy machine 2 threads trained 5x slower than 1
    measure_threads: bool = False
    # policy@0's held-out evaluation (Stages.heldout) runs before round 0's batch, not beside round 0
    heldout_first: bool = False
    report_hint: str = "tracerl report"  # where a user reads the rounds manifest; named in errors

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.lead < 0 or self.max_no_signal < 1:
            raise ValueError(
                f"rounds must be >= 1, lead >= 0 and max_no_signal >= 1; got {self.rounds}, {self.lead}, "
                f"{self.max_no_signal}"
            )


# ------------------------------------------------------------------------------------ the stages
class Outcome(Protocol):
    """What one trainer call did (``trainer.rounds.RoundOutcome``)."""

    status: str  # published | trained | waiting (no signal in the data) | locked
    message: str


@dataclass(frozen=True)
class Training:
    """One trainer call: its torch threads, whether it publishes, and (beside the next batch) the
    threads to use from now on, asked before each micro-batch."""

    threads: int
    publish: bool
    threads_now: Callable[[], int] | None = None


@dataclass
class Batch:
    """A batch of rollouts, all of it stored: its records (``rollout.records.RolloutRecord``, read for
    ``rollout_id`` and ``reward``) and the seconds it took."""

    records: list[Any]
    seconds: float
    # set when the batch's producer converted it once stored (``Stages.convert``'s answer and its
    # seconds): with batches run ahead that happens in the producer's thread, off the trainer's path
    converted: tuple[int, str] | None = None
    convert_s: float = 0.0


@dataclass
class Stages:
    """The stages the loop drives, as callables."""

    rollouts: Callable[[int], Batch]  # training batch b (its tasks: the b-th of the split), until stored
    # convert the store; how many of these rollouts now have transitions, and what conversion did
    convert: Callable[[list[str]], tuple[int, str]]
    train: Callable[[Training], Outcome]  # one trainer call (``run_once``)
    round_row: Callable[[int], dict[str, Any] | None]  # round k's row of the rounds manifest
    alive: Callable[[], None] = lambda: None  # raises when a process the loop needs has died
    abort: threading.Event = field(default_factory=threading.Event)  # set: a running batch is killed
    heldout: Callable[[int], Any] | None = None  # policy@k's held-out rollouts; None: no evaluation
    score_heldout: Callable[[int, Any], None] = lambda _k, _result: None  # what ``heldout`` returned
    # True while a batch's agents run (the engine busy with its calls); None: while ``rollouts`` runs. A
    # batch's tail (its spans stored, then converted) takes little CPU: a round beside it takes the cores
    agents_running: Callable[[], bool] | None = None


# ------------------------------------------------------------------------------------ what it reports
@dataclass
class RoundDone:
    """Round k, recorded: its manifest row, its wall time and where that went."""

    round: int
    row: dict[str, Any]
    seconds: float  # from asking for the batch to recording the round
    rollout_s: float  # the batch's own time (run ahead, when lead > 0)
    convert_s: float
    train_s: float
    wait_s: float = 0.0  # waiting for the batch (on-policy: all of it; run ahead: what was left of it)
    batch_convert_s: float = (
        0.0  # the conversion its producer did once the batch was stored (Batch.convert_s)
    )
    trained_at: float = 0.0  # monotonic end of its training (its span in LoopResult.train_spans)


@dataclass
class NoSignal:
    """A batch of policy@version in which every task's rollouts scored alike."""

    version: int
    records: list[Any]
    stopping: bool  # the last one allowed: the loop stops


@dataclass
class LoopResult:
    """What the rounds did: the final policy's version and the figures of bench/async_round.py."""

    version: int = 0  # rounds published: the last policy is policy@version
    rounds: list[RoundDone] = field(default_factory=list)
    samples: int = 0  # calls trained on, all rounds
    # monotonic (start, end) of each training batch and of each round's training: idle fractions
    rollout_spans: list[tuple[float, float]] = field(default_factory=list)
    train_spans: list[tuple[float, float]] = field(default_factory=list)
    # LoopPlan.measure_threads: the trainer's mean seconds per micro-batch by thread limit and count
    thread_means: dict[int, dict[int, float]] = field(default_factory=dict)


@dataclass
class _State:
    """Where the loop is: the trainer's round, the next batch, the no-signal streak."""

    wanted: int  # training batches the loop needs: one more for each batch without signal
    k: int = 0  # the trainer's round: trains on policy@k, publishes policy@k+1
    b: int = 0  # the next batch to take
    no_signal: int = 0  # batches in a row without signal
    background: ThreadPoolExecutor | None = None  # runs policy@0's held-out evaluation
    heldout_started: bool = False
    pending: Future[Any] | None = None  # policy@0's held-out evaluation, running beside round 0
    chooser: ThreadChooser | None = None  # LoopPlan.measure_threads: the threads each count measured


# ------------------------------------------------------------------------------------ pure rules
class Beside(Enum):
    """What runs on the machine while a round trains."""

    HELDOUT = "policy@0's held-out evaluation"
    NOTHING = "nothing"
    NEXT_BATCH = "the next batch's agents"


def beside(plan: LoopPlan, heldout_pending: bool) -> Beside:
    """The held-out evaluation when it runs; else the next batch when batches run ahead; else nothing."""
    if heldout_pending:
        return Beside.HELDOUT
    return Beside.NEXT_BATCH if plan.lead else Beside.NOTHING


def thread_budget(
    plan: LoopPlan, where: Beside, batch_running: Callable[[], bool], chooser: ThreadChooser | None = None
) -> Training:
    """The trainer call for a round trained beside ``where``.

    Alone, training has the machine's cores (the engine idles between rounds) and publishes. Beside
    the held-out evaluation it trains on the shared threads and does not publish (policy@1 must not
    serve the evaluation's calls). Beside the next batch it starts on the shared threads and takes
    the machine's cores once the batch's agents are done. With a ``chooser``, that count is the limit
    and the chooser picks, per micro-batch, the count up to it that trained fastest."""
    publish = where is not Beside.HELDOUT

    def limit() -> int:
        if where is Beside.NEXT_BATCH:
            return plan.shared_threads if batch_running() else plan.alone_threads
        return plan.alone_threads if where is Beside.NOTHING else plan.shared_threads

    if chooser is not None:
        chooser.begin()
        return Training(threads=limit(), publish=publish, threads_now=lambda: chooser.choose(limit()))
    if where is not Beside.NEXT_BATCH:
        return Training(threads=limit(), publish=publish)
    return Training(threads=plan.shared_threads, publish=True, threads_now=limit)


def held_by_evaluation(b: int, k: int, evaluating: bool) -> bool:
    """Batch ``b`` waits while policy@0's held-out evaluation is planned or running, unless it is the batch
    round ``k`` trains on now. The evaluation is the engine's work beside round 0, and round 0 publishes
    only once it is done: a batch run ahead beside it only shares the engine with it (both at the server's
    batch size), so it delays the evaluation, hence round 0, by about what it gets done (round 0 took
    81.6 s instead of 68.8 s on-policy, bench/async_round.py with the fork launcher, load 7)."""
    return evaluating and b > k


def after_training(status: str, streak: int, limit: int) -> tuple[str, int]:
    """The no-signal rule: ``("record", 0)`` once a round trained; for a batch without signal
    (the trainer waits) ``("resample", streak + 1)``, or ``("stop", limit)`` at the limit."""
    if status != "waiting":
        return "record", 0
    streak += 1
    return ("stop" if streak >= limit else "resample"), streak


def check_converted(k: int, converted: int, records: list[Any], summary: str) -> None:
    """Every rewarded rollout of the batch must have transitions before its round trains."""
    rewarded = sum(r.reward is not None for r in records)
    if converted < rewarded:
        raise RuntimeError(
            f"round {k}: only {converted} of {rewarded} rewarded rollouts were converted ({summary})"
        )


def check_published(k: int, outcome: Outcome, row: dict[str, Any] | None, report_hint: str) -> dict[str, Any]:
    """Round k's manifest row, which must say published (as the trainer's outcome must)."""
    if outcome.status != "published" or row is None or row["status"] != "published":
        raise RuntimeError(
            f"round {k}: training did not publish policy@{k + 1} ({outcome.status}: "
            f"{outcome.message}); see the rounds manifest: {report_hint}"
        )
    return row


# ------------------------------------------------------------------------------------ the phases
def convert_batch(stages: Stages, k: int, batch: Batch) -> None:
    """Convert the store (unless the batch's producer did) and check that the batch's rewarded
    rollouts all became transitions."""
    converted, summary = batch.converted or stages.convert([r.rollout_id for r in batch.records])
    check_converted(k, converted, batch.records, summary)


def train_round(plan: LoopPlan, stages: Stages, ahead: BatchesAhead[Batch], state: _State) -> Outcome:
    """Train round k with the thread budget of what runs beside it (``thread_budget``).

    Beside the held-out evaluation: train without publishing, score the evaluation once its calls
    are all answered, then publish (the second call finds the trained checkpoint and publishes it)."""
    where = beside(plan, state.pending is not None)
    running = stages.agents_running or (lambda: ahead.running)
    outcome = stages.train(thread_budget(plan, where, running, state.chooser))
    if where is Beside.HELDOUT:
        assert state.pending is not None and stages.heldout is not None
        stages.score_heldout(0, state.pending.result())
        state.pending = None
        if outcome.status == "trained":
            outcome = stages.train(thread_budget(plan, Beside.NOTHING, lambda: False, state.chooser))
    return outcome


def record_round(plan: LoopPlan, stages: Stages, k: int, outcome: Outcome) -> dict[str, Any]:
    """Round k's manifest row, once the publish had time to reach the gateway's routing.

    A bare wait, not a poll: the gateway's ``GET /v1/models`` is passed through to the server (which
    lists the new version as soon as the publish returns), so no answer shows when the gateway's own
    cached list expired; ``settle_s`` is set from that cache's lifetime. The next batch was released
    before this wait (``one_round``), so it runs meanwhile; what starts after the loop returns (an
    evaluation of the last policy) is what the wait covers, so only the last round waits: before,
    the wait only delayed the next round's training (0.6 s a round in the demo)."""
    if k == plan.rounds - 1:
        time.sleep(plan.settle_s)
    return check_published(k, outcome, stages.round_row(k), plan.report_hint)


def one_round(
    plan: LoopPlan, stages: Stages, ahead: BatchesAhead[Batch], state: _State, result: LoopResult
) -> RoundDone | NoSignal:
    """Take the next batch, convert it, train on it; record the round, or say it had no signal."""
    t0 = time.perf_counter()
    batch = ahead.get(state.b)
    state.b += 1
    t1 = time.perf_counter()
    convert_batch(stages, state.k, batch)
    t2 = time.perf_counter()
    if state.background is not None and stages.heldout is not None and not state.heldout_started:
        state.pending = state.background.submit(stages.heldout, 0)
        state.heldout_started = True
        state.pending.add_done_callback(lambda _f: ahead.changed())  # a batch held for it may start
    tt = time.monotonic()
    outcome = train_round(plan, stages, ahead, state)
    result.train_spans.append((tt, time.monotonic()))
    ahead.release()
    stages.alive()
    t3 = time.perf_counter()
    action, state.no_signal = after_training(outcome.status, state.no_signal, plan.max_no_signal)
    if action != "record":
        return NoSignal(version=state.k, records=batch.records, stopping=action == "stop")
    row = record_round(plan, stages, state.k, outcome)
    return RoundDone(
        state.k,
        row,
        time.perf_counter() - t0,
        batch.seconds,
        t2 - t1,
        t3 - t2,
        t1 - t0,
        batch.convert_s,
        trained_at=result.train_spans[-1][1],
    )


def run_rounds(
    plan: LoopPlan,
    stages: Stages,
    on_round: Callable[[RoundDone], None] = lambda _done: None,
    on_no_signal: Callable[[NoSignal], None] = lambda _ns: None,
) -> LoopResult:
    """Train ``plan.rounds`` rounds (fewer when batches keep lacking signal); see the module docstring.

    Batch b runs ``stages.rollouts(b)`` in a background thread, up to ``plan.lead`` batches ahead of
    the round being trained. When the loop stops early or fails, ``stages.abort`` is set while the
    batch still running is stopped, then cleared (the caller may run more rollouts afterwards)."""
    result = LoopResult()
    state = _State(wanted=plan.rounds, chooser=ThreadChooser() if plan.measure_threads else None)
    if stages.heldout is not None:
        if plan.heldout_first:  # scored before any batch: nothing waits for it, nothing runs beside it
            stages.score_heldout(0, stages.heldout(0))
        else:
            state.background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="held-out")

    def evaluating() -> bool:  # policy@0's held-out evaluation is still to start, or running (beside round 0)
        if state.background is None:
            return False
        return not state.heldout_started or (state.pending is not None and not state.pending.done())

    ahead = BatchesAhead(
        stages.rollouts,
        plan.lead,
        wanted=lambda b: b < state.wanted and not held_by_evaluation(b, state.k, evaluating()),
    )
    try:
        while state.k < plan.rounds:
            done = one_round(plan, stages, ahead, state, result)
            if isinstance(done, NoSignal):
                on_no_signal(done)
                if done.stopping:
                    break
                state.wanted += 1  # the same policy samples one more batch
                ahead.changed()
                continue
            result.samples += done.row["n_transitions"] or 0
            result.rounds.append(done)
            on_round(done)
            state.k += 1
    finally:
        stages.abort.set()  # a batch still running (only when stopped early) is killed, not left behind
        ahead.close(timeout_s=BATCH_STOP_S)
        stages.abort.clear()
        result.rollout_spans = list(ahead.spans)
    if state.pending is not None:  # every round 0 batch lacked signal: the evaluation still counts
        stages.score_heldout(0, state.pending.result())
    if state.background is not None:
        state.background.shutdown()
    result.version = state.k
    if state.chooser is not None:
        result.thread_means = state.chooser.means
    return result
