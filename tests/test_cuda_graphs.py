"""Decode steps as CUDA graphs: bucket choice and static-buffer padding (CPU), and the decode step run on the static
buffers equal to the eager step on a real tiny model (CPU, the Triton kernels in the interpreter); capture, replay and
greedy tokens with graphs on and off where CUDA is present."""

from __future__ import annotations

import pytest
import torch

from engine.core.startup import start_rank
from engine.plan.checks import resolve_plan
from engine.runtime.cuda_graphs import DecodeGraphs, DecodeRows, StaticDecodeInputs, bucket_for, capture_sizes
from engine.runtime.step import ScheduledChunk, ScheduledStep
from tests.oracle import prompt_ids, write_plan

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def test_capture_sizes_and_buckets():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_sizes(1) == [1]
    sizes = capture_sizes(20)
    assert [bucket_for(n, sizes) for n in (1, 3, 4, 5, 9, 17, 20, 21)] == [1, 4, 4, 8, 16, 20, 20, None]


def test_fill_pads_rows_past_the_step_and_overwrites_an_earlier_step():
    inputs = StaticDecodeInputs(max_rows=8, max_blocks=4, device=torch.device("cpu"))
    inputs.fill(DecodeRows([5] * 8, [9] * 8, [7] * 8, [3] * 8, [[1, 2, 3, 4]] * 8), 8)
    inputs.fill(DecodeRows([11, 12, 13], [40, 41, 0], [17, -1, 2], [41, 20, 1], [[4, 5], [6], [7, 8, 9]]), 4)
    assert inputs.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert inputs.positions[:4].tolist() == [40, 41, 0, 0]
    assert inputs.slots[:4].tolist() == [17, -1, 2, -1]  # the padding row writes no cache slot
    assert inputs.lens[:4].tolist() == [41, 20, 1, 0]  # ... and attends to no keys
    assert inputs.tables[:4, :3].tolist() == [[4, 5, 0], [6, 0, 0], [7, 8, 9], [0, 0, 0]]
    md = inputs.metadata(4, backend=None, max_len=64, block_size=16, need_lse=True)
    assert md.decode.lens.data_ptr() == inputs.lens.data_ptr()  # views: a replay reads what `fill` wrote
    assert md.slot_mapping.data_ptr() == inputs.slots.data_ptr()
    assert md.decode.query_start.tolist() == [0, 1, 2, 3, 4] and md.num_decode_tokens == 4


@pytest.fixture
def make_runner(tmp_path):
    """make_runner(folder, device, eager): a plan's runner stepped from this thread, which gets its CPU set back
    afterwards (the runner pins the stepping thread's OpenMP team; later tests would inherit one core)."""
    made = []

    def make(folder, device: str, eager: bool):
        settings = {"launch.device": device, "attention.backend": "triton", "model.enforce_eager": eager,
                    "scheduler.max_num_seqs": 8, "model.max_model_len": 256}  # fmt: skip
        made.append(start_rank(resolve_plan(write_plan(tmp_path, folder, settings, f"{device}-{eager}.yaml")))[2])
        return made[-1]

    yield make
    for runner in made:
        runner.release_threads()


def _prefill_then_decode(runner, prompts: list[list[int]]) -> tuple[ScheduledStep, torch.Tensor]:
    """Prefill `prompts` (one block table each), then the decode step of one more token each; returns that step
    and its eager logits."""
    tables = [[2 * i, 2 * i + 1] for i in range(len(prompts))]
    prefill = ScheduledStep([ScheduledChunk(i, p, 0, tables[i], True) for i, p in enumerate(prompts)])
    first = runner.execute(prefill).logits.argmax(-1).tolist()
    decode = ScheduledStep([ScheduledChunk(i, [first[i]], len(p), tables[i], True) for i, p in enumerate(prompts)])
    return decode, runner.execute(decode).logits


def test_decode_on_static_buffers_equals_the_eager_step(make_runner, tiny_models):
    """The step a graph records (padded to a bucket, metadata from the buffers) gives the eager step's logits on the
    real rows: the padding rows change nothing. CPU: the Triton kernels in the interpreter, no graph."""
    runner = make_runner(tiny_models("deepseek_v2"), "cpu", eager=True)
    prompts = prompt_ids(3, [5, 17, 30], seed=2)
    step, eager = _prefill_then_decode(runner, prompts)
    graphs = DecodeGraphs(runner._graph_forward, runner.backend, [4], 256, 8, 16, False, runner.device)
    graphs.inputs.fill(runner._decode_rows(step, with_lens=True), 4)
    torch.testing.assert_close(graphs.step(4)[:3], eager, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_gpu_replay_equals_eager(make_runner, tiny_models, arch, rows):
    runner = make_runner(tiny_models(arch), "cuda", eager=False)
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8]
    prompts = prompt_ids(rows, [5 + 7 * i for i in range(rows)], seed=3)
    step, replayed = _prefill_then_decode(runner, prompts)
    graphs, runner.graphs = runner.graphs, None
    eager_logits = runner.execute(step).logits  # the same step again, eagerly: the same KV is rewritten
    runner.graphs = graphs
    torch.testing.assert_close(replayed, eager_logits, atol=2e-2, rtol=2e-2)
    assert torch.equal(replayed.argmax(-1), eager_logits.argmax(-1))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])
def test_gpu_greedy_tokens_graphs_on_equal_off(tmp_path, tiny_models, arch):
    from engine import LLM, SamplingParams

    prompts = prompt_ids(5, [3, 17, 40, 9, 64], seed=5)
    tokens = {}
    for eager in (True, False):
        settings = {"launch.device": "cuda", "attention.backend": "triton", "model.enforce_eager": eager,
                    "model.dtype": "bfloat16", "scheduler.max_num_seqs": 8}  # fmt: skip
        with LLM(write_plan(tmp_path, tiny_models(arch), settings, f"llm-{eager}.yaml")) as llm:
            outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        tokens[eager] = [o.token_ids for o in outs]
    assert tokens[False] == tokens[True]
