"""el_matmul and el_matmul_f32act (neon/quant_matmul.c, neon/matmul_float.c) against
reference.matmul.

Both library variants (base: SMULL/SADALP; dotprod: SDOT), each with its NEON kernels and with
their plain C twins (el_use_generic). The installed library is used when it is there and
current; otherwise the whole neon/ tree is built into a temporary directory with
tools/build_neon.py (on x86 through SIMDe), so the tests also run from a bare checkout.

Error measure: NMSE = mean((y - ref)^2) / mean(ref^2), ref = x @ dequantized(W).T in fp32.
"""
from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from edgellm import quant
from edgellm.backends import neon_lib, reference
from edgellm.backends.neon_lib import fptr

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("base", "dotprod")
EL_TYPE = {T.F32: neon_lib.EL_F32, T.F16: neon_lib.EL_F16, T.Q4_0: neon_lib.EL_Q4_0,
           T.Q4_1: neon_lib.EL_Q4_1, T.Q8_0: neon_lib.EL_Q8_0}
BLOCK_TYPES = (T.Q4_0, T.Q4_1, T.Q8_0)

# Quantized weights are compared with their own dequantization, so the only approximation left
# is x's int8 rounding: error uniform in +-d/2 with d = max|x_block| / 127. For Gaussian x a
# block's max is ~2.1 sigma, so the error's variance is (2.1/127)^2 / 12 ~ 2.3e-5 of x's, and it
# passes through the dot product unchanged in relative terms (errors independent of W): NMSE
# ~2e-5, 20x under the bound (the product bound for matmul in DESIGN.md).
NMSE_QUANT = 5e-4
# F32, and F16 weights widened exactly to fp32: only the summation order differs from BLAS,
# ~K * eps^2 ~ 1e-11 at K = 1536. 1e-9 keeps a wide margin yet fails on one wrong output in
# 64 x 960 (~1.6e-5).
NMSE_FLOAT = 1e-9
# NEON kernels vs their generic twins on the same int8 activations (both twins quantize x bit
# for bit alike): only fp32 rounding of the per-block scaling differs.
NMSE_TWINS = 1e-10
# Largest single error allowed, as a fraction of the outputs' rms: ~10 standard deviations of
# the int8 rounding error (see above); fp32 summation order ~1e-6.
GROSS_QUANT = 0.05
GROSS_FLOAT = 1e-4

MS = (1, 2, 3, 5, 17, 64)
# K in blocks of 32: 1, 2, 3, 5, 18, 48; the x86 AVX-512 GEMV reads 4 blocks at a time, so
# every remainder mod 4 (with and without whole groups before it)
KS = (32, 64, 96, 160, 576, 1536)
NS = (1, 7, 33, 960)

_observed: dict[str, float] = {}      # worst NMSE per weight type, printed at the end (-s)


def _build_module():
    spec = importlib.util.spec_from_file_location("build_neon", ROOT / "tools" / "build_neon.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module", params=VARIANTS)
def lib(request, tmp_path_factory):
    variant = request.param
    try:
        lib = neon_lib.load(variant)
    except neon_lib.NeonLibError:
        # not installed (or stale): build this checkout's neon/ privately
        out = tmp_path_factory.mktemp("neon") / f"_neon_{variant}.so"
        _build_module().build(out, variant)
        lib = neon_lib.load(variant, path=out)
    yield lib
    lib.el_use_generic(0)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if _observed:
        print("\nmax NMSE per weight type: " + ", ".join(f"{k} {v:.2e}" for k, v in sorted(_observed.items())))


# ---- helpers -----------------------------------------------------------------------------------

_WEIGHTS: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}


def weights(qtype: T, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw GGUF bytes (n, bytes_per_row), fp32 dequantized (n, k)), cached per shape."""
    key = (qtype, n, k, seed)
    if key not in _WEIGHTS:
        rng = np.random.default_rng([seed, n, k, int(qtype)])
        w = rng.standard_normal((n, k)).astype(np.float32)
        raw = np.ascontiguousarray(quant.quantize(w, qtype))
        _WEIGHTS[key] = (raw, quant.dequantize(raw.reshape(-1), qtype, (n, k)))
    return _WEIGHTS[key]


def el_matmul(lib, qtype, segs: list[np.ndarray], x: np.ndarray, bias=None, scratch="auto", wtype=None, pool=None):
    """Calls el_matmul on raw segments (pool None: on this thread); returns (rc, y)."""
    M, K = x.shape
    rows = [s.shape[0] for s in segs]
    N = max(1, sum(rows))
    y = np.full((M, N), np.nan, np.float32)
    ptrs = (ctypes.c_void_p * len(segs))(*[s.ctypes.data for s in segs])
    rows_c = (ctypes.c_int * len(segs))(*rows)
    if scratch == "auto":
        buf = np.empty(lib.el_matmul_scratch(M, K) + 1, np.uint8)
        sp = buf.ctypes.data + 1                 # deliberately misaligned: the library aligns it
    else:
        sp = None
    rc = lib.el_matmul(pool, EL_TYPE[qtype] if wtype is None else wtype, ptrs, rows_c, len(segs), fptr(x),
                       fptr(y), M, K, fptr(bias) if bias is not None else None, sp)
    return rc, y


def el_matmul_f32act(lib, qtype, segs: list[np.ndarray], x: np.ndarray, bias=None, wtype=None, pool=None):
    """Calls el_matmul_f32act (fp32 x, no scratch) on raw segments; returns (rc, y)."""
    M, K = x.shape
    rows = [s.shape[0] for s in segs]
    y = np.full((M, max(1, sum(rows))), np.nan, np.float32)
    ptrs = (ctypes.c_void_p * len(segs))(*[s.ctypes.data for s in segs])
    rows_c = (ctypes.c_int * len(segs))(*rows)
    rc = lib.el_matmul_f32act(pool, EL_TYPE[qtype] if wtype is None else wtype, ptrs, rows_c, len(segs), fptr(x),
                              fptr(y), M, K, fptr(bias) if bias is not None else None)
    return rc, y


def nmse(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.mean((y.astype(np.float64) - ref) ** 2) / max(np.mean(ref.astype(np.float64) ** 2), 1e-30))


class Errors:
    """Error statistics of several calls pooled into one NMSE: a handful of outputs (N = 1 with
    M = 1, K = 32) gives a ratio of a few squared errors to a few squared results, which a
    single small result (a near-cancelling dot) can blow up; pooled over every M of a shape the
    ratio is stable, and one wrong output still stands out (1 / 92 outputs = 1e-2).
    fp32_x: x was not rounded to int8 (el_matmul_f32act), so block weights get the float bounds."""

    def __init__(self, qtype, fp32_x: bool = False):
        self.qtype, self.err2, self.ref2, self.n, self.max_abs, self.cases = qtype, 0.0, 0.0, 0, 0.0, []
        self.fp32_x = fp32_x

    def add(self, y, ref, what: str):
        assert np.all(np.isfinite(y)), what
        d = y.astype(np.float64) - ref
        self.err2 += float(np.sum(d * d))
        self.ref2 += float(np.sum(ref.astype(np.float64) ** 2))
        self.n += d.size
        self.max_abs = max(self.max_abs, float(np.max(np.abs(d))))
        self.cases.append(what)

    def check(self) -> float:
        e = self.err2 / max(self.ref2, 1e-30)
        quantized = self.qtype in BLOCK_TYPES and not self.fp32_x
        assert e < (NMSE_QUANT if quantized else NMSE_FLOAT), f"{self.qtype.name} {self.cases}: NMSE {e:.2e}"
        # and no single output far off: the int8 error's std is ~0.5% of the outputs' rms
        rms = (self.ref2 / max(self.n, 1)) ** 0.5
        assert self.max_abs <= (GROSS_QUANT if quantized else GROSS_FLOAT) * rms, \
            f"{self.qtype.name} {self.cases}: max |error| {self.max_abs:.3g} vs rms {rms:.3g}"
        key = self.qtype.name + (" f32act" if self.fp32_x else "")
        _observed[key] = max(_observed.get(key, 0.0), e)
        return e


def run_case(lib, qtype, segs_raw, segs_ref, x, bias, generic: int, errs: Errors):
    lib.el_use_generic(generic)
    try:
        rc, y = el_matmul(lib, qtype, segs_raw, x, bias)
    finally:
        lib.el_use_generic(0)
    what = f"M={x.shape[0]} K={x.shape[1]} N={y.shape[1]} bias={bias is not None} generic={generic}"
    assert rc == 0, what
    ref = reference.matmul(x, np.concatenate(segs_ref), bias)
    errs.add(y, ref, what)


def check(lib, qtype, segs_raw, segs_ref, x, bias, generic: int) -> float:
    errs = Errors(qtype)
    run_case(lib, qtype, segs_raw, segs_ref, x, bias, generic, errs)
    return errs.check()


# ---- conformance -------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.F32, T.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("K", KS)
def test_matmul_matches_reference(lib, qtype, K):
    rng = np.random.default_rng(K)
    for N in NS:
        raw, deq = weights(qtype, N, K)
        bias = rng.standard_normal(N).astype(np.float32) if N in (7, 960) else None
        for generic in (0, 1):
            errs = Errors(qtype)
            for M in MS:
                x = rng.standard_normal((M, K)).astype(np.float32)
                run_case(lib, qtype, [raw], [deq], x, bias, generic, errs)
            errs.check()


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.F32, T.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("M", (1, 5, 64))
def test_segments_like_fused_qkv(lib, qtype, M):
    """Three separate tensors of different heights (Q, K, V) produce one (M, N) result; row counts
    that are not multiples of the 4-row tile and a chunk boundary inside a segment."""
    K = 576
    rows = (130, 33, 67)
    segs = [weights(qtype, n, K, seed=i + 1) for i, n in enumerate(rows)]
    rng = np.random.default_rng(M)
    x = rng.standard_normal((M, K)).astype(np.float32)
    bias = rng.standard_normal(sum(rows)).astype(np.float32)
    for b in (None, bias):
        for generic in (0, 1):
            check(lib, qtype, [s[0] for s in segs], [s[1] for s in segs], x, b, generic)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.F32, T.F16], ids=lambda t: t.name)
def test_neon_matches_generic_twin(lib, qtype):
    """The NEON tile kernels against the scalar twins on identical int8 activations."""
    K, N = 1536, 37
    raw, _ = weights(qtype, N, K)
    x = np.random.default_rng(3).standard_normal((6, K)).astype(np.float32)
    out = []
    for generic in (0, 1):
        lib.el_use_generic(generic)
        rc, y = el_matmul(lib, qtype, [raw], x)
        assert rc == 0
        out.append(y)
    lib.el_use_generic(0)
    assert nmse(out[0], out[1]) < NMSE_TWINS


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.F32, T.F16], ids=lambda t: t.name)
def test_thread_pool_matches_serial(lib, qtype):
    """With a pool the task grid changes (more, smaller chunks) and tasks run concurrently; the
    outputs must agree with the serial run (same kernels, summation order aside) and the
    reference. GEMV, a small GEMM and a fused three-segment GEMM."""
    pool = lib.el_pool_create(3, None, 0)
    assert pool
    try:
        rng = np.random.default_rng(11)
        # GEMVs: one segment, and three uneven ones whose range boundaries fall inside segments
        for M, K, rows in ((1, 576, (960,)), (1, 576, (130, 33, 67)), (1, 64, (1000, 9)), (17, 576, (130, 33, 67)),
                           (64, 1536, (37,))):
            segs = [weights(qtype, n, K, seed=i + 5) for i, n in enumerate(rows)]
            x = rng.standard_normal((M, K)).astype(np.float32)
            bias = rng.standard_normal(sum(rows)).astype(np.float32)
            rc0, y0 = el_matmul(lib, qtype, [s[0] for s in segs], x, bias)
            rc1, y1 = el_matmul(lib, qtype, [s[0] for s in segs], x, bias, pool=pool)
            assert rc0 == rc1 == 0
            assert nmse(y1, y0) < NMSE_TWINS, (M, K, rows)
            errs = Errors(qtype)
            errs.add(y1, reference.matmul(x, np.concatenate([s[1] for s in segs]), bias), f"M={M} pool")
            errs.check()
    finally:
        lib.el_pool_destroy(pool)


def test_float_k_not_multiple_of_4(lib):
    """F32 / F16 accept any K: the 4-wide loop leaves a scalar tail."""
    rng = np.random.default_rng(5)
    for qtype in (T.F32, T.F16):
        for K in (1, 3, 37):
            raw, deq = weights(qtype, 9, K)
            for M in (1, 6):
                x = rng.standard_normal((M, K)).astype(np.float32)
                for generic in (0, 1):
                    check(lib, qtype, [raw], [deq], x, None, generic)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_int_headroom_extremes(lib, qtype):
    """Largest products the formats allow: Q8_0 quants of -128 (ggml never writes them, a file
    may) and 15-valued nibbles against x quantized to +-127. The base variant accumulates
    products in int16 before widening; this is where it would overflow."""
    K, N = 64, 5
    raw, _ = weights(qtype, N, K)
    raw = raw.copy()
    blocks = raw.reshape(-1).view(quant._BLOCK_DTYPES[qtype])
    blocks["qs"] = -128 if qtype == T.Q8_0 else 0xFF
    deq = quant.dequantize(raw.reshape(-1), qtype, (N, K))
    x = np.full((3, K), -1.0, np.float32)
    x[1] = 1.0
    for generic in (0, 1):
        check(lib, qtype, [raw], [deq], x, None, generic)


@pytest.mark.parametrize("K", [32, 96, 576, 1536])
def test_q8_0_gemm_rows_are_the_gemv_bits(lib, K):
    """Q8_0 has one exact result per row on every tile: int32 block sums, then one FMA by d_w d_x
    per block in block order. So a GEMM row (the NEON 4 x 4 tile, x86's 8-row AVX2 or 16-row
    AVX-512 tile) equals that row alone (the 4-row tile, or x86's AVX-512 GEMV) bit for bit; an
    x86 AVX-512 build runs its GEMV both ways (el_x86_gemv: 1 the AVX-512 one, 0 the 4-row AVX2
    tile). Weights of -128 and x of +-127 (K = 96) take the tiles' u = q_w + 128 to its ends.
    N: 16-row groups, an 8-row tail, a lone row; M: one tile, tails of 1..3 x rows."""
    wide = lib.el_x86_gemv(-1)
    masks = (wide,) if wide < 0 else (0, 1)
    rng = np.random.default_rng(K)
    try:
        for N in (1, 8, 23, 40, 57):
            raw, _ = weights(T.Q8_0, N, K, seed=2)
            if K == 96:
                raw = raw.copy()
                raw.reshape(-1).view(quant._BLOCK_DTYPES[T.Q8_0])["qs"][::3] = -128
            for M in (2, 4, 7, 37):
                x = rng.standard_normal((M, K)).astype(np.float32)
                x[1, :32] = np.sign(x[1, :32])
                bias = rng.standard_normal(N).astype(np.float32)
                rc, y = el_matmul(lib, T.Q8_0, [raw], x, bias=bias)
                assert rc == 0
                for mask in masks:
                    if mask >= 0:
                        lib.el_x86_gemv(mask)
                    for r in range(M):
                        rc, y1 = el_matmul(lib, T.Q8_0, [raw], x[r:r + 1], bias=bias)
                        assert rc == 0
                        np.testing.assert_array_equal(y1[0].view(np.uint32), y[r].view(np.uint32),
                                                      err_msg=f"K={K} N={N} M={M} row {r} mask={mask}")
    finally:
        if wide >= 0:
            lib.el_x86_gemv(wide)


def test_scratch_null_allocates(lib):
    """scratch = NULL: the library allocates (and frees) the int8 copy of x itself."""
    raw, _ = weights(T.Q4_1, 33, 576)
    x = np.random.default_rng(7).standard_normal((5, 576)).astype(np.float32)
    rc1, y1 = el_matmul(lib, T.Q4_1, [raw], x)
    rc2, y2 = el_matmul(lib, T.Q4_1, [raw], x, scratch=None)
    assert rc1 == rc2 == 0
    np.testing.assert_array_equal(y1, y2)


def test_zero_x_and_zero_row_segment(lib):
    """An all-zero x block (scale 0, no NaN) and an empty segment between two others."""
    raw, deq = weights(T.Q4_0, 8, 64)
    empty = np.zeros((0, raw.shape[1]), np.uint8)
    x = np.zeros((2, 64), np.float32)
    x[1] = np.random.default_rng(9).standard_normal(64)
    for generic in (0, 1):
        lib.el_use_generic(generic)
        rc, y = el_matmul(lib, T.Q4_0, [raw, empty, raw], x)
        lib.el_use_generic(0)
        assert rc == 0
        assert np.all(y[0] == 0.0)
        assert nmse(y[1], reference.matmul(x[1:], np.concatenate([deq, deq]))[0]) < NMSE_QUANT


def test_scratch_size(lib):
    assert lib.el_matmul_scratch(0, 64) == 0 and lib.el_matmul_scratch(4, -1) == 0
    # int8 per input plus two fp32 per block, at least
    assert lib.el_matmul_scratch(512, 1536) >= 512 * 1536 + 2 * 4 * 512 * 48


# ---- bad arguments -----------------------------------------------------------------------------

def test_bad_arguments_return_negative_codes(lib):
    raw, _ = weights(T.Q4_0, 4, 64)
    x = np.ones((2, 64), np.float32)
    ok_rc, _ = el_matmul(lib, T.Q4_0, [raw], x)
    assert ok_rc == 0
    # K = 33 with a block type (x has 33 columns; the weights are never read)
    assert el_matmul(lib, T.Q4_0, [raw], np.ones((2, 33), np.float32))[0] < 0
    assert el_matmul(lib, T.Q4_0, [raw], x, wtype=99)[0] < 0                 # unknown type
    assert el_matmul(lib, T.Q4_0, [raw], x, wtype=-1)[0] < 0
    assert el_matmul(lib, T.Q4_0, [raw], np.ones((0, 64), np.float32))[0] < 0  # M = 0
    assert el_matmul(lib, T.Q4_0, [raw[:0]], x)[0] < 0                        # N = 0

    def call(**kw):
        a = dict(pool=None, wtype=neon_lib.EL_Q4_0, ptrs=(ctypes.c_void_p * 1)(raw.ctypes.data),
                 rows=(ctypes.c_int * 1)(4), n_seg=1, x=fptr(x), y=fptr(np.empty((2, 4), np.float32)),
                 M=2, K=64, bias=None, scratch=None)
        a.update(kw)
        return lib.el_matmul(*a.values())

    assert call() == 0
    assert call(ptrs=None) < 0
    assert call(rows=None) < 0
    assert call(n_seg=0) < 0
    assert call(x=None) < 0
    assert call(y=None) < 0
    assert call(K=0) < 0
    assert call(M=-3) < 0
    assert call(rows=(ctypes.c_int * 1)(-4)) < 0
    assert call(ptrs=(ctypes.c_void_p * 1)(None)) < 0


# ---- el_matmul_f32act: block weights against fp32 x ----------------------------------------------
# x is not rounded and each weight is its exact dequantization, so only the summation order differs
# from reference.matmul: the float bounds (NMSE_FLOAT, GROSS_FLOAT) apply to the block types too.

F32ACT_MS = (1, 2, 3, 6, 17, 45)   # from 2 rows the GEMM form (matmul_bqpanel.c): 17 and 45 end
                                   # mid register block, K 576 and 1536 take several k slices
F32ACT_KS = (32, 576, 1536)


def run_f32act(lib, qtype, segs_raw, segs_ref, x, bias, generic: int, errs: Errors, pool=None) -> np.ndarray:
    lib.el_use_generic(generic)
    try:
        rc, y = el_matmul_f32act(lib, qtype, segs_raw, x, bias, pool=pool)
    finally:
        lib.el_use_generic(0)
    what = f"f32act M={x.shape[0]} K={x.shape[1]} N={y.shape[1]} segs={len(segs_raw)} bias={bias is not None} " \
           f"generic={generic}"
    assert rc == 0, what
    errs.add(y, reference.matmul(x, np.concatenate(segs_ref), bias), what)
    return y


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.F32, T.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("K", F32ACT_KS)
def test_f32act_matches_reference(lib, qtype, K):
    rng = np.random.default_rng(100 + K)
    for N in NS:
        raw, deq = weights(qtype, N, K)
        bias = rng.standard_normal(N).astype(np.float32) if N in (7, 960) else None
        for generic in (0, 1):
            errs = Errors(qtype, fp32_x=True)
            for M in F32ACT_MS:
                x = rng.standard_normal((M, K)).astype(np.float32)
                run_f32act(lib, qtype, [raw], [deq], x, bias, generic, errs)
            errs.check()


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("M", F32ACT_MS)
def test_f32act_segments(lib, qtype, M):
    """Four tensors of different heights (one empty) produce one (M, N) result: row counts that
    are not multiples of the 4-row tile, a chunk boundary inside a segment, with and without bias."""
    K = 576
    segs = [weights(qtype, n, K, seed=i + 1) for i, n in enumerate((130, 33, 67))]
    segs.insert(2, (segs[0][0][:0], segs[0][1][:0]))       # an empty segment (0 rows)
    rows = [s[0].shape[0] for s in segs]
    rng = np.random.default_rng(M)
    x = rng.standard_normal((M, K)).astype(np.float32)
    bias = rng.standard_normal(sum(rows)).astype(np.float32)
    for b in (None, bias):
        for generic in (0, 1):
            errs = Errors(qtype, fp32_x=True)
            run_f32act(lib, qtype, [s[0] for s in segs], [s[1] for s in segs], x, b, generic, errs)
            errs.check()


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_f32act_is_finer_than_int8_x(lib, qtype):
    """The point of the path: on the same Gaussian x, el_matmul's int8 rounding of x leaves an
    NMSE near 2e-5 (see NMSE_QUANT), el_matmul_f32act only fp32 summation order (~1e-13)."""
    K, N = 576, 257
    raw, deq = weights(qtype, N, K)
    x = np.random.default_rng(21).standard_normal((3, K)).astype(np.float32)
    ref = reference.matmul(x, deq)
    rc8, y8 = el_matmul(lib, qtype, [raw], x)
    rc32, y32 = el_matmul_f32act(lib, qtype, [raw], x)
    assert rc8 == rc32 == 0
    e8, e32 = nmse(y8, ref), nmse(y32, ref)
    assert e32 < NMSE_FLOAT and e8 > 1e4 * e32, (e8, e32)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_f32act_thread_pool_matches_serial(lib, qtype):
    """With a pool the task grid has more, smaller chunks, but every chunk starts at a multiple of
    the 4-row tile and a tile's sums do not depend on the chunk: outputs equal the serial run's
    bit for bit. An lm_head-shaped GEMV (960 rows of a 576-wide head), a small and a larger GEMM."""
    pool = lib.el_pool_create(3, None, 0)
    assert pool
    try:
        rng = np.random.default_rng(13)
        # GEMVs: one segment, and three uneven ones whose range boundaries fall inside segments
        for M, K, rows in ((1, 576, (960,)), (1, 576, (130, 33, 67)), (1, 64, (1000, 9)), (17, 576, (130, 33, 67)),
                           (64, 1536, (37,))):
            segs = [weights(qtype, n, K, seed=i + 5) for i, n in enumerate(rows)]
            x = rng.standard_normal((M, K)).astype(np.float32)
            bias = rng.standard_normal(sum(rows)).astype(np.float32)
            for generic in (0, 1):
                errs = Errors(qtype, fp32_x=True)
                y0 = run_f32act(lib, qtype, [s[0] for s in segs], [s[1] for s in segs], x, bias, generic, errs)
                y1 = run_f32act(lib, qtype, [s[0] for s in segs], [s[1] for s in segs], x, bias, generic, errs,
                                pool=pool)
                np.testing.assert_array_equal(y1, y0, err_msg=f"M={M} rows={rows} generic={generic}")
                errs.check()
    finally:
        lib.el_pool_destroy(pool)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_f32act_extreme_quants(lib, qtype):
    """The widest quants the formats hold (Q8_0 -128, which ggml never writes but a file may;
    nibbles 0 and 15) against x = +-1 and large x: widened exactly, no saturation."""
    K, N = 64, 5
    raw, _ = weights(qtype, N, K)
    for fill in ((-128, 127) if qtype == T.Q8_0 else (0x00, 0xFF, 0x0F)):
        r = raw.copy()
        blocks = r.reshape(-1).view(quant._BLOCK_DTYPES[qtype])
        blocks["qs"] = fill
        deq = quant.dequantize(r.reshape(-1), qtype, (N, K))
        x = np.full((3, K), -1.0, np.float32)
        x[1] = 1.0
        x[2] = 3.0e4
        for generic in (0, 1):
            errs = Errors(qtype, fp32_x=True)
            run_f32act(lib, qtype, [r], [deq], x, None, generic, errs)
            errs.check()


def test_f32act_bad_arguments_return_negative_codes(lib):
    raw, _ = weights(T.Q8_0, 4, 64)
    x = np.ones((2, 64), np.float32)
    assert el_matmul_f32act(lib, T.Q8_0, [raw], x)[0] == 0
    assert el_matmul_f32act(lib, T.Q8_0, [raw], np.ones((2, 48), np.float32))[0] < 0   # K % 32
    assert el_matmul_f32act(lib, T.Q8_0, [raw], x, wtype=99)[0] < 0
    assert el_matmul_f32act(lib, T.Q8_0, [raw], np.ones((0, 64), np.float32))[0] < 0  # M = 0
    assert el_matmul_f32act(lib, T.Q8_0, [raw[:0]], x)[0] < 0                        # N = 0
    y = np.empty((2, 4), np.float32)
    ptrs, rows = (ctypes.c_void_p * 1)(raw.ctypes.data), (ctypes.c_int * 1)(4)
    assert lib.el_matmul_f32act(None, neon_lib.EL_Q8_0, ptrs, rows, 1, fptr(x), fptr(y), 2, 64, None) == 0
    assert lib.el_matmul_f32act(None, neon_lib.EL_Q8_0, None, rows, 1, fptr(x), fptr(y), 2, 64, None) < 0
    assert lib.el_matmul_f32act(None, neon_lib.EL_Q8_0, ptrs, None, 1, fptr(x), fptr(y), 2, 64, None) < 0
    assert lib.el_matmul_f32act(None, neon_lib.EL_Q8_0, ptrs, rows, 0, fptr(x), fptr(y), 2, 64, None) < 0
    assert lib.el_matmul_f32act(None, neon_lib.EL_Q8_0, ptrs, rows, 1, None, fptr(y), 2, 64, None) < 0
    assert lib.el_matmul_f32act(None, neon_lib.EL_Q8_0, ptrs, rows, 1, fptr(x), None, 2, 64, None) < 0
    assert lib.el_matmul_f32act(None, neon_lib.EL_Q8_0, (ctypes.c_void_p * 1)(None), rows, 1, fptr(x), fptr(y),
                                2, 64, None) < 0


def test_neon_lm_head_keeps_x_fp32(lib, monkeypatch):
    """backends/neon.py: lm_head runs el_matmul_f32act (float bound), matmul stays on int8 x."""
    from edgellm.backends import neon

    monkeypatch.setitem(neon._state, "lib", lib)
    monkeypatch.setitem(neon._state, "pool", None)
    monkeypatch.setitem(neon._state, "threads", 2)
    monkeypatch.setitem(neon._state, "cores", ())
    try:
        K, N = 576, 301
        raw, deq = weights(T.Q8_0, N, K, seed=9)
        w = neon.QMatrix.from_arrays("Q8_0", [raw], [N], K)
        x = np.random.default_rng(17).standard_normal((2, K)).astype(np.float32)
        ref = reference.matmul(x, deq)
        assert nmse(neon.lm_head(x, w), ref) < NMSE_FLOAT
        assert nmse(neon.matmul(x, w), ref) > 1e-7       # int8 rounding of x: ~2e-5
    finally:
        neon._state["pool"] = None   # (the variant's pool, freed by its own library once dropped)


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
@pytest.mark.parametrize("M", (1, 5, 40))
def test_a_nan_in_x_reaches_the_output_on_both_twins(lib, qtype, M):
    """x's int8 quantization took a NaN's block maximum with EL_MAX, which drops the NaN unless
    it comes last: the generic twin turned a NaN input into finite outputs, while the SIMD
    kernels (and the reference) give NaN."""
    raw, _ = weights(qtype, 33, 96)
    x = np.random.default_rng(3).standard_normal((M, 96)).astype(np.float32)
    x[M // 2, 40] = np.nan                       # mid-block: not the last value EL_MAX sees
    got = {}
    for generic in (0, 1):
        lib.el_use_generic(generic)
        rc, y = el_matmul(lib, qtype, [raw], x)
        assert rc == 0
        got[generic] = np.isnan(y)
    lib.el_use_generic(0)
    want = np.zeros((M, 33), bool)
    want[M // 2] = True                          # the row whose x holds the NaN, and only it
    assert (got[0] == want).all() and (got[1] == want).all()


@pytest.mark.parametrize("M", [1, 5, 40])
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0])
def test_a_block_too_small_for_its_scale_quantizes_as_the_generic_twin(lib, qtype, M):
    """x blocks whose largest |x| is below ~3.7e-37 make 1/d infinite: the SIMD quantizers'
    int32 conversions saturated there and their block sums overflowed (undefined; a helper's
    aarch64 UBSan run), while the generic twin sums its clamped values. They take the generic
    form now: the outputs of both twins agree, blocks of ordinary size beside them too."""
    rng = np.random.default_rng([M, int(qtype)])
    raw, _ = weights(qtype, 24, 64, seed=3)
    x = rng.standard_normal((M, 64)).astype(np.float32)
    x[:, :32] *= np.float32(1e-38)               # each row's first block: a scale 1/d overflows
    x[0] *= np.float32(1e-38)                    # and all of row 0: its outputs are those blocks
    got = {}
    for generic in (0, 1):
        lib.el_use_generic(generic)
        try:
            rc, got[generic] = el_matmul(lib, qtype, [raw], x)
        finally:
            lib.el_use_generic(0)
        assert rc == 0
    assert np.isfinite(got[0]).all()
    for r in range(M):      # row by row: row 0's outputs are ~1e-38 beside the others' ~1
        np.testing.assert_allclose(got[0][r], got[1][r], rtol=1e-4, atol=1e-3 * float(np.abs(got[1][r]).max()))
