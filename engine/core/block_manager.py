"""KV block accounting on rank 0: logical (virtual) blocks, reference counts, prefix caching.

One block id stands for `block_size * dcp` tokens of a sequence (a virtual block): every DCP
rank stores its `block_size`-token share in its own pool under the same id, so one table serves
all ranks. Full blocks are keyed by a hash chain of their tokens; a new sequence whose prompt
starts with cached blocks reuses them and skips their prefill. Free blocks keep their contents
until reallocated (least recently freed first), so a finished prompt's prefix stays reusable.
Without prefix caching no content is reused, and blocks go most recently freed first: a CPU cache's
memory is mapped on first touch (`kv_cache.zeros`), and a block whose pages an earlier request
faulted in is written at memory speed, where a never-used one costs page faults (~12x the write of a
2048-token prefill's KV, docs/results/vs-vllm-cpu.md) and a benchmark's repeated batches would fault in the whole
cache one run after another.
"""

from __future__ import annotations

from collections import OrderedDict

from engine import dcp
from engine.core.sequence import Sequence


class BlockManager:
    """Allocates and frees virtual KV blocks; never touches tensors or torch.distributed."""

    def __init__(self, num_blocks: int, block_size: int, dcp_size: int, prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache has no blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dcp_size = dcp_size
        self.span = dcp.tokens_per_virtual_block(block_size, dcp_size)
        self.prefix_caching = prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        # allocation takes the front (LRU) or, without prefix caching, the back (LIFO): block 0 first either way
        order = range(num_blocks) if prefix_caching else reversed(range(num_blocks))
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in order)
        self.seq_hashes: dict[int, list[int]] = {}  # seq_id -> hashes of its full blocks
        self.peak_used = 0
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` positions occupies."""
        return dcp.blocks_needed(num_tokens, self.block_size, self.dcp_size)

    def _hash_chain(self, seq: Sequence, num_full: int) -> list[int]:
        hashes = self.seq_hashes.setdefault(seq.seq_id, [])
        parent = hashes[-1] if hashes else 0
        for i in range(len(hashes), num_full):
            parent = hash((parent, *seq.token_ids[i * self.span : (i + 1) * self.span]))
            hashes.append(parent)
        return hashes

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix of a new sequence; returns tokens reused.

        At least one token is always left to compute, so the step yields logits to sample from. A request
        for prompt logprobs computes every prompt position, so it reuses nothing.
        """
        if not self.prefix_caching or seq.block_table or seq.params.prompt_logprobs is not None:
            return 0
        full = (len(seq) - 1) // self.span
        hashes = self._hash_chain(seq, full)
        self.prefix_query_tokens += len(seq)
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        self._note_peak()
        reused = len(seq.block_table) * self.span
        self.prefix_hit_tokens += reused
        return reused

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Allocate blocks so the sequence covers `num_tokens` positions; False (nothing changed) if short."""
        missing = self.blocks_for(num_tokens) - len(seq.block_table)
        if missing > len(self.free):
            return False
        for _ in range(missing):
            block, _ = self.free.popitem(last=not self.prefix_caching)  # LRU for prefix reuse, else LIFO
            old = self.block_hash[block]
            if old is not None:
                self.block_hash[block] = None
                if self.cached.get(old) == block:
                    del self.cached[old]
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        self._note_peak()
        return True

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` positions, which `grow` took for positions that were
        never kept (rejected speculative tokens): each goes back where `grow` took it from, so the pool is as if
        it had not been taken. They hold no registered prefix (only blocks of computed tokens are registered)."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            assert self.ref_counts[block] == 1 and self.block_hash[block] is None, "a shrunk block was shared"
            self.ref_counts[block] = 0
            self.free[block] = None
            self.free.move_to_end(block, last=not self.prefix_caching)

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's blocks that are now full of computed tokens as reusable (the target's KV: a draft
        model, whose cache shares the block ids, computes a sequence that reuses them from its start)."""
        if not self.prefix_caching:
            return
        full = seq.num_computed_tokens // self.span
        for i, h in enumerate(self._hash_chain(seq, full)[:full]):
            block = seq.block_table[i]
            if self.block_hash[block] is None and h not in self.cached:
                self.block_hash[block] = h
                self.cached[h] = block

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks no one uses become free (contents kept for reuse)."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        seq.block_table = []
        self.seq_hashes.pop(seq.seq_id, None)

    def _note_peak(self) -> None:
        self.peak_used = max(self.peak_used, self.num_used_blocks)
