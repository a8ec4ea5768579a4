"""Which vector instructions this CPU lets the engine use: found once per process, asked by every kernel-path choice.

Levels, lowest first: `baseline` (no target flags: what the compiler targets by default, any CPU), `avx2`
(x86-64-v3: AVX2, FMA, F16C, BMI, ...), `avx512` (x86-64-v4: AVX-512 F/BW/CD/DQ/VL). The engine's C++
kernels are built per level (`target_flags`; an AVX-512 CPU with AVX512-BF16 gets a build of its own with the bf16
dot-product instructions, `bf16_dot`), where a compiler cannot build one, the next lower (`kernel_builds`), and
oneDNN's bfloat16 packing is only chosen where torch's oneDNN can run it (`onednn_bf16`). `DCPCTL_CPU_ISA=avx2`
(or `baseline`) makes the CPU report less than it has, so that a machine with AVX-512 runs, and tests, what an
AVX2-only CPU runs; `torch_isa_env` gives the
variables that cap torch's and oneDNN's own kernels the same way (they must be set before torch's first
CPU op, so `engine/__init__.py` sets them at import). No torch import here: plan checks use this module.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UserError

ENV = "DCPCTL_CPU_ISA"
LEVELS = ("baseline", "avx2", "avx512")


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# /proc/cpuinfo flags each level needs on top of the one below (the x86-64 psABI levels v2+v3 and v4)
_LEVEL_FLAGS = {
    "baseline": frozenset(),
    "avx2": _names("avx avx2 bmi1 bmi2 f16c fma abm movbe xsave cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3"),
    "avx512": _names("avx512f avx512bw avx512cd avx512dq avx512vl"),
}
_MARCH = {"baseline": None, "avx2": "x86-64-v3", "avx512": "x86-64-v4"}
# the compiler flags of each level's instructions on top of the one below: what `-march=x86-64-v3` / `-v4` turn on
# (the same machine code with GCC 12), spelled out because only GCC 11+ and clang 12+ know those level names
_TARGET_FLAGS = {
    "baseline": "",
    "avx2": "-mcx16 -msahf -mpopcnt -msse3 -msse4.1 -msse4.2 -mssse3 "
    "-mavx -mavx2 -mbmi -mbmi2 -mf16c -mfma -mlzcnt -mmovbe -mxsave",
    "avx512": "-mavx512f -mavx512bw -mavx512cd -mavx512dq -mavx512vl",
}
# what torch's oneDNN and ATen dispatch may use at each level (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY)
_TORCH_CAPS = {"baseline": ("SSE41", "default"), "avx2": ("AVX2", "avx2"), "avx512": ("AVX512_CORE", "avx512")}


@dataclass(frozen=True)
class CpuIsa:
    """The level the engine runs at, what the CPU itself has, and the CPU flags visible at that level."""

    level: str
    detected: str
    flags: frozenset[str]

    @property
    def forced(self) -> bool:
        """True when DCPCTL_CPU_ISA lowered the level below the CPU's."""
        return self.level != self.detected

    @property
    def march(self) -> str | None:
        """The x86-64 psABI level the engine's C++ kernels target at this level (None: the compiler's default)."""
        return _MARCH[self.level]

    @property
    def bf16_dot(self) -> bool:
        """Whether the kernels are built with AVX512-BF16 (vdpbf16ps): an AVX-512 level whose CPU has it. gcc's
        x86-64-v4 does not include it, and a forced lower level hides it with the rest of AVX-512."""
        return self.level == "avx512" and "avx512_bf16" in self.flags

    @property
    def amx_bf16(self) -> bool:
        """Whether torch's bf16 products can run on AMX tiles here (oneDNN's brgemm): an AVX-512 level whose CPU has
        amx_bf16 (Sapphire Rapids and later); a forced lower level hides it with the rest of AVX-512."""
        return self.level == "avx512" and "amx_bf16" in self.flags

    @property
    def target_flags(self) -> list[str]:
        """The compiler's target flags of this level's kernel build: its instruction sets (never `-march=native`)."""
        levels = LEVELS[: LEVELS.index(self.level) + 1]
        flags = [flag for level in levels for flag in _TARGET_FLAGS[level].split()]
        return flags + (["-mavx512bf16"] if self.bf16_dot else [])

    @property
    def build_variant(self) -> str:
        """The name of the kernel build for this level, part of its cache key."""
        return (self.march or "portable") + ("-avx512bf16" if self.bf16_dot else "")

    @property
    def onednn_bf16(self) -> bool:
        """Whether torch's oneDNN packs bfloat16 weights here: it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT."""
        return self.level == "avx512" or "avx_ne_convert" in self.flags

    def kernel_builds(self) -> list[CpuIsa]:
        """The kernel builds to try, best first: this level's, then (where a compiler cannot build it) each lower
        level's; an AVX512-BF16 build falls back to the plain AVX-512 one first."""
        below = [CpuIsa(level, self.detected, _visible_flags(self.flags, level)) for level in LEVELS]
        builds = [self, *reversed(below[: LEVELS.index(self.level) + 1])]
        return [isa for i, isa in enumerate(builds) if isa.build_variant not in {b.build_variant for b in builds[:i]}]

    def describe(self) -> str:
        """One line: the level, bf16 dot-product support, and whether it was forced."""
        extra = " + avx512_bf16" if "avx512_bf16" in self.flags else ""
        origin = f", forced by {ENV} (the CPU has {self.detected})" if self.forced else ""
        return f"{self.level}{extra}{origin}"


def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. not Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def level_of(flags: frozenset[str], machine: str) -> str:
    """The highest level whose flags (and every lower level's) the CPU has; non-x86 CPUs are `baseline`."""
    if machine.lower() not in ("x86_64", "amd64"):
        return "baseline"
    level, needed = "baseline", frozenset()
    for name in LEVELS[1:]:
        needed |= _LEVEL_FLAGS[name]
        if not needed <= flags:
            break
        level = name
    return level


def _visible_flags(flags: frozenset[str], level: str) -> frozenset[str]:
    """The flags a CPU of exactly `level` would have: those of the levels up to it."""
    allowed = frozenset().union(*(_LEVEL_FLAGS[name] for name in LEVELS[: LEVELS.index(level) + 1]))
    return flags & allowed


def requested_level() -> str:
    """DCPCTL_CPU_ISA, or `auto`; a UserError names the choices for anything else."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value != "auto" and value not in LEVELS:
        raise UserError(f"{ENV}={value!r} is not one of auto, {', '.join(LEVELS)}")
    return value


@functools.cache
def detect() -> CpuIsa:
    """This CPU's level, lowered to DCPCTL_CPU_ISA when that asks for less (never raised above the CPU's)."""
    flags = _cpu_flags()
    detected = level_of(flags, platform.machine())
    requested = requested_level()
    if requested == "auto" or LEVELS.index(requested) >= LEVELS.index(detected):
        return CpuIsa(detected, detected, flags)
    return CpuIsa(requested, detected, _visible_flags(flags, requested))


def torch_isa_env(isa: CpuIsa) -> dict[str, str]:
    """Variables that cap oneDNN and ATen's dispatch at a forced level (empty when nothing is forced)."""
    if not isa.forced:
        return {}
    onednn, aten = _TORCH_CAPS[isa.level]
    return {"ONEDNN_MAX_CPU_ISA": onednn, "ATEN_CPU_CAPABILITY": aten}


def cap_torch_isa() -> None:
    """Export `torch_isa_env` into this process (unless already set): before torch's first CPU op it takes effect
    in torch, and child processes (ranks, benchmarks) inherit it. A bad DCPCTL_CPU_ISA is left for `detect`."""
    try:
        env = torch_isa_env(detect())
    except UserError:
        return
    for key, value in env.items():
        os.environ.setdefault(key, value)
