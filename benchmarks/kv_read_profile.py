"""Where a hand-off READ's time goes, without a model: SmolLM2-shaped KV caches (30 layers, K/V, 3 KV heads of 64,
float32, block 64, 256 MiB, allocated as the engine does) in a prefill process and a decode process (decode rank 0
of tp1/dcp2), the engine's planner and NIXL agents (engine.kv_transfer), one pull after another into fresh decode
blocks.

Each pull is timed stage by stage: planning the descriptors, building NIXL's descriptor lists, `initialize_xfer`,
posting (`transfer`) and waiting for completion. In the same process, one raw READ of the same bytes as a single
region (into a scratch buffer touched beforehand) and the same descriptors READ again into the now-touched blocks.
`--fault-in` makes the decode cache resident first (as P/D ranks do at start-up); without it the decode blocks are
touched for the first time by the READ. Pull 0 is reported apart (a connection's first READ also completes its
wire-up).

    .venv/bin/python benchmarks/kv_read_profile.py [--interleave 64] [--tokens 512] [--pulls 6] [--fault-in]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 64
CACHE_BYTES = 256 * 2**20
BLOCKS = CACHE_BYTES // (LAYERS * 2 * KV_HEADS * BLOCK * HEAD_DIM * 4)
STAGES = ("plan", "lists", "init", "post", "wait", "total", "raw", "again")


def _storage() -> torch.Tensor:
    from engine.attention import kv_cache

    storage, _ = kv_cache.allocate(
        LAYERS, BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, False, torch.float32, torch.device("cpu"), True
    )
    return storage


def _prefill(conn) -> None:
    from engine.attention import kv_cache
    from engine.kv_transfer.ranks import KVExporter

    storage = _storage()
    kv_cache.fault_in(storage)
    storage.normal_()  # what prefill wrote
    exporter = KVExporter(0, kv_cache.geometry(storage, True), False)
    conn.send(json.dumps(exporter.endpoint.to_json()))
    conn.recv()  # until the decode side is done
    exporter.close()


def _decode(endpoint_json: str, args: argparse.Namespace, out) -> None:
    from engine.attention import kv_cache
    from engine.dcp import DcpSpec
    from engine.kv_transfer import transport
    from engine.kv_transfer.handles import RankEndpoint
    from engine.kv_transfer.planner import PullSide, plan_pull
    from engine.parallel_layout import ParallelLayout, kv_head_sources

    source = RankEndpoint.from_json(json.loads(endpoint_json))
    storage = _storage()
    if args.fault_in:
        kv_cache.fault_in(storage)
    geometry = kv_cache.geometry(storage, True)
    agent = transport.Agent("profile-decode-r0", geometry.base_addr, geometry.nbytes, 0, False)
    agent.connect(source.agent, source.metadata)
    nixl = agent._agent
    heads = kv_head_sources(ParallelLayout.build(1, 1, 9, 3, False), ParallelLayout.build(1, 2, 9, 3, False), 0)
    src_blocks = -(-args.tokens // BLOCK)
    dst_blocks = -(-args.tokens // (2 * BLOCK))
    rows = []
    for i in range(args.pulls):
        first = (i * dst_blocks) % (BLOCKS - dst_blocks)  # fresh decode blocks each pull while the cache lasts
        t0 = time.perf_counter()
        d = plan_pull(
            PullSide(DcpSpec(BLOCK, BLOCK, 1), list(range(src_blocks)), {0: source.geometry}),
            PullSide(DcpSpec(BLOCK, args.interleave, 2), list(range(first, first + dst_blocks)), {0: geometry}),
            0,
            0,
            heads,
            0,
            args.tokens - 1,
        )[0]
        t1 = time.perf_counter()
        local = agent._descs(d.dst_addr, d.length, 0, "DRAM")
        remote = agent._descs(d.src_addr, d.length, 0, "DRAM")
        t2 = time.perf_counter()
        handle = nixl.initialize_xfer("READ", local, remote, source.agent)
        t3 = time.perf_counter()
        state = nixl.transfer(handle)
        t4 = time.perf_counter()
        while state == "PROC":
            state = nixl.check_xfer_state(handle)
        t5 = time.perf_counter()
        handle.release()
        assert state == "DONE", state
        raw = agent.read_raw(source.agent, 0, source.geometry.base_addr, d.nbytes, 30.0, "DRAM")
        again = agent.read([(source.agent, 0, d.src_addr, d.dst_addr, d.length)], 30.0, "DRAM")
        stages = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t1, raw, again)
        rows.append({"descriptors": len(d), "bytes": d.nbytes, **dict(zip(STAGES, stages, strict=True))})
    agent.close()
    out.send(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interleave", type=int, default=64, choices=(1, 2, 4, 8, 16, 32, 64))
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--pulls", type=int, default=6)
    parser.add_argument("--fault-in", action="store_true", help="make the decode cache resident first")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    prefill = ctx.Process(target=_prefill, args=(p_child,))
    prefill.start()
    endpoint = p_conn.recv()
    d_conn, d_child = ctx.Pipe()
    decode = ctx.Process(target=_decode, args=(endpoint, args, d_child))
    decode.start()
    rows = d_conn.recv()
    decode.join()
    p_conn.send("done")
    prefill.join()
    later = rows[1:] or rows
    cache = "resident" if args.fault_in else "untouched"
    print(
        f"interleave {args.interleave}, {args.tokens} tokens, decode cache {cache}: "
        f"{rows[0]['descriptors']:,} descriptors, {rows[0]['bytes'] / 2**20:.2f} MiB per pull"
    )
    print("| stage | pull 0 ms | later pulls ms (min / median) |\n|---|---:|---:|")
    for stage in STAGES:
        values = [r[stage] * 1e3 for r in later]
        print(f"| {stage} | {rows[0][stage] * 1e3:.2f} | {min(values):.2f} / {statistics.median(values):.2f} |")
    ratio = [r["total"] / r["raw"] for r in later]
    print(f"pull / raw (later pulls): min {min(ratio):.2f}, median {statistics.median(ratio):.2f}")


if __name__ == "__main__":
    main()
