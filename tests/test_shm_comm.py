"""Shared-memory collectives (engine.shm_comm) against gloo on the same inputs, in real multi-process worlds.

Each case starts a world of 2 or 4 processes on gloo, gives groups of the layouts' shapes (the whole world, runs
of consecutive ranks like DCP groups, strided ranks like query groups) a shared-memory segment, and runs every
collective through both, on every dtype and on shapes that are uneven, empty and larger than a segment's slot.
Copies and two-rank sums must equal gloo's bits; sums over more ranks must equal the documented order
(fp32, group-rank order) on every rank and agree with gloo to fp32 rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine import distributed
from engine.runtime.launcher import free_port
from tests.oracle import prompt_ids, read_jsonl, write_plan

pytestmark = pytest.mark.multiproc

SHAPES = [(1, 576), (8, 576), (3, 7), (5, 1), (0, 4), (2048, 576), (4, 300_001)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _input(rank: int, step: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=generator)
    return (torch.randn(shape, generator=generator) * 3).to(dtype)


def _ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The documented order: fp32, group rank 0 first, one rounding to the dtype at the end."""
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    return total.to(parts[0].dtype)


def _world(rank: int, world: int, port: int, body, out: str, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RESULT_DIR=out)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    failures: list[str] = []
    try:
        body(rank, world, failures, timeout_s)
    except Exception:
        failures.append(traceback.format_exc())
    Path(out, f"rank{rank}.json").write_text(json.dumps(failures))
    dist.destroy_process_group()


def run_world(tmp_path: Path, world: int, body, timeout_s: float = 60.0) -> dict[int, list[str]]:
    """Run `body(rank, world, failures, timeout_s)` on `world` processes; each rank's failures."""
    mp.start_processes(
        _world, args=(world, free_port(), body, str(tmp_path), timeout_s), nprocs=world, start_method="spawn"
    )
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)}


def _groups(world: int) -> list[list[int]]:
    if world == 2:
        return [[0, 1]]
    return [list(range(world)), [0, 1], [2, 3], [0, 2], [1, 3]]


def _attach(layouts: list[list[int]], timeout_s: float) -> list[tuple[list[int], dist.ProcessGroup, object]]:
    """Every layout group (created on every rank), with this rank's shared-memory form of it."""
    mine = []
    for ranks in layouts:
        group = dist.new_group(ranks, backend="gloo")
        if dist.get_rank() in ranks:
            attached = distributed.shm_comm.attach(group, timeout_s)
            assert not isinstance(attached, str), attached
            mine.append((ranks, group, attached))
    return mine


def _check(failures: list[str], what: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | None = None):
    """got == want bit for bit, or, with `bound`, |got - want| <= bound elementwise."""
    if got.shape != want.shape or got.dtype != want.dtype:
        failures.append(f"{what}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}")
        return
    error = (got.double() - want.double()).abs()
    if (bound is None and not torch.equal(got, want)) or (bound is not None and bool((error > bound).any())):
        failures.append(f"{what}: max difference {error.max().item()}")


def _reorder_bound(parts: list[torch.Tensor]) -> torch.Tensor:
    """How far two summation orders of `parts` (each rounding to the dtype) can fall apart: n * u * sum |x_r|,
    u the dtype's unit roundoff; the standard bound for a reordered floating-point sum."""
    unit = torch.finfo(parts[0].dtype).eps / 2
    return len(parts) * unit * torch.stack([p.double().abs() for p in parts]).sum(0)


def _collectives_match_gloo(rank: int, world: int, failures: list[str], timeout_s: float) -> None:
    for ranks, group, shm in _attach(_groups(world), timeout_s):
        size, me = len(ranks), ranks.index(rank)
        for step, (shape, dtype) in enumerate((s, d) for s in SHAPES for d in [*DTYPES, torch.int64]):
            what = f"group {ranks} {dtype} {list(shape)}"
            inputs = [_input(r, step, shape, dtype) for r in ranks]
            x = inputs[me]
            gathered = [torch.empty_like(x) for _ in ranks]
            dist.all_gather(gathered, x, group=group)
            _check(failures, f"all_gather {what}", shm.all_gather_rows(x), torch.cat(gathered))
            parts = shm.gather_to_first(x)
            if me == 0:
                _check(failures, f"gather {what}", torch.stack(parts), torch.stack(inputs))
            else:
                assert parts is None
            rows = torch.cat([_input(10 * rank + j, step, shape, dtype) for j in range(size)])  # chunk j: to rank j
            want = torch.empty_like(rows)
            dist.all_to_all_single(want, rows, group=group)
            _check(failures, f"all_to_all {what}", shm.all_to_all_rows(rows), want)
            if dtype == torch.int64:
                continue
            want = x.clone()
            dist.all_reduce(want, group=group)
            got = x.clone()
            shm.all_reduce(got)
            bound = None if size == 2 else _reorder_bound(inputs)
            _check(failures, f"all_reduce vs gloo {what}", got, want, bound)
            _check(failures, f"all_reduce order {what}", got, _ordered_sum(inputs))
            want = torch.empty_like(x)
            dist.reduce_scatter_tensor(want, rows, group=group)
            got = shm.reduce_scatter_rows(rows)
            mine = [_input(10 * r + me, step, shape, dtype) for r in ranks]  # chunk `me` of every rank's rows
            bound = None if size == 2 else _reorder_bound(mine)
            _check(failures, f"reduce_scatter vs gloo {what}", got, want, bound)
            _check(failures, f"reduce_scatter order {what}", got, _ordered_sum(mine))
        leftover = [p.name for p in distributed.shm_comm.SHM_DIR.glob(f"dcpctl-{os.getpid()}-*")]
        if leftover:
            failures.append(f"segments still linked after attach: {leftover}")


@pytest.mark.parametrize("world", [2, 4])
def test_every_collective_matches_gloo(tmp_path, world):
    failures = run_world(tmp_path, world, _collectives_match_gloo)
    assert failures == {r: [] for r in range(world)}


def _back_to_back(rank: int, world: int, failures: list[str], timeout_s: float) -> None:
    """Thousands of small collectives of changing kinds and sizes: the sequence flags never mix two rounds."""
    ((ranks, _, shm),) = _attach([[0, 1]], timeout_s)
    for step in range(3000):
        shape = (1 + step % 5, 1 + step % 97)
        inputs = [_input(r, step, shape, torch.float32) for r in ranks]
        kind = step % 3
        if kind == 0:
            got = inputs[rank].clone()
            shm.all_reduce(got)
            want = inputs[0] + inputs[1]
        elif kind == 1:
            got, want = shm.all_gather_rows(inputs[rank]), torch.cat(inputs)
        else:
            got = shm.all_to_all_rows(torch.cat([inputs[rank]] * 2))
            want = torch.cat(inputs)
        if not torch.equal(got, want):
            failures.append(f"step {step} kind {kind}: differs")
            return


def test_thousands_of_back_to_back_collectives(tmp_path):
    failures = run_world(tmp_path, 2, _back_to_back)
    assert failures == {0: [], 1: []}


def _peer_dies(rank: int, world: int, failures: list[str], timeout_s: float) -> None:
    ((_, _, shm),) = _attach([[0, 1]], timeout_s)
    x = torch.ones(4)
    shm.all_reduce(x)
    if rank == 1:
        Path(os.environ["RESULT_DIR"], "rank1.json").write_text("[]")
        os._exit(0)  # gone without a word, as after SIGKILL
    start = time.monotonic()
    try:
        shm.all_reduce(x)
        failures.append("all_reduce returned without its peer")
    except RuntimeError as exc:
        took = time.monotonic() - start
        if "shared-memory peer lost: rank 1" not in str(exc) or took > 5:
            failures.append(f"after {took:.1f} s: {exc}")


def test_a_dead_peer_raises_within_seconds(tmp_path):
    failures = run_world(tmp_path, 2, _peer_dies)
    assert failures == {0: [], 1: []}


def _peer_stalls(rank: int, world: int, failures: list[str], timeout_s: float) -> None:
    ((_, _, shm),) = _attach([[0, 1]], timeout_s)
    if rank == 1:
        time.sleep(timeout_s + 3)  # alive but never arrives
        return
    start = time.monotonic()
    try:
        shm.all_reduce(torch.ones(4))
        failures.append("all_reduce returned without its peer")
    except RuntimeError as exc:
        took = time.monotonic() - start
        if "shared-memory collective timed out: rank 0 waited" not in str(exc) or not timeout_s <= took < timeout_s + 2:
            failures.append(f"after {took:.1f} s: {exc}")


def test_a_stalled_peer_times_out(tmp_path):
    failures = run_world(tmp_path, 2, _peer_stalls, timeout_s=1.0)
    assert failures == {0: [], 1: []}


def _fallbacks(rank: int, world: int, failures: list[str], timeout_s: float) -> None:
    """Where a group cannot have shared memory, every rank of it keeps gloo (auto) or raises (strict)."""
    from engine.errors import UserError

    if rank == 1:  # one rank cannot map the segment: its peer must learn it too
        distributed.shm_comm._map = lambda *_: (None, "rank 1 cannot map it (simulated)")
    group = dist.new_group([0, 1], backend="gloo")
    said = distributed.use_shared_memory([group], strict=False)
    want = "rank 1 cannot map it (simulated)" if rank == 1 else "1 rank(s) of the group could not use shared memory"
    if said != f"gloo (shared memory unavailable: {want})":
        failures.append(f"auto: {said}")
    x = torch.full((3,), float(rank + 1))
    if not torch.equal(distributed.all_reduce(x, group), torch.full((3,), 3.0)):
        failures.append(f"gloo fallback sums {x}")
    distributed.shm_comm.SHM_DIR = Path("/nonexistent/shm")
    try:
        distributed.use_shared_memory([dist.new_group([0, 1], backend="gloo")], strict=True)
        failures.append("strict: no error")
    except UserError as exc:
        if (
            str(exc)
            != "launch.cpu_comm=shm: /nonexistent/shm does not exist on this system; set launch.cpu_comm=gloo (or auto)"
        ):
            failures.append(f"strict: {exc}")


def test_groups_without_shared_memory_keep_gloo_or_fail_clearly(tmp_path):
    failures = run_world(tmp_path, 2, _fallbacks)
    assert failures == {0: [], 1: []}


def test_a_run_over_shared_memory_gives_the_bits_of_gloo(tmp_path, tiny_models):
    """A real `dcpctl run` (MLA tp2/dcp2, chunked prefill): every group has two ranks, so every sum has one order
    and the tokens and logprobs over shared memory equal gloo's exactly (bfloat16 and the other collectives are
    compared op by op above)."""
    folder = tiny_models("deepseek_v2")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompt_ids(4, [3, 31, 47, 100])))
    settings = {
        "parallel.tp": 2,
        "parallel.dcp": 2,
        "parallel.interleave": 2,
        "scheduler.max_num_batched_tokens": 24,
    }
    runs = {}
    for comm in ("gloo", "shm"):
        plan = write_plan(tmp_path, folder, {**settings, "launch.cpu_comm": comm}, f"{comm}.yaml")
        out = tmp_path / f"{comm}.jsonl"
        cmd = [sys.executable, "-m", "dcpctl.cli", "run", str(plan), "--prompts-file", str(prompts)]
        cmd += ["--max-tokens", "16", "--ignore-eos", "--logprobs", "1", "--output", str(out)]
        stats = tmp_path / f"{comm}-stats"
        env = dict(os.environ, DCPCTL_RANK_STATS_DIR=str(stats))
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        said = "shared memory (gloo for control messages)" if comm == "shm" else "gloo"
        assert [json.loads(p.read_text())["collectives"] for p in sorted(stats.glob("rank*.json"))] == [said] * 2
        runs[comm] = [(r["token_ids"], [lp["logprob"] for lp in r["logprobs"]]) for r in read_jsonl(out)]
    assert runs["shm"] == runs["gloo"]
