"""Each module's split under a plan's dense placement, and each rank's share: the heads it projects and attends,
the attention output columns the DCP combine hands it, the slices of o_proj, MLP, MoE and vocabulary it holds.

Notation: T = tp, D = dcp, R = KV replication, H = query heads, A = the heads a rank attends with, Dv = attention
output width per head (GQA head_dim, MLA kv_lora_rank), Do = o_proj input width per head (GQA head_dim, MLA
v_head_dim). The attention output of a DCP group is the [A * Dv] columns of its A heads; the combine delivers DCP
rank j the columns [merge_starts[j], merge_starts[j] + W). With the sharded placement W = A * Dv / D (slices may
cut through a GQA head; MLA needs whole heads), and o_proj reads exactly the merged columns (MLA: those heads'
v_head_dim columns after W_UV).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.parallel_layout import ParallelLayout

DENSE_PLACEMENTS = ("replicated", "sharded")
COMM_BACKENDS = ("ag_rs", "a2a")
COMM_CHOICES = ("auto", *COMM_BACKENDS)  # auto: a2a where the dense layers are sharded over the world, else ag_rs


class ModelShape(Protocol):
    """The shape facts of a model the placement needs (engine.checkpoints.model_info.ModelInfo has them)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    is_mla: bool
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    first_k_dense_replace: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool


@dataclass(frozen=True)
class Split:
    """Slice `index` of `parts` equal slices of a dimension; partial outputs are summed over `group` ('tp'|'world')."""

    group: str
    parts: int
    index: int

    def span(self, total: int) -> range:
        """The indices of this slice of `total` (which `parts` divides)."""
        size = total // self.parts
        return range(self.index * size, (self.index + 1) * size)

    def padded(self, total: int) -> tuple[int, range]:
        """(rows per slice, the real rows of this slice) when `parts` need not divide `total`: every slice holds
        ceil(total / parts) rows and the last ones are padded (vocabularies)."""
        per = -(-total // self.parts)
        start = min(total, self.index * per)
        return per, range(start, min(total, start + per))


def slice_of(part: range, total: int) -> Split:
    """The Split whose span of `total` is `part` (an equal slice of it, e.g. a rank's query heads)."""
    size = len(part)
    return Split("tp", total // size, part.start // size)


@dataclass(frozen=True)
class ModuleSplit:
    """How every rank splits one kind of dense module, and why it fell back from the sharded split (or None)."""

    module: str  # "o_proj", "mlp", "moe", "vocab"
    layers: range  # the decoder layers that have it (empty range: the vocabulary, once per model)
    group: str  # "world" or "tp": the ranks over which it is split and its partial outputs summed
    parts: int
    fallback: str | None = None


@dataclass(frozen=True)
class RankPlacement:
    """What one rank computes in each layer and which slices of the weights it holds."""

    rank: int
    dcp_rank: int
    q_heads: range  # query heads it projects
    attended: range  # query heads it attends with (q_heads, or its query group's heads after the query gather)
    value_dim: int  # Dv
    merge_starts: tuple[int, ...]  # per DCP rank: first column of the attended [A * Dv] output that rank merges
    merge_width: int  # W
    o_proj: Split  # slice of the o_proj input (heads * Do) it reads; MLA: also the heads whose latent it merges
    mlp: Split
    moe: Split
    vocab: Split
    computes_logits: bool  # runs the LM head (rank 0 samples from the gathered logits)

    @property
    def gather_queries(self) -> bool:
        return self.q_heads != self.attended

    @property
    def merge_start(self) -> int:
        return self.merge_starts[self.dcp_rank]

    @property
    def merge_columns(self) -> range:
        """The columns of the whole [H * Dv] attention output this rank merges."""
        start = self.attended.start * self.value_dim + self.merge_start
        return range(start, start + self.merge_width)

    @property
    def merge_heads(self) -> range:
        """The heads whose columns this rank merges (the first and last may be cut)."""
        cols = self.merge_columns
        return range(cols.start // self.value_dim, (cols.stop - 1) // self.value_dim + 1)

    @property
    def head_aligned(self) -> bool:
        return self.merge_start % self.value_dim == 0 and self.merge_width % self.value_dim == 0


def _layers_text(layers: range) -> str:
    return f"layers {layers.start}-{layers.stop - 1}" if len(layers) > 1 else f"layer {layers.start}"


def _fallback(module: str, layers: range, world: int, why: str, tp: int) -> str:
    return (
        f"{_layers_text(layers)} {module}: not split over the {world} ranks ({why}); "
        f"split over tp={tp} as with parallel.dense=replicated"
    )


@dataclass(frozen=True)
class DensePlacement:
    """The dense placement of a layout for a model: every module's split, and each rank's share."""

    layout: ParallelLayout
    model: ModelShape
    dense: str  # as the plan asks: replicated | sharded
    comm_backend: str  # the DCP combine: ag_rs | a2a (`parallel.dcp_comm_backend`, auto resolved)
    sharded: bool  # the dense layers are split over the world (asked for, and there are replica ranks)
    o_proj: ModuleSplit
    mlp: ModuleSplit | None  # None: no dense MLP layer (all MoE)
    moe: ModuleSplit | None  # None: no MoE layer
    vocab: ModuleSplit

    @classmethod
    def build(
        cls, layout: ParallelLayout, model: ModelShape, dense: str = "sharded", comm_backend: str = "auto"
    ) -> DensePlacement:
        """Decide every split once; a split the world cannot make falls back to the TP group with its reason.

        `comm_backend` auto is a2a with the sharded placement, where each DCP rank merges its own 1/dcp of the
        columns, and ag_rs otherwise (where the ranks of a replica layout each merge every column, the all-to-all
        measured slower: docs/results/dcp.md)."""
        t, n = layout.tp, layout.world_size
        sharded = dense == "sharded" and layout.replicas > 1
        if comm_backend == "auto":
            comm_backend = "a2a" if sharded else "ag_rs"
        all_layers = range(model.num_layers)
        dense_layers, moe_layers = _mlp_layers(model)

        def split(module: str, layers: range, ok: bool, why: str) -> ModuleSplit:
            if not sharded:
                return ModuleSplit(module, layers, "tp", t)
            if ok:
                return ModuleSplit(module, layers, "world", n)
            return ModuleSplit(module, layers, "tp", t, _fallback(module, layers, n, why, t))

        heads = attended_heads(layout)
        dv = value_dim(model)
        d = layout.dcp
        if model.is_mla:
            o_ok, o_why = heads % d == 0, f"MLA merges whole heads and {heads} heads do not divide dcp={d}"
        else:
            o_ok = heads * dv % d == 0
            o_why = f"{heads} heads x {dv} = {heads * dv} attention output columns do not divide dcp={d}"
        inter, moe_inter = model.intermediate_size, model.moe_intermediate_size
        return cls(
            layout=layout,
            model=model,
            dense=dense,
            comm_backend=comm_backend,
            sharded=sharded,
            o_proj=split("o_proj", all_layers, o_ok, o_why),
            mlp=split("mlp", dense_layers, inter % n == 0, f"intermediate_size={inter} % {n} != 0")
            if dense_layers
            else None,
            moe=split("moe", moe_layers, moe_inter % n == 0, f"moe_intermediate_size={moe_inter} % {n} != 0")
            if moe_layers
            else None,
            vocab=split("vocab", range(0), True, ""),
        )

    @property
    def fallbacks(self) -> list[str]:
        """Why a module stayed on the TP group although the plan asked for the sharded placement."""
        return [m.fallback for m in (self.o_proj, self.mlp, self.moe) if m is not None and m.fallback]

    def rank(self, rank: int) -> RankPlacement:
        """The share of global rank `rank`."""
        layout, model = self.layout, self.model
        role = layout.role(rank)
        t, span, d = layout.tp, layout.q_span, layout.dcp
        heads_per_tp = layout.num_heads // t
        q_tp = range(role.tp_rank * heads_per_tp, (role.tp_rank + 1) * heads_per_tp)
        group_heads = span * heads_per_tp
        attended = range(role.dcp_group * group_heads, (role.dcp_group + 1) * group_heads)
        dv = value_dim(model)

        def module_split(split: ModuleSplit | None, index_in_world: int) -> Split:
            if split is None or split.group == "tp":
                return Split("tp", t, role.tp_rank)
            return Split("world", split.parts, index_in_world)

        if self.o_proj.group == "world":
            width = len(attended) * dv // d
            merge_starts = tuple(j * width for j in range(d))
            o_proj = Split("world", self.o_proj.parts, role.dcp_group * d + role.dcp_rank)
        else:
            width = heads_per_tp * dv
            merge_starts = tuple((j % span) * width for j in range(d))
            o_proj = Split("tp", t, role.tp_rank)
        return RankPlacement(
            rank=rank,
            dcp_rank=role.dcp_rank,
            q_heads=attended if self.sharded else q_tp,
            attended=attended,
            value_dim=dv,
            merge_starts=merge_starts,
            merge_width=width,
            o_proj=o_proj,
            mlp=module_split(self.mlp, rank),
            moe=module_split(self.moe, rank),
            vocab=module_split(self.vocab, rank),
            computes_logits=self.vocab.group == "world" or role.replica == 0,
        )

    def ranks(self) -> list[RankPlacement]:
        return [self.rank(r) for r in range(self.layout.world_size)]

    def notes(self, dense_set: bool = True) -> list[str]:
        """What the placement means for this plan, one line each (plan validate / show print them). `dense_set`:
        the plan sets parallel.dense itself (the default needs no note where it changes nothing)."""
        layout = self.layout
        n = layout.world_size
        if self.dense == "sharded" and layout.replicas == 1:
            if not dense_set:
                return []
            why = "dcp=1" if layout.dcp == 1 else f"dcp={layout.dcp} divides R={layout.replication}"
            return [
                f"parallel.dense=sharded: no replica ranks ({why}), so the dense layers are tensor-parallel "
                f"over all {n} ranks either way"
            ]
        notes = list(self.fallbacks)
        if self.sharded and self.o_proj.group == "world" and not self.model.is_mla:
            share = self.rank(0)
            heads = len(share.attended)
            if not all(self.rank(r).head_aligned for r in range(n)):
                prefill = max(len(self.rank(r).merge_heads) for r in range(n))
                notes.append(
                    f"o_proj input: {heads * share.value_dim} columns of a DCP group split {share.merge_width} per "
                    f"rank ({heads} heads do not divide dcp={layout.dcp}, so slices cut heads; prefill attention "
                    f"computes up to {prefill} heads per rank)"
                )
        return notes


def attended_heads(layout: ParallelLayout) -> int:
    """A: the query heads each rank attends with (its DCP group's heads)."""
    return layout.q_span * layout.num_heads // layout.tp


def value_dim(model: ModelShape) -> int:
    """Dv: width per head of what attention returns (MLA: the latent; the combine merges this)."""
    return model.kv_lora_rank if model.is_mla else model.head_dim


def _mlp_layers(model: ModelShape) -> tuple[range, range]:
    """(dense MLP layers, MoE layers) of the decoder, as the engine builds them."""
    if model.is_mla and model.n_routed_experts:
        first = min(model.first_k_dense_replace, model.num_layers)
        return range(first), range(first, model.num_layers)
    return range(model.num_layers), range(0)
