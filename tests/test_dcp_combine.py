"""The DCP combine over real gloo groups: both backends give each rank exact softmax attention for its columns.

Every rank attends to a disjoint subset of the keys (DCP ownership by interleave 1), so the merged columns must equal
attention over all keys, for slices that follow heads and slices that cut through them, for rows where some ranks
or every rank hold no key (output 0, never NaN, even when an empty partial is NaN), in fp32 and bf16.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.attention.dcp_combine import CombineSpec, combine
from engine.distributed import ParallelContext
from engine.parallel_layout import ParallelLayout
from engine.placement.split import DensePlacement

pytestmark = pytest.mark.multiproc

KEYS, ROWS = 9, 7
LENGTHS = [9, 5, 1, 0, 3, 2, 8]  # keys each row attends to: row 3 sees none, rows 2 and 5 miss some ranks


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model facts a placement reads."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    is_mla: bool = False
    kv_lora_rank: int = 0
    num_layers: int = 1
    intermediate_size: int = 64
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    first_k_dense_replace: int = 0


# (model, tp, dcp, dense): world sizes 2 and 4
CASES = {
    2: [
        (Shape(9, 3, 8), 1, 2, "sharded"),  # SmolLM2's heads: the slice cuts head 4
        (Shape(9, 3, 8), 1, 2, "replicated"),
        (Shape(4, 1, 8), 2, 2, "replicated"),  # DCP inside the TP group
    ],
    4: [
        (Shape(6, 2, 4), 1, 4, "sharded"),  # slices cross heads and KV groups
        (Shape(6, 2, 4), 1, 4, "replicated"),  # every rank merges all heads (duplicate slices)
        (Shape(4, 1, 0, True, 8), 2, 4, "sharded"),  # MLA: whole heads per rank
        (Shape(4, 1, 0, True, 8), 2, 4, "replicated"),  # two query sets x two replicas
        (Shape(8, 1, 4), 4, 4, "replicated"),  # DCP inside the TP group, four ranks
    ],
}


def _exact(scores: torch.Tensor, values: torch.Tensor, held: torch.Tensor, poison: bool):
    """Attention of scores [T, A, L] over values [L, A, Dv] restricted to `held` keys [T, L]."""
    masked = scores.masked_fill(~held[:, None, :], float("-inf"))
    lse = torch.logsumexp(masked, dim=-1)
    probs = torch.exp(masked - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("tal,lad->tad", probs, values)
    if poison:  # a backend that leaves NaN where it saw no key must still contribute exactly 0
        out = torch.where(torch.isinf(lse).unsqueeze(-1), float("nan"), out)
    return out, lse


def _check(rank: int, world: int) -> None:
    for model, tp, dcp, dense in CASES[world]:
        layout = ParallelLayout.build(tp, dcp, model.num_heads, model.num_kv_heads, model.is_mla)
        assert layout.world_size == world
        groups = [dist.new_group(g, backend="gloo") for g in layout.dcp_groups()]
        mine = next(grp for grp, ranks in zip(groups, layout.dcp_groups(), strict=True) if rank in ranks)
        for backend, dtype, poison in [
            ("a2a", torch.float32, True),
            ("ag_rs", torch.float32, True),
            ("a2a", torch.bfloat16, False),
            ("ag_rs", torch.bfloat16, False),
        ]:
            placement = DensePlacement.build(layout, model, dense, backend)
            role = layout.role(rank)
            par = ParallelContext(layout, rank, 0, torch.device("cpu"), role, placement.rank(rank), backend)
            par.dcp_group = mine
            spec = CombineSpec(par)
            share = par.placement
            heads, dv = len(share.attended), share.value_dim
            gen = torch.Generator().manual_seed(1000 * role.dcp_group + 7)  # the same on every rank of the group
            scores = 3 * torch.randn(ROWS, heads, KEYS, generator=gen)
            values = torch.randn(KEYS, heads, dv, generator=gen)
            valid = torch.arange(KEYS)[None, :] < torch.tensor(LENGTHS)[:, None]
            held = valid & (torch.arange(KEYS) % dcp == role.dcp_rank)[None, :]
            out, lse = _exact(scores, values, held, poison)
            merged, _ = combine(out.to(dtype), lse, spec)
            full, _ = _exact(scores, values, valid, False)
            expected = full.reshape(ROWS, -1)[:, share.merge_start : share.merge_start + share.merge_width]
            assert merged.dtype == dtype and not torch.isnan(merged).any(), (model, tp, dcp, dense, backend)
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            assert torch.allclose(merged.float(), expected, atol=tol), (model, tp, dcp, dense, backend, dtype)
            assert torch.equal(merged[3], torch.zeros_like(merged[3]))  # a row empty everywhere is exactly 0


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        _check(rank, world)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_combine_is_exact_softmax_for_every_layout_and_backend(world):
    from engine.runtime.launcher import free_port

    mp.spawn(_worker, args=(world, free_port()), nprocs=world, join=True)  # a failing rank raises here
