"""One KV cache allocation for all layers, laid out as the attention backend prefers.

Layers always see [num_blocks, block_size, kv_heads, dim] tensors; a backend with `head_major_cache`
gets storage ordered [num_blocks, kv_heads, block_size, dim] behind those views. The storage is block-major across
layers (`kv_layout`): a layer's view strides over whole blocks of all layers and K/V, so every kernel takes the
block stride from its view (`stride(0)`) rather than assuming a contiguous per-layer cache.
"""

from __future__ import annotations

import math
import mmap

import torch

from engine.attention import kv_layout


def allocate(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    key_dim: int,
    value_in_key: bool,
    dtype: torch.dtype,
    device: torch.device,
    head_major: bool,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """The storage and each layer's (key cache, value cache or None when values live in the keys, as in MLA)."""
    kinds = 1 if value_in_key else 2
    shape = kv_layout.storage_shape(num_layers, kinds, num_blocks, block_size, kv_heads, key_dim, head_major)
    # zeros, not empty: padded gathers read unwritten slots, and 0 * NaN would poison the output
    storage = zeros(shape, dtype, device)
    views = storage.permute(0, 1, 2, 4, 3, 5) if head_major else storage
    return storage, [(views[:, i, 0], None if value_in_key else views[:, i, 1]) for i in range(num_layers)]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor; on CPU backed by an anonymous memory mapping.

    The OS maps zero pages on first touch, so only the blocks a run writes are ever cleared: clearing a
    1 GiB cache up front took seconds of kernel time per rank on a virtual machine (page clearing), and
    two ranks sharing two cores paid it twice before either became healthy.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    buffer = mmap.mmap(-1, numel * dtype.itemsize)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer faults and TLB misses where transparent huge pages are opt-in
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


def fault_in(storage: torch.Tensor) -> None:
    """Make every page of a CPU storage resident now instead of on first touch. A P/D rank does this once at
    start-up (about 0.7 s per GiB here, 4 KiB pages): NIXL copies into and out of the storage, and a READ into
    pages never touched paid their faults inside the transfer (2.5-3.5x the copy itself at interleave = block
    size). On a prefill rank it keeps the benchmark's raw single-region READ honest: pages no prompt has touched
    yet would be read as the kernel's shared zero page."""
    if storage.device.type == "cpu":
        storage.zero_()  # zeros already: this only faults the pages in


def geometry(storage: torch.Tensor, head_major: bool) -> kv_layout.CacheGeometry:
    """Where `allocate`'s storage lies in memory, for the KV hand-off's byte descriptors."""
    num_blocks, layers, kinds = storage.shape[:3]
    heads, block_size = (storage.shape[3], storage.shape[4]) if head_major else (storage.shape[4], storage.shape[3])
    return kv_layout.CacheGeometry(
        base_addr=storage.data_ptr(),
        nbytes=storage.numel() * storage.element_size(),
        layers=layers,
        kinds=kinds,
        num_blocks=num_blocks,
        block_size=block_size,
        heads=heads,
        head_bytes=storage.shape[5] * storage.element_size(),
        head_major=head_major,
        device_id=storage.device.index or 0,
    )
