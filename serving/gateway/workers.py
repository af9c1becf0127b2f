"""``tracerl gateway --workers N``: N gateway processes serving one port.

One gateway process is one event loop, so it relays at most what one core can (about 1 ms of CPU
per 16-chunk streamed call at 256 streams, measured with ``bench/gateway.py``; 1.1 ms with 1000-token
prompts, whose ids the span carries as one JSON string: 1.8 ms while they were int arrays).
N processes bind the same port with ``SO_REUSEPORT`` and the kernel spreads client connections over
them, so the gateway scales with cores the way vLLM's API server does with ``--api-server-count``.

Nothing a call needs is shared between calls, so the processes need not talk to each other:
stickiness is a rendezvous hash of the rollout id (the same in every process) and failover is decided
per call. What is per process: the cached ``/v1/models`` answer (each process asks the upstream on
its own), the memory of an upstream refusing ``return_token_ids`` (each process meets the refusal
once), ``--max-connections`` (the cap of each process, so N times that in all) and the span
exporter (each process exports its own spans to ``--otlp``).

The processes are forked before any of them starts a thread; the first is the parent, which stops
the others when it is stopped (SIGTERM, SIGINT) and which they do not outlive (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from serving.processes import die_with_parent


@dataclass
class Worker:
    """This process's place among the workers: index 0 is the parent."""

    index: int
    port: int
    children: list[int] = field(default_factory=list)
    _hold: socket.socket | None = None

    @property
    def parent(self) -> bool:
        return self.index == 0

    def serving(self) -> None:
        """Call once this process's server is bound: the parent stops reserving the port."""
        if self._hold is not None:
            self._hold.close()
            self._hold = None

    def finish(self) -> None:
        """After this process's server has stopped (in a ``finally``): the parent stops and reaps the
        others; a child exits here, so it never returns into the command line's caller (its error, if
        it is ending with one, is printed and its exit status is 1)."""
        if not self.parent:
            failed = sys.exc_info()[0] is not None and sys.exc_info()[0] is not SystemExit
            if failed:
                traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1 if failed else 0)
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for pid in self.children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def fork_workers(n: int, host: str, port: int) -> Worker:
    """Fork ``n - 1`` children (none for ``n <= 1``); returns in every process with its ``Worker``.

    ``port`` 0 is resolved first (a socket bound with ``SO_REUSEPORT`` holds it until ``serving()``),
    so every process binds the same port. Call before starting any thread.
    """
    if n <= 1:
        return Worker(0, port)
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    hold = socket.socket(family, kind, proto)
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    hold.bind(addr)  # bound, never listening: it receives no connections
    port = hold.getsockname()[1]
    parent = os.getpid()
    sys.stdout.flush()  # what is buffered now would be written by every process
    children: list[int] = []
    for i in range(1, n):
        pid = os.fork()
        if pid == 0:
            hold.close()
            die_with_parent(signal.SIGTERM, parent)
            return Worker(i, port)
        children.append(pid)
    return Worker(0, port, children, hold)


GIL_SWITCH_S = 0.0005  # how long a thread may keep the GIL while another waits (Python's default: 5 ms)


def tune_for_relaying() -> threading.Event:
    """Tune a gateway process once it is serving: the collector (``calm_gc``) and the GIL handoff.

    The span exporter's thread (``BatchSpanProcessor``) encodes each batch in Python (OTLP protobuf),
    so while it exports it and the serving loop take turns on the GIL; with the default switch
    interval each turn can keep the loop waiting 5 ms, and every stream's chunk that arrived in that
    time waits with it. At 0.5 ms the loop gets the GIL back within 0.5 ms. Measured while the token
    ids were int arrays (about 90 us a span to encode; one JSON string each since: ~28 us with
    1000-token prompts, ``bench/gateway_spans.py``), with ``bench/gateway.py --sweep 64
    --prompt-tokens 1000``, this gateway against one with 5 ms in the same run, load 0.4, two runs:
    p99 added 14.5 / 15.7 ms against 35.8 / 23.1 ms, CPU per call the same. With the bench's 5-token
    prompts (spans cheap to encode) no difference shows; with the string ids it is not re-measured.
    The extra handoffs happen only while another thread wants the GIL, so an idle exporter costs
    nothing. Returns the event that stops ``calm_gc``'s collecting thread.
    """
    sys.setswitchinterval(GIL_SWITCH_S)
    return calm_gc()


COLLECT_EVERY_S = 300.0  # while serving, a full collection this often at the latest ...
COLLECT_AT_OBJECTS = 250_000  # ... or sooner, once this many more objects are tracked than after the last one


def calm_gc(every_s: float = COLLECT_EVERY_S, at_objects: int = COLLECT_AT_OBJECTS) -> threading.Event:
    """Keep the cyclic garbage collector off the serving loop's path; call once the process is serving.

    Relaying allocates a few thousand short-lived dicts and lists per streamed call (every chunk is parsed).
    With the default gen-0 threshold (700) the collector ran several times per call (16% of the gateway's
    py-spy samples at 128 streams); at 20,000 it still ran 4-5 times in a 35 s bench run at 256 streams,
    mostly when 256 connections opened at once, each pass walking every live object of the calls in flight
    with the serving thread holding the GIL: 2-33 ms in which every stream's next chunk waits, so a pass in a
    measured window put its length into the p99. The passes freed 3 objects a run: relaying makes almost no
    reference cycles, reference counting frees the rest. So objects that exist at startup are frozen out of
    every collection, automatic collection is off, and a thread that wakes once a second collects everything
    every ``every_s`` seconds, or sooner once the tracked objects grew by ``at_objects`` (``gc.get_count``: a
    burst of garbage cycles, e.g. exceptions with their tracebacks, is collected within a second or so of
    reaching that). Measured with ``bench/gateway.py --sweep 256 --gateway-root`` (the gen-0 threshold of
    20,000) in the same runs, load 0.6-1.6, five runs with no pass of this policy in them: interleaved (each
    client alternating between the two gateways: the same moments' load) p99 -42.9 and -12.7 ms in the two runs
    where a pass of the old policy fell in the window, -0.4 to +0.8 ms in the other three; as phases, one after
    the other, p99 added 3.8, 5.5, 24.0, 9.0 and 54.9 ms against 52.5, 20.5, 19.3, 13.6 and 14.5 ms. The passes
    were the largest single stalls of the tail, but not the whole of it (54.9 ms with none).
    A full pass is as long as before (17-18 ms at 256 streams) when it comes. Setting the returned event stops
    the thread (tests).
    """
    gc.collect()
    gc.freeze()
    gc.disable()
    stop = threading.Event()
    args = (every_s, at_objects, stop)
    threading.Thread(target=_collect_when_due, args=args, name="tracerl-gc", daemon=True).start()
    return stop


def _collect_when_due(every_s: float, at_objects: int, stop: threading.Event) -> None:
    last = time.monotonic()
    while not stop.wait(min(1.0, every_s)):
        if time.monotonic() - last >= every_s or gc.get_count()[0] >= at_objects:
            gc.collect()
            last = time.monotonic()
