"""KV block pool: reference counts, free list, LRU list of evictable cached blocks, hash index."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import Callable, Iterable, Sequence

BlockHash = bytes
HashFn = Callable[[BlockHash | None, Sequence[int]], BlockHash]


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """128-bit BLAKE2b digest of (parent block's digest, this block's token ids).

    Chaining makes a block's digest stand for its whole prefix. A token re-check on a hit
    only guards the block itself, so the prefix is protected by the digest alone: 128
    cryptographic bits keep a chain collision out of reach (Python's 64-bit tuple hash
    is not collision-resistant). Hashing a 16-token block costs about a microsecond.
    """
    digest = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        digest.update(parent_hash)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, hash_fn: HashFn = hash_block_tokens) -> list[BlockHash]:
    """The chained digests of the full blocks of `token_ids`: what a prefix-cache lookup of
    these tokens asks the pool for, block by block (the partial last block has none)."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_fn(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


class Block:
    """One KV block's bookkeeping: who uses it and, once full and computed, what it holds."""

    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None  # chained digest; set when the block is full
        self.token_ids: tuple[int, ...] | None = None  # kept to re-check tokens on a hit

    def clear_hash(self) -> None:
        self.block_hash = None
        self.token_ids = None

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_count}, hashed={self.block_hash is not None})"


class BlockPool:
    """Owns every block id. Invariants:

    - a ref-0 block is in exactly one of `_free` (no hash) or `_evictable` (registered hash);
    - `_cached[h] == b` implies `blocks[b].block_hash == h` (the block is "registered");
    - a block may carry a hash without being registered when another block registered the
      same content first; such a block goes back to the free list when released, unless the
      other copy has been evicted meanwhile (then it takes over the registration).
    """

    def __init__(self, num_blocks: int):
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        # Insertion order is recency: the first key is the least recently freed (evicted first).
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks that allocate_new can hand out now (free + evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_unused(self) -> int:
        """Blocks that hold nothing reusable: allocate_new hands these out before evicting a cached one."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> list[BlockHash]:
        """Every registered digest (in use or evictable). One C-level copy of the index's keys,
        so another thread may call it while the engine thread changes the index."""
        return list(self._cached)

    def num_evictable_among(self, block_ids: Iterable[int]) -> int:
        return sum(1 for block_id in block_ids if block_id in self._evictable)

    def lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> int | None:
        """The registered block with this digest and exactly these tokens, else None."""
        block_id = self._cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def check_cached(self, block_id: int) -> None:
        """Raise unless block_id is a live cached block (it may have been evicted since lookup)."""
        if not 0 <= block_id < len(self.blocks):
            raise ValueError(f"computed block id {block_id} is out of range [0, {len(self.blocks)})")
        block = self.blocks[block_id]
        if block.block_hash is None or self._cached.get(block.block_hash) != block_id:
            raise ValueError(
                f"computed block {block_id} is no longer cached; "
                "call get_computed_blocks right before allocate"
            )

    def take(self, block_id: int) -> None:
        """Add a reference to a cached block, pulling it off the evictable list if unused."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def allocate_new(self) -> int:
        """A block with one reference: from the free list, else by evicting the LRU cached block."""
        if self._free:
            block_id = self._free.popleft()
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._unregister(self.blocks[block_id])
        else:
            raise RuntimeError("block pool exhausted; callers must check num_free first")
        self.blocks[block_id].ref_count = 1
        return block_id

    def release(self, block_id: int) -> None:
        """Drop one reference; at zero the block becomes evictable (if cached) or free."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise ValueError(f"block {block_id} released with ref_count {block.ref_count} (double free)")
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.block_hash is not None and self._cached.setdefault(block.block_hash, block_id) == block_id:
            self._evictable[block_id] = None  # new keys go last: most recently freed
        else:
            block.clear_hash()
            self._free.append(block_id)

    def register(self, block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """Record a full, computed block's digest. The first block registered for a digest wins."""
        block = self.blocks[block_id]
        if block.block_hash is not None and block.block_hash != block_hash:
            self._unregister(block)
        block.block_hash = block_hash
        block.token_ids = token_ids
        self._cached.setdefault(block_hash, block_id)

    def reset(self) -> int:
        """Forget every unused cached block; returns how many went back to the free list."""
        num_dropped = len(self._evictable)
        for block_id in self._evictable:
            self._unregister(self.blocks[block_id])
            self._free.append(block_id)
        self._evictable.clear()
        return num_dropped

    def _unregister(self, block: Block) -> None:
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        block.clear_hash()
