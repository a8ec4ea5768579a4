"""BlockManager's allocation order: least recently freed first with prefix caching, most recently freed without."""

from __future__ import annotations

from engine.core.block_manager import BlockManager
from engine.core.sequence import SamplingParams, Sequence


def _run(blocks: BlockManager, tokens: int) -> list[int]:
    """Allocate a `tokens`-long sequence, release it, and return the blocks it had."""
    seq = Sequence("r", list(range(tokens)), SamplingParams())
    assert blocks.grow(seq, tokens)
    table = list(seq.block_table)
    blocks.release(seq)
    return table


def test_without_prefix_caching_a_later_request_reuses_the_freed_blocks():
    """The blocks whose pages the first request faulted in are the next request's, in the same order."""
    blocks = BlockManager(num_blocks=32, block_size=16, dcp_size=1, prefix_caching=False)
    first = _run(blocks, 64)
    assert first == [0, 1, 2, 3]
    assert _run(blocks, 64) == first
    assert _run(blocks, 96) == [*first, 4, 5]  # a longer one takes the freed blocks, then untouched ones
    assert blocks.num_used_blocks == 0


def test_with_prefix_caching_freed_blocks_wait_behind_the_untouched_ones():
    """Freed blocks keep their cached prefix as long as possible: the next request takes blocks never used."""
    blocks = BlockManager(num_blocks=32, block_size=16, dcp_size=1, prefix_caching=True)
    first = _run(blocks, 64)
    assert set(_run(blocks, 64)).isdisjoint(first)
