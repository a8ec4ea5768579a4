"""The byte layout of one rank's KV storage (plain ints, no torch): the one place that knows its dimension order.

The storage is block-major across layers: [blocks, layers, kinds, heads, block_size, dim] (head-major) or [blocks,
layers, kinds, block_size, heads, dim] (token-major); kinds is 2 (keys, values) or 1 when values live in the keys
(MLA). One block of every layer and kind is then one contiguous range, so the KV hand-off moves a whole block in one
descriptor. The allocator builds its tensors from `storage_shape`; the hand-off computes byte addresses with
`CacheGeometry.offset`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

HEAD_MAJOR_BACKENDS = frozenset({"torch", "cpu"})  # attention backends that read a head-major cache (cpu: torch's)


def storage_shape(
    layers: int, kinds: int, num_blocks: int, block_size: int, heads: int, dim: int, head_major: bool
) -> tuple[int, ...]:
    """The storage tensor's shape."""
    inner = (heads, block_size, dim) if head_major else (block_size, heads, dim)
    return (num_blocks, layers, kinds, *inner)


@dataclass(frozen=True)
class CacheGeometry:
    """Where each (layer, kind, slot, head) of one rank's KV storage lives in memory (one contiguous region)."""

    base_addr: int
    nbytes: int
    layers: int
    kinds: int  # 2: keys and values; 1: values live in the keys (MLA)
    num_blocks: int
    block_size: int
    heads: int
    head_bytes: int  # one head of one token: dim x element size
    head_major: bool
    device_id: int = 0

    @property
    def block_bytes(self) -> int:
        return self.heads * self.block_size * self.head_bytes

    def offset(self, layer: Any, kind: Any, slot: Any, head: Any) -> Any:
        """Byte offset of one head of one token; element-wise on ints or numpy arrays."""
        block, token = slot // self.block_size, slot % self.block_size
        inner = head * self.block_size + token if self.head_major else token * self.heads + head
        return ((block * self.layers + layer) * self.kinds + kind) * self.block_bytes + inner * self.head_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheGeometry:
        """Rebuild from `to_dict` output; ValueError when a field is missing or not of its type."""
        if not isinstance(data, dict):
            raise ValueError("a cache geometry must be an object")
        values = {}
        for f in fields(cls):
            value = data.get(f.name)
            kind = bool if f.type == "bool" else int
            if type(value) is not kind or (kind is int and value < 0):
                raise ValueError(f"cache geometry field {f.name} must be a non-negative {kind.__name__}")
            values[f.name] = value
        geometry = cls(**values)
        expected = geometry.layers * geometry.kinds * geometry.num_blocks * geometry.block_bytes
        if geometry.nbytes != expected or geometry.kinds not in (1, 2):
            raise ValueError(f"cache geometry is inconsistent: {geometry.nbytes} bytes, its shape makes {expected}")
        return geometry
