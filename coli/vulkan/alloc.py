"""Best-fit sub-allocator over device-memory blocks (docs/vulkan.md "Memory").

Tensors are placed at offsets inside blocks of ``block_bytes`` (256 MiB by default): one memory object
per tensor would make every submit pay for thousands of referenced allocations. A request takes the
free extent that leaves the least room (best fit) over every block; a free coalesces with its
neighbours; a block left empty goes back to the driver at once. A request larger than a block gets a
block of its own size. Pure Python: the driver calls are the ``new_block``/``free_block`` callbacks,
so the allocator is tested against a byte map without a device.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Allocation:
    """A placed tensor: ``block`` (the allocator's block id), byte ``offset`` in it, ``size`` in bytes."""
    block: int
    offset: int
    size: int


class _Block:
    __slots__ = ("id", "size", "handle", "starts", "sizes", "used")

    def __init__(self, bid: int, size: int, handle: Any):
        self.id, self.size, self.handle = bid, size, handle
        self.starts = [0]       # free extents, sorted by start
        self.sizes = [size]
        self.used = 0


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class BlockAllocator:
    """Best-fit allocator over blocks.

    new_block(size) -> handle  allocates a block of device memory (raise to refuse);
    free_block(handle)         returns it to the driver.
    ``align`` is the least alignment of every offset (a power of two).
    """

    def __init__(self, block_bytes: int, new_block: Callable[[int], Any],
                 free_block: Callable[[Any], None], align: int = 256):
        if block_bytes <= 0 or align <= 0 or align & (align - 1):
            raise ValueError("block_bytes must be > 0 and align a power of two")
        self.block_bytes = block_bytes
        self.align = align
        self._new, self._free = new_block, free_block
        self.blocks: dict[int, _Block] = {}
        self._next_id = 0

    # -- placement ---------------------------------------------------------------------------------
    def alloc(self, size: int, align: int = 1) -> Allocation:
        """Place ``size`` bytes (> 0) at an offset aligned to max(align, self.align)."""
        if size <= 0:
            raise ValueError("size must be > 0")
        a = max(align, self.align)
        best = None  # (waste, block id, index, aligned start)
        for b in self.blocks.values():
            for i, (s, n) in enumerate(zip(b.starts, b.sizes)):
                st = _round_up(s, a)
                if st + size <= s + n:
                    key = (n - size, b.id, s)
                    if best is None or key < best[0]:
                        best = (key, b, i, st)
        if best is None:
            bsize = max(self.block_bytes, _round_up(size, self.align))
            handle = self._new(bsize)
            b = _Block(self._next_id, bsize, handle)
            self._next_id += 1
            self.blocks[b.id] = b
            best = (None, b, 0, 0)
        _, b, i, st = best
        s, n = b.starts[i], b.sizes[i]
        pieces = []
        if st > s:
            pieces.append((s, st - s))
        if st + size < s + n:
            pieces.append((st + size, s + n - st - size))
        b.starts[i:i + 1] = [p[0] for p in pieces]
        b.sizes[i:i + 1] = [p[1] for p in pieces]
        b.used += size
        return Allocation(b.id, st, size)

    def free(self, a: Allocation) -> None:
        """Give an allocation back; coalesce; return the block to the driver when it empties."""
        b = self.blocks[a.block]
        i = bisect.bisect_left(b.starts, a.offset)
        if i < len(b.starts) and b.starts[i] < a.offset + a.size:
            raise ValueError(f"double free or overlap at block {a.block} offset {a.offset}")
        if i > 0 and b.starts[i - 1] + b.sizes[i - 1] > a.offset:
            raise ValueError(f"double free or overlap at block {a.block} offset {a.offset}")
        s, n = a.offset, a.size
        if i < len(b.starts) and b.starts[i] == s + n:          # merge with the next extent
            n += b.sizes[i]
            del b.starts[i], b.sizes[i]
        if i > 0 and b.starts[i - 1] + b.sizes[i - 1] == s:     # merge with the previous extent
            b.sizes[i - 1] += n
        else:
            b.starts.insert(i, s)
            b.sizes.insert(i, n)
        b.used -= a.size
        if b.used == 0:
            del self.blocks[b.id]
            self._free(b.handle)

    # -- figures -----------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return sum(b.used for b in self.blocks.values())

    @property
    def reserved_bytes(self) -> int:
        """Bytes of device memory held in blocks."""
        return sum(b.size for b in self.blocks.values())

    @property
    def free_bytes(self) -> int:
        return sum(sum(b.sizes) for b in self.blocks.values())

    @property
    def largest_free(self) -> int:
        return max((max(b.sizes) for b in self.blocks.values() if b.sizes), default=0)

    @property
    def frag(self) -> float:
        """1 - largest free extent / free bytes (0.0 when nothing is free)."""
        f = self.free_bytes
        return 0.0 if f == 0 else 1.0 - self.largest_free / f

    def handle(self, block: int) -> Any:
        return self.blocks[block].handle
