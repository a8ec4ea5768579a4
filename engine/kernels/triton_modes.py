"""Compiled or interpreted Triton kernels, chosen per launch by the tensors' device.

CUDA tensors run compiled kernels; CPU tensors run the same kernel bodies in the Triton interpreter (tests, CPU
plans). The interpreted versions are made by `triton.jit` under a scoped TRITON_INTERPRET=1 (triton reads it when a
function is decorated), so nothing depends on the variable being set before triton is imported (torch._dynamo
imports triton early). For that, kernel bodies call no jitted library function (`tl.zeros`, `tl.max`, `tl.sum`,
`tl.sigmoid` are jitted): `tl.full` and `tl.reduce` with triton's own combine functions, which the interpreter runs
in numpy. The interpreter computes `tl.dot` on bf16/fp16 bits wrongly, so there every dot runs in fp32.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import torch
import triton


@contextlib.contextmanager
def _interpret_env(on: bool) -> Iterator[None]:
    previous = os.environ.get("TRITON_INTERPRET")
    if on:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if on and previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        elif on:
            os.environ["TRITON_INTERPRET"] = previous


def jit_bodies(bodies: dict[str, Callable], interpret: bool) -> SimpleNamespace:
    """`bodies` jitted for the compiler (False) or the interpreter (True); cache the result per mode."""
    with _interpret_env(interpret):
        return SimpleNamespace(**{name: triton.jit(body) for name, body in bodies.items()})


def interpreted(t: torch.Tensor) -> bool:
    """Whether kernels on `t` run in the Triton interpreter: every non-CUDA tensor, or all with TRITON_INTERPRET=1."""
    return t.device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
