"""The npu unit's LiteRT/TFLite path (backends/npu_tflite.py): op conformance of every weight
format against npu_graphs.reference, padded buckets, the on-disk model cache, typed errors, and
the flatbuffer validator under targeted and random corruption.

Runs on the default CPU path of whatever runtime is installed (ai_edge_litert's XNNPACK here);
the tests that need a runtime skip with the reason when there is none (the [npu] extra)."""
from __future__ import annotations

import ctypes.util
import importlib
import logging
import os
import struct
import sys
import types

import numpy as np
import pytest

from edgellm.backends import npu_graphs as G
from edgellm.backends import npu_tflite as T
from edgellm.errors import ConfigError, EdgeLLMError

pytest.importorskip("tflite", reason="the tflite schema package (the [npu] extra) writes the models")
_OK, _WHY = T.available()
needs_runtime = pytest.mark.skipif(not _OK, reason=f"no TFLite runtime: {_WHY}")

K, N, FF = 64, 96, 128                   # small dims; SmolLM2's are d=576, ff=1536, qkv N=960
BUCKETS = (32, 64, 128, 256)


def nmse(y, ref) -> float:
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.sum((y - ref) ** 2) / np.sum(ref ** 2))


def _linear(fmt, k, n, tokens, bias, seed=0, name="blk.0.qkv"):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    return G.LinearGraph(name, G.quantize(w, fmt, b), tokens)


def _ffn(fmt, d, ff, tokens, seed=0, name="blk.0.ffn"):
    rng = np.random.default_rng(seed)
    gu = rng.standard_normal((2 * ff, d)).astype(np.float32) / np.sqrt(d)
    dn = rng.standard_normal((d, ff)).astype(np.float32) / np.sqrt(ff)
    return G.FfnGraph(name, G.quantize(gu, fmt), G.quantize(dn, fmt), tokens)


def _x(graph, seed=1):
    k = graph.w.k if isinstance(graph, G.LinearGraph) else graph.gate_up.k
    return np.random.default_rng(seed).standard_normal((graph.tokens, k)).astype(np.float32)


# -- expected error of the dynamic-range (hybrid) paths -----------------------------------------
# int8/int4 FULLY_CONNECTED quantizes each input row to int8 on the fly, asymmetric: step
# s = (max(row, 0) - min(row, 0)) / 255 (both kernels, XNNPACK and the builtin one, checked
# bit-for-bit against this scheme). The rounding error is uniform in [-s/2, s/2] (variance
# s^2 / 12) and independent across k, so one output y[t, n] = sum_k x[t, k] W[n, k] gets error
# variance s_t^2 / 12 * sum_k W[n, k]^2. Expected NMSE = sum of those / sum y^2. For N(0, 1) rows
# of K=64, s ~ 4.9 / 255 and the NMSE ~ s^2 / 12 ~ 3e-5 (2e-5 more or less with the bias).
# int4 adds its scale rounding: scales are stored f16, and XNNPACK rounds them again to bf16
# (relative error up to 2^-9), a known deterministic weight error dW: + (x dW^T)^2.
# The FFN linearizes: gate/up errors pass through h = silu(g) * u with their derivatives, then h
# is quantized again for the down projection. Measured / expected is 0.96..1.06 over these
# shapes; the tests accept 0.5..2 (quantization must be there, and no worse than derived).
# int8s: the same derivation per 64-column slice, each with its own step s_{t,j} from that slice of
# the row alone (and weights rounded per slice, which the reference already holds): the variance
# of x[t, k] is s_{t, k // 64}^2 / 12. A slice's range is smaller than its row's, so the expected
# NMSE is lower (2.9e-5 against int8's 5.05e-5, N(0, 1) rows of K=576; measured / expected is
# 0.92..1.01 over the int8s tests). Rounding
# whole rows instead would be only 1.3x-1.7x this expectation at K=192..576, inside 0.5..2: that
# the kernel rounds per slice is checked exactly by test_int8s_is_exactly_one_hybrid_fc_per_slice.
def _elem_var(x, fmt):
    """(T, K): variance of the rounding error the kernel adds to each input element."""
    t, k = x.shape
    width = G.INT8S_SLICE if fmt == "int8s" else k
    xs = x.reshape(t, k // width, width)
    s = (np.maximum(xs.max(2), 0) - np.minimum(xs.min(2), 0)) / 255.0      # (T, K / width)
    return np.repeat(s ** 2 / 12.0, width, axis=1)


def _bf16(a):
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def _weight_error(w: G.QLinear) -> np.ndarray:
    if w.fmt != "int4":
        return np.zeros((w.n, w.k))
    s = _bf16(w.scale.astype(np.float16).astype(np.float32)).astype(np.float64)
    run = (w.q.astype(np.float64) - 8).reshape(w.n, -1, G.INT4_BLOCK) * s[:, :, None]
    return run.reshape(w.n, w.k) - w.dequantize().astype(np.float64)


def expected_hybrid_nmse(graph, x) -> float:
    x = x.astype(np.float64)
    if isinstance(graph, G.LinearGraph):
        W = graph.w.dequantize().astype(np.float64)
        var = _elem_var(x, graph.w.fmt) @ (W ** 2).T + (x @ _weight_error(graph.w).T) ** 2
        return float(var.sum() / np.sum(G.reference(graph, x) ** 2))
    Wgu = graph.gate_up.dequantize().astype(np.float64)
    Wd = graph.down.dequantize().astype(np.float64)
    ff = Wgu.shape[0] // 2
    v1 = _elem_var(x, graph.gate_up.fmt) @ (Wgu ** 2).T + (x @ _weight_error(graph.gate_up).T) ** 2
    gu = x @ Wgu.T
    g, u = gu[:, :ff], gu[:, ff:]
    sig = 1.0 / (1.0 + np.exp(-g))
    silu, dsilu = g * sig, sig * (1.0 + g * (1.0 - sig))
    h = silu * u
    vh = (dsilu * u) ** 2 * v1[:, :ff] + silu ** 2 * v1[:, ff:] + _elem_var(h, graph.down.fmt)
    vy = vh @ (Wd ** 2).T + (h @ _weight_error(graph.down).T) ** 2
    return float(vy.sum() / np.sum((h @ Wd.T) ** 2))


# Float paths: both sides are f32 dot products of length K (numpy's reference and the kernel's,
# in other summation orders), so the difference is rounding only: a random walk of ~K roundings
# of relative size u = 2^-24, NMSE ~ K u^2 ~ 2e-12 at K=576 (measured ~2e-14 at K=64). fp16
# weights are dequantized exactly (every f16 is an f32), so the same bound holds; 1e-10 is 50x
# the estimate, and an fp16 rounding of weights or activations anywhere (~1e-7) fails it.
FLOAT_BOUND = 1e-10


def _check(graph, y, x, label):
    got = nmse(y, G.reference(graph, x))
    fmt = graph.w.fmt if isinstance(graph, G.LinearGraph) else graph.gate_up.fmt
    if fmt in ("fp32", "fp16"):
        print(f"{label}: NMSE {got:.3g} (bound {FLOAT_BOUND:g})")
        assert got <= FLOAT_BOUND, f"{label}: NMSE {got:.3g} > {FLOAT_BOUND:g}"
    else:
        want = expected_hybrid_nmse(graph, x)
        print(f"{label}: NMSE {got:.3g}, expected {want:.3g} (ratio {got / want:.3f})")
        assert 0.5 * want <= got <= 2.0 * want, f"{label}: NMSE {got:.3g}, expected {want:.3g}"


# -- conformance ---------------------------------------------------------------------------------
@needs_runtime
@pytest.mark.parametrize("tokens", BUCKETS)
@pytest.mark.parametrize("kind", ["linear", "linear+bias", "ffn"])
@pytest.mark.parametrize("fmt", ["fp32", "fp16", "int8", "int8s", "int4"])
def test_subgraph_matches_reference(tmp_path, fmt, kind, tokens):
    graph = _ffn(fmt, K, FF, tokens) if kind == "ffn" else _linear(fmt, K, N, tokens, kind == "linear+bias")
    sub = T.compile(graph, cache_dir=tmp_path)
    x = _x(graph)
    y = sub.run(x)
    assert y.shape == sub.output_shape and y.dtype == np.float32
    _check(graph, y, x, f"{fmt} {kind} T={tokens}")


# int8s with several slices: K = 64 above is one slice (no SPLIT, no ADD) and the FFN's down
# projection (K = FF = 128) two; here 3 slices in, and 5 in the FFN's down projection (a SPLIT
# wider than the 2-way FFN split).
K8S, FF8S = 3 * G.INT8S_SLICE, 5 * G.INT8S_SLICE


@needs_runtime
@pytest.mark.parametrize("tokens", BUCKETS)
@pytest.mark.parametrize("kind", ["linear", "linear+bias", "ffn"])
def test_int8s_slices_match_reference(tmp_path, kind, tokens):
    graph = _ffn("int8s", K8S, FF8S, tokens) if kind == "ffn" else \
        _linear("int8s", K8S, N, tokens, kind == "linear+bias")
    sub = T.compile(graph, cache_dir=tmp_path)
    x = _x(graph)
    y = sub.run(x)
    assert y.shape == sub.output_shape and y.dtype == np.float32
    _check(graph, y, x, f"int8s {kind} K={K8S} ff={FF8S} T={tokens}")


@needs_runtime
@pytest.mark.parametrize("fmt", ["int8s", "int8", "int4", "fp16", "fp32"])
@pytest.mark.parametrize("kind", ["linear", "ffn"])
def test_one_interpreter_resized_per_bucket_gives_each_buckets_bits(tmp_path, kind, fmt):
    """TfliteRows: the smallest bucket's interpreter resized to the others (the npu unit's CPU
    path, one interpreter per graph instead of one per bucket: each held its own copy of the
    weights) gives, bit for bit, what each bucket's own static-shape model gives, in any order
    of buckets, on one interpreter."""
    k = K8S if fmt == "int8s" else K
    make = (lambda t: _ffn(fmt, k, FF8S, t)) if kind == "ffn" else (lambda t: _linear(fmt, k, N, t, True))
    base = T.compile(make(BUCKETS[0]), cache_dir=tmp_path)
    before = T.stats.interpreters
    views = {b: base.rows(b) for b in BUCKETS}
    assert T.stats.interpreters == before           # views, no interpreter each
    for i, b in enumerate(BUCKETS + BUCKETS[::-1] + (BUCKETS[-1], BUCKETS[0])):
        graph = make(b)
        x = _x(graph, seed=i) * (1 + i) + 0.25 * i          # rows of other ranges and means
        own = T.compile(graph, cache_dir=tmp_path).run(x)
        got = views[b].run(x)
        assert got.shape == views[b].output_shape == own.shape
        assert np.array_equal(got.view(np.uint32), own.view(np.uint32)), f"{kind} {fmt} T={b}"
        out = np.empty_like(own)
        assert views[b].run(x, out) is out and np.array_equal(out.view(np.uint32), own.view(np.uint32))
    with pytest.raises(G.NpuInputError, match=r"\(64, "):
        views[64].run(np.zeros((32, k), np.float32))
    assert np.array_equal(base.run(_x(make(32))), T.compile(make(32), cache_dir=tmp_path).run(_x(make(32))))


@needs_runtime
def test_a_delegates_subgraph_is_not_resized(tmp_path, noop_delegate):
    sub = T.compile(_linear("int8", K, N, 32, bias=True), delegate=noop_delegate, cache_dir=tmp_path)
    with pytest.raises(G.NpuGraphError, match="its own shape"):
        sub.rows(64)


@needs_runtime
@pytest.mark.parametrize("fmt", ["fp32", "fp16", "int8", "int8s", "int4"])
def test_smollm2_qkv_shape(tmp_path, fmt):
    graph = _linear(fmt, 576, 960, 32, bias=False, name="blk.0.attn_qkv")
    x = _x(graph)
    _check(graph, T.compile(graph, cache_dir=tmp_path).run(x), x, f"{fmt} 576->960 T=32")


def _emulate_hybrid(graph, x, int4_scale_round):
    """The hybrid FC exactly: each row of x quantized to int8, asymmetric, then exact products
    with the weights as the kernel holds them (int4 scales rounded as `int4_scale_round`)."""
    x = x.astype(np.float64)
    lo, hi = np.minimum(x.min(1), 0), np.maximum(x.max(1), 0)
    s = (hi - lo) / 255.0
    zp = np.rint(-128.0 - lo / s)
    xq = (np.clip(np.rint(x / s[:, None]) + zp[:, None], -128, 127) - zp[:, None]) * s[:, None]
    w = graph.w
    if w.fmt == "int4":
        sc = int4_scale_round(w.scale).astype(np.float64)
        W = ((w.q.astype(np.float64) - 8).reshape(w.n, -1, G.INT4_BLOCK) * sc[:, :, None]).reshape(w.n, w.k)
    else:
        W = w.q.astype(np.float64) * w.scale.astype(np.float64)[:, None]
    return xq @ W.T + (0.0 if w.bias is None else w.bias)


@needs_runtime
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_hybrid_path_is_exactly_per_row_asymmetric_int8(tmp_path, fmt):
    """The scheme the NMSE derivation assumes, checked directly: the output equals an emulation
    of per-row asymmetric int8 input quantization to f32 rounding (int4: scales as f16, which
    the builtin kernel uses, or rounded again to bf16 as XNNPACK does)."""
    graph = _linear(fmt, 576, 960, 32, bias=True)
    x = _x(graph) + 0.5                          # one-sided-ish rows: the zero point matters
    y = T.compile(graph, cache_dir=tmp_path).run(x)
    rounds = [lambda s: s.astype(np.float16).astype(np.float32),
              lambda s: _bf16(s.astype(np.float16).astype(np.float32))]
    got = min(nmse(y, _emulate_hybrid(graph, x, r)) for r in rounds)
    print(f"{fmt}: NMSE against the emulated hybrid kernel {got:.3g}")
    assert got <= FLOAT_BOUND


def _quantize_slices_xnnpack(x, width):
    """Each row's `width`-column slices rounded to int8 as XNNPACK's dynamically quantized FC
    does it, in f32: multiplier m = 255 / (max(row, 0) - min(row, 0)), zero point from the end
    with the smaller error, q = round-half-even(x * m) + zp, then back by 1 / m. f64 arithmetic
    (as _emulate_hybrid) now and then lands a value on the other side of a rounding step, which
    FLOAT_BOUND catches (seen: one value of 18432 at K=576, NMSE 9.5e-9)."""
    f32 = np.float32
    t, k = x.shape
    xs = x.astype(f32).reshape(t, k // width, width)
    lo, hi = np.minimum(xs.min(2), 0).astype(f32), np.maximum(xs.max(2), 0).astype(f32)
    span = (hi - lo).astype(f32)
    m = np.where(span == 0, f32(1), f32(255) / np.where(span == 0, f32(1), span)).astype(f32)
    lo_m, hi_m = (lo * m).astype(f32), (hi * m).astype(f32)
    zp = np.where((f32(-128) + lo_m) + (f32(127) + hi_m) > 0, f32(-128) - lo_m, f32(127) - hi_m)
    zp = np.rint(np.clip(zp, -128, 127))[:, :, None]
    q = np.clip(np.rint((xs * m[:, :, None]).astype(f32)) + zp, -128, 127)
    return ((q - zp) * (f32(1) / m).astype(np.float64)[:, :, None]).reshape(t, k)


@needs_runtime
def test_int8s_is_exactly_one_hybrid_fc_per_slice(tmp_path):
    """int8s as the derivation assumes it, checked directly: the output equals per-slice int8
    input rounding times each slice's own per-channel weights, summed, to f32 rounding."""
    graph = _linear("int8s", 576, 960, 32, bias=True)
    x = _x(graph) + 0.5                          # one-sided-ish rows: the zero point matters
    x[3] = 0.0                                   # a padding row: zero range, multiplier 1
    x[5, 64:128] *= 100.0                        # one slice's range must not reach the others
    y = T.compile(graph, cache_dir=tmp_path).run(x)
    w = graph.w
    W = (w.q.astype(np.float64).reshape(w.n, -1, G.INT8S_SLICE)
         * w.scale.astype(np.float64)[:, :, None]).reshape(w.n, w.k)
    want = _quantize_slices_xnnpack(x, G.INT8S_SLICE) @ W.T + w.bias
    got = nmse(y, want)
    print(f"int8s: NMSE against the emulated per-slice hybrid kernel {got:.3g}")
    assert got <= FLOAT_BOUND
    assert nmse(y[5], want[5]) <= FLOAT_BOUND
    # and not one hybrid FC over the whole row: row 5's large slice would coarsen the others
    whole = _quantize_slices_xnnpack(x, w.k) @ W.T + w.bias
    assert nmse(whole[5], G.reference(graph, x)[5]) > 10 * nmse(y[5], G.reference(graph, x)[5])


@needs_runtime
@pytest.mark.parametrize("fmt", ["int8", "int8s", "int4"])
def test_all_zero_rows_and_blocks(tmp_path, fmt):
    """quantize() gives a zero row (int8), row slice (int8s) or block (int4) scale 0, which
    XNNPACK refuses: the writer rewrites those weights (still exactly 0) so the model loads and
    matches."""
    w = np.random.default_rng(3).standard_normal((N, 2 * K)).astype(np.float32)
    w[5] = 0.0
    w[7, :G.INT4_BLOCK] = 0.0
    w[9, G.INT8S_SLICE:2 * G.INT8S_SLICE] = 0.0
    graph = G.LinearGraph("zeros", G.quantize(w, fmt), 32)
    assert (graph.w.scale == 0).any()
    x = _x(graph)
    y = T.compile(graph, cache_dir=tmp_path).run(x)
    assert np.all(y[:, 5] == 0.0)
    _check(graph, y, x, f"{fmt} zero rows")


@needs_runtime
@pytest.mark.parametrize("fmt", ["fp32", "int8", "int8s"])
def test_padded_rows_give_the_same_real_rows(tmp_path, fmt):
    """20 real rows padded to the 32 bucket: what the padding holds changes none of them."""
    graph = _ffn(fmt, K, FF, 32)
    sub = T.compile(graph, cache_dir=tmp_path)
    real = _x(graph)[:20]
    zeros = np.zeros((32, K), np.float32)
    zeros[:20] = real
    junk = np.random.default_rng(9).standard_normal((32, K)).astype(np.float32) * 100
    junk[:20] = real
    a, b = sub.run(zeros)[:20], sub.run(junk)[:20]
    assert np.array_equal(a, b)          # rows are independent, per-row input quantization too
    ref20 = G.FfnGraph(graph.name, graph.gate_up, graph.down, 20)
    _check(ref20, a, real, f"{fmt} 20 of 32 rows")


@needs_runtime
def test_run_accepts_strided_input_and_out_buffer(tmp_path):
    graph = _linear("fp32", K, N, 32, bias=True)
    sub = T.compile(graph, cache_dir=tmp_path)
    x = _x(graph)
    wide = np.zeros((32, 2 * K), np.float32)
    wide[:, ::2] = x
    out = np.empty(sub.output_shape, np.float32)
    assert sub.run(wide[:, ::2], out=out) is out
    np.testing.assert_array_equal(out, sub.run(x))


# -- typed errors ----------------------------------------------------------------------------------
@needs_runtime
@pytest.mark.parametrize("bad", [
    np.zeros((31, K), np.float32),            # not the bucket
    np.zeros((32, K + 1), np.float32),
    np.zeros((32, K), np.float64),            # not float32
    [[0.0] * K] * 32,                         # not an array
])
def test_wrong_input_is_a_typed_error(tmp_path, bad):
    sub = T.compile(_linear("fp32", K, N, 32, bias=False), cache_dir=tmp_path)
    with pytest.raises(T.NpuInputError, match=r"float32 \(32, 64\)"):
        sub.run(bad)
    with pytest.raises(T.NpuInputError):
        sub.run(np.zeros((32, K), np.float32), out=np.zeros((32, N), np.float64))


@needs_runtime
def test_missing_delegate_is_a_typed_error_naming_it(tmp_path):
    path = str(tmp_path / "no_such_dir" / "libvendor_npu_delegate.so")
    with pytest.raises(T.TfliteDelegateError) as e:
        T.compile(_linear("int8", K, N, 32, bias=False), delegate=path, cache_dir=tmp_path)
    assert e.value.delegate == path and path in str(e.value)
    with pytest.raises(T.TfliteDelegateError, match="libnot_a_delegate_anywhere.so"):
        T.compile(_linear("int8", K, N, 32, bias=False), delegate="libnot_a_delegate_anywhere.so",
                  cache_dir=tmp_path)


# A minimal external delegate (the tflite_plugin_* interface load_delegate calls): it claims no
# node, so the CPU runs everything; option mode=fail_create / fail_prepare makes it fail there.
_NOOP_DELEGATE_C = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
typedef struct TfLiteDelegate {
  void *data_;
  int (*Prepare)(void *context, struct TfLiteDelegate *delegate);
  void *CopyFromBufferHandle, *CopyToBufferHandle, *FreeBufferHandle;
  int64_t flags;
  void *opaque_delegate_builder;
} TfLiteDelegate;
static int prepare_ok(void *c, TfLiteDelegate *d) { (void)c; (void)d; return 0; }
static int prepare_fail(void *c, TfLiteDelegate *d) { (void)c; (void)d; return 1; }
TfLiteDelegate *tflite_plugin_create_delegate(char **keys, char **values, size_t n,
                                              void (*report)(const char *)) {
  int fail_prepare = 0;
  for (size_t i = 0; i < n; i++) {
    if (!strcmp(keys[i], "mode") && !strcmp(values[i], "fail_create")) { report("asked to fail"); return NULL; }
    if (!strcmp(keys[i], "mode") && !strcmp(values[i], "fail_prepare")) fail_prepare = 1;
  }
  TfLiteDelegate *d = calloc(1, sizeof(TfLiteDelegate));
  d->Prepare = fail_prepare ? prepare_fail : prepare_ok;
  return d;
}
void tflite_plugin_destroy_delegate(TfLiteDelegate *d) { free(d); }
"""


@pytest.fixture(scope="module")
def noop_delegate(tmp_path_factory):
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to build the test delegate")
    d = tmp_path_factory.mktemp("delegate")
    (d / "noop_delegate.c").write_text(_NOOP_DELEGATE_C)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "libnoop_delegate.so"),
                    str(d / "noop_delegate.c")], check=True)
    return str(d / "libnoop_delegate.so")


@needs_runtime
def test_an_external_delegate_is_loaded_with_its_options(tmp_path, noop_delegate):
    graph = _linear("int8", K, N, 32, bias=True)
    sub = T.compile(graph, delegate=noop_delegate, delegate_options={"mode": "ok"}, cache_dir=tmp_path)
    assert sub.delegate == noop_delegate
    x = _x(graph)
    np.testing.assert_array_equal(sub.run(x), T.compile(graph, cache_dir=tmp_path).run(x))
    with pytest.raises(T.TfliteDelegateError, match="asked to fail") as e:
        T.compile(graph, delegate=noop_delegate, delegate_options={"mode": "fail_create"}, cache_dir=tmp_path)
    assert e.value.delegate == noop_delegate
    with pytest.raises(T.TfliteDelegateError, match="refused subgraph 'blk.0.qkv'"):
        T.compile(graph, delegate=noop_delegate, delegate_options={"mode": "fail_prepare"}, cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="delegate_options"):
        T.compile(graph, delegate=noop_delegate, delegate_options={"mode": ["ok"]}, cache_dir=tmp_path)


@needs_runtime
def test_a_library_that_is_not_a_delegate_is_refused(tmp_path):
    libm = ctypes.util.find_library("m")
    if libm is None:
        pytest.skip("no libm to load")
    with pytest.raises(T.TfliteDelegateError, match="not a TFLite external delegate"):
        T.compile(_linear("fp32", K, N, 32, bias=False), delegate=libm, cache_dir=tmp_path)


def test_rejected_graphs_name_the_graph():
    rng = np.random.default_rng(0)
    gu = G.quantize(rng.standard_normal((2 * FF, K)).astype(np.float32), "fp32")
    dn = G.quantize(rng.standard_normal((K + 1, FF)).astype(np.float32), "fp32")   # d mismatch
    with pytest.raises(T.NpuGraphError, match="'blk.9.ffn'.*gate_up"):
        T.build_flatbuffer(G.FfnGraph("blk.9.ffn", gu, dn, 32))
    with pytest.raises(T.NpuGraphError, match="tokens"):
        T.build_flatbuffer(_linear("fp32", K, N, 0, bias=False))
    w = G.quantize(rng.standard_normal((N, K)).astype(np.float32), "int4")
    huge = G.QLinear("int4", N, K, w.q, w.scale * 1e6)          # scales past float16
    ok, why = T.supports(G.LinearGraph("big", huge, 32))
    assert not ok and "float16" in why
    wide = G.QLinear("int4", N, K, w.q + 16, w.scale)          # not 4-bit values
    ok, why = T.supports(G.LinearGraph("wide", wide, 32))
    assert not ok and "0..15" in why


def test_int8s_shapes_and_scales_are_checked():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"int8s.*multiple of 64.*\(96, 96\)"):
        G.quantize(rng.standard_normal((96, 96)).astype(np.float32), "int8s")
    w = G.quantize(rng.standard_normal((N, 2 * G.INT8S_SLICE)).astype(np.float32), "int8s")
    assert w.scale.shape == (N, 2) and w.q.dtype == np.int8
    assert w.digest() != G.QLinear("int8", w.n, w.k, w.q, w.scale[:, 0]).digest()
    cases = {
        "scale (96, 2)": G.QLinear("int8s", N, w.k, w.q, w.scale[:, :1]),      # per row only
        "multiple of 64": G.QLinear("int8s", N, 96, w.q[:, :96], w.scale[:, :1]),
        "expected int8": G.QLinear("int8s", N, w.k, w.q.astype(np.int16), w.scale),
        "negative": G.QLinear("int8s", N, w.k, w.q, -w.scale),
        "not finite": G.QLinear("int8s", N, w.k, w.q, np.where(w.scale > 0, np.inf, 0).astype(np.float32)),
    }
    for want, q in cases.items():
        ok, why = T.supports(G.LinearGraph("blk.0.qkv", q, 32))
        assert not ok and want in why, (want, why)
        with pytest.raises(T.NpuGraphError, match="'blk.0.qkv'"):
            T.build_flatbuffer(G.LinearGraph("blk.0.qkv", q, 32))


@needs_runtime
def test_int4_where_the_runtime_cannot_is_a_typed_error(tmp_path, monkeypatch):
    assert T.int4_supported() == (True, "")        # this runtime runs blockwise INT4
    monkeypatch.setattr(T, "_int4_state", (False, "int4 weights are not supported by this runtime"))
    with pytest.raises(T.NpuGraphError, match="'blk.0.qkv'.*int4"):
        T.compile(_linear("int4", K, N, 32, bias=False), cache_dir=tmp_path)


def test_a_runtime_that_fails_under_numpy_2_is_reported(monkeypatch):
    """tflite_runtime 2.14 imports under numpy 2, then fails at Interpreter(): available() says so."""
    fake = types.ModuleType("fake_tflite_runtime_interpreter")

    def interpreter(**_):
        raise AttributeError("_ARRAY_API not found")

    fake.Interpreter, fake.load_delegate = interpreter, None
    monkeypatch.setitem(sys.modules, "fake_tflite_runtime_interpreter", fake)
    monkeypatch.setattr(T, "_RUNTIMES", (("tflite_runtime", "fake_tflite_runtime_interpreter"),))
    monkeypatch.setattr(T, "_runtime_state", None)
    ok, why = T.available()
    assert not ok
    assert "tflite_runtime" in why and "_ARRAY_API" in why and f"numpy {np.__version__}" in why
    with pytest.raises(T.TfliteUnavailable):
        T.compile(_linear("fp32", K, N, 32, bias=False))


# -- the cache -------------------------------------------------------------------------------------
@needs_runtime
def test_second_compile_loads_from_the_cache(tmp_path):
    graph = _ffn("int8", K, FF, 64)
    before = (T.stats.built, T.stats.loaded, T.stats.interpreters)
    y1 = T.compile(graph, cache_dir=tmp_path).run(_x(graph))
    y2 = T.compile(graph, cache_dir=tmp_path).run(_x(graph))
    after = (T.stats.built, T.stats.loaded, T.stats.interpreters)
    assert tuple(a - b for a, b in zip(after, before)) == (1, 1, 2)
    np.testing.assert_array_equal(y1, y2)
    (path,) = tmp_path.glob("*.tflc")
    assert path == T.cache_path(graph, tmp_path) and path.read_bytes()[:8] == b"ELTFLC01"
    # other weights, another bucket: other files
    T.compile(_ffn("int8", K, FF, 64, seed=5), cache_dir=tmp_path)
    T.compile(_ffn("int8", K, FF, 32), cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.tflc"))) == 3


def test_default_cache_dir_is_under_edgellm_home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    graph = _linear("fp16", K, N, 32, bias=False)
    assert T.cache_path(graph).parent == tmp_path / "cache" / "npu" / "tflite"
    T.load_or_build(graph)
    assert T.cache_path(graph).is_file()


def _damage(path, how):
    if how in ("fifo", "devzero"):    # (a FIFO hung the load; /dev/zero was read to 3.3 GB)
        path.unlink()
        os.mkfifo(path) if how == "fifo" else path.symlink_to("/dev/zero")
        return
    data = bytearray(path.read_bytes())
    hdr = T._HEADER.size
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "payload-bit":
        data[hdr + (len(data) - hdr) // 2] ^= 0x10
    elif how == "empty":
        data = bytearray()
    elif how == "stale-writer":
        struct.pack_into("<I", data, 12, T.WRITER_VERSION + 1)
    elif how == "valid-checksum-bad-model":     # a consistent header around a broken flatbuffer
        payload = bytearray(data[hdr:])
        payload[4:8] = b"XXXX"
        import hashlib
        struct.pack_into("<32s", data, 24, hashlib.sha256(bytes(payload)).digest())
        data[hdr:] = payload
    path.write_bytes(bytes(data))


@needs_runtime
@pytest.mark.parametrize("how", ["truncated", "payload-bit", "empty", "stale-writer",
                                 "valid-checksum-bad-model", "fifo", "devzero"])
def test_a_damaged_cache_file_is_rebuilt_with_one_warning(tmp_path, caplog, how):
    graph = _linear("int8", K, N, 32, bias=True)
    x = _x(graph)
    good = T.compile(graph, cache_dir=tmp_path).run(x)
    path = T.cache_path(graph, tmp_path)
    _damage(path, how)
    before = (T.stats.built, T.stats.loaded, T.stats.rebuilt)
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        y = T.compile(graph, cache_dir=tmp_path).run(x)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "rebuilding" in warnings[0].getMessage()
    assert str(path) in warnings[0].getMessage()
    after = (T.stats.built, T.stats.loaded, T.stats.rebuilt)
    assert tuple(a - b for a, b in zip(after, before)) == (1, 0, 1)
    np.testing.assert_array_equal(y, good)
    caplog.clear()                                 # rewritten: the next compile loads it quietly
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        T.compile(graph, cache_dir=tmp_path)
    assert not caplog.records and T.stats.loaded == after[1] + 1


# -- the validator ---------------------------------------------------------------------------------
def test_schema_constants_match_the_package():
    op = importlib.import_module("tflite.BuiltinOperator").BuiltinOperator
    opt = importlib.import_module("tflite.BuiltinOptions").BuiltinOptions
    tt = importlib.import_module("tflite.TensorType").TensorType
    assert (T._FC, T._DEQ, T._SPLIT, T._LOGISTIC, T._MUL, T._ADD) == (
        op.FULLY_CONNECTED, op.DEQUANTIZE, op.SPLIT, op.LOGISTIC, op.MUL, op.ADD)
    assert (T._Opt.FullyConnectedOptions, T._Opt.MulOptions, T._Opt.SplitOptions,
            T._Opt.DequantizeOptions, T._Opt.AddOptions) == (
        opt.FullyConnectedOptions, opt.MulOptions, opt.SplitOptions, opt.DequantizeOptions,
        opt.AddOptions)
    assert (T._TT.FLOAT32, T._TT.FLOAT16, T._TT.INT32, T._TT.INT8, T._TT.INT4) == (
        tt.FLOAT32, tt.FLOAT16, tt.INT32, tt.INT8, tt.INT4)


def _model(buf):
    return importlib.import_module("tflite.Model").Model.GetRootAs(buf, 0)


def _patch_i32(buf: bytes, pos: int, value: int) -> bytes:
    b = bytearray(buf)
    struct.pack_into("<i", b, pos, value)
    return bytes(b)


def _op_input_pos(buf, op, j):
    o = _model(buf).Subgraphs(0).Operators(op)
    return o._tab.Vector(o._tab.Offset(6)) + 4 * j


def _field_pos(table, slot):
    off = table._tab.Offset(4 + 2 * slot)
    assert off, f"slot {slot} absent"
    return table._tab.Pos + off


def _corruptions(buf):
    """(what, corrupted bytes, expected field substring), built on a valid FFN model."""
    m = _model(buf)
    sg = m.Subgraphs(0)
    out = [
        ("empty", b"", "header"),
        ("truncated header", buf[:6], "header"),
        ("file identifier", buf[:4] + b"TFL2" + buf[8:], "file_identifier"),
        ("op input index", _patch_i32(buf, _op_input_pos(buf, 0, 1), 99), "operators[0].inputs[1]"),
        ("op reads a later tensor", _patch_i32(buf, _op_input_pos(buf, 2, 0), 10), "operators[2].inputs[0]"),
        ("tensor buffer index", _patch_i32(buf, _field_pos(sg.Tensors(1), 2), 99), "tensors[1].buffer"),
        ("opcode index", _patch_i32(buf, _field_pos(sg.Operators(1), 0), 7), "operators[1].opcode_index"),
        ("builtin code", _patch_i32(buf, _field_pos(m.OperatorCodes(0), 3), 116),
         "operator_codes[0].builtin_code"),
        ("tensor type", buf[:_field_pos(sg.Tensors(1), 1)] + bytes([5])       # INT8 -> STRING
         + buf[_field_pos(sg.Tensors(1), 1) + 1:], "tensors[1].type"),
    ]
    t2 = sg.Tensors(2)                                   # gate_up.out (T, 2 ff)
    shape_at = t2._tab.Vector(t2._tab.Offset(4))
    out.append(("activation shape", _patch_i32(buf, shape_at + 4, 2 * FF + 2), "operators[0].outputs[0]"))
    t1 = sg.Tensors(1)                                   # gate_up.weight: its data no longer fits
    out.append(("weight shape", _patch_i32(buf, t1._tab.Vector(t1._tab.Offset(4)), 2 * FF + 1),
                "tensors[1].buffer"))
    return out


def test_validator_accepts_what_the_writer_builds():
    for fmt in ("fp32", "fp16", "int8", "int8s", "int4"):
        for graph in (_linear(fmt, K, N, 32, True), _linear(fmt, K, N, 32, False), _ffn(fmt, K, FF, 32)):
            T.validate(T.build_flatbuffer(graph))
    for graph in (_linear("int8s", K8S, N, 32, True), _ffn("int8s", K8S, FF8S, 32)):
        T.validate(T.build_flatbuffer(graph))
    # SmolLM2's FFN: 9 and 24 slices, 140 tensors (the validator's count caps hold far more)
    T.validate(T.build_flatbuffer(_ffn("int8s", 576, 1536, 32)))
    # the FFN with a float gate_up and an int8s down: every operator code in one model
    fp = _ffn("fp16", K8S, FF8S, 32)
    T.validate(T.build_flatbuffer(G.FfnGraph("mixed", fp.gate_up, _ffn("int8s", K8S, FF8S, 32).down, 32)))


def _ops_with_code(buf, code):
    m = _model(buf)
    sg = m.Subgraphs(0)
    # BuiltinCode() reads the deprecated field for small codes; ADD (0) is absent in both
    return [i for i in range(sg.OperatorsLength())
            if m.OperatorCodes(sg.Operators(i).OpcodeIndex()).BuiltinCode() == code]


def _patch_u8(buf: bytes, pos: int, value: int) -> bytes:
    return buf[:pos] + bytes([value]) + buf[pos + 1:]


def _int8s_corruptions(buf):
    """(what, corrupted bytes, expected field substring) on a valid 3-slice int8s linear model:
    SPLIT(x) -> 3 slices; FC, FC, ADD, FC, ADD."""
    sg = _model(buf).Subgraphs(0)
    split, = _ops_with_code(buf, T._SPLIT)
    add = _ops_with_code(buf, T._ADD)[0]
    slice1 = sg.Operators(split).Outputs(1)               # a (T, 64) activation, written before
    bias = next(i for i in range(sg.TensorsLength()) if sg.Tensors(i).Name() == b"linear.bias")
    split_opts = sg.Operators(split).BuiltinOptions()
    return [
        ("ADD of unequal shapes", _patch_i32(buf, _op_input_pos(buf, add, 1), slice1), f"operators[{add}]"),
        ("ADD broadcasting the (N,) bias", _patch_i32(buf, _op_input_pos(buf, add, 1), bias),
         f"operators[{add}]"),
        ("ADD with MulOptions", _patch_u8(buf, _field_pos(sg.Operators(add), 3), T._Opt.MulOptions),
         f"operators[{add}].builtin_options_type"),
        ("ADD with no options", _patch_u8(buf, _field_pos(sg.Operators(add), 3), T._Opt.NONE),
         f"operators[{add}].builtin_options"),
        ("SPLIT into 4 for 3 outputs", _patch_i32(buf, split_opts.Pos + split_opts.Offset(4), 4),
         f"operators[{split}].builtin_options"),
        ("SPLIT into 2 slices of 96", _patch_i32(buf, split_opts.Pos + split_opts.Offset(4), 2),
         f"operators[{split}].outputs"),
    ]


@pytest.mark.parametrize("case", range(6))
def test_validator_names_what_is_wrong_in_int8s(case):
    graph = _linear("int8s", K8S, N, 32, True)
    buf = T.build_flatbuffer(graph)
    what, bad, field = _int8s_corruptions(buf)[case]
    with pytest.raises(T.TfliteModelError) as e:
        T.validate(bad, source="fixture.tflite")
    assert field in e.value.field, f"{what}: {e.value}"
    if _OK:
        before = T.stats.interpreters
        with pytest.raises(T.TfliteModelError):
            T.TfliteSubgraph(graph, bad)
        assert T.stats.interpreters == before


def test_validator_rejects_an_add_with_an_activation(monkeypatch):
    """The writer never fuses an activation into ADD (its AddOptions table is empty): one that
    says RELU is refused, naming the options."""
    add_options = importlib.import_module("tflite.AddOptions")
    end = add_options.AddOptionsEnd

    def relu_end(b):
        add_options.AddOptionsAddFusedActivationFunction(b, 1)
        return end(b)

    monkeypatch.setattr(add_options, "AddOptionsEnd", relu_end)
    buf = T.build_flatbuffer(_linear("int8s", K8S, N, 32, False))
    add = _ops_with_code(buf, T._ADD)[0]
    with pytest.raises(T.TfliteModelError, match="only no activation") as e:
        T.validate(buf)
    assert e.value.field == f"operators[{add}].builtin_options"


@pytest.mark.parametrize("case", range(11))
def test_validator_names_what_is_wrong(case):
    graph = _ffn("int8", K, FF, 32)
    buf = T.build_flatbuffer(graph)
    what, bad, field = _corruptions(buf)[case]
    with pytest.raises(T.TfliteModelError) as e:
        T.validate(bad, source="fixture.tflite")
    assert field in e.value.field, f"{what}: {e.value}"
    assert "fixture.tflite" in str(e.value)
    if _OK:                   # and no interpreter ever sees it
        before = T.stats.interpreters
        with pytest.raises(T.TfliteModelError):
            T.TfliteSubgraph(graph, bad)
        assert T.stats.interpreters == before


def test_validator_rejects_non_bytes():
    with pytest.raises(T.TfliteModelError, match="expected bytes"):
        T.validate(None)


@needs_runtime
def test_random_corruption_never_crashes(tmp_path):
    """A few hundred mutations of small valid models (truncation, byte flips mostly in the
    flatbuffer structure rather than the weights, interesting 32-bit values): validate() either
    rejects with TfliteModelError, or the model loads and runs; any error is a typed one."""
    rng = np.random.default_rng(2024)
    graphs = []
    for fmt in ("fp32", "fp16", "int8", "int4"):
        graphs += [_linear(fmt, 32, 8, 4, True), _ffn(fmt, 32, 32, 4)]
    graphs += [_linear("int8s", 128, 8, 4, True), _ffn("int8s", 64, 128, 4)]
    models = []
    for g in graphs:
        buf = T.build_flatbuffer(g)
        m, data = _model(buf), np.zeros(len(buf), bool)
        for i in range(m.BuffersLength()):
            b = m.Buffers(i)
            if b._tab.Offset(4):
                v = b._tab.Vector(b._tab.Offset(4))
                data[v:v + b.DataLength()] = True
        models.append((g, buf, np.nonzero(~data)[0]))    # positions outside the weight data
    rejected = ran = typed_at_load = 0
    for _ in range(400):
        g, buf, structure = models[rng.integers(len(models))]
        b = bytearray(buf)
        how = rng.integers(4)
        if how == 0:
            b = b[: rng.integers(len(b))]
        elif how == 1:
            for _ in range(rng.integers(1, 4)):
                b[structure[rng.integers(len(structure))]] = rng.integers(256)
        elif how == 2:
            at = int(structure[rng.integers(len(structure))]) & ~3
            value = [0, 1, 2, 4, 8, 0x7FFFFFFF, 0xFFFFFFFF, len(b), int(rng.integers(64))][rng.integers(9)]
            b[at:at + 4] = int(value).to_bytes(4, "little")
        else:
            b[rng.integers(len(b))] ^= 1 << int(rng.integers(8))
        b = bytes(b)
        try:
            T.validate(b)
        except T.TfliteModelError:
            rejected += 1
            continue
        try:
            sub = T.TfliteSubgraph(g, b)
            sub.run(np.random.default_rng(1).standard_normal(sub.input_shape).astype(np.float32))
            ran += 1
        except EdgeLLMError:
            typed_at_load += 1
    print(f"400 mutants: {rejected} rejected by validate(), {ran} ran, {typed_at_load} typed errors at load")
    assert rejected >= 200 and ran >= 20


# -- the npu unit's choice -------------------------------------------------------------------------
def test_litert_defaults_to_int8s_and_onnx_refuses_it(monkeypatch):
    from edgellm.backends import UnitFailed, npu, npu_onnx

    monkeypatch.delenv("EDGELLM_NPU_FORMAT", raising=False)
    assert npu.weight_format(T) == "int8s"
    assert npu.weight_format(npu_onnx) == "int8b"
    monkeypatch.setenv("EDGELLM_NPU_FORMAT", "int8")
    assert npu.weight_format(T) == "int8"
    monkeypatch.setenv("EDGELLM_NPU_FORMAT", "int8s")
    assert npu.weight_format(T) == "int8s"
    with pytest.raises(UnitFailed, match="int8s.*ONNX"):
        npu.weight_format(npu_onnx)


def test_prepared_nbytes_counts_the_slice_scales(monkeypatch):
    from edgellm.backends import npu

    cfg = types.SimpleNamespace(d_model=576, d_ff=1536, q_dim=576, kv_dim=192, n_layers=30, vocab_size=49152)
    sizes = {}
    for fmt in ("int8", "int8s"):
        monkeypatch.setenv("EDGELLM_NPU_FORMAT", fmt)
        sizes[fmt] = npu.prepared_nbytes(cfg, {"ffn_down"})
    # ffn_down (576, 1536): 24 slice scales a row instead of one, per bucket
    assert sizes["int8s"] - sizes["int8"] == 30 * 576 * 4 * 23 * len(npu.buckets())


@pytest.mark.parametrize("fmt", G.FORMATS)
def test_quantize_in_row_chunks_gives_the_whole_matrixs_bits(fmt, monkeypatch):
    """quantize() works through a tall matrix _QUANT_ROWS rows at a time (the head's f32
    temporaries made the load's peak RSS): the same q, scales and bias as all rows at once."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((301, 128)).astype(np.float32) * rng.uniform(0, 3, (301, 1)).astype(np.float32)
    w[7] = 0.0                                     # a zero row: scale 0, q 0
    b = rng.standard_normal(301).astype(np.float32)
    whole = G.quantize(w, fmt, b)
    monkeypatch.setattr(G, "_QUANT_ROWS", 64)
    parts = G.quantize(w, fmt, b)
    assert parts.q.dtype == whole.q.dtype and np.array_equal(parts.q, whole.q)
    assert (parts.scale is None) == (whole.scale is None)
    if whole.scale is not None:
        assert np.array_equal(parts.scale.view(np.uint32), whole.scale.view(np.uint32))
    assert np.array_equal(parts.bias, whole.bias) and parts.digest() == whole.digest()


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"])
def test_a_gguf_matrix_requantized_a_slice_at_a_time_gives_the_same_bits(qtype, monkeypatch):
    """The npu unit requantizes a tall GGUF matrix (the head) from _GgufRows, dequantizing
    _QUANT_ROWS rows at a time, not the whole f32 matrix first: the same QLinear."""
    from gguf import GGMLQuantizationType as QT

    from edgellm import quant
    from edgellm.backends import npu

    qt = QT[qtype]
    w = np.random.default_rng(6).standard_normal((300, 128)).astype(np.float32)
    raw = quant.quantize(w, qt)
    monkeypatch.setattr(G, "_QUANT_ROWS", 64)
    rows = npu._GgufRows(raw, qt, w.shape)
    full = quant.dequantize(raw, qt, w.shape)
    assert np.array_equal(rows[64:128].view(np.uint32), full[64:128].view(np.uint32))
    for fmt in ("int8s", "int8", "fp16"):
        a, b = G.quantize(rows, fmt), G.quantize(full, fmt)
        assert a.digest() == b.digest(), fmt
