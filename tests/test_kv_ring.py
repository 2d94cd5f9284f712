"""Ring-buffer KV cache (edgellm/kv/ring.py): property tests of random operation sequences against a
plain list model, RoPE/attention equivalence with the pool path, and flat memory.

The list model is the whole sequence of token ids; the ring must hold exactly its first `sinks`
ids, then its last `window - sinks`, in that order. Each token's K/V rows are a function of its id,
so reading the ring is checked row for row.

EDGELLM_PROPERTY_EXAMPLES sets the number of random operation sequences (default 10000)."""
from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgellm.backends import reference
from edgellm.errors import ConfigError
from edgellm.kv.pool import KVPool, quantize_int8
from edgellm.kv.ring import RingIndex, RingKV
from edgellm.model.config import ModelConfig

EXAMPLES = int(os.environ.get("EDGELLM_PROPERTY_EXAMPLES", "10000"))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

L, KVH, HD = 2, 2, 2   # tiny dims: the bookkeeping, not the arithmetic, is under test
MAX_ID = 4096          # token ids a test may use (a sequence draws at most 12 chunks of <= 12)


def _tables():
    """Every token's K and V rows, distinct per token, layer, head and dim. Per precision, the
    (L, 2 * KVH, MAX_ID, HD) float32 rows a read must give (K heads then V heads; f16 rounded
    through float16), and the float32 rows written."""
    k = (np.arange(MAX_ID, dtype=np.float64)[None, None, :, None] * (L * KVH * HD)
         + np.arange(L * KVH * HD, dtype=np.float64).reshape(L, KVH, 1, HD))
    kv = np.concatenate([k, -k - 0.5], axis=1).astype(np.float32)
    q, scale = quantize_int8(kv)                               # per (layer, head, token) row, as written
    return {"f32": kv, "f16": kv.astype(np.float16).astype(np.float32),
            "int8": q.astype(np.float32) * scale[..., None]}


TABLES = _tables()
WRITE_K = np.ascontiguousarray(TABLES["f32"][:, :KVH].transpose(0, 2, 1, 3))   # (L, MAX_ID, KVH, HD)
WRITE_V = np.ascontiguousarray(TABLES["f32"][:, KVH:].transpose(0, 2, 1, 3))   # (L, MAX_ID, KVH, HD)


def rows(ids, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(T, KVH, HD) float32 K and V rows of tokens `ids`."""
    return WRITE_K[layer, ids], WRITE_V[layer, ids]


def window_of(seq: list[int], sinks: int, cap: int) -> list[int]:
    """What the ring must hold for the sequence `seq`."""
    return seq[:sinks] + seq[sinks:][-cap:] if len(seq) > sinks else list(seq)


def expect_read(ring: RingKV, held: list[int], layers=range(L), prefix: int | None = None) -> None:
    """read() of each layer gives the rows of `held` in order (or of its first `prefix`)."""
    n = len(held) if prefix is None else prefix
    want = TABLES[ring.precision][layers[0] : layers[-1] + 1, :, held[:n]] if len(layers) else None
    got = []
    for layer in layers:
        k, v = ring.read(layer, n)
        assert k.dtype == np.float32 and v.dtype == np.float32 and k.shape == v.shape == (KVH, n, HD)
        got += (k, v)
    if got:   # one comparison for every layer: (layers, 2 * KVH, n, HD)
        assert (np.concatenate(got).reshape(want.shape) == want).all(), (list(layers), held, n)


def expect_committed(ring: RingKV, seq: list[int]) -> None:
    held = window_of(seq, ring.sinks, ring.max_chunk)
    assert ring.n_reserved == 0
    assert ring.n_tokens == len(held) <= ring.window
    assert ring.total_tokens == len(seq)
    assert ring.tokens == held
    expect_read(ring, held)


def truncate_is_exact(seq: list[int], held: list[int], m: int) -> bool:
    return 0 <= m <= len(held) and (m == len(held) or held[:m] == seq[:m])


# ---- the operation sequences -------------------------------------------------------------------
# Hypothesis draws each sequence as bytes (one draw, so 10,000 sequences stay cheap) that decode
# into operations, 4 bytes each; shrinking bytes shrinks the sequence. A failure prints the
# decoded operations.

CHUNK, TRUNCATE, FREE = "chunk", "truncate", "free"
NO_CANCEL, CANCEL_CHUNK, CANCEL_TO = "commit", "cancel", "cancel+truncate"


def decode_ops(raw: bytes, cap: int) -> list[tuple]:
    """4 bytes per operation: b0 picks the kind (chunk 80%, truncate 15%, free 5%); a chunk takes
    its size from b1, its ending from b2 (commit 75%, cancel, cancel then truncate) with the
    layers written before a cancel, and b3 seeds where its write splits and where it truncates."""
    ops = []
    for i in range(0, len(raw) - 3, 4):
        b0, b1, b2, b3 = raw[i : i + 4]
        if b0 < 205:
            t = 1 + b1 % cap
            end = NO_CANCEL if b2 < 192 else CANCEL_CHUNK if b2 < 224 else CANCEL_TO
            ops.append((CHUNK, t, end, b2 % (L + 1), b3 % (t + 1), b3))
        elif b0 < 243:
            ops.append((TRUNCATE, b1))
        else:
            ops.append((FREE,))
    return ops


def apply_truncate(ring: RingKV, seq: list[int], m: int) -> list[int]:
    held = window_of(seq, ring.sinks, ring.max_chunk)
    exact = truncate_is_exact(seq, held, m)
    assert ring.can_truncate(m) == exact
    before = ring.index.state
    reserved = ring.n_reserved
    if not exact:
        with pytest.raises(ConfigError):
            ring.truncate(m)
        assert ring.index.state == before and ring.n_reserved == reserved  # refused: nothing changed
        return seq
    ring.truncate(m)
    return seq if m == len(held) else seq[:m]


def run_ops(ring: RingKV, ops: list[tuple]) -> None:
    nbytes, k_buf = ring.nbytes, ring.k
    sinks = ring.sinks
    seq: list[int] = []
    next_id = 0
    for op in ops:
        if op[0] == CHUNK:
            _, t, end, layers_done, split, seed = op
            ids = list(range(next_id, next_id + t))
            next_id += t
            committed_before = ring.n_tokens
            state_before = ring.index.state
            ring.reserve(t)
            assert ring.n_tokens == committed_before and ring.total_tokens == len(seq)  # not committed yet
            held_after = window_of(seq + ids, sinks, ring.max_chunk)
            start = ring.chunk_start(t)
            assert start == len(held_after) - t
            assert ring.positions() == range(start, start + t)
            n_write = L if end == NO_CANCEL else layers_done
            pieces = ((0, split), (split, t)) if seed % 3 == 0 else ((0, t),)   # sometimes in two writes
            for layer in range(n_write):
                for a, b in pieces:
                    if b > a:   # ids are consecutive: their rows are a slice of the table
                        ring.write(layer, start + a, WRITE_K[layer, ids[a] : ids[a] + b - a],
                                   WRITE_V[layer, ids[a] : ids[a] + b - a])
            # what attention sees during the chunk: the window of the sequence with the chunk last
            expect_read(ring, held_after, layers=range(n_write))
            if n_write and seed % 4 == 0:   # a partial read is a prefix of the full one
                expect_read(ring, held_after, layers=range(1), prefix=seed % (len(held_after) + 1))
            if end == NO_CANCEL:
                ring.commit(ring.n_tokens + t, ids)
                seq = seq + ids
                # commit moves no rows (checked just above, all layers): counts and ids suffice
                assert ring.n_reserved == 0 and ring.total_tokens == len(seq)
                assert ring.n_tokens == len(held_after) and ring.tokens == held_after
                continue
            elif end == CANCEL_CHUNK:
                ring.truncate(ring.n_tokens)
                assert ring.index.state == state_before
            else:
                seq = apply_truncate(ring, seq, seed % (committed_before + 1))
                if ring.n_reserved:   # refused: cancel the chunk alone, which is always exact
                    ring.truncate(ring.n_tokens)
                    assert ring.index.state == state_before
        elif op[0] == TRUNCATE:
            seq = apply_truncate(ring, seq, op[1] % (ring.n_tokens + 2))   # n_tokens + 1 is out of range
        else:
            ring.free()
            seq = []
        expect_committed(ring, seq)
    assert ring.nbytes == nbytes and ring.k is k_buf


@PROPERTY
@given(st.binary(min_size=2 + 4 * 3, max_size=2 + 4 * 12))
def test_random_operation_sequences_match_list_model(raw):
    """One draw per sequence (cheap enough for 10,000): byte 0 picks sinks 0..4 and ring capacity
    1..12, byte 1 the precision (f32, f16 or int8); the rest are 3..12 operations."""
    sinks, cap = raw[0] % 5, 1 + (raw[0] // 5) % 12
    ring = RingKV(L, KVH, HD, sinks + cap, sinks=sinks, precision=("f32", "f16", "int8")[raw[1] % 3])
    ops = decode_ops(raw[2:], cap)
    try:
        run_ops(ring, ops)
    except Exception as e:
        e.add_note(f"window={sinks + cap} sinks={sinks} precision={ring.precision} ops={ops}")
        raise


@settings(PROPERTY, max_examples=max(1, EXAMPLES // 10))   # RingKV's test above covers this index too
@given(st.integers(0, 6), st.integers(1, 16), st.binary(min_size=2 * 6, max_size=2 * 24))
def test_ring_index_slots_against_list_model(sinks, cap, raw):
    """The slot bookkeeping alone: a list of slots filled through reserve's evictions, read back
    through the position -> slot map, must hold the list model's window."""
    index = RingIndex(sinks + cap, sinks)
    slots = [None] * index.window
    seq: list[int] = []
    next_id = 0
    for i in range(0, len(raw) - 1, 2):
        kind, x = raw[i], raw[i + 1]
        if kind < 220:
            t = 1 + x % cap
            new = list(range(next_id, next_id + t))
            next_id += t
            evicted = index.reserve(t)
            start = index.n_tokens - t
            ev_slots = [s + j for _, s, m in evicted for j in range(m)]
            # the evicted tokens are the oldest ring tokens, and the chunk lands on their slots
            held_ring = window_of(seq, sinks, cap)[sinks:]
            assert [slots[s] for s in ev_slots] == held_ring[: len(ev_slots)]
            chunk_slots = index.slots(start, t).tolist()
            assert set(ev_slots) <= set(chunk_slots)
            for p, s in enumerate(chunk_slots):
                slots[s] = new[p]
            seq += new
        else:
            m = x % (index.n_tokens + 1)
            held = window_of(seq, sinks, cap)
            exact = truncate_is_exact(seq, held, m)
            assert index.can_truncate(m) == exact
            if exact:
                index.truncate(m)
                seq = seq if m == len(held) else seq[:m]
        held = window_of(seq, sinks, cap)
        assert index.n_tokens == len(held) and index.state.total == len(seq)
        assert [slots[s] for s in index.slots(0, index.n_tokens)] == held
        runs = index.runs(0, index.n_tokens)
        assert len(runs) <= 3 and sum(m for _, _, m in runs) == index.n_tokens


# ---- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, needle", [
    (dict(window=4, sinks=4), "exceed the sink count"),
    (dict(window=3, sinks=4), "exceed the sink count"),
    (dict(window=8, sinks=-1), "sinks must be >= 0"),
    (dict(window=8.0, sinks=2), "window must be an int"),
    (dict(window=8, sinks=True), "sinks must be an int"),
    (dict(window=8, sinks=2, precision="int4"), "precision"),
])
def test_bad_window_sinks_precision_raise_config_error(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        RingKV(L, KVH, HD, **kwargs)


def test_bad_dims_raise_config_error():
    with pytest.raises(ConfigError, match="n_kv_heads"):
        RingKV(2, 0, 4, window=8)


def test_protocol_misuse_raises_config_error():
    ring = RingKV(L, KVH, HD, window=8, sinks=2)
    assert ring.max_chunk == 6
    for bad in (0, 7, -1):
        with pytest.raises(ConfigError, match="1..6 tokens"):
            ring.reserve(bad)
    k, v = rows([0, 1], 0)
    with pytest.raises(ConfigError, match="reserve"):
        ring.write(0, 0, k, v)
    with pytest.raises(ConfigError, match="reserve"):
        ring.commit(2)
    ring.reserve(2)
    with pytest.raises(ConfigError, match="already reserved"):
        ring.reserve(1)
    with pytest.raises(ConfigError, match="pending chunk holds 2"):
        ring.chunk_start(3)
    with pytest.raises(ConfigError, match="outside the pending chunk"):
        ring.write(0, 1, k, v)
    with pytest.raises(ConfigError, match="shape"):
        ring.write(0, 0, k[:, :1], v[:, :1])
    with pytest.raises(ConfigError, match="layer 2"):
        ring.write(2, 0, k, v)
    with pytest.raises(ConfigError, match="expected 2"):
        ring.commit(3)
    with pytest.raises(ConfigError, match="3 token ids"):
        ring.commit(2, [1, 2, 3])
    ring.write(0, 0, k, v)
    ring.commit(2)                              # ids optional: unknown ids read as -1
    assert ring.tokens == [-1, -1]
    # fill past the window, then a truncation that would need evicted tokens is refused
    for i in range(3):
        ring.reserve(4)
        ring.commit(ring.n_tokens + 4, range(10 * i, 10 * i + 4))
    assert ring.total_tokens == 14 and ring.n_tokens == 8
    with pytest.raises(ConfigError, match="evicted"):
        ring.truncate(5)
    ring.truncate(2)                            # the sinks alone are exact
    assert ring.n_tokens == ring.total_tokens == 2


def test_sink_keys_are_exact_copies_and_shift_bookkeeping():
    """The sinks' keys as written are kept apart: set_sink_keys (the rotated-on copies) never
    changes what sink_keys returns; rope_start counts the sequence, sink_shift the evicted
    tokens; free resets sinks_at; a wrong shape is a ConfigError that writes nothing."""
    ring = RingKV(L, KVH, HD, window=8, sinks=2, precision="f16")
    ring.reserve(3)
    assert ring.rope_start(3) == 0 and ring.sink_shift == 0
    for layer in range(L):
        ring.write(layer, 0, *rows([0, 1, 2], layer))
    ring.commit(3, [0, 1, 2])
    exact = ring.sink_keys()
    assert exact.shape == (2, L, KVH, HD) and exact.dtype == np.float32
    np.testing.assert_array_equal(exact, ring.k[:2].astype(np.float32))
    with pytest.raises(ConfigError, match="set_sink_keys expects"):
        ring.set_sink_keys(exact[:1], 5)
    assert ring.sinks_at == 0
    ring.set_sink_keys(exact + 1.0, 7)
    assert ring.sinks_at == 7 and np.array_equal(ring.sink_keys(), exact)
    np.testing.assert_array_equal(ring.k[:2].astype(np.float32), (exact + 1.0).astype(np.float16).astype(np.float32))
    for i in range(3):                          # 15 tokens, 2 sinks + 6 ring slots held: 7 evicted
        ring.reserve(4)
        assert ring.rope_start(4) == 3 + 4 * i
        ring.commit(ring.n_tokens + 4, range(4))
    assert ring.total_tokens == 15 and ring.n_tokens == 8 and ring.sink_shift == 7
    ring.free()
    assert ring.sinks_at == 0 and ring.sink_shift == 0


def test_rope_rows_equal_the_tables():
    cfg = _cfg(8, 2, 1, "neox")
    cos, sin = reference.rope_tables(cfg, 300)
    pos = np.array([0, 1, 17, 299, 123])
    c, s = reference.rope_rows(cfg, pos)
    np.testing.assert_array_equal(c, cos[pos])
    np.testing.assert_array_equal(s, sin[pos])


def test_engine_protocol_cancel_rolls_back_the_chunk_after_an_eviction():
    """The engine's sequence: reserve, chunk_start, write/read per layer, commit(n_tokens + T);
    a cancel mid-chunk calls truncate(n_tokens) and must restore the evicted rows."""
    ring = RingKV(L, KVH, HD, window=6, sinks=2)
    seq = list(range(6))
    ring.reserve(4)
    start = ring.chunk_start(4)
    for layer in range(L):
        ring.write(layer, start, *rows(seq[:4], layer))
    ring.commit(ring.n_tokens + 4, seq[:4])
    ring.reserve(2)
    for layer in range(L):
        ring.write(layer, ring.chunk_start(2), *rows(seq[4:], layer))
    ring.commit(ring.n_tokens + 2, seq[4:])
    expect_committed(ring, seq)
    ring.reserve(3)                             # evicts 3 of the 4 ring tokens
    assert (ring.n_tokens, ring.total_tokens, ring.tokens) == (6, 6, seq)   # nothing committed yet
    assert ring.positions() == range(3, 6) and ring.chunk_start(3) == 3
    ring.write(0, ring.chunk_start(3), *rows([100, 101, 102], 0))   # cancelled after layer 0
    expect_read(ring, seq[:2] + seq[5:] + [100, 101, 102], layers=[0])
    ring.truncate(ring.n_tokens)
    expect_committed(ring, seq)


# ---- attention through the ring ----------------------------------------------------------------

def _cfg(head_dim: int, n_heads: int, n_kv_heads: int, style: str) -> ModelConfig:
    return ModelConfig(arch="llama", name="ring-test", n_layers=1, d_model=n_heads * head_dim, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, head_dim=head_dim, d_ff=8, vocab_size=16, context_length=4096,
                       rope_theta=10000.0, rope_dim=head_dim, rope_style=style, norm_eps=1e-5,
                       tied_embeddings=True, qkv_bias=False, has_rope_freqs=False)


def _ring_step(ring: RingKV, q, k, v, ids, cfg: ModelConfig):
    """One chunk through the ring, as the engine does it: q and k rotated by their positions in
    the sequence (rope_start), the sinks' exact keys rotated on by sink_shift once per shift,
    then attention over the held keys at their cache positions (chunk_start)."""
    t = len(ids)
    ring.reserve(t)
    start, p, shift = ring.chunk_start(t), ring.rope_start(t), ring.sink_shift
    if ring.sinks_at != shift:
        sk = ring.sink_keys()                                   # (sinks, layers, KVH, hd)
        rows = sk.reshape(-1, *sk.shape[2:])
        c1, s1 = reference.rope_rows(cfg, np.full(len(rows), shift))
        ring.set_sink_keys(reference.rope(rows, c1, s1, cfg.rope_style).reshape(sk.shape), shift)
    c, s = reference.rope_rows(cfg, np.arange(p, p + t))
    ring.write(0, start, reference.rope(k, c, s, cfg.rope_style), v)
    kc, vc = ring.read(0, start + t)
    out = reference.attention(reference.rope(q, c, s, cfg.rope_style), kc, vc, start)
    ring.commit(ring.n_tokens + t, ids)
    return out


@pytest.mark.parametrize("style", ["norm", "neox"])
@pytest.mark.parametrize("precision, tol", [("f32", 1e-5), ("f16", 2e-3), ("int8", 3e-2)])
def test_attention_below_the_window_equals_the_pool_path(style, precision, tol):
    """Shorter than the window nothing slides: rotating keys at read (positions 0..n-1) must give
    the attention of keys rotated once at write into the block pool, chunk by chunk."""
    rng = np.random.default_rng(7)
    H, kvh, hd, window, total = 4, 2, 8, 64, 61
    cfg = _cfg(hd, H, kvh, style)
    cos, sin = reference.rope_tables(cfg, window)
    q = rng.standard_normal((total, H, hd)).astype(np.float32)
    k = rng.standard_normal((total, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((total, kvh, hd)).astype(np.float32)
    ring = RingKV(1, kvh, hd, window, sinks=4, precision=precision)
    flat = KVPool(1, kvh, hd, window // 8, 8, "f32").new_sequence()
    p = 0
    for t in (1, 7, 3, 16, 1, 1, 32):
        if p + t > total:
            t = total - p
        sl = slice(p, p + t)
        got = _ring_step(ring, q[sl], k[sl], v[sl], range(p, p + t), cfg)
        flat.reserve(t)
        flat.write(0, p, reference.rope(k[sl], cos[sl], sin[sl], style), v[sl])
        kc, vc = flat.read(0, p + t)
        flat.commit(p + t, range(p, p + t))
        want = reference.attention(reference.rope(q[sl], cos[sl], sin[sl], style), kc, vc, p)
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
        p += t
    assert p == total and ring.n_tokens == total


@pytest.mark.parametrize("style", ["norm", "neox"])
def test_sliding_window_keeps_relative_distances(style):
    """Long past the window (no sinks), a decode step over the ring equals attention over the last
    `window` keys rotated at their true absolute positions: RoPE scores depend only on distance,
    so cache positions lose nothing inside the window."""
    rng = np.random.default_rng(3)
    H, kvh, hd, window, total = 4, 2, 8, 16, 70
    cfg = _cfg(hd, H, kvh, style)
    cos, sin = reference.rope_tables(cfg, total)
    q = rng.standard_normal((total, H, hd)).astype(np.float32)
    k = rng.standard_normal((total, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((total, kvh, hd)).astype(np.float32)
    ring = RingKV(1, kvh, hd, window, sinks=0)
    _ring_step(ring, q[:10], k[:10], v[:10], range(10), cfg)         # a prefill chunk
    for p in range(10, total):
        got = _ring_step(ring, q[p : p + 1], k[p : p + 1], v[p : p + 1], [p], cfg)
        lo = max(0, p + 1 - window)
        ka = reference.rope(k[lo : p + 1], cos[lo : p + 1], sin[lo : p + 1], style)   # absolute positions
        qa = reference.rope(q[p : p + 1], cos[p : p + 1], sin[p : p + 1], style)
        want = reference.attention(qa, ka.transpose(1, 0, 2), v[lo : p + 1].transpose(1, 0, 2), p - lo)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert ring.n_tokens == window and ring.total_tokens == total


def test_sinks_then_window_at_cache_positions():
    """With sinks, after sliding the query sees the first `sinks` tokens at positions 0..s-1 and
    the last window - s tokens right after them (StreamingLLM's layout)."""
    rng = np.random.default_rng(5)
    H, kvh, hd, window, sinks, total, style = 2, 1, 4, 10, 3, 40, "neox"
    cfg = _cfg(hd, H, kvh, style)
    cos, sin = reference.rope_tables(cfg, window)
    q = rng.standard_normal((total, H, hd)).astype(np.float32)
    k = rng.standard_normal((total, kvh, hd)).astype(np.float32)
    v = rng.standard_normal((total, kvh, hd)).astype(np.float32)
    ring = RingKV(1, kvh, hd, window, sinks=sinks)
    for p in range(total):
        got = _ring_step(ring, q[p : p + 1], k[p : p + 1], v[p : p + 1], [p], cfg)
    held = window_of(list(range(total)), sinks, window - sinks)
    n = len(held)
    kh = reference.rope(k[held], cos[:n], sin[:n], style).transpose(1, 0, 2)
    want = reference.attention(reference.rope(q[-1:], cos[n - 1 : n], sin[n - 1 : n], style), kh,
                               v[held].transpose(1, 0, 2), n - 1)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert ring.tokens == held


# ---- memory ------------------------------------------------------------------------------------

def test_memory_is_flat_however_long_the_sequence():
    window, sinks = 64, 4
    ring = RingKV(L, KVH, HD, window, sinks=sinks, precision="f16")
    assert ring.nbytes == RingKV.nbytes_for(L, KVH, HD, window, itemsize=2, sinks=sinks)
    assert RingKV(L, KVH, HD, window, sinks=sinks).nbytes == RingKV.nbytes_for(L, KVH, HD, window, sinks=sinks)
    nbytes, bufs = ring.nbytes, (ring.k, ring.v, ring.ids)

    def decode(first: int, count: int) -> None:
        for i in range(first, first + count):
            ring.reserve(1)
            start = ring.chunk_start(1)
            for layer in range(L):
                ring.write(layer, start, *rows([i], layer))
                ring.read(layer, start + 1)
            ring.commit(ring.n_tokens + 1, [i])

    decode(0, 2 * window)                      # past the first wrap: every later step evicts
    tracemalloc.start()
    try:
        # numpy's small caches fill over the first few hundred steps (~64 KB traced, then flat
        # for thousands of steps): measure after them
        decode(2 * window, 1000)
        base, _ = tracemalloc.get_traced_memory()
        decode(2 * window + 1000, 1000)
        now, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert now - base < 16 * 1024, f"ring memory grew by {now - base} bytes over 1000 tokens"
    assert ring.nbytes == nbytes and (ring.k, ring.v, ring.ids) == bufs
    assert ring.total_tokens == 2 * window + 2000 and ring.n_tokens == window
    expect_committed(ring, list(range(ring.total_tokens)))


def test_the_planned_chunk_fits_the_ring(tmp_path):
    """On a ring the plan chose its chunk as for the pool (608 tokens for SmolLM2, 200 when asked)
    and the engine cut it to window - sinks without a word; chunks near that left their first
    tokens a few tokens of context. The plan now keeps within half the room and says so, and a
    prefill_chunk past the room is refused."""
    import edgellm
    from edgellm.errors import ConfigError
    from tests.synthetic import write_tiny_model

    path = write_tiny_model(tmp_path / "m.gguf", seed=1).path
    e = edgellm.load(path, kv="ring", window=64, sinks=4, threads=1)
    assert e.plan.chunk.tokens <= 30 and "ring: at most half the 60 tokens" in e.plan.chunk.derivation[-1]
    with pytest.raises(ConfigError, match=r"prefill_chunk 61 is more than a ring of window 64 with 4 sinks"):
        edgellm.load(path, kv="ring", window=64, sinks=4, prefill_chunk=61)
    assert edgellm.load(path, kv="ring", window=64, sinks=4, prefill_chunk=60).plan.chunk.tokens == 60
    assert edgellm.load(path, threads=1).plan.chunk.tokens > 30      # (the pool keeps its own choice)
