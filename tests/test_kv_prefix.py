"""Prefix cache (edgellm/kv/prefix.py): chained keys, the one-token cap of match, reuse of a cached
prefix's KV, LRU eviction order, duplicate registration, clear, stats; and the random-operation
property test of tests/test_kv_pool.py with the cache in the loop (lookups, registrations,
evictions).

EDGELLM_PROPERTY_EXAMPLES sets the number of random sequences (default 10000)."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given

from edgellm.errors import ConfigError, ContextFull
from edgellm.kv.pool import KVInvariantError, KVPool
from edgellm.kv.prefix import PrefixCache

from .test_kv_pool import PROPERTY, Harness, decode, examples, run_ops

BT = 4


def kv_of(ids, layer, kvh=1, hd=2):
    """A position's K/V as a function of its prefix, like a real model's (so equal prefixes
    computed twice give equal data): (T, kvh, hd) each."""
    out_k, out_v = [], []
    for p in range(len(ids)):
        seed = int.from_bytes(hashlib.blake2b(np.asarray(ids[: p + 1], "<i4").tobytes() + bytes([layer]),
                                              digest_size=8).digest(), "little")
        r = np.random.default_rng(seed).standard_normal((2, kvh, hd)).astype(np.float32)
        out_k.append(r[0])
        out_v.append(r[1])
    return np.array(out_k).reshape(-1, kvh, hd), np.array(out_v).reshape(-1, kvh, hd)


def compute(seq, ids, n_layers=2):
    """The forward pass's side of the contract: reserve, write every layer, commit."""
    start = seq.n_tokens
    seq.reserve(len(ids) - start)
    for layer in range(n_layers):
        k, v = kv_of(ids, layer)
        seq.write(layer, start, k[start:], v[start:])
    seq.commit(len(ids), ids[start:])


def assert_holds(seq, ids, n_layers=2):
    assert seq.tokens == list(ids) and seq.n_tokens == len(ids)
    for layer in range(n_layers):
        k, v = kv_of(ids, layer)
        got_k, got_v = seq.read(layer, len(ids))
        np.testing.assert_array_equal(got_k, k.transpose(1, 0, 2))
        np.testing.assert_array_equal(got_v, v.transpose(1, 0, 2))


def new_pool(n_blocks=16):
    pool = KVPool(2, 1, 2, n_blocks, BT, "f32")
    return pool, PrefixCache(pool)


def test_keys_are_blake2b_chained_over_int32_ids():
    pool, cache = new_pool()
    s = pool.new_sequence()
    ids = list(range(100, 109))
    compute(s, ids)
    assert cache.register(s) == 2  # two full blocks; the ninth token is not cached
    root = hashlib.blake2b(b"edgellm-prefix-v1", digest_size=16).digest()
    h1 = hashlib.blake2b(root + np.asarray(ids[:4], "<i4").tobytes(), digest_size=16).digest()
    h2 = hashlib.blake2b(h1 + np.asarray(ids[4:8], "<i4").tobytes(), digest_size=16).digest()
    assert cache._index == {h1: s.block_table[0], h2: s.block_table[1]}
    salted = PrefixCache(KVPool(1, 1, 2, 4, BT, "f32"), salt=b"model-sha")
    assert salted._root != root


def test_match_leaves_at_least_one_token_to_compute():
    pool, cache = new_pool()
    s = pool.new_sequence()
    ids = list(range(12))
    compute(s, ids)
    cache.register(s)
    assert cache.match(ids) == (s.block_table[:2], 8)        # 12 = 3 full blocks, capped at 8
    assert cache.match(ids + [99]) == (s.block_table[:3], 12)
    assert cache.match(ids[:5]) == (s.block_table[:1], 4)
    assert cache.match(ids[:4]) == ([], 0)
    assert cache.match([]) == ([], 0)
    assert cache.match([1] + ids) == ([], 0)                 # keys cover the whole prefix
    other = list(ids)
    other[5] = 77
    assert cache.match(other + [1]) == (s.block_table[:1], 4)  # diverges inside block 2
    with pytest.raises(ValueError):
        cache.match([-1, 2, 3])


def test_attach_reuses_cached_kv_and_computes_only_the_rest():
    pool, cache = new_pool()
    a = pool.new_sequence()
    system = list(range(50, 60))  # 10 tokens: 2 full blocks + 2
    compute(a, system + [1, 2])
    cache.register(a)
    b = pool.new_sequence()
    prompt = system + [7, 7, 7]
    assert cache.lookup(b, prompt) == 8
    assert b.block_table == a.block_table[:2] and b.tokens == prompt[:8]
    assert [pool.refcount(x) for x in b.block_table] == [2, 2]
    free0 = pool.free_blocks
    compute(b, prompt)  # positions 8..12: new blocks only, nothing copied
    assert pool.free_blocks == free0 - 2
    assert_holds(b, prompt)
    assert_holds(a, system + [1, 2])
    st = cache.stats()
    assert (st.lookups, st.hits, st.misses, st.hit_tokens) == (1, 1, 0, 8)
    pool.check()
    cache.check()


def test_writing_into_a_cached_block_copies_it():
    pool, cache = new_pool()
    a = pool.new_sequence()
    ids = list(range(8))
    compute(a, ids)
    cache.register(a)
    cached = list(a.block_table)
    a.truncate(6)                 # inside the second (cached) block, which a alone holds
    assert pool.refcount(cached[1]) == 1 and pool.is_cached(cached[1])
    compute(a, ids[:6] + [40, 41])
    assert a.block_table[1] != cached[1]            # copied, not overwritten
    assert pool.block_state(cached[1]) == "cached"  # still resident, unreferenced
    b = pool.new_sequence()
    assert cache.lookup(b, ids + [0]) == 8          # the original prefix still matches, intact
    assert_holds(b, ids)
    assert_holds(a, ids[:6] + [40, 41])
    pool.check()


def test_lru_eviction_order_and_index_removal():
    pool, cache = new_pool(n_blocks=6)
    s1, s2 = pool.new_sequence(), pool.new_sequence()
    compute(s1, [1] * 8)
    compute(s2, [2] * 8)
    cache.register(s1)
    cache.register(s2)
    a0, a1 = s1.block_table
    b0, b1 = s2.block_table
    s1.free()  # tail first: a1 becomes less recently used than a0
    s2.free()
    assert list(pool._evictable) == [a1, a0, b1, b0]
    assert pool.free_blocks == 2 and pool.evictable_blocks == 4
    # reusing s1's prefix makes its blocks most recently used once released again
    s3 = pool.new_sequence()
    assert cache.lookup(s3, [1] * 8 + [5]) == 8
    assert pool.evictable_blocks == 2
    s3.free()
    assert list(pool._evictable) == [b1, b0, a1, a0]
    # an allocation of 4 blocks: both free ones, then b1 and b0 (LRU first)
    s4 = pool.new_sequence()
    s4.reserve(16)
    assert pool.evictions == 2 and cache.stats().evictions == 2
    assert not cache.is_cached(b0) and not cache.is_cached(b1)
    assert cache.is_cached(a0) and cache.is_cached(a1)
    assert cache.match([2] * 8 + [0]) == ([], 0)
    assert cache.match([1] * 8 + [0]) == ([a0, a1], 8)
    s4.reserve(20)  # one block more: a1 (the tail of the chain) goes before a0
    assert not cache.is_cached(a1) and cache.is_cached(a0)
    assert cache.match([1] * 8 + [0]) == ([a0], 4)
    pool.check()
    cache.check()


def test_full_pool_evicts_only_unreferenced_blocks():
    pool, cache = new_pool(n_blocks=4)
    held = pool.new_sequence()
    compute(held, [3] * 8)
    cache.register(held)  # cached and referenced: not evictable
    gone = pool.new_sequence()
    compute(gone, [4] * 8)
    cache.register(gone)
    gone.free()           # cached, unreferenced: evictable
    s = pool.new_sequence()
    s.reserve(8)          # takes the two evictable blocks
    with pytest.raises(ContextFull):
        pool.new_sequence().reserve(1)
    assert_holds(held, [3] * 8)
    assert cache.match([3] * 8 + [0])[1] == 8
    pool.check()
    cache.check()


def test_same_prefix_computed_twice_keeps_one_cached_copy():
    pool, cache = new_pool()
    a, b = pool.new_sequence(), pool.new_sequence()
    compute(a, [9] * 8)
    compute(b, [9] * 8)
    assert cache.register(a) == 2
    assert cache.register(b) == 0
    assert cache.register(a) == 0  # registering again is fine
    assert cache.stats().cached_blocks == 2
    assert not any(cache.is_cached(x) for x in b.block_table)
    free0 = pool.free_blocks
    b.free()
    assert pool.free_blocks == free0 + 2  # b's copies were not cached: straight back to free
    pool.check()
    cache.check()


def test_clear_returns_unreferenced_blocks_and_keeps_held_ones():
    pool, cache = new_pool(n_blocks=8)
    a, b = pool.new_sequence(), pool.new_sequence()
    compute(a, [1] * 8)
    compute(b, [2] * 8)
    cache.register(a)
    cache.register(b)
    b.free()
    assert (pool.free_blocks, pool.evictable_blocks) == (4, 2)
    cache.clear()
    assert (pool.free_blocks, pool.evictable_blocks, cache.stats().cached_blocks) == (6, 0, 0)
    assert_holds(a, [1] * 8)
    a.reserve(1)  # a's blocks are plain again: no copy of the last block needed
    assert pool.free_blocks == 5
    a.free()
    assert pool.free_blocks == 8
    pool.check()
    cache.check()


def test_attach_checks_its_blocks():
    pool, cache = new_pool(n_blocks=4)
    a = pool.new_sequence()
    compute(a, [1] * 8)
    cache.register(a)
    blocks, n = cache.match([1] * 8 + [2])
    with pytest.raises(KVInvariantError):
        cache.attach(pool.new_sequence(), blocks[::-1], n)  # not a chain from the root
    with pytest.raises(KVInvariantError):
        cache.attach(pool.new_sequence(), blocks, n - 1)
    with pytest.raises(KVInvariantError):
        cache.attach(a, blocks, n)  # a is not empty
    a.free()
    pool.new_sequence().reserve(16)  # evicts both
    with pytest.raises(KVInvariantError, match="not cached"):
        cache.attach(pool.new_sequence(), blocks, n)
    with pytest.raises(ConfigError):
        PrefixCache(pool)  # one cache per pool
    pool.check()


def test_miss_statistics():
    pool, cache = new_pool()
    cache.match([1, 2, 3, 4, 5])
    s = pool.new_sequence()
    assert cache.lookup(s, [1, 2, 3]) == 0 and s.n_tokens == 0
    st = cache.stats()
    assert (st.lookups, st.hits, st.misses, st.hit_tokens, st.cached_blocks) == (2, 0, 2, 0, 0)


@PROPERTY
@given(data=examples)
def test_pool_with_prefix_cache_random_operations_match_model(data):
    cfg, ops = decode(data)
    run_ops(Harness(*cfg, with_cache=True), ops)
