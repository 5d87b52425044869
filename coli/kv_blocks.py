"""The paged KV cache's block accounting (``coli serve``'s default, ``--kv-unified``): the context's positions
(``--ctx``, llama-server's ``-c`` cells with its unified cache) cut into blocks of :data:`BLOCK` positions that
the slots take as their sequences grow and give back when their rows are dropped, as vLLM's block manager
(``BlockSpaceManager``: a free list, a block table per sequence) and llama.cpp's unified KV cells (any sequence
may hold any number of the shared cells).

Where the blocks' memory is: each slot's cache (``coli.models.base.Cache``) spans the whole context in virtual
memory, one contiguous run of positions a head as the attention kernels read it, on fresh anonymous mappings of
4 KiB pages (``memory.fresh_pages``: no transparent huge pages, which would commit 2 MiB at a first write, and
no memset of reused heap memory) whose pages the kernel commits as rows are written and takes back when a slot
gives its blocks back (``Cache.give_back``: ``madvise(DONTNEED)``).
This is vAttention's design (Prabhu et al., "vAttention: Dynamic Memory Management for Serving LLMs without
PagedAttention", ASPLOS 2025: the KV cache contiguous in virtual memory, physical pages mapped on demand), so
the kernels need no block table: a slot's positions ``0 .. n`` are its blocks, in order, and the
:class:`Blocks` table says which of the pool's blocks it holds. The pool bounds what all slots hold together
to the context's positions, as one slot's cache of the whole context held before (``--parallel 1``).
"""
from __future__ import annotations

#: positions a block (the unit a slot takes and gives back; ``coli.runtime.KV_STEP``, the RAM ledger's step)
BLOCK = 64


class Blocks:
    """A pool of ``n`` blocks of ``size`` positions, lent to owners (any hashable: the server's slots).

    ``table[owner]`` is the list of block ids the owner holds, its positions' blocks in order (block ``i`` of
    the list covers positions ``i * size .. (i + 1) * size - 1``); ``free`` the ids nobody holds. Invariants
    (:meth:`check`): every id in ``0 .. n-1`` is in exactly one of them."""

    def __init__(self, n: int, size: int = BLOCK):
        if n < 1 or size < 1:
            raise ValueError(f"Blocks: {n} blocks of {size} positions (both at least 1)")
        self.n, self.size = int(n), int(size)
        self.free = list(range(self.n - 1, -1, -1))  # pop() lends the lowest id
        self.table: dict = {}
        self.most = 0  # the most blocks held at once

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold positions ``0 .. positions-1``."""
        return -(-max(0, int(positions)) // self.size)

    def held(self, owner=None) -> int:
        """Blocks ``owner`` holds (all owners together when None)."""
        if owner is None:
            return self.n - len(self.free)
        return len(self.table.get(owner, ()))

    def grow(self, owner, positions: int) -> bool:
        """Make ``owner`` hold the blocks of positions ``0 .. positions-1`` (those it holds are kept): True, or
        False with nothing taken when the free blocks are too few."""
        t = self.table.setdefault(owner, [])
        want = self.blocks_for(positions) - len(t)
        if want <= 0:
            return True
        if want > len(self.free):
            return False
        t.extend(self.free.pop() for _ in range(want))
        self.most = max(self.most, self.held())
        return True

    def shrink(self, owner, positions: int) -> int:
        """``owner`` keeps the blocks of positions ``0 .. positions-1`` and gives the rest back; how many it gave."""
        t = self.table.get(owner, [])
        keep = self.blocks_for(positions)
        gone = t[keep:]
        del t[keep:]
        self.free.extend(reversed(gone))
        return len(gone)

    def check(self) -> None:
        """AssertionError unless every block is free or held by exactly one owner (no block lent twice, none lost)."""
        ids = list(self.free) + [b for t in self.table.values() for b in t]
        assert sorted(ids) == list(range(self.n)), (len(ids), self.n)
