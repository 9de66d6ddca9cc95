"""Paged KV block manager: per-sequence block tables over a pool with a hash-chained prefix cache.

Block ids only; the tensors live in the model runner. Block i of a sequence holds tokens
[i * block_size, (i + 1) * block_size). Once a block is full and computed, cache_blocks
registers its chained digest so a later prompt with the same prefix reuses it.
"""

from __future__ import annotations

from typing import Sequence as TokenIds

from quill.engine.block_pool import BlockPool, HashFn, hash_block_tokens
from quill.engine.sequence import Sequence


class BlockManager:
    """Allocates, caches and frees KV blocks for Sequences (see module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        *,
        hash_fn: HashFn = hash_block_tokens,
    ):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn = hash_fn  # injectable so tests can force collisions
        self._pool = BlockPool(num_blocks)
        self.num_query_tokens = 0  # prompt tokens looked up in get_computed_blocks
        self.num_hit_tokens = 0  # of those, tokens found cached

    # ---- gauges -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Allocatable now: truly free plus evictable cached blocks (ref count 0)."""
        return self._pool.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref count > 0."""
        return self.num_blocks - self._pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a registered hash, whatever their ref count."""
        return self._pool.num_cached

    @property
    def hit_rate(self) -> float:
        """Cached tokens / queried tokens over all get_computed_blocks calls (0.0 before any)."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def is_cached(self, block_id: int) -> bool:
        """Whether the block holds a registered prefix-cache entry (kept after its sequence frees it)."""
        return self._pool.blocks[block_id].block_hash is not None

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    # ---- prefix cache -------------------------------------------------------------------

    def cached_hashes(self) -> list:
        """The digests of every block the prefix cache holds (safe to call from another thread)."""
        return self._pool.cached_hashes() if self.enable_prefix_caching else []

    def get_computed_blocks(self, token_ids: TokenIds[int]) -> tuple[list[int], int]:
        """Longest cached run of full leading blocks: (block_ids, num_cached_tokens).

        Capped at (len - 1) // block_size blocks so the last token is always computed and
        yields logits. Takes no references: pass the ids to allocate in the same step.
        """
        if not self.enable_prefix_caching:
            return [], 0
        size = self.block_size
        max_blocks = max(len(token_ids) - 1, 0) // size
        block_ids: list[int] = []
        parent_hash = None
        for i in range(max_blocks):
            block_tokens = tuple(token_ids[i * size : (i + 1) * size])
            parent_hash = self._hash_fn(parent_hash, block_tokens)
            block_id = self._pool.lookup(parent_hash, block_tokens)
            if block_id is None:
                break
            block_ids.append(block_id)
        num_cached_tokens = len(block_ids) * size
        self.num_query_tokens += len(token_ids)
        self.num_hit_tokens += num_cached_tokens
        return block_ids, num_cached_tokens

    def cache_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Register digests for every full block of seq whose tokens are all computed (idempotent)."""
        if not self.enable_prefix_caching:
            return
        if not 0 <= num_computed_tokens <= seq.num_tokens:
            raise ValueError(
                f"num_computed_tokens must be in [0, {seq.num_tokens}] (the sequence's length), "
                f"got {num_computed_tokens}"
            )
        table, blocks, size = seq.block_table, self._pool.blocks, self.block_size
        num_full = min(num_computed_tokens // size, len(table))
        # Hashed blocks always form a prefix of the table, so scan back from the last full
        # block: usually zero or one new block per call, whatever the sequence's length.
        first_new = num_full
        while first_new > 0 and blocks[table[first_new - 1]].block_hash is None:
            first_new -= 1
        if first_new == num_full:
            return
        parent_hash = blocks[table[first_new - 1]].block_hash if first_new else None
        tokens = seq.token_ids_slice(first_new * size, num_full * size)
        for i in range(first_new, num_full):
            offset = (i - first_new) * size
            block_tokens = tuple(tokens[offset : offset + size])
            parent_hash = self._hash_fn(parent_hash, block_tokens)
            self._pool.register(table[i], parent_hash, block_tokens)

    def reset_prefix_cache(self) -> None:
        """Drop the hashes of all unused (ref 0) cached blocks; blocks in use keep theirs."""
        self._pool.reset()

    # ---- allocation ---------------------------------------------------------------------

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None) -> int:
        """New pool blocks allocate(seq, num_new_tokens, computed_blocks) would take (0 if none)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        num_computed_blocks = len(computed_blocks) if computed_blocks else 0
        # The cached prefix counts as computed whether or not the caller has already
        # advanced seq.num_computed_tokens past it.
        covered = max(seq.num_computed_tokens, num_computed_blocks * self.block_size) + num_new_tokens
        num_blocks_total = -(-covered // self.block_size)
        return max(num_blocks_total - len(seq.block_table) - num_computed_blocks, 0)

    def allocate_unused(self, seq: Sequence, num_new_tokens: int) -> bool:
        """allocate(), but only from blocks that hold no prefix-cache entry (speculative proposals: a
        guess never evicts a cached prefix the run without it would have kept)."""
        if self.num_blocks_needed(seq, num_new_tokens) > self._pool.num_unused:
            return False
        return self.allocate(seq, num_new_tokens)

    def allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Grow seq.block_table to cover num_computed_tokens + num_new_tokens tokens.

        computed_blocks (from get_computed_blocks, first allocation only) go first in the
        table, one reference each; num_new_tokens then counts tokens past that prefix.
        All-or-nothing: returns False and changes nothing when the pool is short.
        """
        computed = list(computed_blocks) if computed_blocks else []
        if computed and seq.block_table:
            raise ValueError(
                f"computed_blocks are only for a sequence's first allocation; "
                f"seq {seq.seq_id} already holds {len(seq.block_table)} blocks"
            )
        num_new_blocks = self.num_blocks_needed(seq, num_new_tokens, computed)
        for block_id in computed:
            self._pool.check_cached(block_id)
        # Taking a ref-0 cached block removes it from the allocatable count.
        if num_new_blocks > self._pool.num_free - self._pool.num_evictable_among(computed):
            return False
        for block_id in computed:
            self._pool.take(block_id)
        seq.block_table.extend(computed)
        seq.block_table.extend(self._pool.allocate_new() for _ in range(num_new_blocks))
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> int:
        """Release seq's blocks past those holding its first num_tokens tokens (rejected proposals'
        slots); -> blocks released. Such blocks were never full with computed tokens, so they carry
        no prefix-cache hash."""
        keep = -(-num_tokens // self.block_size)
        extra = seq.block_table[keep:]
        for block_id in reversed(extra):
            self._pool.release(block_id)
        del seq.block_table[keep:]
        return len(extra)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references, last block first so a prefix's tail is evicted before its head."""
        for block_id in reversed(seq.block_table):
            self._pool.release(block_id)
        seq.block_table = []
