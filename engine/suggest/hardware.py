"""Device figures for planning: presets from vendors' data sheets, and `cpu` measured on this machine.

Each preset cites its data sheet. Figures are per device (one rank each): memory, peak memory bandwidth, dense
16-bit tensor throughput (fp32 runs at half of it: TF32 on Hopper / Blackwell tensor cores, FP32 matrix on CDNA 3),
and the interconnect inside a node (NVLink / Infinity Fabric, per direction: half the bidirectional figure a data
sheet quotes) and across nodes (one 400 Gb/s NIC per GPU, as in DGX H100/H200/B200 and MI300X platforms).
Collective latencies are not in data sheets: the presets assume NCCL/RCCL's small-message latency (~10 us inside a
node, ~20 us across nodes); they matter only for steps made of many small collectives.

`cpu` is measured (`engine.suggest.measure`): copy bandwidth, gloo's collective latency, and at the model's decode
shapes the engine's own linear layers (FLOP/s), decode attention (KV bytes/s) and host time per layer, for a rank per
core and for one rank on all cores, and a collective's latency inside a two-rank decode step
(`engine.suggest.decode_timing`). Its ranks share one memory system and the cores (`shared` = True), as the engine
runs them.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, replace

from engine import devices
from engine.checkpoints.model_info import ModelInfo
from engine.errors import UserError

GB = 10**9
TB = 10**12
TFLOPS = 10**12
NIC_400G = 50 * GB  # one 400 Gb/s InfiniBand NDR / RoCE port per GPU


@dataclass(frozen=True)
class DeviceSpec:
    """What one device (one rank) offers, and where the figures come from."""

    name: str
    kind: str  # "cuda" or "cpu": the plan's launch.device
    memory_bytes: int  # per device (cpu: the node's free RAM, shared by its ranks)
    bandwidth: float  # memory bandwidth, bytes/s (cpu: the node's, shared)
    flops16: float  # dense 16-bit matmul FLOP/s (cpu: the node's, shared)
    flops32: float  # dense fp32 matmul FLOP/s
    link_bandwidth: float  # bytes/s each rank sends inside a node
    network_bandwidth: float  # bytes/s each rank sends to other nodes
    link_latency_s: float  # per collective inside a node
    network_latency_s: float  # per collective that crosses nodes
    source: str
    attention_bandwidth: float | None = None  # KV bytes/s decode attention reads (cpu: measured); None: `bandwidth`
    # cpu: the node's matmul FLOP/s and attention KV bytes/s when one rank runs on all its cores (its threads wait
    # for each other at every layer), where the figures above are a rank per core's; None: the same
    single_rank_flops: float | None = None
    single_rank_attention_bandwidth: float | None = None
    layer_overhead_s: float = 0.0  # host time per layer of a decode step (cpu: measured; GPU presets: 0, the roofline)
    dcp_layer_overhead_s: float = 0.0  # the same on a rank of a layout with dcp > 1 (its combine's small ops)
    # cpu: the server's work per streamed token (SSE, its event loop), on a core the step needs (measured); GPU
    # presets: 0 (it runs on the host's cores, not on the device)
    serve_token_s: float = 0.0
    shared: bool = False  # ranks of a node share its memory, bandwidth and cores (cpu)
    devices_per_node: int = 8  # a node's devices when --devices is not given

    def flops(self, dtype_bytes: int) -> float:
        return self.flops16 if dtype_bytes <= 2 else self.flops32


def _gpu(name: str, memory: float, bandwidth: float, flops16: float, link: float, source: str) -> DeviceSpec:
    """A GPU: fp32 at half the 16-bit rate, one 400 Gb/s NIC, NCCL-like latencies (module docstring)."""
    return DeviceSpec(
        name=name,
        kind="cuda",
        memory_bytes=int(memory),
        bandwidth=bandwidth,
        flops16=flops16,
        flops32=flops16 / 2,
        link_bandwidth=link,
        network_bandwidth=NIC_400G,
        link_latency_s=10e-6,
        network_latency_s=20e-6,
        source=source,
    )


PRESETS: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        _gpu(
            "h100",
            80 * GB,
            3.35 * TB,
            989 * TFLOPS,
            450 * GB,
            "NVIDIA H100 Tensor Core GPU data sheet (SXM5): 80 GB HBM3, 3.35 TB/s, BF16 989 TFLOPS dense, "
            "NVLink 900 GB/s",
        ),
        _gpu(
            "h200",
            141 * GB,
            4.8 * TB,
            989 * TFLOPS,
            450 * GB,
            "NVIDIA H200 Tensor Core GPU data sheet (SXM): 141 GB HBM3e, 4.8 TB/s, BF16 989 TFLOPS dense, "
            "NVLink 900 GB/s",
        ),
        _gpu(
            "b200",
            180 * GB,
            8 * TB,
            2250 * TFLOPS,
            900 * GB,
            "NVIDIA HGX B200 data sheet: 1,440 GB HBM3e and 64 TB/s over 8 GPUs (180 GB, 8 TB/s each), "
            "BF16 2.25 PFLOPS dense per GPU, NVLink 5 1.8 TB/s per GPU",
        ),
        _gpu(
            "mi300x",
            192 * GB,
            5.3 * TB,
            1307 * TFLOPS,
            448 * GB,
            "AMD Instinct MI300X data sheet: 192 GB HBM3, 5.3 TB/s, BF16 1307.4 TFLOPS dense, "
            "Infinity Fabric 7 links x 128 GB/s = 896 GB/s peer bandwidth",
        ),
    )
}
DEVICE_NAMES = (*PRESETS, "cpu", "custom")


def preset(name: str) -> DeviceSpec:
    """A GPU preset by name, or a UserError naming the choices (`cpu` is measured: `engine.suggest.measure`)."""
    try:
        return PRESETS[name]
    except KeyError:
        close = difflib.get_close_matches(name, DEVICE_NAMES, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise UserError(f"--device {name!r} is not one of {', '.join(DEVICE_NAMES)}{hint}") from None


def with_figures(spec: DeviceSpec, **figures: float | None) -> DeviceSpec:
    """`spec` with the figures given on the command line (None: keep the preset's); the name says it changed."""
    given = {k: v for k, v in figures.items() if v is not None}
    for key, value in given.items():
        if value <= 0:
            raise UserError(f"--{key.replace('_', '-')} must be positive (got {value:g})")
    if not given:
        return spec
    if "memory_bytes" in given:
        given["memory_bytes"] = int(given["memory_bytes"])
    changed = ", ".join(sorted(given))
    return replace(
        spec, name=f"{spec.name} (custom {changed})", source=f"{spec.source}; overridden: {changed}", **given
    )


def custom(memory: float | None, bandwidth: float | None, flops: float | None, link: float | None) -> DeviceSpec:
    """A device described on the command line (`--device custom`): every figure must be given."""
    missing = [
        n
        for n, v in (("memory", memory), ("bandwidth", bandwidth), ("flops", flops), ("link-bandwidth", link))
        if v is None
    ]
    if missing:
        raise UserError(
            f"--device custom needs {', '.join('--' + m for m in missing)} "
            "(e.g. --memory 80GB --bandwidth 3.35TB/s --flops 989T --link-bandwidth 450GB/s)"
        )
    return _gpu("custom", memory, bandwidth, flops, link, "given on the command line")


def cpu(model: ModelInfo, remeasure: bool = False) -> DeviceSpec:
    """This machine's CPU as one node for `model`: free RAM, measured bandwidth and collective latency (inside the
    node: what a collective adds to a real two-rank decode step of the model's tiny twin, as `launch.cpu_comm=auto`
    runs it; gloo's between nodes), and the engine's linear layers, decode attention and host work per layer timed at
    the model's decode shapes (a rank per core, and one rank on all cores).

    Its ranks share everything; 16-bit matmuls are taken at the measured fp32 rate (CPUs without AMX gain little).
    """
    from engine.suggest.decode_shapes import decode_shapes
    from engine.suggest.measure import cpu_figures, figures_file

    figures = cpu_figures(decode_shapes(model), remeasure)
    cores = devices.cpu_cores()
    flops = figures["linear_flops_per_core"] * cores
    return DeviceSpec(
        name="cpu",
        kind="cpu",
        memory_bytes=devices.available_memory_bytes(),
        bandwidth=figures["bandwidth"],
        flops16=flops,
        flops32=flops,
        link_bandwidth=figures["bandwidth"] / 2,  # between local ranks: a copy through shared memory
        network_bandwidth=NIC_400G,
        link_latency_s=figures["step_collective_s"],
        network_latency_s=figures["collective_latency_s"],
        attention_bandwidth=figures["attention_bytes_per_core"] * cores,
        single_rank_flops=figures["linear_flops_one_rank"],
        single_rank_attention_bandwidth=figures["attention_bytes_one_rank"],
        source=f"measured on this machine ({cores} cores; cached in {figures_file()}, --remeasure to redo)",
        layer_overhead_s=figures["layer_host_s"],
        dcp_layer_overhead_s=figures["dcp_layer_host_s"],
        serve_token_s=figures["serve_token_s"],
        shared=True,
        devices_per_node=cores,
    )


_FIGURE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKMGTP]?)(i?)([bB]?)\s*(/s|flops|FLOPS)?\s*$")
_PREFIX = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


def parse_figure(option: str, text: str) -> float:
    """'3.35TB/s', '141GB', '80GiB', '989T', '989TFLOPS' -> a number (bytes, bytes/s or FLOP/s)."""
    match = _FIGURE.match(text)
    if not match:
        raise UserError(f"{option} {text!r} is not a figure like 141GB, 80GiB, 4.8TB/s or 989T")
    value, prefix, binary = float(match.group(1)), match.group(2), match.group(3)
    scale = 1024 ** ("KMGTP".index(prefix.upper()) + 1) if binary and prefix else _PREFIX[prefix]
    if value <= 0:
        raise UserError(f"{option} {text!r} must be positive")
    return value * scale


def device_spec(
    name: str,
    model: ModelInfo,
    remeasure: bool = False,
    memory: float | None = None,
    bandwidth: float | None = None,
    flops: float | None = None,
    link: float | None = None,
) -> DeviceSpec:
    """The device `--device NAME` names (`cpu`: measured for `model`), with the figures given on the command line
    in place of its own."""
    if name == "custom":
        return custom(memory, bandwidth, flops, link)
    spec = cpu(model, remeasure) if name == "cpu" else preset(name)
    if flops is not None:  # the figure given stands for every layout
        spec = replace(spec, single_rank_flops=None)
    return with_figures(
        spec,
        memory_bytes=memory,
        bandwidth=bandwidth,
        flops16=flops,
        flops32=flops if spec.shared or flops is None else flops / 2,
        link_bandwidth=link,
    )
