"""The glibc allocator settings: a step's large temporaries come from the reusable heap."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

ALLOCATION_PROBE = """
import ctypes, sys
import torch
from engine.runtime.host_allocator import reuse_freed_memory

class MallInfo2(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in names.split()]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
if sys.argv[1] == "tuned":
    assert reuse_freed_memory()
before = mallinfo2().hblkhd
buffer = torch.empty(6 * 2**20)  # 24 MiB: above glibc's default mmap threshold, below the tuned one
mmapped = mallinfo2().hblkhd - before
del buffer
print(mmapped, mallinfo2().fordblks)  # bytes mmapped for it, then bytes kept free in the heap after freeing it
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
@pytest.mark.parametrize("mode", ["default", "tuned"])
def test_reuse_freed_memory_serves_step_sized_buffers_from_the_heap(mode):
    """Tuned, a 24 MiB step temporary comes from the heap and stays there when freed (no fresh mmap per step)."""
    out = subprocess.run([sys.executable, "-c", ALLOCATION_PROBE, mode], capture_output=True, text=True, check=True)
    mmapped, kept_free = (int(n) for n in out.stdout.split())
    if mode == "tuned":
        assert mmapped == 0
        assert kept_free >= 24 * 2**20  # the next step finds it in the heap, already faulted in
    else:
        assert mmapped >= 24 * 2**20
