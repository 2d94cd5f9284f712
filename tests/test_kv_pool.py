"""KV block pool (edgellm/kv/pool.py): layout, precision round trips, copy-on-write, ContextFull,
truncate/free accounting, and a property test of random operation sequences against a plain
Python model (each sequence a list of token ids; the K/V rows of a position are a fixed function
of its prefix, so the model needs no arena of its own).

EDGELLM_PROPERTY_EXAMPLES sets the number of random sequences per property test (default 10000).
The harness (`run_ops`) is shared with tests/test_kv_prefix.py, which adds the prefix cache."""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgellm.errors import ConfigError, ContextFull
from edgellm.kv.pool import KVInvariantError, KVPool, f16_to_f32, quantize_int8
from edgellm.kv.prefix import PrefixCache

settings.register_profile(
    "edgellm-property",
    max_examples=int(os.environ.get("EDGELLM_PROPERTY_EXAMPLES", "10000")),
    deadline=None,
    database=None,  # keep the checkout clean; a failure prints its falsifying example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROPERTY = settings.get_profile("edgellm-property")


def rows(rng, t, kvh=2, hd=4, scale=1.0):
    return (rng.standard_normal((t, kvh, hd)) * scale).astype(np.float32)


def filled(precision="f32", n_layers=2, kvh=2, hd=4, n_blocks=8, bt=4, n=10, seed=0):
    """A pool and one sequence of n committed tokens; returns (pool, seq, K, V) with K, V
    (layers, n, kvh, hd) as written."""
    rng = np.random.default_rng(seed)
    pool = KVPool(n_layers, kvh, hd, n_blocks, bt, precision)
    seq = pool.new_sequence()
    seq.reserve(n)
    K = np.stack([rows(rng, n, kvh, hd) for _ in range(n_layers)])
    V = np.stack([rows(rng, n, kvh, hd) for _ in range(n_layers)])
    for layer in range(n_layers):
        seq.write(layer, 0, K[layer], V[layer])
    seq.commit(n, range(n))
    return pool, seq, K, V


# ---- layout, configuration ---------------------------------------------------------------------

@pytest.mark.parametrize("precision,itemsize", [("f32", 4), ("f16", 2), ("int8", 1)])
def test_layout_and_nbytes(precision, itemsize):
    pool = KVPool(3, 2, 8, 5, 4, precision)
    assert pool.k.shape == pool.v.shape == (5, 3, 4, 2, 8)  # (blocks, layers, block_tokens, kvh, hd)
    assert pool.k.dtype.itemsize == itemsize
    if precision == "int8":
        assert pool.k_scale.shape == pool.v_scale.shape == (5, 3, 4, 2)
    assert pool.nbytes == KVPool.nbytes_for(3, 2, 8, 5, 4, precision)
    extra = 2 * 5 * 3 * 4 * 2 * 4 if precision == "int8" else 0
    assert pool.nbytes == 2 * 5 * 3 * 4 * 2 * 8 * itemsize + extra
    assert (pool.n_blocks, pool.block_tokens, pool.free_blocks) == (5, 4, 5)
    assert pool.new_sequence().slides is False


@pytest.mark.parametrize("kwargs", [dict(n_blocks=0), dict(block_tokens=0), dict(head_dim=-1),
                                    dict(precision="bf16"), dict(n_layers=2.0)])
def test_bad_configuration_is_a_config_error(kwargs):
    args = dict(n_layers=2, n_kv_heads=2, head_dim=4, n_blocks=4, block_tokens=4, precision="f16")
    args.update(kwargs)
    with pytest.raises(ConfigError):
        KVPool(**args)
    with pytest.raises(ConfigError):
        KVPool.nbytes_for(**args)


# ---- precision -------------------------------------------------------------------------------

def test_f32_round_trip_is_exact():
    pool, seq, K, V = filled("f32", n=13)
    for layer in range(2):
        k, v = seq.read(layer, 13)
        assert k.shape == v.shape == (2, 13, 4) and k.dtype == np.float32
        np.testing.assert_array_equal(k, K[layer].transpose(1, 0, 2))
        np.testing.assert_array_equal(v, V[layer].transpose(1, 0, 2))


def test_f16_round_trip_is_float16_rounding():
    pool, seq, K, V = filled("f16", n=13)
    for layer in range(2):
        k, v = seq.read(layer, 13)
        np.testing.assert_array_equal(k, K[layer].astype(np.float16).astype(np.float32).transpose(1, 0, 2))
        np.testing.assert_array_equal(v, V[layer].astype(np.float16).astype(np.float32).transpose(1, 0, 2))


def test_f16_to_f32_is_exact_on_every_bit_pattern():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(4, 128, 128)
    out = np.empty(bits.shape, dtype=np.float32)
    f16_to_f32(bits, out, (np.empty(bits.shape, np.uint32), np.empty(bits.shape, bool)))
    ref = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.isnan(out[nan]).all()
    np.testing.assert_array_equal(out[~nan].view(np.uint32), ref[~nan].view(np.uint32))  # signed zeros too


def test_f16_large_read_takes_the_bit_path_exactly():
    from edgellm.kv.pool import F16_BITS_MIN
    rng = np.random.default_rng(5)
    pool = KVPool(1, 2, 64, 4, 16, "f16")
    seq = pool.new_sequence()
    n = 40
    assert 2 * n * 64 >= F16_BITS_MIN
    seq.reserve(n)
    K = rows(rng, n, 2, 64)
    K[3, 0, :4] = [1e5, -1e5, np.nan, 1e-6]  # overflow to inf, NaN, float16 subnormal
    with np.errstate(over="ignore", invalid="ignore"):
        seq.write(0, 0, K, -K)
        want = K.astype(np.float16).astype(np.float32).transpose(1, 0, 2)
    seq.commit(n, range(n))
    k, v = seq.read(0, n)
    np.testing.assert_array_equal(k, want)  # NaNs compare equal here
    np.testing.assert_array_equal(v, -want)


def test_int8_error_bound():
    """Symmetric per (token, head): |x - x^| <= scale / 2 = amax / 254 per element, within the
    stated bound of amax / 127 of its row (the head_dim values of one token and head)."""
    rng = np.random.default_rng(3)
    pool = KVPool(1, 2, 16, 4, 4, "int8")
    seq = pool.new_sequence()
    seq.reserve(12)
    # rows of very different magnitudes, an outlier, and an all-zero row
    K = rows(rng, 12, 2, 16) * np.logspace(-3, 3, 12, dtype=np.float32)[:, None, None]
    K[4, 1, 3] = 1e4
    K[7, 0] = 0.0
    K[9, 1] = np.linspace(-1e-39, 5e-40, 16)  # subnormal: the scale itself loses precision
    V = -K[::-1].copy()
    seq.write(0, 0, K, V)
    seq.commit(12, range(12))
    k, v = seq.read(0, 12)
    for got, want in ((k, K), (v, V)):
        want = want.transpose(1, 0, 2)
        amax = np.abs(want).max(axis=-1, keepdims=True)
        err = np.abs(got - want)
        assert (err <= amax / 127).all()
        normal = amax >= 1e-30
        assert (err <= amax / 254 * (1 + 1e-5))[normal[..., 0]].all()  # what rounding gives
    assert (k[0, 7] == 0).all()


def test_int8_append_never_requantizes_earlier_tokens():
    rng = np.random.default_rng(4)
    pool = KVPool(1, 2, 4, 2, 8, "int8")
    seq = pool.new_sequence()
    seq.reserve(1)
    small = rows(rng, 1, scale=1e-3)
    seq.write(0, 0, small, small)
    seq.commit(1, [0])
    before = [a.copy() for a in seq.read(0, 1)]
    seq.reserve(1)
    seq.write(0, 1, rows(rng, 1, scale=1e3), rows(rng, 1, scale=1e3))  # same block, huge amax
    seq.commit(2, [1])
    after = seq.read(0, 2)
    np.testing.assert_array_equal(after[0][:, :1], before[0])
    np.testing.assert_array_equal(after[1][:, :1], before[1])


def test_quantize_int8_zero_row_has_zero_scale():
    q, s = quantize_int8(np.zeros((3, 2, 4), np.float32))
    assert (q == 0).all() and (s == 0).all()


@pytest.mark.parametrize("precision", ["f32", "f16", "int8"])
def test_read_into_caller_buffers(precision):
    pool, seq, K, V = filled(precision, n=11)
    bufs = (np.full((2, 32, 4), np.nan, np.float32), np.full((2, 32, 4), np.nan, np.float32))
    for layer in range(2):
        k, v = seq.read(layer, 11, out=bufs)
        assert np.shares_memory(k, bufs[0]) and np.shares_memory(v, bufs[1])
        k2, v2 = seq.read(layer, 11)
        np.testing.assert_array_equal(k, k2)
        np.testing.assert_array_equal(v, v2)
    assert seq.read(0, 7)[0].shape == (2, 7, 4)
    assert seq.read(0, 0)[0].shape == (2, 0, 4)
    with pytest.raises(ValueError):
        seq.read(0, 11, out=(np.empty((2, 8, 4), np.float32),) * 2)
    with pytest.raises(ValueError):
        seq.read(0, 11, out=(np.empty((2, 16, 4), np.float64),) * 2)
    with pytest.raises(KVInvariantError):
        seq.read(0, seq.capacity + 1)


# ---- sharing, copy-on-write --------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["f32", "f16", "int8"])
def test_fork_then_write_copies_the_shared_block(precision):
    pool, a, K, V = filled(precision, n=10, bt=4)   # blocks: 0..3, 4..7, 8..9 (+ room)
    want = [a.read(layer, 10) for layer in range(2)]
    b = a.fork()
    assert b.block_table == a.block_table and b.tokens == a.tokens and b.n_tokens == 10
    assert all(pool.refcount(x) == 2 for x in a.block_table)
    free0 = pool.free_blocks
    b.reserve(3)  # positions 10..12: writes the partial third block (shared) and a new fourth
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert pool.refcount(a.block_table[2]) == 1 and pool.refcount(b.block_table[2]) == 1
    assert pool.free_blocks == free0 - 2
    rng = np.random.default_rng(9)
    for layer in range(2):
        b.write(layer, 10, rows(rng, 3), rows(rng, 3))
    b.commit(13, [7, 8, 9])
    for layer in range(2):  # a is unchanged; b's copied block kept a's first 10 positions
        got_a, got_b = a.read(layer, 10), b.read(layer, 10)
        for x, y, w in zip(got_a, got_b, want[layer]):
            np.testing.assert_array_equal(x, w)
            np.testing.assert_array_equal(y, w)
    pool.check()


def test_writing_a_shared_or_unreserved_block_is_refused():
    pool, a, K, V = filled("f32", n=10, bt=4)
    b = a.fork()
    one = np.zeros((1, 2, 4), np.float32)
    with pytest.raises(KVInvariantError, match="shared"):
        b.write(0, 10, one, one)  # block 2 is shared and b did not reserve
    with pytest.raises(KVInvariantError, match="reserved"):
        a.write(0, a.capacity, one, one)
    with pytest.raises(ValueError):
        a.write(0, 0, np.zeros((1, 3, 4), np.float32), np.zeros((1, 3, 4), np.float32))
    np.testing.assert_array_equal(a.read(0, 10)[0], K[0].transpose(1, 0, 2))


def test_fork_reservations_are_copied_on_write_too():
    pool = KVPool(1, 2, 4, 8, 4, "f32")
    a = pool.new_sequence()
    a.reserve(8)           # two reserved blocks, nothing committed
    b = a.fork()           # shares both
    b.reserve(8)
    assert set(a.block_table).isdisjoint(b.block_table)
    pool.check()


# ---- ContextFull -------------------------------------------------------------------------------

def snapshot(pool, seqs):
    return ([list(s.block_table) for s in seqs], [s.n_tokens for s in seqs], list(pool._ref),
            sorted(pool._free), list(pool._evictable))


def test_context_full_reports_figures_and_changes_nothing():
    pool, a, K, V = filled("f16", n=10, n_blocks=4, bt=4)  # 3 of 4 blocks used
    b = a.fork()
    before = snapshot(pool, [a, b])
    with pytest.raises(ContextFull) as e:
        a.reserve(6)  # positions 10..15: copy of block 2 + one new block = 2 needed, 1 free
    msg = str(e.value)
    assert "2 more blocks of 4 tokens needed" in msg and "1 free" in msg and "of 4" in msg
    assert (e.value.needed_blocks, e.value.free_blocks, e.value.block_tokens) == (2, 1, 4)
    assert snapshot(pool, [a, b]) == before
    for layer in range(2):
        np.testing.assert_array_equal(b.read(layer, 10)[0], a.read(layer, 10)[0])
    a.reserve(2)  # one copy fits
    pool.check()
    with pytest.raises(ContextFull):
        pool.new_sequence().reserve(1)


def test_full_pool_never_hands_out_a_referenced_block():
    pool = KVPool(1, 1, 2, 3, 2, "f32")
    seqs = []
    for i in range(3):
        s = pool.new_sequence()
        s.reserve(2)
        s.write(0, 0, np.full((2, 1, 2), i, np.float32), np.full((2, 1, 2), -i, np.float32))
        s.commit(2, [i, i])
        seqs.append(s)
    with pytest.raises(ContextFull):
        pool.new_sequence().reserve(1)
    for i, s in enumerate(seqs):
        assert (s.read(0, 2)[0] == i).all() and (s.read(0, 2)[1] == -i).all()


# ---- truncate / free / commit ------------------------------------------------------------------

def test_truncate_and_free_return_blocks():
    pool, a, K, V = filled("f32", n=10, n_blocks=8, bt=4)
    assert pool.free_blocks == 5
    a.reserve(6)  # to 16: block 2 gets its tail, block 3 is new
    assert pool.free_blocks == 4
    a.truncate(10)  # drops the uncommitted reservation (a cancelled chunk)
    assert pool.free_blocks == 5 and a.capacity == 12 and a.n_tokens == 10
    a.truncate(8)   # block boundary: block 2 is released
    assert pool.free_blocks == 6 and a.tokens == list(range(8))
    a.truncate(5)   # inside block 1: kept
    assert pool.free_blocks == 6 and a.n_tokens == 5
    np.testing.assert_array_equal(a.read(1, 5)[0], K[1, :5].transpose(1, 0, 2))
    a.free()
    a.free()  # idempotent
    assert pool.free_blocks == 8 and a.n_tokens == 0 and a.block_table == [] and pool.live_sequences == 0
    with pytest.raises(ValueError):
        a.truncate(1)
    a.reserve(1)  # reusable after free
    assert pool.free_blocks == 7
    pool.check()


def test_commit_checks_its_arguments():
    pool = KVPool(1, 1, 2, 4, 4, "f32")
    s = pool.new_sequence()
    s.reserve(3)
    with pytest.raises(ValueError):
        s.commit(3, [1, 2])
    with pytest.raises(KVInvariantError):
        s.commit(5, range(5))
    s.commit(2, np.array([5, 6]))
    assert s.tokens == [5, 6] and isinstance(s.tokens[0], int)
    with pytest.raises(KVInvariantError):
        s.commit(1, [])
    with pytest.raises(ValueError):
        s.reserve(-1)


# ---- property test: random operation sequences against a plain model ---------------------------

TABLE_ROWS = 1024
# The K/V of a position are TABLE[hash of its prefix]: (rows, layers<=2, k|v, kvh<=2, hd<=3).
TABLE = np.random.default_rng(12345).standard_normal((TABLE_ROWS, 2, 2, 2, 3)).astype(np.float32)
VOCAB = 3       # few distinct ids, so prefixes repeat and the cache gets hits
MAX_LIVE = 4


@functools.lru_cache(maxsize=None)
def tables(precision, n_layers, kvh, hd):
    """The rows written for these dimensions, and what the pool should give back for them."""
    table = TABLE[:, :n_layers, :, :kvh, :hd]
    if precision == "f16":
        return table, table.astype(np.float16).astype(np.float32)
    if precision == "int8":
        q, s = quantize_int8(table)
        return table, q.astype(np.float32) * s[..., None]
    return table, table


class Harness:
    """Drives a pool (and optionally a prefix cache) and a plain model side by side, checking
    after every operation that every live sequence reads exactly what the model holds and that
    the block accounting adds up."""

    def __init__(self, precision, n_layers, kvh, hd, n_blocks, bt, with_cache):
        self.pool = KVPool(n_layers, kvh, hd, n_blocks, bt, precision)
        self.cache = PrefixCache(self.pool) if with_cache else None
        self.table, self.expect = tables(precision, n_layers, kvh, hd)
        self.tol = 0.0 if precision != "int8" else 1e-6
        self.live = []   # [seq, model] where model = [token ids, row per position]
        self.seen = []   # token lists that were computed (prompts for later lookups)
        self.salt = 0    # pool-only runs give every extension its own data
        self.with_cache = with_cache
        self.bt = bt

    def row_after(self, prev, tok, salt):
        return (prev * 1000003 + tok * 7919 + salt * 104729 + 1) % (1 << 61)

    def extend_model(self, model, toks, salt):
        hs = model[1]
        for t in toks:
            hs.append(self.row_after(hs[-1] if hs else 0, t, salt))
        model[0].extend(toks)

    def rows_for(self, model, start, end):
        return np.asarray(model[1][start:end], dtype=np.int64) % TABLE_ROWS

    # -- operations --

    def needed_blocks(self, seq, t):
        bt, pool = self.bt, self.pool
        first, end = seq.n_tokens // bt, -(-(seq.n_tokens + t) // bt)
        table = seq.block_table
        cow = [table[i] for i in range(first, min(end, len(table)))
               if pool.refcount(table[i]) > 1 or pool.is_cached(table[i])]
        return len(cow) + max(0, end - len(table))

    def reserve_fits(self, seq, t):
        """Whether reserve(t) must succeed: every block at once, or, one short of that, copies
        made one at a time, each giving back a block this sequence alone held."""
        bt, pool = self.bt, self.pool
        first, end = seq.n_tokens // bt, -(-(seq.n_tokens + t) // bt)
        table = seq.block_table
        cow = [table[i] for i in range(first, min(end, len(table)))
               if pool.refcount(table[i]) > 1 or pool.is_cached(table[i])]
        need, avail = self.needed_blocks(seq, t), pool.available_blocks
        own = sum(1 for b in cow if pool.refcount(b) == 1)
        return need <= avail or (bool(cow) and avail >= 1 and avail + own >= need)

    def extend(self, i, toks, cancel_after=None):
        """Reserve, write every layer, commit (or, with cancel_after, write that many layers and
        roll back like a cancelled chunk). Returns False when the pool was full."""
        seq, model = self.live[i]
        t = len(toks)
        need = self.needed_blocks(seq, t)
        avail = self.pool.available_blocks
        fits = self.reserve_fits(seq, t)
        before = snapshot(self.pool, [s for s, _ in self.live])
        lru = list(self.pool._evictable)
        ev0 = self.pool.evictions
        try:
            seq.reserve(t)
        except ContextFull:
            assert not fits, (need, avail)
            assert snapshot(self.pool, [s for s, _ in self.live]) == before
            return False
        assert fits, (need, avail)
        if need <= avail:   # (one copy at a time reuses the blocks it gives back: another order)
            evicted = self.pool.evictions - ev0
            assert evicted == max(0, need - before[3].__len__())
            assert all(not self.pool.is_cached(b) for b in lru[:evicted])  # the least recently used went
            assert all(self.pool.is_cached(b) for b in lru[evicted:])
        salt = 0 if self.with_cache else self.salt
        self.salt += 1
        trial = [list(model[0]), list(model[1])]
        self.extend_model(trial, toks, salt)
        r = self.rows_for(trial, seq.n_tokens, seq.n_tokens + t)
        start = seq.n_tokens
        layers = range(self.pool.n_layers) if cancel_after is None else range(cancel_after)
        for layer in layers:
            seq.write(layer, start, self.table[r, layer, 0], self.table[r, layer, 1])
        if cancel_after is not None:
            seq.truncate(seq.n_tokens)
            assert seq.capacity == -(-seq.n_tokens // self.bt) * self.bt
            return True
        seq.commit(start + t, toks)
        model[0], model[1] = trial
        self.seen.append(list(model[0]))
        return True

    def new(self, prompt=None):
        seq = self.pool.new_sequence()
        model = [[], []]
        if prompt is not None:
            blocks, n = self.cache.match(prompt)
            assert n == len(blocks) * self.bt and (n < len(prompt) or n == 0)
            self.cache.attach(seq, blocks, n)
            self.extend_model(model, prompt[:n], 0)
            assert seq.n_tokens == n and seq.tokens == prompt[:n] and seq.block_table == blocks
        self.live.append([seq, model])
        return len(self.live) - 1

    def fork(self, i):
        seq, model = self.live[i]
        self.live.append([seq.fork(), [list(model[0]), list(model[1])]])

    def truncate(self, i, n):
        seq, model = self.live[i]
        seq.truncate(n)
        del model[0][n:], model[1][n:]

    def free(self, i):
        seq, _ = self.live.pop(i)
        seq.free()
        assert seq.block_table == [] and seq.n_tokens == 0

    # -- the checks --

    def check(self):
        pool, bt = self.pool, self.bt
        pool.check()
        if self.cache is not None:
            self.cache.check()
        holders = [0] * pool.n_blocks
        for seq, model in self.live:
            assert seq.n_tokens == len(model[0]) and seq.tokens == model[0]
            assert len(seq.block_table) >= -(-seq.n_tokens // bt)
            for b in seq.block_table:
                holders[b] += 1
            n = seq.n_tokens
            if n == 0:
                continue
            want = self.expect[self.rows_for(model, 0, n)].transpose(1, 2, 3, 0, 4)  # (L, k|v, KVH, n, hd)
            for layer in range(pool.n_layers):
                k, v = seq.read(layer, n)
                # plain comparisons: np.testing's helpers would dominate the run time
                if self.tol:
                    assert max(np.abs(k - want[layer, 0]).max(), np.abs(v - want[layer, 1]).max()) <= self.tol
                else:
                    assert (k == want[layer, 0]).all() and (v == want[layer, 1]).all(), (layer, n)
        assert holders == [pool.refcount(b) for b in range(pool.n_blocks)]
        free = set(pool._free)
        assert len(free) == pool.free_blocks
        assert all(holders[b] == 0 for b in free)
        states = [pool.block_state(b) for b in range(pool.n_blocks)]
        assert states.count("free") == len(free)
        assert states.count("referenced") == sum(1 for h in holders if h)
        assert len(free) + states.count("referenced") + states.count("cached") == pool.n_blocks
        assert states.count("cached") == pool.evictable_blocks
        if self.cache is not None:
            cached = [b for b in range(pool.n_blocks) if self.cache.is_cached(b)]
            assert self.cache.stats().cached_blocks == len(cached)
            assert all(states[b] != "free" for b in cached)


# the kind byte picks from this table, so repeats set the mix
OPS = ("new", "extend", "extend", "extend", "cancel", "fork", "fork", "truncate", "free", "register",
       "lookup", "lookup", "clear")


def run_ops(h: Harness, ops) -> None:
    bt = h.bt
    for kind, arg in ops:
        kind = OPS[kind % len(OPS)]
        if not h.with_cache and kind in ("register", "lookup", "clear"):
            kind = "extend"
        n = len(h.live)
        i = arg % n if n else None
        toks = [(arg >> (4 + 2 * j)) % VOCAB for j in range(1 + (arg >> 2) % (2 * bt + 1))]
        if kind == "new" or (i is None and kind != "clear"):
            if n < MAX_LIVE:
                h.new()
        elif kind == "extend":
            if h.extend(i, toks) and h.with_cache and arg & 0x8000:
                h.cache.register(h.live[i][0])
        elif kind == "cancel":
            h.extend(i, toks, cancel_after=(arg >> 12) % h.pool.n_layers)
        elif kind == "fork":
            if n < MAX_LIVE:
                h.fork(i)
        elif kind == "truncate":
            h.truncate(i, (arg >> 3) % (h.live[i][0].n_tokens + 1))
        elif kind == "free":
            if h.with_cache and arg & 0x10:  # a finished request offers its blocks first
                h.cache.register(h.live[i][0])
            h.free(i)
        elif kind == "register":
            h.cache.register(h.live[i][0])
        elif kind == "lookup":
            if n < MAX_LIVE and h.seen:
                base = h.seen[(arg >> 3) % len(h.seen)]
                prompt = base[: (arg >> 6) % (len(base) + 1)] + toks
                j = h.new(prompt)
                h.extend(j, prompt[h.live[j][0].n_tokens:])
                if arg & 4:
                    h.cache.register(h.live[j][0])
        elif kind == "clear":
            if arg % 4 == 0:
                h.cache.clear()
        h.check()
    for i in range(len(h.live) - 1, -1, -1):  # everything back: free list + cached = all blocks
        h.free(i)
        h.check()
    assert h.pool.free_blocks + h.pool.evictable_blocks == h.pool.n_blocks


# (precision, n_layers, kv_heads, head_dim, n_blocks, block_tokens). hypothesis favours the first
# choice of a sampled_from, so the lists start with a middling pool rather than the smallest
MAX_OPS = 24
# One byte string per example: 2 bytes of configuration, then 3 bytes an operation (kind, 16-bit
# argument). A single draw keeps hypothesis's own cost per example low (~1 ms here), and the
# minimum length keeps sequences from being trivially short (left to itself hypothesis draws
# very short strings); it still shrinks toward short, low-valued sequences.
examples = st.binary(min_size=2 + 3 * 4, max_size=2 + 3 * MAX_OPS)
# zero bytes (where shrinking goes) pick a middling pool, not the smallest
PRECISION_CHOICES, LAYERS, KV_HEADS, HEAD_DIMS = ("f16", "int8", "f32"), (2, 1), (2, 1), (3, 1, 2)
N_BLOCKS, BLOCK_TOKENS = (7, 2, 12, 4, 9, 3, 6, 10, 5, 8, 11), (2, 1, 4, 3)


def decode(data: bytes) -> tuple[tuple, list[tuple[int, int]]]:
    """(precision, n_layers, kv_heads, head_dim, n_blocks, block_tokens), [(kind, arg), ...]"""
    a, b = data[0], data[1]
    cfg = (PRECISION_CHOICES[a % 3], LAYERS[a // 3 % 2], KV_HEADS[a // 6 % 2], HEAD_DIMS[a // 12 % 3],
           N_BLOCKS[b % 11], BLOCK_TOKENS[b // 11 % 4])
    ops = [(data[j], data[j + 1] | data[j + 2] << 8) for j in range(2, len(data) - 2, 3)]
    return cfg, ops


@PROPERTY
@given(data=examples)
def test_pool_random_operations_match_model(data):
    cfg, ops = decode(data)
    run_ops(Harness(*cfg, with_cache=False), ops)
