"""``trainer/cpu_memory.keep_freed_memory``: after it, memory a process frees is handed out again without
the kernel faulting fresh pages in; glibc's defaults fault them again each time (the pattern of a training
micro-batch: the same large blocks allocated, written and freed over and over)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc"),
    pytest.mark.slow,  # a fresh interpreter: the thresholds are per process
]

PROBE = """
import ctypes, resource, sys
libc = ctypes.CDLL("libc.so.6")
malloc, free, memset = libc.malloc, libc.free, libc.memset
malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
free.argtypes, memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
if sys.argv[1] == "keep":
    from trainer.cpu_memory import keep_freed_memory
    assert keep_freed_memory() and keep_freed_memory()
size, pages = 24 << 20, 2 * (24 << 20) // 4096
faulted = []
for _ in range(6):  # two 24 MiB blocks written and freed, as a micro-batch's activations are
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [malloc(size) for _ in range(2)]
    for b in blocks:
        memset(b, 1, size)
    for b in blocks:
        free(b)
    faulted.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / pages)
print(" ".join(f"{f:.3f}" for f in faulted))
"""


def _faulted(mode: str) -> list[float]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60, check=True)
    return [float(x) for x in out.stdout.split()]


def test_freed_blocks_are_reused_without_page_faults():
    keep, plain = _faulted("keep"), _faulted("plain")
    assert keep[0] > 0.9, keep  # the first time the pages are new to the process either way
    assert max(keep[1:]) < 0.05, keep
    # glibc's defaults give the blocks back (they are above its 128 KiB mmap threshold) and fault them
    # in again: what the trainer paid every micro-batch
    assert min(plain[1:]) > 0.5, plain
