"""What one accepted layout buys and costs: KV capacity, weights, collectives and a roofline decode step.

Capacity comes from the plan check's own KV sizing (`engine.plan.kv_sizing`, what the engine allocates), weights per
rank from `engine.placement.weights`, collectives from `engine.placement.collectives`, the KV a rank reads from the
DCP math (`engine.dcp.local_len`). The decode step at `batch` sequences of `context` tokens is

    max(weight bytes / memory bandwidth, matmul FLOPs / matmul throughput)
    + max(KV bytes / attention bandwidth, attention FLOPs / matmul throughput)
    + collectives + host overhead per layer + serving

the linear layers and the attention each a roofline of their own, as the engine runs them one after the other. Ranks
that share a memory system and cores (a CPU node) add up their bytes and FLOPs (cpu: against its per-core figures,
timed with every core busy at once, so the ranks' contention for memory and caches is in them; a lone rank on a CPU
node runs at the node's single-rank figures); the attention reads KV at the device's attention bandwidth where it has
one below its memory bandwidth (cpu: the engine's decode attention as measured; GPU presets: the memory
bandwidth); each collective costs its latency plus its bytes over the link (the network when its group spans
nodes); the host time per layer is the device's for the layout's kind (dcp 1, or dcp > 1 with its combine; GPU
presets: none); serving is the server's work per streamed token (cpu: measured) for `batch` tokens, added whole: it
takes a core from one of the step's threads or ranks, and the others wait for that one at the next parallel region or
collective (GPU presets: none); the MoE experts read per step are the distinct ones
`batch` tokens of `experts_per_token` choices are expected to reach.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import dcp
from engine.checkpoints.model_info import ModelInfo
from engine.parallel_layout import ParallelLayout
from engine.placement.collectives import Collective, collectives
from engine.placement.split import DensePlacement, attended_heads
from engine.placement.weights import WeightShare, weight_shares
from engine.plan.kv_sizing import KVSizing
from engine.suggest.hardware import DeviceSpec


@dataclass(frozen=True)
class Cluster:
    """The devices a layout runs on: `devices` per node, `nodes` nodes, each device as `spec` says."""

    spec: DeviceSpec
    devices: int
    nodes: int

    @property
    def total(self) -> int:
        return self.devices * self.nodes

    def nodes_of(self, world: int) -> int:
        """Nodes a world of this many ranks spans (whole nodes once it outgrows one)."""
        return max(1, world // self.devices)


@dataclass(frozen=True)
class StepCollective:
    """One collective of the decode step: `count` runs per step, each sending `bytes_per_op` per rank."""

    where: str
    op: str
    group: str
    ranks: int
    count: int
    bytes_per_op: int
    crosses_nodes: bool
    seconds: float

    @property
    def bytes_per_step(self) -> int:
        return self.count * self.bytes_per_op


@dataclass(frozen=True)
class DecodeStep:
    """The roofline of one decode step, in seconds, and what decides it."""

    memory_s: float  # the linear layers' weights read
    compute_s: float  # the linear layers' matmuls
    kv_s: float  # the decode attention's KV read
    attention_compute_s: float  # the decode attention's FLOPs
    comm_s: float
    overhead_s: float
    serve_s: float  # the server's work for the step's streamed tokens (on a core the step needed)
    bytes_read: float  # by the busiest memory system: weights and KV
    flops: float  # on the busiest compute share: matmuls and attention
    collectives: tuple[StepCollective, ...]

    @property
    def seconds(self) -> float:
        return max(self.memory_s, self.compute_s) + self.attention_s + self.comm_s + self.overhead_s + self.serve_s

    @property
    def attention_s(self) -> float:
        """The decode attention: its KV read or its FLOPs, whichever takes longer."""
        return max(self.kv_s, self.attention_compute_s)

    @property
    def bound(self) -> str:
        """What limits the step: memory (weights and KV read), compute or communication."""
        parts = {
            "memory": self.memory_s + self.kv_s,
            "compute": self.compute_s + self.attention_compute_s,
            "communication": self.comm_s,
        }
        return max(parts, key=parts.__getitem__)


def expert_fraction(model: ModelInfo, batch: float) -> float:
    """Expected fraction of routed experts `batch` tokens reach (each picks `experts_per_token` of them)."""
    experts, k = model.n_routed_experts, model.experts_per_token
    if not experts or not k:
        return 1.0
    return 1.0 - (1.0 - min(k, experts) / experts) ** batch


def _weight_reads(shares: list[WeightShare], model: ModelInfo, batch: float, elem: int) -> tuple[float, float]:
    """(bytes read, matmul elements per token) of one rank's weights in a decode step of `batch` tokens."""
    read = elements = 0.0
    for share in shares:
        size = share.bytes(elem)
        count = share.copies * share.elements
        if share.module == "experts":
            read += size * expert_fraction(model, batch)
            elements += count * model.experts_per_token / max(1, model.n_routed_experts)
        elif share.module == "embed_tokens" and not model.tie_word_embeddings:
            continue  # a lookup of `batch` rows; the LM head is its own tensor
        elif share.module in ("norms", "norm"):
            read += size  # read, but no matmul
        else:
            read += size
            elements += count
    return read, elements


def _attention_flops(layout: ParallelLayout, model: ModelInfo, tokens_read: int) -> float:
    """FLOPs of decode attention on one rank per sequence: scores and values over its share of the context."""
    if model.is_mla:
        key, value = model.kv_lora_rank + model.qk_rope_head_dim, model.kv_lora_rank
    else:
        key = value = model.head_dim
    return 2.0 * attended_heads(layout) * tokens_read * (key + value) * model.num_layers


def _group_ranks(layout: ParallelLayout, group: str) -> list[list[int]]:
    return {
        "query": layout.query_groups,
        "dcp": layout.dcp_groups,
        "tp": layout.tp_groups,
        "world": lambda: [list(range(layout.world_size))],
    }[group]()


def _step_collectives(
    items: list[Collective], layout: ParallelLayout, cluster: Cluster, batch: float
) -> tuple[StepCollective, ...]:
    per_node = max(1, layout.world_size // cluster.nodes_of(layout.world_size))
    spec = cluster.spec
    out = []
    for c in items:
        crosses = any(len({r // per_node for r in ranks}) > 1 for ranks in _group_ranks(layout, c.group))
        bandwidth, latency = (
            (spec.network_bandwidth, spec.network_latency_s) if crosses else (spec.link_bandwidth, spec.link_latency_s)
        )
        count = len(c.layers) if c.layers is not None else 1
        per_op = round(c.bytes_per_token * batch)
        out.append(
            StepCollective(
                c.where, c.op, c.group, c.ranks, count, per_op, crosses, count * (latency + per_op / bandwidth)
            )
        )
    return tuple(out)


def decode_step(
    placement: DensePlacement,
    kv: KVSizing,
    interleave: int,
    cluster: Cluster,
    dtype_bytes: int,
    batch: float,
    context: int,
) -> DecodeStep:
    """The roofline decode step of `batch` sequences of `context` tokens under this placement."""
    layout, model = placement.layout, placement.model
    spec = cluster.spec
    ranks_sharing = layout.world_size // cluster.nodes_of(layout.world_size) if spec.shared else 1
    tokens_read = max(dcp.local_len(context, r, interleave, layout.dcp) for r in range(layout.dcp))
    weights_read = matmul_flops = 0.0
    for rank in range(layout.world_size):
        read, elements = _weight_reads(weight_shares(placement, rank), model, batch, dtype_bytes)
        weights_read, matmul_flops = max(weights_read, read), max(matmul_flops, 2.0 * batch * elements)
    kv_read = batch * tokens_read * kv.bytes_per_token
    attention_flops = batch * _attention_flops(layout, model, tokens_read)
    flops, attention_bandwidth = spec.flops(dtype_bytes), spec.attention_bandwidth
    if spec.shared and ranks_sharing == 1:  # one rank on all the node's cores
        flops = spec.single_rank_flops or flops
        attention_bandwidth = spec.single_rank_attention_bandwidth or attention_bandwidth
    kv_bandwidth = min(spec.bandwidth, attention_bandwidth or spec.bandwidth)
    steps = _step_collectives(collectives(placement, dtype_bytes), layout, cluster, batch)
    return DecodeStep(
        memory_s=ranks_sharing * weights_read / spec.bandwidth,
        compute_s=ranks_sharing * matmul_flops / flops,
        kv_s=ranks_sharing * kv_read / kv_bandwidth,
        attention_compute_s=ranks_sharing * attention_flops / flops,
        comm_s=sum(c.seconds for c in steps),
        overhead_s=(spec.dcp_layer_overhead_s if layout.dcp > 1 else spec.layer_overhead_s) * model.num_layers,
        serve_s=batch * spec.serve_token_s,
        bytes_read=ranks_sharing * (weights_read + kv_read),
        flops=ranks_sharing * (matmul_flops + attention_flops),
        collectives=steps,
    )
