"""Op conformance of the NEON library's elementwise, attention and thread-pool entry points
against backends/reference.py (NMSE bounds from DESIGN.md: elementwise 1e-7, attention 5e-4),
for both library variants, each case run through the NEON kernels and their `_generic` twins.

The installed library (edgellm/_neon_<variant>*.so, built by pip install) is used when it is
present and not older than neon/; otherwise the whole of neon/*.c is built into a temporary
directory with tools/build_neon.py, so the tests run both in CI and in a source checkout.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edgellm.backends import neon_lib, reference
from edgellm.backends.neon_lib import EL_F16, EL_F32, EL_KV_I8, fptr
from edgellm.kv.pool import quantize_int8

ROOT = Path(__file__).resolve().parent.parent
NEON = ROOT / "neon"
VARIANTS = ("base", "dotprod")
EW_BOUND = 1e-7        # elementwise NMSE bound
ATTN_BOUND = 5e-4      # attention NMSE bound
KERNEL_SOURCES = ("threadpool.c", "elementwise.c", "attention.c")   # the files whose ops are tested here

_TASK_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_int)


def _build_neon_module():
    spec = importlib.util.spec_from_file_location("build_neon", ROOT / "tools" / "build_neon.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _installed_is_current(path: Path) -> bool:
    """An installed library older than any neon/ source would test stale code."""
    newest = max(p.stat().st_mtime for p in NEON.glob("*.[ch]"))
    return path.stat().st_mtime >= newest


@pytest.fixture(scope="module", params=VARIANTS)
def lib(request, tmp_path_factory):
    variant = request.param
    lib = None
    try:
        path = neon_lib.library_path(variant)
        if os.environ.get("EDGELLM_NEON_LIB") or _installed_is_current(path):
            lib = neon_lib.load(variant, path=path)
    except (neon_lib.NeonLibError, OSError):
        pass
    if lib is None:
        out = tmp_path_factory.mktemp(f"neon_{variant}") / f"libedgellm_{variant}.so"
        try:
            _build_neon_module().build(out, variant)
        except subprocess.CalledProcessError as e:
            pytest.fail(f"building the {variant} NEON library failed:\n{e.stderr}")
        lib = neon_lib.load(variant, path=out, partial=True)
    # not in neon_lib's table: Python never calls it, the tests drive it with a ctypes callback
    lib.el_parallel_for.restype = None
    lib.el_parallel_for.argtypes = [ctypes.c_void_p, ctypes.c_int, _TASK_FN, ctypes.c_void_p]
    return lib


@pytest.fixture(params=[0, 1], ids=["neon", "generic"])
def el(lib, request):
    """The library with el_use_generic set for the test (and reset after)."""
    lib.el_use_generic(request.param)
    yield lib
    lib.el_use_generic(0)


@pytest.fixture(scope="module")
def pool2(lib):
    """A 2-thread pool (the caller + one worker)."""
    p = lib.el_pool_create(2, None, 0)
    assert p
    yield p
    lib.el_pool_destroy(p)


def nmse(y: np.ndarray, ref: np.ndarray) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.mean((y - ref) ** 2) / max(np.mean(ref**2), 1e-300))


def f32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _pool(pool2, use_pool: bool):
    return pool2 if use_pool else None


# ---- elementwise ------------------------------------------------------------------------------

@pytest.mark.parametrize("T,d,use_pool", [(1, 576, False), (7, 37, False), (3, 5, True), (33, 1000, True),
                                          (300, 64, True), (2, 16, False)])
def test_rmsnorm(el, pool2, T, d, use_pool):
    rng = np.random.default_rng(T * 1000 + d)
    x, w = f32(rng.standard_normal((T, d)) * 3), f32(rng.standard_normal(d))
    y = np.empty_like(x)
    assert el.el_rmsnorm(_pool(pool2, use_pool), fptr(x), fptr(w), fptr(y), T, d, 1e-5) == 0
    assert nmse(y, reference.rmsnorm(x, w, 1e-5)) <= EW_BOUND


@pytest.mark.parametrize("style", ["norm", "neox"])
@pytest.mark.parametrize("T,heads,hd,rope_dim", [(1, 9, 64, 64), (5, 3, 64, 32), (3, 2, 32, 32),
                                                 (4, 1, 36, 20), (2, 3, 10, 6)])
@pytest.mark.parametrize("inplace", [False, True])
def test_rope(el, style, T, heads, hd, rope_dim, inplace):
    rng = np.random.default_rng(T * 97 + hd + rope_dim)
    x = f32(rng.standard_normal((T, heads, hd)))
    ang = rng.uniform(-50, 50, (T, rope_dim // 2))
    cos, sin = f32(np.cos(ang)), f32(np.sin(ang))
    ref = reference.rope(x, cos, sin, style)
    y = x.copy() if inplace else np.full_like(x, np.nan)
    src = y if inplace else x
    assert el.el_rope(fptr(src), fptr(y), T, heads, hd, rope_dim, fptr(cos), fptr(sin), int(style == "neox")) == 0
    assert nmse(y, ref) <= EW_BOUND
    np.testing.assert_array_equal(y[..., rope_dim:], x[..., rope_dim:])   # copied, not rotated


@pytest.mark.parametrize("T,ff,use_pool", [(1, 1536, False), (3, 37, False), (1, 20000, True), (64, 300, True),
                                           (2, 3, False)])
def test_swiglu(el, pool2, T, ff, use_pool):
    rng = np.random.default_rng(T + ff)
    gu = f32(rng.standard_normal((T, 2 * ff)) * 4)
    gu.flat[:: 7] *= 25          # exp far into both tails: e^-100 and e^100
    y = np.full((T, ff), np.nan, np.float32)
    assert el.el_swiglu(_pool(pool2, use_pool), fptr(gu), fptr(y), T, ff) == 0
    assert np.isfinite(y).all()
    with np.errstate(over="ignore"):       # the reference's e^100 overflows to inf: silu -> -0
        ref = reference.swiglu(gu)
    assert nmse(y, ref) <= EW_BOUND


def test_swiglu_exp_accuracy(el):
    """silu(g) for a dense sweep of g: the polynomial exp's error, element by element."""
    g = f32(np.linspace(-90, 90, 4099))
    gu = f32(np.concatenate([g, np.ones_like(g)])[None, :])
    y = np.empty((1, g.size), np.float32)
    assert el.el_swiglu(None, fptr(gu), fptr(y), 1, g.size) == 0
    ref = (g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64)))).astype(np.float32)
    big = np.abs(ref) > 1e-30
    rel = np.abs(y[0][big] - ref[big]) / np.abs(ref[big])
    assert rel.max() < 2e-6, rel.max()


@pytest.mark.parametrize("rows,n", [(1, 1), (3, 7), (2, 1000), (5, 33)])
def test_softmax(el, rows, n):
    rng = np.random.default_rng(rows * n)
    x = f32(rng.standard_normal((rows, n)) * 20)
    if n > 2:
        x[0, 1] = -np.inf          # a masked entry: exactly 0
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    ref = e / e.sum(axis=1, keepdims=True)
    y = x.copy()
    assert el.el_softmax(fptr(y), rows, n) == 0
    assert nmse(y, ref) <= EW_BOUND
    if n > 2:
        assert y[0, 1] == 0.0


@pytest.mark.parametrize("n", [1, 17, 1000, 4099])
def test_add(el, n):
    rng = np.random.default_rng(n)
    a, b = f32(rng.standard_normal(n)), f32(rng.standard_normal(n))
    y = np.empty_like(a)
    assert el.el_add(fptr(a), fptr(b), fptr(y), n) == 0
    np.testing.assert_array_equal(y, reference.add(a, b))


def test_elementwise_bad_args(el):
    x = f32(np.ones((2, 8)))
    c = f32(np.ones((2, 4)))
    assert el.el_rmsnorm(None, None, fptr(x), fptr(x), 2, 8, 1e-5) < 0
    assert el.el_rmsnorm(None, fptr(x), fptr(x), fptr(x), 0, 8, 1e-5) < 0
    assert el.el_rmsnorm(None, fptr(x), fptr(x), fptr(x), 2, 8, -1.0) < 0
    assert el.el_rope(fptr(x), fptr(x), 2, 1, 8, 9, fptr(c), fptr(c), 0) < 0      # rope_dim > hd
    assert el.el_rope(fptr(x), fptr(x), 2, 1, 8, 7, fptr(c), fptr(c), 0) < 0      # odd rope_dim
    assert el.el_rope(fptr(x), fptr(x), 2, 1, 8, 8, fptr(c), fptr(c), 2) < 0      # unknown style
    assert el.el_swiglu(None, fptr(x), fptr(x), 2, 0) < 0
    assert el.el_softmax(None, 1, 4) < 0
    assert el.el_softmax(fptr(x), 2, -1) < 0
    assert el.el_add(fptr(x), None, fptr(x), 4) < 0
    assert el.el_add(fptr(x), fptr(x), fptr(x), 0) == 0


# ---- attention --------------------------------------------------------------------------------

def _qkv(rng, T, H, KVH, hd, start):
    n = start + T
    q = f32(rng.standard_normal((T, H, hd)) * 2)
    k = f32(rng.standard_normal((KVH, n, hd)) * 2)
    v = f32(rng.standard_normal((KVH, n, hd)))
    return q, k, v


# (T, H, KVH, hd, start): one token, one head, GQA 3:1 as SmolLM2, hd 32, odd hd (vector tails),
# a chunk after cached context, a prefill longer than a tile, a group wider than a tile (G = 20);
# decode tokens at hd 80, 48, 20 and 36 (the decode blocks' 64- and 16-dim passes, their masked and
# 4-dim tails), and with 4 and 5 query heads a kv head (a 4-row block, then 4 + 1)
ATTN_CASES = [(1, 1, 1, 64, 0), (1, 9, 3, 64, 100), (5, 9, 3, 64, 0), (17, 4, 2, 32, 40), (3, 6, 2, 20, 7),
              (40, 2, 1, 64, 0), (9, 20, 1, 18, 3), (1, 9, 3, 64, 700), (2, 8, 8, 64, 600), (2, 2, 1, 64, 600),
              (1, 6, 2, 80, 70), (1, 3, 1, 48, 9), (1, 4, 2, 20, 33), (1, 8, 2, 64, 90), (1, 10, 2, 36, 50)]


@pytest.mark.parametrize("T,H,KVH,hd,start", ATTN_CASES)
@pytest.mark.parametrize("use_pool", [False, True])
def test_attention_dense(el, pool2, T, H, KVH, hd, start, use_pool):
    rng = np.random.default_rng(T * 31 + H * 7 + hd + start)
    q, k, v = _qkv(rng, T, H, KVH, hd, start)
    out = np.full((T, H * hd), np.nan, np.float32)
    rc = el.el_attention_dense(_pool(pool2, use_pool), fptr(q), fptr(out), T, H, KVH, hd, start, fptr(k), fptr(v))
    assert rc == 0
    err = nmse(out, reference.attention(q, k, v, start))
    assert err <= ATTN_BOUND, err


@pytest.mark.parametrize("threads,T,H,KVH,hd,start", [(16, 400, 1, 1, 32, 200), (8, 1, 9, 3, 64, 4095),
                                                     (5, 3, 4, 2, 64, 2000)])
def test_attention_key_split(el, threads, T, H, KVH, hd, start):
    """Few tiles for many threads: the keys are split and the partial softmax states merged,
    including rows that see no key of a split (T = 400 from 200: rows t < 100 end before the
    second half). More threads than cores is fine for correctness."""
    rng = np.random.default_rng(threads + T)
    q, k, v = _qkv(rng, T, H, KVH, hd, start)
    out = np.full((T, H * hd), np.nan, np.float32)
    p = el.el_pool_create(threads, None, 0)
    assert p
    try:
        rc = el.el_attention_dense(p, fptr(q), fptr(out), T, H, KVH, hd, start, fptr(k), fptr(v))
    finally:
        el.el_pool_destroy(p)
    assert rc == 0
    err = nmse(out, reference.attention(q, k, v, start))
    assert err <= ATTN_BOUND, err


def _pool_arena(rng, n, n_layers, block_tokens, KVH, hd, dtype):
    """A KV arena (blocks, layers, block_tokens, KVH, hd) as kv/pool.py lays it out, with the
    sequence's blocks scattered (shuffled, spare blocks between them) and every other layer and
    unused row filled with garbage that must not be read."""
    n_used = -(-n // block_tokens)
    n_blocks = 2 * n_used + 3
    table = rng.permutation(n_blocks)[:n_used].astype(np.int32)
    shape = (n_blocks, n_layers, block_tokens, KVH, hd)
    k = rng.standard_normal(shape).astype(dtype) * 2
    v = rng.standard_normal(shape).astype(dtype)
    return k, v, table


def _gather(arena, table, layer, n):
    """(KVH, n, hd) fp32 rows of one layer, position p from block table[p // bt], row p % bt."""
    rows = arena[table, layer].reshape(-1, *arena.shape[3:])[:n]      # (n, KVH, hd)
    return f32(rows.astype(np.float32).transpose(1, 0, 2))


# (T, H, KVH, hd, start, block_tokens). Several tiles read each kv head's keys in: 40 tokens of a
# 3-head group (2 token tiles), an 80-head group (2 head slices), hd 36, and 2 token tiles of one
# kv head on 2 threads (keys split as well)
POOL_ATTN_CASES = [(1, 9, 3, 64, 0, 16), (1, 9, 3, 64, 44, 16), (7, 9, 3, 64, 50, 32), (20, 4, 4, 32, 0, 16),
                   (3, 2, 1, 36, 29, 16), (1, 9, 3, 64, 1023, 32), (1, 6, 2, 80, 70, 16), (40, 9, 3, 64, 30, 16),
                   (5, 80, 1, 32, 70, 16), (30, 6, 2, 36, 100, 16), (40, 3, 1, 64, 472, 16)]


@pytest.mark.parametrize("kv_dtype", [np.float16, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("T,H,KVH,hd,start,block_tokens", POOL_ATTN_CASES)
@pytest.mark.parametrize("use_pool", [False, True])
def test_attention_pool(el, pool2, kv_dtype, T, H, KVH, hd, start, block_tokens, use_pool):
    rng = np.random.default_rng(T * 13 + start + hd + block_tokens)
    n, n_layers = start + T, 3
    layer = (T + start) % 2 + 1
    k, v, table = _pool_arena(rng, n, n_layers, block_tokens, KVH, hd, kv_dtype)
    q = f32(rng.standard_normal((T, H, hd)) * 2)
    kv_type = EL_F16 if kv_dtype == np.float16 else EL_F32
    out = np.full((T, H * hd), np.nan, np.float32)
    rc = el.el_attention_pool(_pool(pool2, use_pool), fptr(q), fptr(out), T, H, KVH, hd, start,
                              k.ctypes.data, v.ctypes.data, kv_type,
                              table.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), block_tokens, n_layers, layer)
    assert rc == 0
    ref = reference.attention(q, _gather(k, table, layer, n), _gather(v, table, layer, n), start)
    err = nmse(out, ref)
    assert err <= ATTN_BOUND, err


@pytest.mark.parametrize("T,H,KVH,hd,start,block_tokens", POOL_ATTN_CASES)
@pytest.mark.parametrize("use_pool", [False, True])
def test_attention_f16_pool_equals_f32(el, pool2, T, H, KVH, hd, start, block_tokens, use_pool):
    """fp16 K/V widen to fp32 exactly, and the f16 path (each tile converting its chunks, the
    decode path converting rows in registers) runs the same blocks on the same values as the f32
    path reading the arena in place: the outputs are equal bit for bit."""
    rng = np.random.default_rng(T * 7 + H + start)
    n, n_layers, layer = start + T, 2, 1
    k, v, table = _pool_arena(rng, n, n_layers, block_tokens, KVH, hd, np.float16)
    q = f32(rng.standard_normal((T, H, hd)) * 2)
    outs = []
    for arena_k, arena_v, kv_type in ((k, v, EL_F16), (k.astype(np.float32), v.astype(np.float32), EL_F32)):
        out = np.full((T, H * hd), np.nan, np.float32)
        rc = el.el_attention_pool(_pool(pool2, use_pool), fptr(q), fptr(out), T, H, KVH, hd, start,
                                  arena_k.ctypes.data, arena_v.ctypes.data, kv_type,
                                  table.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), block_tokens, n_layers, layer)
        assert rc == 0
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])


def _i8_arena(rng, n, n_layers, block_tokens, KVH, hd):
    """An int8 pool arena as kv/pool.py writes it (quantize_int8 of random rows, every row of every
    block, so garbage rows carry scales too), its two el_kv_i8 descriptors and the dequantized
    fp32 arenas (q * scale, as the pool's reader computes them)."""
    k, v, table = _pool_arena(rng, n, n_layers, block_tokens, KVH, hd, np.float32)
    k[table[:1]] *= 50.0                  # a block of large keys: scales differ by rows and blocks
    (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
    desc = (neon_lib.ElKvI8(kq.ctypes.data, ks.ctypes.data), neon_lib.ElKvI8(vq.ctypes.data, vs.ctypes.data))
    deq = [f32(qa.astype(np.float32) * sa[..., None]) for qa, sa in ((kq, ks), (vq, vs))]
    return (kq, ks, vq, vs), desc, deq, table


@pytest.mark.parametrize("T,H,KVH,hd,start,block_tokens", POOL_ATTN_CASES)
@pytest.mark.parametrize("use_pool", [False, True])
def test_attention_i8_pool(el, pool2, T, H, KVH, hd, start, block_tokens, use_pool):
    """An int8 pool (EL_KV_I8): against the reference on the dequantized keys and values within
    ATTN_BOUND, and bit for bit equal to the f32 pool holding those values: chunks (T > 1) and
    decode tokens dequantize each chunk of keys into the buffers the f32 blocks read."""
    rng = np.random.default_rng(T * 5 + H + start + hd)
    n, n_layers, layer = start + T, 3, 2
    arrays, desc, (kf, vf), table = _i8_arena(rng, n, n_layers, block_tokens, KVH, hd)
    q = f32(rng.standard_normal((T, H, hd)) * 2)
    tp = table.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
    outs = []
    for kp, vp, kv_type in ((ctypes.addressof(desc[0]), ctypes.addressof(desc[1]), EL_KV_I8),
                            (kf.ctypes.data, vf.ctypes.data, EL_F32)):
        out = np.full((T, H * hd), np.nan, np.float32)
        rc = el.el_attention_pool(_pool(pool2, use_pool), fptr(q), fptr(out), T, H, KVH, hd, start, kp, vp, kv_type,
                                  tp, block_tokens, n_layers, layer)
        assert rc == 0
        outs.append(out)
    ref = reference.attention(q, _gather(kf, table, layer, n), _gather(vf, table, layer, n), start)
    err = nmse(outs[0], ref)
    assert err <= ATTN_BOUND, err
    np.testing.assert_array_equal(outs[0], outs[1])


def test_attention_i8_pool_generic_twin(el):
    """The generic twin reads the int8 arena element by element (q * scale)."""
    rng = np.random.default_rng(11)
    T, H, KVH, hd, start, bt = 3, 6, 2, 36, 40, 16
    n, n_layers, layer = start + T, 2, 1
    arrays, desc, (kf, vf), table = _i8_arena(rng, n, n_layers, bt, KVH, hd)
    q = f32(rng.standard_normal((T, H, hd)))
    out = np.full((T, H * hd), np.nan, np.float32)
    el.el_use_generic(1)
    try:
        rc = el.el_attention_pool(None, fptr(q), fptr(out), T, H, KVH, hd, start, ctypes.addressof(desc[0]),
                                  ctypes.addressof(desc[1]), EL_KV_I8, table.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                  bt, n_layers, layer)
    finally:
        el.el_use_generic(0)
    assert rc == 0
    err = nmse(out, reference.attention(q, _gather(kf, table, layer, n), _gather(vf, table, layer, n), start))
    assert err <= ATTN_BOUND, err


def _i8_cases(hd: int) -> np.ndarray:
    """Rows for the int8 K/V quantizer: random at several magnitudes, rounding ties (k + 0.5 times
    the scale, both signs), a row that reaches +-127 exactly, zeros, a subnormal maximum, a tiny
    scale next to a huge value, NaN and inf."""
    rng = np.random.default_rng(hd)
    x = (rng.standard_normal((300, hd)) * rng.choice([1e-30, 1e-3, 1.0, 1e3, 1e30], (300, 1))).astype(np.float32)
    x[0] = 0.0
    x[1] = (np.arange(hd) % 127 + 0.5) * 3.0 * np.where(np.arange(hd) % 2, 1, -1)
    x[1, 0] = 127 * 3.0                   # scale 3.0 exactly: every other value a tie
    x[2] = 1e-40
    x[3] = -1e-40
    x[3, -1] = 3e-39
    x[4, 0], x[5, -1], x[6, 0] = np.nan, np.inf, -np.inf
    x[7, :] = 1e-38
    x[7, 0] = 1e38
    return x


@pytest.mark.parametrize("generic", [0, 1], ids=["native", "generic"])
@pytest.mark.parametrize("hd", [64, 7, 13, 128])
def test_kv_quantize_i8_equals_the_pool_writer(el, generic, hd):
    """el_kv_quantize_i8 (what the fused step stores into an int8 pool) against kv/pool.py's
    quantize_int8, bit for bit: scales, and every int8 value, special rows included."""
    x = _i8_cases(hd)
    q = np.full(x.shape, 99, np.int8)
    s = np.full(x.shape[0], 99.0, np.float32)
    el.el_use_generic(generic)
    try:
        assert el.el_kv_quantize_i8(x.ctypes.data, q.ctypes.data, s.ctypes.data, x.shape[0], hd) == 0
    finally:
        el.el_use_generic(0)
    with np.errstate(all="ignore"):
        rq, rs = quantize_int8(x)
    np.testing.assert_array_equal(s.view(np.uint32), rs.view(np.uint32))
    bad = np.flatnonzero((q != rq).any(axis=1))
    assert bad.size == 0, [(int(r), x[r][:4], q[r][:4], rq[r][:4]) for r in bad[:3]]


def test_kv_quantize_i8_bad_args(el):
    x = f32(np.ones((2, 8)))
    q = np.zeros((2, 8), np.int8)
    s = np.zeros(2, np.float32)
    assert el.el_kv_quantize_i8(fptr(x), q.ctypes.data, s.ctypes.data, 2, 0) < 0
    assert el.el_kv_quantize_i8(fptr(x), q.ctypes.data, s.ctypes.data, -1, 8) < 0
    assert el.el_kv_quantize_i8(None, q.ctypes.data, s.ctypes.data, 2, 8) < 0
    assert el.el_kv_quantize_i8(fptr(x), q.ctypes.data, None, 2, 8) < 0
    assert el.el_kv_quantize_i8(None, None, None, 0, 8) == 0
    assert not q.any() and not s.any()


def test_attention_bad_args(el):
    T, H, KVH, hd, start = 2, 4, 2, 8, 3
    n = start + T
    q = f32(np.ones((T, H, hd)))
    out = np.zeros((T, H * hd), np.float32)
    k = f32(np.ones((KVH, n, hd)))
    table = np.zeros(4, np.int32)
    tp = table.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
    dense = el.el_attention_dense
    assert dense(None, None, fptr(out), T, H, KVH, hd, start, fptr(k), fptr(k)) < 0
    assert dense(None, fptr(q), fptr(out), T, H, KVH, hd, start, fptr(k), None) < 0
    for bad in [(0, H, KVH, hd, start), (T, 0, KVH, hd, start), (T, H, 0, hd, start), (T, H, KVH, 0, start),
                (T, H, KVH, hd, -1), (T, 4, 3, hd, start), (T, H, KVH, 4096, start), (2, H, KVH, hd, 2**31 - 2),
                (2**16, 2**16, 1, hd, 0)]:                     # T * H query rows overflow int
        assert dense(None, fptr(q), fptr(out), *bad, fptr(k), fptr(k)) < 0, bad

    def pool_call(kv_type=EL_F32, table_p=tp, block_tokens=4, n_layers=2, layer=1):
        return el.el_attention_pool(None, fptr(q), fptr(out), T, H, KVH, hd, start, k.ctypes.data, k.ctypes.data,
                                    kv_type, table_p, block_tokens, n_layers, layer)

    assert pool_call(kv_type=2) < 0            # Q4_0 K/V: not a pool storage type
    empty = neon_lib.ElKvI8(None, None)
    half = neon_lib.ElKvI8(k.ctypes.data, None)   # an int8 arena without its scales
    for kd, vd in ((empty, empty), (half, half), (neon_lib.ElKvI8(k.ctypes.data, k.ctypes.data), half)):
        assert el.el_attention_pool(None, fptr(q), fptr(out), T, H, KVH, hd, start, ctypes.addressof(kd),
                                    ctypes.addressof(vd), EL_KV_I8, tp, 4, 2, 1) < 0
    assert pool_call(kv_type=-1) < 0
    assert pool_call(table_p=None) < 0
    assert pool_call(block_tokens=0) < 0
    assert pool_call(n_layers=0) < 0
    assert pool_call(layer=2) < 0              # layer == n_layers
    assert pool_call(layer=-1) < 0
    table[1] = -5
    assert pool_call() < 0                     # a negative block id in the used part of the table


# ---- thread pool ------------------------------------------------------------------------------

def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.parametrize("n_tasks", [0, -3, 1, 2, 3, 1000])
def test_parallel_for_covers_every_task_once(lib, pool2, n_tasks):
    seen = []
    lock = threading.Lock()

    @_TASK_FN
    def task(ctx, t, n):
        with lock:
            seen.append((t, n))

    lib.el_parallel_for(pool2, n_tasks, task, None)
    expect = sorted((t, n_tasks) for t in range(max(n_tasks, 0)))
    assert sorted(seen) == expect
    seen.clear()
    lib.el_parallel_for(None, n_tasks, task, None)      # NULL pool: inline on the caller
    assert sorted(seen) == expect


def test_pool_matches_serial(lib):
    """rmsnorm of many rows through pools of 2 and 3 threads (tasks claimed dynamically) equals
    the serial result bit for bit: every row ran exactly once, with the same kernel."""
    rng = np.random.default_rng(0)
    T, d = 4096, 48
    x, w = f32(rng.standard_normal((T, d))), f32(rng.standard_normal(d))
    serial = np.empty_like(x)
    assert lib.el_rmsnorm(None, fptr(x), fptr(w), fptr(serial), T, d, 1e-6) == 0
    for n in (2, 3):
        p = lib.el_pool_create(n, None, 0)
        assert p and lib.el_pool_threads(p) == n
        try:
            for _ in range(20):
                y = np.full_like(x, np.nan)
                assert lib.el_rmsnorm(p, fptr(x), fptr(w), fptr(y), T, d, 1e-6) == 0
                np.testing.assert_array_equal(y, serial)
        finally:
            lib.el_pool_destroy(p)


def test_pool_affinity_read_back(lib):
    allowed = sorted(os.sched_getaffinity(0))
    for core in allowed[:4]:
        cores = (ctypes.c_int * 2)(allowed[0], core)        # worker 1 gets cores[1 % 2]
        p = lib.el_pool_create(2, cores, 2)
        assert p
        try:
            buf = (ctypes.c_int * 1024)()
            count = lib.el_pool_affinity(p, 1, buf, 1024)
            assert list(buf[:count]) == [core]
            count = lib.el_pool_affinity(p, 0, buf, 1024)     # the caller is not re-pinned
            assert sorted(buf[:count]) == allowed
            assert lib.el_pool_affinity(p, 2, buf, 1024) < 0
            assert lib.el_pool_affinity(p, -1, buf, 1024) < 0
        finally:
            lib.el_pool_destroy(p)


def test_pool_bad_args(lib):
    assert not lib.el_pool_create(0, None, 0)
    assert not lib.el_pool_create(100000, None, 0)
    cores = (ctypes.c_int * 1)(-1)
    assert not lib.el_pool_create(2, cores, 1)
    assert not lib.el_pool_create(2, cores, 0)
    assert lib.el_pool_threads(None) == 1
    lib.el_pool_destroy(None)


def test_pool_create_destroy_100(lib):
    """100 pools created, used and destroyed (some while their workers spin, some once they
    sleep): no thread left behind, no hang."""
    before = _thread_count()
    rng = np.random.default_rng(1)
    x, w = f32(rng.standard_normal((512, 64))), f32(np.ones(64))
    y = np.empty_like(x)
    errors = []

    def churn():
        try:
            for i in range(100):
                p = lib.el_pool_create(2 + i % 3, None, 0)
                assert p
                if i % 2:
                    assert lib.el_rmsnorm(p, fptr(x), fptr(w), fptr(y), 512, 64, 1e-6) == 0
                if i % 10 == 9:
                    time.sleep(0.002)          # past the spin window: workers are asleep
                lib.el_pool_destroy(p)
        except Exception as e:                 # pragma: no cover - reported below
            errors.append(e)

    th = threading.Thread(target=churn, daemon=True)
    th.start()
    th.join(timeout=60)
    assert not th.is_alive(), "creating/destroying pools hung"
    assert not errors, errors
    deadline = time.monotonic() + 5      # the churn thread itself may take a moment to exit
    while _thread_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    # no worker left behind; fewer is fine: a thread of an earlier test (a pool freed by the
    # garbage collector, a library's helper) may exit meanwhile (CI once counted 7 after 8)
    assert _thread_count() <= before


def test_pool_wakes_after_sleep(lib, pool2):
    """A job published while the worker sleeps (past its spin window) still completes."""
    seen = []

    @_TASK_FN
    def task(ctx, t, n):
        seen.append(t)

    for _ in range(3):
        time.sleep(0.01)
        seen.clear()
        lib.el_parallel_for(pool2, 64, task, None)
        assert sorted(seen) == list(range(64))


# ---- real NEON: the aarch64 compiler accepts these files --------------------------------------

@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None, reason="aarch64-linux-gnu-gcc is not installed")
@pytest.mark.parametrize("variant", VARIANTS)
def test_cross_compiles_for_aarch64(variant, tmp_path):
    flags = _build_neon_module().compile_flags(variant, arm=True)
    for src in KERNEL_SOURCES:
        cmd = ["aarch64-linux-gnu-gcc", *flags, "-Wall", "-Wextra", "-Werror", "-fPIC", "-c", str(NEON / src),
               "-o", str(tmp_path / (src + ".o"))]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, f"{src} ({variant}):\n{r.stderr}"


# ---- the peak probe (peak_probe.c): no numeric output to compare, so its contract ------------------

PEAK_FP32, PEAK_FP16, PEAK_INT8 = 0, 1, 2


def _peak(lib, kind, iters):
    ops = ctypes.c_double(-1.0)
    rc = lib.el_peak_probe(kind, iters, ctypes.byref(ops))
    return rc, ops.value


@pytest.mark.parametrize("kind, lanes", [(PEAK_FP32, (4, 8, 16)), (PEAK_INT8, (8, 16, 32, 64))])
def test_peak_probe_counts_12_chains_of_its_widest_mac(lib, kind, lanes):
    rc, ops = _peak(lib, kind, 1000)
    assert rc == 0
    per_chain_step = ops / (1000 * 12 * 2)          # MACs per instruction of this build
    assert per_chain_step in lanes
    rc, ops2 = _peak(lib, kind, 3000)
    assert rc == 0 and ops2 == 3 * ops


def test_peak_probe_fp16_is_native_or_unsupported(lib):
    rc, ops = _peak(lib, PEAK_FP16, 100)
    if platform.machine().lower() not in ("aarch64", "arm64"):
        assert rc == -3            # x86 has no fp16 FMA here; SIMDe would time an emulation
    else:
        assert (rc, ops) == (0, 100 * 12 * 8 * 2) or rc == -3


@pytest.mark.parametrize("kind, iters", [(7, 10), (-1, 10), (PEAK_FP32, 0), (PEAK_INT8, -5)])
def test_peak_probe_rejects_bad_arguments(lib, kind, iters):
    assert _peak(lib, kind, iters)[0] == -1
    assert lib.el_peak_probe(PEAK_FP32, 10, None) == -1


def test_peak_per_core_reports_positive_rates():
    from edgellm.backends import neon, neon_probe
    if not neon.available()[0]:
        pytest.skip(f"neon unit unavailable: {neon.available()[1]}")
    peaks, note = neon_probe.peak_per_core(seconds=0.002, runs=3)
    assert set(peaks) == {"fp32", "fp16", "int8"} and all(v > 0 for v in peaks.values())
    if "fp16" in note:              # no native fp16: its work runs in fp32, at the fp32 rate
        assert peaks["fp16"] == peaks["fp32"]


@pytest.mark.parametrize("T,H,KVH,hd,start", [(8, 1, 1, 64, 0), (32, 9, 3, 64, 100), (5, 2, 1, 36, 3)])
@pytest.mark.parametrize("use_pool", [False, True])
def test_attention_a_later_tokens_inf_value_stays_out_of_earlier_rows(el, pool2, T, H, KVH, hd, start, use_pool):
    """A V row holding inf (an fp16 store of 70000) at the chunk's last token: the rows before it
    never see that key, but a row group's PV ran over its widest row's keys, and 0 * inf = NaN
    reached the earlier rows (a helper's aarch64 probe; NR = 2 there, 4 on x86). Every row that
    does not see it must be finite and equal the reference's; the last row is inf / NaN there."""
    rng = np.random.default_rng(T + H + start)
    q, k, v = _qkv(rng, T, H, KVH, hd, start)
    v[:, start + T - 1, 1] = np.inf
    out = np.full((T, H * hd), np.nan, np.float32)
    rc = el.el_attention_dense(_pool(pool2, use_pool), fptr(q), fptr(out), T, H, KVH, hd, start, fptr(k), fptr(v))
    assert rc == 0
    ref = reference.attention(q, k, v, start)
    assert np.isfinite(out[:-1]).all(), np.argwhere(~np.isfinite(out[:-1]))[:4]
    assert np.isfinite(ref[:-1]).all() and nmse(out[:-1], ref[:-1]) <= ATTN_BOUND


def test_attention_a_minus_inf_first_score_weighs_nothing(el):
    """A key whose score is -inf (a query against a key of -inf) has weight 0; the generic twin
    computed -inf - -inf = NaN for it when it came first, and every later key of the row was NaN
    (a helper's aarch64 probe). Both twins match the reference, which gives it weight 0."""
    rng = np.random.default_rng(5)
    T, H, KVH, hd, start = 3, 2, 1, 8, 0
    q, k, v = _qkv(rng, T, H, KVH, hd, start)
    q[:] = np.abs(q) + 0.1
    k[:, 0, :] = -np.inf                       # every score against key 0 is -inf
    out = np.full((T, H * hd), np.nan, np.float32)
    assert el.el_attention_dense(None, fptr(q), fptr(out), T, H, KVH, hd, start, fptr(k), fptr(v)) == 0
    with np.errstate(invalid="ignore"):          # (row 0 sees key 0 alone: -inf - -inf there)
        ref = reference.attention(q, k, v, start)
    assert np.isfinite(ref[1:]).all()
    assert np.isfinite(out[1:]).all() and nmse(out[1:], ref[1:]) <= ATTN_BOUND
