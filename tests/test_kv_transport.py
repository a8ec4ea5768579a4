"""NIXL in one process: two agents, real KV caches in two layouts, READs with the planner's descriptors."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine import dcp
from engine.attention import kv_cache
from engine.dcp import DcpSpec
from engine.kv_transfer import transport
from engine.kv_transfer.planner import PullSide, plan_pull
from engine.parallel_layout import ParallelLayout, kv_head_sources

_names = itertools.count()


def test_the_project_environment_imports_nixl():
    assert transport.unavailable_reason() is None


def test_a_failing_import_is_the_reason_with_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl_cu12", None)
    reason = transport.unavailable_reason()
    assert reason.startswith("the NIXL transport cannot be imported (ModuleNotFoundError")
    assert "pip install nixl-cu12" in reason


def agent_for(storage: torch.Tensor, head_major: bool) -> tuple[transport.Agent, object]:
    geo = kv_cache.geometry(storage, head_major)
    return transport.Agent(f"test-{next(_names)}", geo.base_addr, geo.nbytes, 0, False), geo


def caches(layers=2, blocks=6, block_size=8, heads=2, dim=4, head_major=True):
    storage, views = kv_cache.allocate(
        layers, blocks, block_size, heads, dim, False, torch.float32, torch.device("cpu"), head_major
    )
    return storage, views


def test_read_moves_each_decode_ranks_positions_between_layouts():
    """Prefill dcp1 (head-major) -> decode dcp2 ranks (token-major), interleave 2 on a block of 8."""
    layout1 = ParallelLayout.build(1, 1, 4, 2, False)
    layout2 = ParallelLayout.build(1, 2, 4, 2, False)
    src_storage, src_views = caches(head_major=True)
    for layer, (k, v) in enumerate(
        src_views
    ):  # [blocks, block_size, heads, dim] views: value = (layer, kv, slot, head)
        for kind, view in enumerate((k, v)):
            slots = torch.arange(6 * 8).view(6, 8, 1, 1)
            heads = torch.arange(2).view(1, 1, 2, 1)
            view.copy_((layer * 10 + kind) * 1000 + slots * 10 + heads + torch.zeros(6, 8, 2, 4))
    src_agent, src_geo = agent_for(src_storage, True)
    src_agent.start_progress()
    src_table, dst_table = [4, 1, 3], [2, 0]
    end = 19  # a 20-token prompt
    try:
        for rank in range(2):
            dst_storage, dst_views = caches(head_major=False)
            dst_agent, dst_geo = agent_for(dst_storage, False)
            try:
                dst_agent.connect(src_agent.name, src_agent.metadata())
                descs = plan_pull(
                    PullSide(DcpSpec(8, 8, 1), src_table, {0: src_geo}),
                    PullSide(DcpSpec(8, 2, 2), dst_table, {rank: dst_geo}),
                    rank,
                    rank,
                    kv_head_sources(layout1, layout2, rank),
                    0,
                    end,
                )[0]
                seconds = dst_agent.read(
                    [(src_agent.name, 0, descs.src_addr, descs.dst_addr, descs.length)], 5.0, "DRAM"
                )
                assert seconds > 0
                for p in range(end):
                    if dcp.owner(p, 2, 2) != rank:
                        continue
                    d = dcp.slot(p, rank, dst_table, 8, 2, 2)
                    s = dcp.slot(p, 0, src_table, 8, 8, 1)
                    for layer, (k, v) in enumerate(dst_views):
                        for kind, view in enumerate((k, v)):
                            got = view[d // 8, d % 8, :, 0].tolist()
                            assert got == [(layer * 10 + kind) * 1000 + s * 10 + h for h in range(2)]
            finally:
                dst_agent.close()
    finally:
        src_agent.close()


def test_a_target_nobody_progresses_is_a_bounded_error():
    src_storage, _ = caches()
    dst_storage, _ = caches()
    src_agent, src_geo = agent_for(src_storage, True)  # no progress thread: the READ can never complete
    dst_agent, dst_geo = agent_for(dst_storage, True)
    try:
        dst_agent.connect(src_agent.name, src_agent.metadata())
        one = np.ones(1, dtype=np.int64)
        with pytest.raises(transport.TransferError, match=r"made no progress for 0\.3 s"):
            dst_agent.read(
                [(src_agent.name, 0, one * src_geo.base_addr, one * dst_geo.base_addr, one * src_geo.nbytes)],
                0.3,
                "DRAM",
            )
    finally:
        dst_agent.close()
        src_agent.close()


def test_addresses_outside_the_registration_and_garbage_metadata_are_errors():
    src_storage, _ = caches()
    dst_storage, _ = caches()
    src_agent, src_geo = agent_for(src_storage, True)
    src_agent.start_progress()
    dst_agent, dst_geo = agent_for(dst_storage, True)
    try:
        with pytest.raises(transport.TransferError, match="cannot connect"):
            dst_agent.connect("forged", b"not nixl metadata")
        dst_agent.connect(src_agent.name, src_agent.metadata())
        one = np.ones(1, dtype=np.int64)
        outside = one * (src_geo.base_addr + src_geo.nbytes)
        with pytest.raises(transport.TransferError, match=f"READ from {src_agent.name} failed"):
            dst_agent.read([(src_agent.name, 0, outside, one * dst_geo.base_addr, one * 64)], 2.0, "DRAM")
        assert dst_agent.read_raw(src_agent.name, 0, src_geo.base_addr, 4096, 2.0, "DRAM") > 0
    finally:
        dst_agent.close()
        src_agent.close()


LEFT_OPEN = """
import torch
from engine.kv_transfer import transport
memory = torch.zeros(1 << 16)
target = transport.Agent("target", memory.data_ptr(), memory.numel() * 4, 0, False)
target.start_progress()
transport.Agent("initiator", memory.data_ptr(), memory.numel() * 4, 0, False).connect("target", target.metadata())
"""


@pytest.mark.slow
def test_a_process_that_exits_with_agents_open_exits_cleanly():
    """Agents left open at exit are closed by the module; otherwise UCX's threads abort about every second exit
    ("terminate called without an active exception", exit code 134), so a few tries catch a regression."""
    for _ in range(4):
        done = subprocess.run([sys.executable, "-c", LEFT_OPEN], capture_output=True, text=True, timeout=120)
        assert (done.returncode, "terminate called" in done.stderr) == (0, False), done.stderr[-2000:]
