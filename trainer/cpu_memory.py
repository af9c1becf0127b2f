"""Keep a CPU trainer's freed memory for its next micro-batch instead of handing it back to the kernel.

Why: glibc's malloc serves a block above its mmap threshold (128 KiB, raised as such blocks are freed, up to
32 MiB) with a fresh ``mmap`` and gives it back with ``munmap`` when torch frees the tensor, and it trims
the top of the heap once more than twice that threshold lies free there. A training step allocates and
frees the same activations, logits and gradients every micro-batch, so each micro-batch faulted in its
memory again, page by page, each page zeroed by the kernel. In the demo (SmolLM2-135M LoRA, 640-token rows,
one thread) that was 50k-370k page faults and 0.1-1.1 s of kernel time per 1.6-2.5 s micro-batch, and the
kernel time grew when the rollouts' processes ran beside it (the agents' forks fault too). A fixed mmap
threshold at glibc's maximum and a trim threshold that keeps a trainer's working set make the heap
hold on to that memory: the same micro-batches then fault a few thousand pages or none.

There is no library call for this: ``mallopt`` is glibc's own knob (``man 3 mallopt``), reached through
ctypes. Elsewhere (musl, macOS, Windows) nothing is changed. Blocks above 32 MiB are still mapped fresh,
which is why the CPU head runs on chunks whose logits stay below it (``trainer/head_logprobs.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's cap on 64-bit (HEAP_MAX_SIZE / 2); a larger value is refused
TRIM_THRESHOLD = 1 << 30  # free heap top kept: above a 135M-1.5B LoRA step's working set on a CPU


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's mmap threshold to its maximum and the trim threshold to ``TRIM_THRESHOLD``, once per
    process; True when glibc took both. Raising the thresholds only changes where malloc finds memory,
    never what a program computes; the cost is that freed memory up to ``TRIM_THRESHOLD`` stays with
    the process."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # no C library with a mallopt (musl's is a stub that returns 0)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
