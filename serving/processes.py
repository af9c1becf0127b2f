"""Child processes that end with their parent, however the parent ends (Linux ``PR_SET_PDEATHSIG``).

The gateway's worker processes, the vLLM server and the trainer's torchrun and ranks all use it, so a
``kill -9`` of the command that started them leaves nothing running.
"""

from __future__ import annotations

import ctypes
import os
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int, parent: int | None = None) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies, however it dies (Linux's
    ``PR_SET_PDEATHSIG``; elsewhere a no-op: the parent's own stop is all there is). With ``parent``
    (its pid, taken before the fork), a parent that died before this took effect is caught too.
    Used by the gateway's workers and by the trainer's torchrun and ranks."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
