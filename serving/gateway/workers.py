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


def tune_for_relaying() -> None:
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
    nothing.
    """
    calm_gc()
    sys.setswitchinterval(GIL_SWITCH_S)


def calm_gc() -> None:
    """Tune the cyclic garbage collector for a relaying process; call once it is serving.

    Relaying allocates a few thousand short-lived dicts and lists per streamed call (every chunk is
    parsed), so with the default gen-0 threshold (700) the collector ran several times per call and
    took 16% of the gateway's samples (py-spy, 128 streams). Objects that exist at startup (modules,
    the app) are frozen out of every collection, and gen 0 is collected every 20,000 allocations:
    CPU per streamed call fell by about 12% (``bench/gateway.py``). Cycles are still collected.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)
