"""Unit tests for the paged KV block manager and its prefix cache (no model, no tensors)."""

import random

import pytest

from quill.engine.block_manager import BlockManager
from quill.engine.block_pool import hash_block_tokens
from quill.engine.sequence import Sequence
from quill.sampling_params import SamplingParams

BS = 4  # block size used throughout


def make_seq(tokens) -> Sequence:
    return Sequence("req", list(tokens), SamplingParams())


def admit(bm: BlockManager, tokens) -> Sequence:
    """Look up the prefix cache, allocate for the rest of the prompt, mark it computed and cache it."""
    seq = make_seq(tokens)
    computed, num_cached = bm.get_computed_blocks(seq.all_token_ids)
    assert bm.allocate(seq, seq.num_tokens - num_cached, computed)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_blocks(seq, seq.num_computed_tokens)
    return seq


def decode_one(bm: BlockManager, seq: Sequence, token: int) -> None:
    """Append a sampled token, allocate room for it, then compute it (as one engine step does)."""
    seq.append_token(token, 0.0)
    assert bm.allocate(seq, 1)
    seq.num_computed_tokens += 1
    bm.cache_blocks(seq, seq.num_computed_tokens)


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    refs = {}
    for seq in live:
        for block_id in seq.block_table:
            refs[block_id] = refs.get(block_id, 0) + 1
    assert {b.block_id: b.ref_count for b in bm._pool.blocks if b.ref_count} == refs
    assert bm.num_used_blocks == len(refs)
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks


# ---- allocation ---------------------------------------------------------------------------


def test_allocate_grows_across_block_boundaries():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(range(6))
    assert bm.allocate(seq, 6)
    assert len(seq.block_table) == 2 and len(set(seq.block_table)) == 2
    seq.num_computed_tokens = 6
    first_two = list(seq.block_table)
    for expected_blocks in (2, 2, 3, 3, 3, 3, 4):  # tokens 7..13
        seq.append_token(100, 0.0)
        assert bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
        assert len(seq.block_table) == expected_blocks
    assert seq.block_table[:2] == first_two  # growth never reshuffles earlier blocks
    assert bm.num_used_blocks == 4 and bm.num_free_blocks == 4
    assert bm.usage() == pytest.approx(0.5)


def test_allocate_is_noop_when_already_covered():
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = make_seq(range(3))
    assert bm.allocate(seq, 3)
    assert bm.allocate(seq, 0)
    seq.num_computed_tokens = 3
    assert bm.allocate(seq, 1)  # 4th token still fits in block 0
    assert len(seq.block_table) == 1 and bm.num_used_blocks == 1


def test_free_returns_blocks_and_clears_table():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a, b = make_seq(range(9)), make_seq(range(50, 55))
    assert bm.allocate(a, 9) and bm.allocate(b, 5)
    assert bm.num_used_blocks == 5
    bm.free(a)
    assert a.block_table == [] and bm.num_used_blocks == 2 and bm.num_free_blocks == 4
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks and bm.usage() == 0.0


def test_allocate_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_seq(range(8))
    assert bm.allocate(a, 8)
    b = make_seq(range(100, 108))
    assert not bm.allocate(b, 8)  # needs 2, 1 left
    assert b.block_table == [] and bm.num_free_blocks == 1
    assert bm.allocate(b, 4)  # one block fits
    b.num_computed_tokens = 4
    assert not bm.allocate(b, 4) and len(b.block_table) == 1


def test_all_or_nothing_keeps_computed_blocks_cached():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = admit(bm, range(9))  # 3 blocks, 2 of them full and cached
    bm.free(a)
    computed, num_cached = bm.get_computed_blocks(list(range(8)) + [7] * 5)
    assert num_cached == 8
    b = make_seq(list(range(8)) + [7] * 5)
    # Needs 2 more blocks but taking the 2 cached ones leaves only 1 allocatable.
    assert not bm.allocate(b, 5, computed)
    assert b.block_table == [] and bm.num_free_blocks == 3 and bm.num_cached_blocks == 2
    assert bm.get_computed_blocks(list(range(9)))[1] == 8


# ---- prefix cache -------------------------------------------------------------------------


def test_hit_after_free_reuses_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = admit(bm, range(10))
    a_table = list(a.block_table)
    assert bm.num_cached_blocks == 2
    bm.free(a)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    b = make_seq(list(range(10)) + [42])
    computed, num_cached = bm.get_computed_blocks(b.all_token_ids)
    assert computed == a_table[:2] and num_cached == 8
    assert bm.allocate(b, b.num_tokens - num_cached, computed)
    assert b.block_table[:2] == a_table[:2] and len(b.block_table) == 3
    assert bm.num_used_blocks == 3


def test_hash_chain_same_block_different_prefix_misses():
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.free(admit(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Block 2 is identical, block 1 differs: the chain must not hit block 2 alone.
    assert bm.get_computed_blocks([0, 2, 3, 4, 5, 6, 7, 8, 9]) == ([], 0)
    # Same first block, different second: exactly one block hits.
    blocks, num_cached = bm.get_computed_blocks([1, 2, 3, 4, 5, 6, 7, 0, 9])
    assert len(blocks) == 1 and num_cached == 4


def test_token_recheck_on_forced_hash_collision():
    bm = BlockManager(num_blocks=8, block_size=BS, hash_fn=lambda parent, tokens: b"collide")
    bm.free(admit(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Every block digests the same; only the stored tokens tell them apart.
    assert bm.get_computed_blocks([9, 9, 9, 9, 9]) == ([], 0)
    blocks, num_cached = bm.get_computed_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert num_cached == 4  # block 0 matches; block 1 finds block 0's tokens and stops


def test_monkeypatched_hash_fn_is_used(monkeypatch):
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.free(admit(bm, range(9)))
    monkeypatch.setattr(bm, "_hash_fn", lambda parent, tokens: b"other")
    assert bm.get_computed_blocks(list(range(9))) == ([], 0)


def test_hit_capped_at_len_minus_one():
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.free(admit(bm, range(8)))
    assert bm.num_cached_blocks == 2
    assert bm.get_computed_blocks(list(range(8)))[1] == 4  # exact multiple: one block less
    assert bm.get_computed_blocks(list(range(9)))[1] == 8
    assert bm.get_computed_blocks(list(range(4))) == ([], 0)
    assert bm.get_computed_blocks([]) == ([], 0)


def test_hit_rate_counts_tokens():
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.get_computed_blocks(list(range(9)))  # cold: 0 of 9
    bm.free(admit(bm, range(9)))  # admit queries 9 more, 0 hit
    bm.get_computed_blocks(list(range(10)))  # 8 of 10
    assert (bm.num_query_tokens, bm.num_hit_tokens) == (28, 8)
    assert bm.hit_rate == pytest.approx(8 / 28)
    assert BlockManager(4, BS).hit_rate == 0.0


def test_lru_eviction_order_tail_first_and_recent_last():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = admit(bm, [1, 2, 3, 4])  # 2 full blocks
    b = admit(bm, [5, 6, 7, 8])
    bm.free(a)
    bm.free(b)  # LRU order: a1, a0, b1, b0
    filler = make_seq([0])
    assert bm.allocate(filler, 1)  # evicts a1
    assert bm.get_computed_blocks([1, 2, 3, 4, 0])[1] == 2  # a0 still there
    assert bm.num_cached_blocks == 3
    # Re-use b's prefix and free it again: b's blocks become the most recent.
    c = admit(bm, [5, 6, 7, 8, 9])
    bm.free(c)  # order: a0, (c2: not full, to free list), b1, b0
    assert bm.allocate(filler, 2)  # takes the free block (c's tail)
    assert bm.allocate(filler, 2)  # evicts a0
    assert bm.get_computed_blocks([1, 2, 3, 4, 0]) == ([], 0)
    assert bm.get_computed_blocks([5, 6, 7, 8, 0])[1] == 4


def test_shared_blocks_freed_by_last_sharer():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = admit(bm, range(9))
    b = admit(bm, list(range(8)) + [50])  # shares a's 2 full blocks
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm._pool.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert bm.num_used_blocks == 4
    check_invariants(bm, [a, b])
    bm.free(a)
    assert bm.num_used_blocks == 3  # shared blocks survive a's release
    assert bm.allocate(make_seq(range(12)), 12)  # takes 3: must not steal b's blocks
    assert not bm.allocate(make_seq([1]), 1)
    assert bm.get_computed_blocks(list(range(9)))[1] == 8
    bm.free(b)
    assert bm.num_used_blocks == 3


def test_double_free_raises():
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = make_seq(range(5))
    assert bm.allocate(seq, 5)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(ValueError, match="double free"):
        bm.free(seq)


def test_cache_blocks_idempotent_and_covers_decoded_tokens():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = admit(bm, range(6))
    assert bm.num_cached_blocks == 1
    bm.cache_blocks(seq, 6)
    bm.cache_blocks(seq, 4)
    assert bm.num_cached_blocks == 1
    decode_one(bm, seq, 60)
    assert bm.num_cached_blocks == 1  # 7 tokens: block 1 not full
    decode_one(bm, seq, 61)
    assert bm.num_cached_blocks == 2  # 8 tokens computed: block 1 registered
    # A follow-up turn (prompt + output + more) hits both blocks, output block included.
    follow_up = seq.all_token_ids + [70, 71]
    bm.free(seq)
    assert bm.get_computed_blocks(follow_up)[1] == 8


def test_cache_blocks_only_registers_computed_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(range(12))
    assert bm.allocate(seq, 12)
    seq.num_computed_tokens = 7  # a chunked prefill stopped inside block 1
    bm.cache_blocks(seq, 7)
    assert bm.num_cached_blocks == 1
    bm.cache_blocks(seq, 12)
    assert bm.num_cached_blocks == 3


def test_duplicate_content_keeps_first_and_breaks_neither():
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(9))
    a, b = make_seq(prompt), make_seq(prompt)
    assert bm.allocate(a, 9) and bm.allocate(b, 9)  # same step: neither could hit
    for seq in (a, b):
        seq.num_computed_tokens = 9
        bm.cache_blocks(seq, 9)
    assert bm.num_cached_blocks == 2
    assert bm.get_computed_blocks(prompt)[0] == a.block_table[:2]
    bm.free(b)  # b's duplicates are not cached twice: straight to the free list
    assert bm.num_cached_blocks == 2 and bm.num_used_blocks == 3
    assert bm.get_computed_blocks(prompt)[0] == a.block_table[:2]
    a_table = list(a.block_table)
    bm.free(a)
    assert bm.get_computed_blocks(prompt)[0] == a_table[:2]
    assert bm.num_free_blocks == 8


def test_duplicate_takes_over_when_first_copy_is_gone():
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = list(range(9))
    a, b = make_seq(prompt), make_seq(prompt)
    assert bm.allocate(a, 9) and bm.allocate(b, 9)
    for seq in (a, b):
        seq.num_computed_tokens = 9
        bm.cache_blocks(seq, 9)
    bm.free(a)
    bm.reset_prefix_cache()  # a's copies dropped while b still holds its own
    assert bm.get_computed_blocks(prompt) == ([], 0)
    b_table = list(b.block_table)
    bm.free(b)
    assert bm.get_computed_blocks(prompt)[0] == b_table[:2]


def test_reset_prefix_cache_drops_only_unused_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.free(admit(bm, range(9)))
    running = admit(bm, range(100, 109))
    assert bm.num_cached_blocks == 4
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 2
    assert bm.get_computed_blocks(list(range(9))) == ([], 0)
    assert bm.get_computed_blocks(list(range(100, 109)))[1] == 8
    bm.free(running)
    assert bm.num_free_blocks == 8


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    a = admit(bm, range(9))
    assert bm.num_cached_blocks == 0
    bm.free(a)
    assert bm.get_computed_blocks(list(range(9))) == ([], 0)
    assert bm.num_query_tokens == 0 and bm.num_free_blocks == 4


def test_cached_prefix_counts_whether_or_not_num_computed_advanced():
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.free(admit(bm, range(9)))
    prompt = list(range(10))
    for advance in (False, True):
        seq = make_seq(prompt)
        computed, num_cached = bm.get_computed_blocks(prompt)
        if advance:
            seq.num_computed_tokens = num_cached
        assert bm.num_blocks_needed(seq, len(prompt) - num_cached, computed) == 1
        assert bm.allocate(seq, len(prompt) - num_cached, computed)
        assert len(seq.block_table) == 3
        bm.free(seq)


def test_no_leaks_under_random_workload():
    rng = random.Random(1234)
    bm = BlockManager(num_blocks=24, block_size=BS)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    live: list[Sequence] = []
    for _ in range(300):
        if live and (rng.random() < 0.3 or bm.num_free_blocks < 4):
            bm.free(live.pop(rng.randrange(len(live))))
        elif rng.random() < 0.4 and live:
            seq = rng.choice(live)
            seq.append_token(rng.randrange(50), 0.0)
            if bm.allocate(seq, 1):
                seq.num_computed_tokens += 1
                bm.cache_blocks(seq, seq.num_computed_tokens)
            else:
                seq._output_token_ids.pop()
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            seq = make_seq(tokens)
            computed, num_cached = bm.get_computed_blocks(tokens)
            if bm.allocate(seq, len(tokens) - num_cached, computed):
                seq.num_computed_tokens = len(tokens)
                bm.cache_blocks(seq, len(tokens))
                live.append(seq)
        check_invariants(bm, live)
    assert bm.num_hit_tokens > 0  # the shared prefixes did get reused
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and len(bm._pool._free) == bm.num_blocks


# ---- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({"num_blocks": 0, "block_size": 4}, "num_blocks"),
    ({"num_blocks": 4, "block_size": 0}, "block_size"),
    ({"num_blocks": 2.5, "block_size": 4}, "num_blocks"),
])
def test_constructor_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockManager(**kwargs)


def test_bad_calls_name_the_problem():
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = make_seq(range(5))
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate(seq, -1)
    assert bm.allocate(seq, 5)
    with pytest.raises(ValueError, match="first allocation"):
        bm.allocate(seq, 1, [3])
    with pytest.raises(ValueError, match="num_computed_tokens"):
        bm.cache_blocks(seq, 6)


def test_stale_computed_blocks_rejected():
    bm = BlockManager(num_blocks=2, block_size=BS)
    bm.free(admit(bm, range(5)))
    computed, _ = bm.get_computed_blocks(list(range(5)))
    assert computed
    assert bm.allocate(make_seq(range(8)), 8)  # evicts the cached block
    with pytest.raises(ValueError, match="no longer cached"):
        bm.allocate(make_seq(range(5)), 1, computed)


def test_default_hash_is_chained_and_stable():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(None, (1, 2, 3, 4)) and len(first) == 16
    assert hash_block_tokens(first, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
