"""glibc malloc settings that let each engine step reuse the memory the previous step freed.

A step allocates the same large temporaries every time (activations of up to
`scheduler.max_num_batched_tokens` rows). By default glibc serves big blocks with fresh mmaps and
gives freed heap tops back to the kernel, so every step page-faults and zero-fills megabytes again;
on the shared VMs we measured, that made a bfloat16 RMSNorm over 2048 rows ~6x slower and
bfloat16 decode at batch 16 ~20% slower (docs/results/cpu-kernels.md).
"""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's ceiling on 64-bit: larger blocks (weights, KV cache) stay mmaps
_SETTINGS = ((_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 64 * 2**20))


def reuse_freed_memory() -> bool:
    """Keep freed memory in the heap for reuse; False where the C library is not glibc (no `mallopt`)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all(mallopt(param, value) == 1 for param, value in _SETTINGS)
