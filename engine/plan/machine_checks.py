"""The checks of a plan against the machine it launches on: world size over the nodes, GPUs and cores, the
addresses this node binds, and the RAM its CPU ranks' KV caches take."""

from __future__ import annotations

import socket

from engine import devices
from engine.plan.kv_sizing import format_bytes
from engine.plan.resolved import ResolvedPlan
from engine.plan.validation import PlanProblems

MAX_WORLD_SIZE = 65536  # ranks of one plan; far beyond any deployment, so a larger one is a typo


def check_devices(problems: PlanProblems, res: ResolvedPlan, here: bool) -> None:
    """The world size against the nodes; with `here`, against this node's GPUs, cores, addresses and RAM."""
    plan = res.plan
    world = res.world_size
    if world is None:
        return
    if world > MAX_WORLD_SIZE:
        problems.error(
            "parallel.dcp" if res.layout.replicas > 1 else "parallel.tp",
            f"world size {world} (tp={plan.parallel.tp} x replicas {res.layout.replicas}) is more ranks than "
            f"dcpctl launches (at most {MAX_WORLD_SIZE}); lower parallel.tp or parallel.dcp",
        )
        return
    nnodes = max(1, plan.launch.nnodes)
    if world % nnodes:
        problems.error(
            "launch.nnodes",
            f"world size {world} (tp={plan.parallel.tp} x replicas "
            f"{res.layout.replicas}) is not divisible by launch.nnodes={nnodes}",
        )
        return
    local = res.local_world_size
    if not here:
        return
    _check_addresses(problems, res)
    if res.device == "cuda":
        gpus = devices.cuda_device_count()
        if gpus < local:
            problems.error(
                "launch.device",
                f"the plan needs {local} GPUs on this node (world size {world} over "
                f"{nnodes} node(s)) but {gpus} are visible; lower parallel.tp/dcp or add nodes",
            )
        if plan.launch.dist_backend == "gloo":
            problems.warnings.append("launch.dist_backend=gloo on CUDA moves tensors through host memory (slow)")
    else:
        cores = devices.cpu_cores()
        if local > cores:
            problems.warnings.append(
                f"{local} ranks on {cores} CPU cores: ranks share cores (fine for checking correctness, slow for speed)"
            )
        _check_ram(problems, res, local)


def _check_addresses(problems: PlanProblems, res: ResolvedPlan) -> None:
    """The addresses this node binds: a single node's master (torchrun retries one that does not resolve for
    minutes) and node 0's server must resolve to an address of this machine."""
    lch, serve = res.plan.launch, res.plan.serve
    single = lch.nnodes == 1 and not lch.rdzv_endpoint and (res.world_size or 1) > 1
    if single and (problem := local_address_problem(lch.master_addr)):
        problems.error(
            "launch.master_addr", f"launch.master_addr={lch.master_addr} {problem}; on one node use 127.0.0.1"
        )
    if lch.node_rank == 0 and (problem := local_address_problem(serve.host)):
        problems.error(
            "serve.host", f"serve.host={serve.host} {problem}; use 127.0.0.1, or 0.0.0.0 for every interface"
        )


def local_address_problem(host: str) -> str | None:
    """Why a socket cannot bind `host` on this machine (it does not resolve, or is not one of its addresses)."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError, ValueError):
        return "does not resolve to an address"
    try:
        with socket.socket(family, kind) as sock:
            sock.bind(address)
    except OSError:
        return f"({address[0]}) is not an address of this machine"
    return None


def _check_ram(problems: PlanProblems, res: ResolvedPlan, local: int) -> None:
    """A CPU plan's KV caches on this node: an error beyond the machine's RAM, a warning beyond what is free now."""
    kv = (res.kv_budget_bytes or 0) * local
    total, free = devices.total_memory_bytes(), devices.available_memory_bytes()
    what = f"cache.memory={res.plan.cache.memory} x {local} local rank(s) is {format_bytes(kv)} of KV cache"
    if total and kv > total:
        problems.error(
            "cache.memory",
            f"{what}, more than this machine's {format_bytes(total)} of RAM; lower cache.memory "
            "(or give a fraction of free RAM, e.g. 0.5)",
        )
    elif free and kv > free:
        problems.warnings.append(f"{what}, more than the {format_bytes(free)} of RAM free now; the run may fail")
