"""The DCP math module against naive enumeration, on ints and on torch tensors."""

import itertools

import pytest
import torch

from engine import dcp

CASES = [
    (b, i, d) for b in (1, 2, 4, 8, 16, 64) for d in (1, 2, 3, 4) for i in (1, 2, 4, 8, 16, 64) if i <= b and b % i == 0
]


def naive_layout(length, interleave, dcp_size):
    """Walk the positions in runs of `interleave`, dealing runs to ranks round-robin."""
    owners, local_idx, counts = [], [], [0] * dcp_size
    for p in range(length):
        r = (p // interleave) % dcp_size
        owners.append(r)
        local_idx.append(counts[r])
        counts[r] += 1
    return owners, local_idx, counts


def naive_slots(length, table, block_size, interleave, dcp_size):
    """Each rank fills its B slots of the physical block behind each virtual block in position order."""
    owners, _, _ = naive_layout(length, interleave, dcp_size)
    span = block_size * dcp_size
    slots = {r: [-1] * length for r in range(dcp_size)}
    for vb in range(-(-length // span)):
        for r in range(dcp_size):
            mine = [p for p in range(vb * span, min(length, (vb + 1) * span)) if owners[p] == r]
            assert len(mine) <= block_size
            for offset, p in enumerate(mine):
                slots[r][p] = table[vb] * block_size + offset
    return slots


@pytest.mark.parametrize(("block_size", "interleave", "dcp_size"), CASES)
def test_owner_local_index_and_local_len_match_enumeration(block_size, interleave, dcp_size):
    length = 3 * block_size * dcp_size + 5
    owners, local_idx, _ = naive_layout(length, interleave, dcp_size)
    for p in range(length):
        assert dcp.owner(p, interleave, dcp_size) == owners[p]
        assert dcp.local_index(p, interleave, dcp_size) == local_idx[p]
    for n in range(length + 1):
        _, _, counts = naive_layout(n, interleave, dcp_size)
        assert [dcp.local_len(n, r, interleave, dcp_size) for r in range(dcp_size)] == counts


@pytest.mark.parametrize(("block_size", "interleave", "dcp_size"), CASES)
def test_slots_match_enumeration(block_size, interleave, dcp_size):
    length = 2 * block_size * dcp_size + 3
    table = [7, 2, 9, 4, 11]
    expected = naive_slots(length, table, block_size, interleave, dcp_size)
    for r in range(dcp_size):
        got = [dcp.slot(p, r, table, block_size, interleave, dcp_size) for p in range(length)]
        assert got == expected[r]


def test_local_sequence_is_contiguous_in_the_shared_block_table():
    """Local index j of a rank lives at table[j // B] * B + j % B: ordinary paging per rank."""
    for block_size, interleave, dcp_size in CASES:
        table = [5, 1, 8, 3]
        length = 3 * block_size * dcp_size
        for p in range(length):
            r = dcp.owner(p, interleave, dcp_size)
            j = dcp.local_index(p, interleave, dcp_size)
            assert (
                dcp.slot(p, r, table, block_size, interleave, dcp_size)
                == table[j // block_size] * block_size + j % block_size
            )


def test_tensor_forms_equal_int_forms():
    block_size, interleave, dcp_size = 8, 2, 3
    positions = torch.arange(0, 100)
    table = torch.tensor([[4, 0, 6, 2, 9], [1, 3, 5, 7, 8]])
    rows = positions % 2
    for r in range(dcp_size):
        got = dcp.slot(positions, r, table, block_size, interleave, dcp_size, rows=rows)
        want = [
            dcp.slot(int(p), r, table[int(row)].tolist(), block_size, interleave, dcp_size)
            for p, row in zip(positions, rows, strict=True)
        ]
        assert got.tolist() == want
        lengths = torch.arange(0, 60)
        assert dcp.local_len(lengths, r, interleave, dcp_size).tolist() == [
            dcp.local_len(int(n), r, interleave, dcp_size) for n in lengths
        ]
    assert dcp.owner(positions, interleave, dcp_size).tolist() == [
        dcp.owner(int(p), interleave, dcp_size) for p in positions
    ]


def test_blocks_needed_covers_length():
    for length, block_size, dcp_size in itertools.product(range(0, 70), (1, 4, 16), (1, 2, 3)):
        n = dcp.blocks_needed(length, block_size, dcp_size)
        assert n * block_size * dcp_size >= length
        assert (n - 1) * block_size * dcp_size < length or n == 0
