"""Host memory for attention on the CPU: keep freed blocks inside the process.

PyTorch's CPU allocator is the C library's malloc. glibc serves every block of 128 KiB or more
(at first; the limit moves with use) by a fresh mmap and unmaps it on free, and trims the heap
top back to the OS, so a loop of equal-sized attention pieces pays page faults for the same
memory on every iteration: at the replay's test layout that is about 6 million faults and a
fifth of the wall time, spent in the kernel and spread unevenly over the ranks being timed.
`retain_freed_memory()` sets glibc's thresholds once per process so that blocks up to
`MMAP_LIMIT` come from the heap and freed memory is kept for the next piece (the effect of
running under tcmalloc or jemalloc, without preloading them). It is applied by the commands that
time or run attention on the CPU (`libra bench replay`, `libra calibrate`, CPU training); a GPU
run's host side does not need it, and other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

MMAP_LIMIT = 32 << 20
"""Blocks below this come from the heap (glibc's largest mmap threshold on 64-bit systems)."""
TRIM_LIMIT = 1 << 30
"""Free memory at the heap top kept before any is handed back to the OS."""
TOP_PAD = 64 << 20
"""Extra heap requested from the OS each time the heap grows."""

_applied: bool | None = None


def retain_freed_memory() -> bool:
    """Apply the thresholds above (once per process). Returns True where they are in effect,
    False where the C library is not glibc or refuses them (nothing is changed then)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    _applied = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_LIMIT),
            (_M_TRIM_THRESHOLD, TRIM_LIMIT),
            (_M_TOP_PAD, TOP_PAD),
        )
    )
    return _applied
