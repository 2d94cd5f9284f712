"""Op conformance of the opencl unit's elementwise and attention kernels (opencl_kernels/
elementwise.cl and attention.cl, through backends/opencl_elementwise.py and opencl_attention.py)
against backends/reference.py, on this machine's OpenCL device (PoCL's CPU device in CI).

Bounds (DESIGN.md): elementwise NMSE <= 1e-7. Attention: DESIGN allows 5e-4; these kernels do
fp32 arithmetic on exactly the reference's inputs (f16 K/V convert exactly to f32, and the
reference runs on those converted values), so the only differences are summation order and the
<= 3 ulp of OpenCL's exp: NMSE ~1e-12 at worst is observed. The bound used is 1e-9: three
orders above what is seen, and far more sensitive to an off-by-one in the causal range. (Leaving
out one key shifts NMSE by anything from ~1e-11, a key of negligible weight, to ~1e-2 on these
inputs; 5e-4 lets most such bugs through.) Besides NMSE, every result gets a gross check:
no NaN/inf where the reference has none, and no single element off by more than GROSS_* times the
result's largest magnitude (an NMSE over a big array can hide one wrong element).

Unread parts of a pool arena (other layers, unused blocks, rows past n) hold NaN: a kernel that
reads one position too many, the wrong layer or the wrong block fails loudly.
"""
from __future__ import annotations

import gc
import logging
import weakref

import numpy as np
import pytest

from edgellm.backends import opencl_attention as oa
from edgellm.backends import opencl_elementwise as oe
from edgellm.backends import reference
from edgellm.kv.pool import KVPool

EW_BOUND = 1e-7        # elementwise NMSE (DESIGN.md)
ATTN_BOUND = 1e-9      # attention NMSE: fp32 on identical inputs (module docstring)
GROSS_EW = 1e-5        # max |y - ref| / max |ref|, elementwise
GROSS_ATTN = 1e-4      # max |y - ref| / max |ref|, attention

log = logging.getLogger("edgellm.tests")
_WORST: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report_worst():
    yield
    for op, v in sorted(_WORST.items()):
        log.info("worst NMSE %-14s %.2e", op, v)


@pytest.fixture(scope="module")
def rt(cl_runtime):
    return cl_runtime


def f32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def nmse(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.mean((y - ref) ** 2) / max(np.mean(ref**2), 1e-300))


def check(op: str, y, ref, bound: float, gross: float) -> None:
    y, ref = np.asarray(y), np.asarray(ref)
    assert y.shape == ref.shape and y.dtype == np.float32, (y.shape, y.dtype, ref.shape)
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(y), finite), f"{op}: non-finite values where the reference has none"
    y64, r64 = y[finite].astype(np.float64), ref[finite].astype(np.float64)
    err = nmse(y64, r64)
    _WORST[op] = max(_WORST.get(op, 0.0), err)
    assert err <= bound, f"{op}: NMSE {err:.3e} > {bound:.0e}"
    peak = max(float(np.max(np.abs(r64), initial=0.0)), 1e-30)
    worst = float(np.max(np.abs(y64 - r64), initial=0.0)) / peak
    assert worst <= gross, f"{op}: an element is off by {worst:.3e} x max|ref|"


# ---- elementwise --------------------------------------------------------------------------------

@pytest.mark.parametrize("T,d", [(1, 576), (7, 37), (3, 5), (33, 1000), (2, 16), (70, 64), (1, 3)])
def test_rmsnorm(rt, T, d):
    rng = np.random.default_rng(T * 1000 + d)
    x, w = f32(rng.standard_normal((T, d)) * 3), f32(rng.standard_normal(d))
    check("rmsnorm", oe.rmsnorm(rt, x, w, 1e-5), reference.rmsnorm(x, w, 1e-5), EW_BOUND, GROSS_EW)


def test_rmsnorm_row_independent(rt):
    """Rows of wildly different scale: each row normalised by its own RMS."""
    x = f32(np.array([[1e-3] * 9, [1e3] * 9, list(range(9))]))
    w = f32(np.ones(9))
    check("rmsnorm", oe.rmsnorm(rt, x, w, 0.0), reference.rmsnorm(x, w, 0.0), EW_BOUND, GROSS_EW)


@pytest.mark.parametrize("style", ["norm", "neox"])
@pytest.mark.parametrize("T,heads,hd,rope_dim", [(1, 9, 64, 64), (5, 3, 64, 32), (3, 2, 32, 32), (4, 1, 36, 20),
                                                 (2, 3, 10, 6), (3, 2, 18, 18), (1, 1, 7, 2)])
def test_rope(rt, style, T, heads, hd, rope_dim):
    rng = np.random.default_rng(T * 97 + hd + rope_dim)
    x = f32(rng.standard_normal((T, heads, hd)))
    ang = rng.uniform(-50, 50, (T, rope_dim // 2))
    cos, sin = f32(np.cos(ang)), f32(np.sin(ang))
    y = oe.rope(rt, x, cos, sin, style)
    check("rope", y, reference.rope(x, cos, sin, style), EW_BOUND, GROSS_EW)
    np.testing.assert_array_equal(y[..., rope_dim:], x[..., rope_dim:])   # copied, not rotated


def test_rope_positions_differ_per_token(rt):
    """cos/sin rows belong to tokens, shared by every head of the token."""
    T, heads, hd = 3, 4, 8
    x = f32(np.ones((T, heads, hd)))
    ang = f32(np.arange(T * 4).reshape(T, 4))
    y = oe.rope(rt, x, np.cos(ang), np.sin(ang), "neox")
    for t in range(T):
        assert np.allclose(y[t], y[t, :1]), "heads of one token must rotate alike"
    check("rope", y, reference.rope(x, f32(np.cos(ang)), f32(np.sin(ang)), "neox"), EW_BOUND, GROSS_EW)


@pytest.mark.parametrize("T,ff", [(1, 1536), (3, 37), (64, 300), (2, 3), (1, 1)])
def test_swiglu(rt, T, ff):
    rng = np.random.default_rng(T + ff)
    gu = f32(rng.standard_normal((T, 2 * ff)) * 4)
    gu.flat[::7] *= 25          # exp far into both tails: e^-100 and e^100
    y = oe.swiglu(rt, gu)
    with np.errstate(over="ignore"):       # the reference's e^100 overflows to inf: silu -> -0
        ref = reference.swiglu(gu)
    check("swiglu", y, ref, EW_BOUND, GROSS_EW)


@pytest.mark.parametrize("shape", [(1,), (17,), (4099,), (3, 5), (2, 3, 7)])
def test_add(rt, shape):
    rng = np.random.default_rng(sum(shape))
    a, b = f32(rng.standard_normal(shape)), f32(rng.standard_normal(shape))
    np.testing.assert_array_equal(oe.add(rt, a, b), reference.add(a, b))   # one rounding: exact


def _softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("rows,n", [(1, 1), (3, 7), (2, 1000), (5, 33), (1, 49157)])
def test_softmax(rt, rows, n):
    rng = np.random.default_rng(rows * n)
    x = f32(rng.standard_normal((rows, n)) * 20)
    if n > 2:
        x[0, 1] = -np.inf          # a masked entry: exactly 0
    y = oe.softmax(rt, x)
    check("softmax", y, _softmax64(x), EW_BOUND, GROSS_EW)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-5)
    if n > 2:
        assert y[0, 1] == 0.0


def test_softmax_large_offsets(rt):
    """Rows far from 0 (logits ~1e4): only the max-subtracted form stays finite."""
    x = f32(np.array([[1e4, 1e4 - 1, 1e4 - 2, 1e4 - 30, 1e4 - 5], [-1e4, -1e4 + 3, -1e4, -1e4, -1e4]]))
    check("softmax", oe.softmax(rt, x), _softmax64(x), EW_BOUND, GROSS_EW)


def test_elementwise_empty(rt):
    assert oe.rmsnorm(rt, np.empty((0, 8), np.float32), np.ones(8, np.float32), 1e-5).shape == (0, 8)
    assert oe.rope(rt, np.empty((0, 2, 8), np.float32), np.empty((0, 4)), np.empty((0, 4)), "norm").shape == (0, 2, 8)
    assert oe.swiglu(rt, np.empty((0, 8), np.float32)).shape == (0, 4)
    assert oe.add(rt, np.empty(0), np.empty(0)).shape == (0,)
    assert oe.softmax(rt, np.empty((0, 3), np.float32)).shape == (0, 3)


def test_elementwise_bad_args(rt):
    x, w = f32(np.ones((2, 8))), f32(np.ones(8))
    c = f32(np.ones((2, 4)))
    cases = [
        ("x", lambda: oe.rmsnorm(rt, w, w, 1e-5)),                       # 1-D x
        ("x", lambda: oe.rmsnorm(rt, np.ones((2, 0)), w, 1e-5)),         # empty rows
        ("w", lambda: oe.rmsnorm(rt, x, np.ones(7), 1e-5)),
        ("eps", lambda: oe.rmsnorm(rt, x, w, -1.0)),
        ("eps", lambda: oe.rmsnorm(rt, x, w, float("nan"))),
        ("x", lambda: oe.rmsnorm(rt, np.array([["a"] * 8] * 2), w, 1e-5)),
        ("style", lambda: oe.rope(rt, x[:, None], c, c, "gptj")),
        ("x", lambda: oe.rope(rt, x, c, c, "norm")),                      # 2-D x
        ("cos", lambda: oe.rope(rt, x[:, None], c[:1], c, "norm")),       # one row for two tokens
        ("sin", lambda: oe.rope(rt, x[:, None], c, c[:, :3], "norm")),
        ("rope_dim", lambda: oe.rope(rt, x[:, None], np.ones((2, 5)), np.ones((2, 5)), "norm")),
        ("gate_up", lambda: oe.swiglu(rt, np.ones((2, 7)))),
        ("gate_up", lambda: oe.swiglu(rt, np.ones(8))),
        ("b", lambda: oe.add(rt, x, w)),
        ("a", lambda: oe.add(rt, np.array(["x"]), np.array(["y"]))),
        ("x", lambda: oe.softmax(rt, w)),
        ("x", lambda: oe.softmax(rt, np.ones((2, 0)))),
    ]
    for arg, call in cases:
        with pytest.raises(ValueError, match=rf"\b{arg}\b"):
            call()


# ---- attention, dense (KVH, n, hd) ---------------------------------------------------------------

def _qkv(rng, T, H, KVH, hd, start, n_extra=0):
    n = start + T + n_extra
    q = f32(rng.standard_normal((T, H, hd)) * 2)
    k = f32(rng.standard_normal((KVH, n, hd)) * 2)
    v = f32(rng.standard_normal((KVH, n, hd)))
    return q, k, v


# (T, H, KVH, hd, start). Plans (opencl_attention.SPLIT_PLANS): T*H < 128 -> split 16x1,
# < 512 -> split 4x4, else one item per row in groups of 64.
ATTN_CASES = [
    (1, 1, 1, 64, 0),          # one token, one head, one key
    (1, 9, 3, 64, 100),        # decode, GQA groups of 3 (SmolLM2)
    (5, 9, 3, 64, 0),          # prefill from empty: the causal triangle
    (17, 4, 2, 32, 40),        # a chunk after cached context
    (3, 6, 2, 20, 7),
    (9, 20, 1, 18, 3),         # head_dim not a multiple of 4, one kv head for 20 heads
    (2, 8, 8, 64, 600),        # groups of 1 (MHA), long context
    (29, 9, 3, 36, 5),         # split 4x4 with padding rows (261 rows)
    (70, 9, 3, 64, 30),        # one item per row, 630 rows: not a multiple of 64
    (2, 3, 1, 3, 5),           # head_dim < 4: no float4 part at all
    (3, 4, 1, 256, 20),        # the largest head_dim
]


@pytest.mark.parametrize("T,H,KVH,hd,start", ATTN_CASES)
def test_attention_dense(rt, T, H, KVH, hd, start):
    rng = np.random.default_rng(T * 31 + H * 7 + hd + start)
    q, k, v = _qkv(rng, T, H, KVH, hd, start)
    check("attention", oa.attention(rt, q, k, v, start), reference.attention(q, k, v, start), ATTN_BOUND, GROSS_ATTN)


def test_attention_dense_longer_cache(rt):
    """k, v holding more positions than start + T (a preallocated buffer): the rest is unread."""
    rng = np.random.default_rng(5)
    T, H, KVH, hd, start = 4, 6, 2, 32, 10
    q, k, v = _qkv(rng, T, H, KVH, hd, start, n_extra=9)
    k[:, start + T:] = np.nan
    v[:, start + T:] = np.nan
    ref = reference.attention(q, k[:, : start + T], v[:, : start + T], start)
    check("attention", oa.attention(rt, q, k, v, start), ref, ATTN_BOUND, GROSS_ATTN)


def test_attention_dense_f16(rt):
    rng = np.random.default_rng(11)
    T, H, KVH, hd, start = 3, 9, 3, 64, 40
    q, k, v = _qkv(rng, T, H, KVH, hd, start)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    ref = reference.attention(q, f32(k16), f32(v16), start)
    check("attention_f16", oa.attention(rt, q, k16, v16, start), ref, ATTN_BOUND, GROSS_ATTN)


@pytest.mark.parametrize("plans", [(), ((10**9, 16, 1),), ((10**9, 4, 4),)], ids=["rows", "split16x1", "split4x4"])
@pytest.mark.parametrize("T,start", [(1, 0), (1, 37), (13, 2), (6, 50)])
def test_attention_every_launch_shape(rt, monkeypatch, plans, T, start):
    """The same problems through each kernel shape, whatever the size heuristic would pick;
    n < S (items that see no key) included."""
    monkeypatch.setattr(oa, "SPLIT_PLANS", plans)
    rng = np.random.default_rng(T + start)
    q, k, v = _qkv(rng, T, 6, 2, 64, start)
    check("attention", oa.attention(rt, q, k, v, start), reference.attention(q, k, v, start), ATTN_BOUND, GROSS_ATTN)


def test_attention_plan_heuristic(rt):
    assert oa._plan(rt, 9, 64) == (16, 1)
    assert oa._plan(rt, 261, 36) == (4, 4)
    assert oa._plan(rt, 630, 64) is None


# ---- attention from the pool arena ---------------------------------------------------------------

def _pool_arena(rng, n, n_layers, layer, block_tokens, KVH, hd, dtype):
    """k, v arenas (blocks, layers, block_tokens, KVH, hd) as kv/pool.py lays them out, and the
    sequence's block table: its blocks shuffled among spare ones. Everything the kernel must not
    read (other layers, spare blocks, rows at positions >= n) is NaN."""
    n_used = -(-n // block_tokens)
    n_blocks = 2 * n_used + 3
    table = rng.permutation(n_blocks)[:n_used].astype(np.int32)
    shape = (n_blocks, n_layers, block_tokens, KVH, hd)
    k = np.full(shape, np.nan, dtype)
    v = np.full(shape, np.nan, dtype)
    for i, b in enumerate(table):
        rows = min(block_tokens, n - i * block_tokens)
        k[b, layer, :rows] = rng.standard_normal((rows, KVH, hd)) * 2
        v[b, layer, :rows] = rng.standard_normal((rows, KVH, hd))
    return k, v, table


def _gather(arena, table, layer, n):
    """(KVH, n, hd) fp32 rows of one layer: position p from block table[p // bt], row p % bt."""
    rows = arena[table, layer].reshape(-1, *arena.shape[3:])[:n]      # (n, KVH, hd)
    return f32(rows.astype(np.float32).transpose(1, 0, 2))


class _Arena:
    """The attributes of kv/pool.KVPool that attention_pool reads."""

    def __init__(self, k, v):
        self.k, self.v = k, v
        self.k_scale = self.v_scale = None
        self.n_blocks, self.n_layers, self.block_tokens, self.n_kv_heads, self.head_dim = k.shape


POOL_CASES = [  # (T, H, KVH, hd, start, block_tokens)
    (1, 9, 3, 64, 0, 16),      # first token
    (1, 9, 3, 64, 44, 16),     # decode, n = 45: not a multiple of the block
    (7, 9, 3, 64, 50, 32),     # a chunk after cached context, crossing a block boundary
    (20, 4, 4, 32, 0, 16),
    (3, 2, 1, 36, 29, 16),
    (1, 9, 3, 64, 1023, 32),   # a full 1k context
    (1, 1, 1, 18, 0, 4),       # one token, one head, head_dim 18
    (29, 9, 3, 36, 5, 8),      # split 4x4
    (70, 9, 3, 64, 5, 16),     # one item per row
]


@pytest.mark.parametrize("kv_dtype", [np.float16, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("T,H,KVH,hd,start,block_tokens", POOL_CASES)
def test_attention_pool(rt, kv_dtype, T, H, KVH, hd, start, block_tokens):
    rng = np.random.default_rng(T * 13 + start + hd + block_tokens)
    n, n_layers = start + T, 3
    layer = (T + start) % 2 + 1
    k, v, table = _pool_arena(rng, n, n_layers, layer, block_tokens, KVH, hd, kv_dtype)
    q = f32(rng.standard_normal((T, H, hd)) * 2)
    arena = _Arena(k, v)
    assert oa.can_read_pool(arena)
    out = oa.attention_pool(rt, q, arena, table, layer, start)
    # f16: the reference runs on the f16 values converted to f32 (exact), so the fp32 bound holds
    ref = reference.attention(q, _gather(k, table, layer, n), _gather(v, table, layer, n), start)
    check(f"attention_pool_{np.dtype(kv_dtype).name}", out, ref, ATTN_BOUND, GROSS_ATTN)


def test_attention_pool_longer_table(rt):
    """A block table with more blocks than the call's positions need (reserved ahead): only the
    covered ones are read; the rest may even be out of range."""
    rng = np.random.default_rng(3)
    T, H, KVH, hd, start, bt = 2, 4, 2, 32, 9, 4
    k, v, table = _pool_arena(rng, start + T, 2, 0, bt, KVH, hd, np.float32)
    long_table = np.concatenate([table, [10**6, -1]]).astype(np.int32)
    q = f32(rng.standard_normal((T, H, hd)))
    ref = reference.attention(q, _gather(k, table, 0, start + T), _gather(v, table, 0, start + T), start)
    check("attention_pool_float32", oa.attention_pool(rt, q, _Arena(k, v), long_table, 0, start), ref,
          ATTN_BOUND, GROSS_ATTN)


@pytest.mark.parametrize("precision", ["f16", "f32"])
def test_attention_pool_sees_host_writes(rt, precision):
    """The host writes the arena between two calls (through the pool, and directly): the second
    call sees the new values, not a copy the driver kept from the first. (On PoCL the buffer is
    the host memory itself, so this checks the behaviour, not that the map/unmap is needed.)"""
    rng = np.random.default_rng(21)
    KVH, hd, H, bt, n_layers, layer = 2, 32, 6, 8, 2, 1
    pool = KVPool(n_layers, KVH, hd, n_blocks=12, block_tokens=bt, precision=precision)
    spare = pool.new_sequence()
    spare.reserve(3 * bt)                     # the sequence's blocks do not start at block 0
    seq = pool.new_sequence()
    start, T = 19, 3
    n = start + T
    seq.reserve(n)
    for lay in range(n_layers):
        seq.write(lay, 0, rng.standard_normal((n, KVH, hd)), rng.standard_normal((n, KVH, hd)))
    seq.commit(n, range(n))
    table = np.asarray(seq.block_table, np.int32)
    q = f32(rng.standard_normal((T, H, hd)))

    def expect():
        k, v = seq.read(layer, n)
        return reference.attention(q, k, v, start)

    first = oa.attention_pool(rt, q, pool, table, layer, start)
    check(f"attention_pool_{pool.k.dtype.name}", first, expect(), ATTN_BOUND, GROSS_ATTN)

    seq.write(layer, 0, rng.standard_normal((n, KVH, hd)), rng.standard_normal((n, KVH, hd)))
    second = oa.attention_pool(rt, q, pool, table, layer, start)
    check(f"attention_pool_{pool.k.dtype.name}", second, expect(), ATTN_BOUND, GROSS_ATTN)
    assert nmse(second, first) > 1e-2

    pool.v[table[1], layer] *= -3             # the host writes the arena directly
    third = oa.attention_pool(rt, q, pool, table, layer, start)
    check(f"attention_pool_{pool.k.dtype.name}", third, expect(), ATTN_BOUND, GROSS_ATTN)
    assert nmse(third, second) > 1e-3


def test_attention_pool_cache_follows_pool(rt):
    """The device wrapper of an arena is dropped with its pool (no arena kept alive by the
    cache), and a pool whose arena array is replaced gets a new wrapper."""
    rng = np.random.default_rng(4)
    pool = KVPool(1, 1, 8, n_blocks=2, block_tokens=4, precision="f32")
    pool.k[...] = rng.standard_normal(pool.k.shape)
    pool.v[...] = rng.standard_normal(pool.v.shape)
    table = np.array([1], np.int32)
    q = f32(rng.standard_normal((2, 2, 8)))

    for i in range(2):
        if i:
            pool.k = f32(rng.standard_normal(pool.k.shape))  # a new arena object: a new wrapper
        ref = reference.attention(q, _gather(pool.k, table, 0, 2), _gather(pool.v, table, 0, 2), 0)
        check("attention_pool_float32", oa.attention_pool(rt, q, pool, table, 0, 0), ref, ATTN_BOUND, GROSS_ATTN)
    arena_ref = weakref.ref(pool.k)
    del pool
    gc.collect()
    assert arena_ref() is None, "the arena outlived its pool: the buffer cache keeps it alive"


def test_can_read_pool():
    assert oa.can_read_pool(KVPool(1, 1, 8, 2, 4, precision="f16"))
    assert oa.can_read_pool(KVPool(1, 1, 8, 2, 4, precision="f32"))
    assert not oa.can_read_pool(KVPool(1, 1, 8, 2, 4, precision="int8"))
    assert not oa.can_read_pool(KVPool(1, 1, 512, 2, 4, precision="f16"))     # head_dim > 256
    assert not oa.can_read_pool(object())


def test_attention_empty_chunk(rt):
    q = np.empty((0, 4, 8), np.float32)
    kv = np.ones((2, 3, 8), np.float32)
    assert oa.attention(rt, q, kv, kv, 3).shape == (0, 32)
    pool = KVPool(1, 2, 8, 2, 4, precision="f32")
    assert oa.attention_pool(rt, q, pool, np.array([0], np.int32), 0, 3).shape == (0, 32)


def test_attention_bad_args(rt):
    T, H, KVH, hd, start = 2, 4, 2, 8, 3
    n = start + T
    q = f32(np.ones((T, H, hd)))
    kv = f32(np.ones((KVH, n, hd)))
    cases = [
        ("q", lambda: oa.attention(rt, q[0], kv, kv, start)),
        ("q", lambda: oa.attention(rt, np.ones((1, 1, 300)), np.ones((1, 1, 300)), np.ones((1, 1, 300)), 0)),
        ("q", lambda: oa.attention(rt, np.array([[["x"]]]), kv, kv, start)),
        ("k", lambda: oa.attention(rt, q, kv[0], kv, start)),
        ("v", lambda: oa.attention(rt, q, kv, kv[:, :4], start)),
        ("k", lambda: oa.attention(rt, q, kv[..., :4], kv[..., :4], start)),            # head_dim differs
        ("k", lambda: oa.attention(rt, q, np.ones((3, n, hd)), np.ones((3, n, hd)), start)),  # 3 !| 4
        ("k", lambda: oa.attention(rt, q, kv, kv, start + 1)),                           # too few positions
        ("start", lambda: oa.attention(rt, q, kv, kv, -1)),
        ("start", lambda: oa.attention(rt, q, kv, kv, 1.0)),
        ("start", lambda: oa.attention(rt, q, kv, kv, True)),
    ]
    pool = KVPool(2, KVH, hd, n_blocks=4, block_tokens=4, precision="f16")
    table = np.array([2, 0], np.int32)
    cases += [
        ("layer", lambda: oa.attention_pool(rt, q, pool, table, 2, start)),
        ("layer", lambda: oa.attention_pool(rt, q, pool, table, -1, start)),
        ("layer", lambda: oa.attention_pool(rt, q, pool, table, 0.0, start)),
        ("table", lambda: oa.attention_pool(rt, q, pool, table[:1], 0, start)),        # covers 4 of 5
        ("table", lambda: oa.attention_pool(rt, q, pool, np.array([2, 4], np.int32), 0, start)),
        ("table", lambda: oa.attention_pool(rt, q, pool, np.array([-1, 0], np.int32), 0, start)),
        ("table", lambda: oa.attention_pool(rt, q, pool, np.array([2.0, 0.0]), 0, start)),
        ("table", lambda: oa.attention_pool(rt, q, pool, np.array([[2, 0]], np.int32), 0, start)),
        ("q", lambda: oa.attention_pool(rt, q[..., :4], pool, table, 0, start)),        # head_dim differs
        ("q", lambda: oa.attention_pool(rt, np.ones((T, 3, hd)), pool, table, 0, start)),  # 3 heads, 2 kv
        ("start", lambda: oa.attention_pool(rt, q, pool, table, 0, -2)),
        ("pool", lambda: oa.attention_pool(rt, q, KVPool(2, KVH, hd, 4, 4, precision="int8"), table, 0, start)),
    ]
    for arg, call in cases:
        with pytest.raises(ValueError, match=rf"\b{arg}\b"):
            call()


def test_attention_a_later_tokens_inf_value_stays_out_of_earlier_rows(rt):
    """A V row holding inf (an fp16 store of 70000) at the chunk's last token: the rows before it
    never see that key and must stay finite and equal the reference's (the neon tile leaked it as
    0 * inf = NaN; a helper's aarch64 probe)."""
    rng = np.random.default_rng(9)
    T, H, KVH, hd, start = 32, 9, 3, 64, 100
    q, k, v = _qkv(rng, T, H, KVH, hd, start)
    v[:, start + T - 1, 1] = np.inf
    got, ref = oa.attention(rt, q, k, v, start), reference.attention(q, k, v, start)
    assert np.isfinite(got[:-1]).all() and np.isfinite(ref[:-1]).all()
    check("attention", got[:-1], ref[:-1], ATTN_BOUND, GROSS_ATTN)
