"""The dcpctl inference engine. `from engine import LLM, SamplingParams` (torch loads on first use)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.devices import cpu_set
from engine.kernels.cpu_isa import cap_torch_isa
from engine.kernels.cpu_threads import default_wait_policy

if TYPE_CHECKING:
    from engine.core.sequence import SamplingParams
    from engine.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

# both must be in the environment before torch loads (anything below may import it)
cap_torch_isa()  # DCPCTL_CPU_ISA=avx2 caps torch's own kernels too
default_wait_policy()  # threads spin ~100 µs at a barrier, then sleep: no long spins on cores another process needs
cpu_set()  # the process's cores, remembered before OpenMP binding pins this thread to one of them


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput"):
        from engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from engine.core.sequence import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
