"""The neon unit's figures for `edgellm profile`: quantized GEMM throughput by rows (the int8
path the model's Q4_1 matmuls take), fp32 and fp16-weight GEMM throughput, per-call overhead, and
attention over the KV pool's blocks and the elementwise ops (device/op_probe.py).

The shapes, run counts and timing are the profile's own (device.probes.ProbeSizes and
median_seconds): as for the numpy unit, every call reads a different weight matrix out of a set
several times the caches, so one-row GEMVs stream from DRAM as decode does."""
from __future__ import annotations

import ctypes
import logging
import math
import time

import numpy as np

from .. import quant
from ..costmodel import NEON_CURVE_FORMAT
from ..device.probes import ProbeSizes, median_seconds
from ..device.profile import GemmFigure, UnitMeasurement

# the weight format of the GEMM curve (the cost model reads its one-row figure as a rate of
# these bytes: costmodel._stream_bandwidth)
CURVE_FORMAT = NEON_CURVE_FORMAT.upper()

log = logging.getLogger("edgellm")


class _GemvFailed(RuntimeError):
    """el_matmul refused a one-row figure's call."""


# row counts of the fp32-activation GEMM figures (those of sizes.gemm_rows among them)
FP32ACT_ROWS = (1, 16, 64, 256)


def probe(sizes: ProbeSizes, threads: int, progress=None) -> UnitMeasurement | None:
    """None when the neon unit is not available here. `sizes` must be resolved (weight_bytes)."""
    from . import neon

    ok, _ = neon.available()
    if not ok:
        return None
    neon.configure(threads=threads, cores=None)
    K, N = sizes.gemm_k, sizes.gemm_n
    rng = np.random.default_rng(0)
    fmt = quant.T[CURVE_FORMAT]
    count = max(2, math.ceil(sizes.weight_bytes / (N * quant.bytes_per_row(fmt, K))))
    one = quant.quantize(rng.standard_normal((N, K)).astype(np.float32), fmt)   # (N, row bytes)
    mats = [neon.QMatrix.from_arrays(CURVE_FORMAT, [one.copy()], [N], K) for _ in range(count)]

    a = np.ones((1, 8), np.float32)
    batch = max(1, sizes.overhead_batch)

    def calls():
        for _ in range(batch):
            neon.add(a, a)
    overhead = median_seconds(calls, sizes) / batch
    curve = []
    for i, m in enumerate(sizes.gemm_rows):
        if progress:
            progress(f"{CURVE_FORMAT.lower()} gemm {m}x{K}x{N}", i, len(sizes.gemm_rows))
        x = rng.standard_normal((m, K)).astype(np.float32)
        turn = iter(range(1 << 62))
        t = median_seconds(lambda: neon.matmul(x, mats[next(turn) % count]), sizes)
        # never let a noisy overhead figure eat more than half of a measured time
        curve.append(GemmFigure(m=m, k=K, n=N, flops=2.0 * m * K * N / max(t - overhead, 0.5 * t)))
    flops = {"int8": max(g.flops for g in curve)}
    # the same GEMM with fp32 activations (a precision plan's ask for a sensitive layer): its cost
    # against the int8 path's depends on the rows (2.7x at 1 row, 7.7x at 256 on an x86 host)
    fp32act = []
    rows = [m for m in sizes.gemm_rows if m in FP32ACT_ROWS]
    for i, m in enumerate(rows):
        if progress:
            progress(f"{CURVE_FORMAT.lower()} gemm, fp32 activations {m}x{K}x{N}", i, len(rows))
        x = rng.standard_normal((m, K)).astype(np.float32)
        turn = iter(range(1 << 62))
        t = median_seconds(lambda: neon.matmul(x, mats[next(turn) % count], precision="fp32"), sizes)
        fp32act.append(GemmFigure(m=m, k=K, n=N, flops=2.0 * m * K * N / max(t - overhead, 0.5 * t)))
    x = rng.standard_normal((256, K)).astype(np.float32)
    for prec, typ, dtype in (("fp32", "F32", np.float32), ("fp16", "F16", np.float16)):
        w = rng.standard_normal((N, K)).astype(dtype)
        qm = neon.QMatrix.from_arrays(typ, [w.view(np.uint8)], [N], K)
        flops[prec] = 2.0 * 256 * K * N / median_seconds(lambda: neon.matmul(x, qm), sizes)
    gemv, gemv_fp32act = measure_gemv(sizes, progress)
    from ..device import op_probe

    def attend(q, seq, layer, start):   # straight from the pool's blocks, as the engine does
        return neon.attention_pool(q, seq.pool, np.asarray(seq.block_table, np.int32), layer, start)
    return UnitMeasurement(precision_flops=flops, gemm=tuple(curve), call_overhead_s=overhead, threads=threads,
                           attention=op_probe.measure_attention(attend, sizes, overhead, progress),
                           elementwise=op_probe.measure_elementwise(neon, sizes, overhead, progress),
                           gemm_fp32act=tuple(fp32act), gemv=gemv, gemv_fp32act=gemv_fp32act)


# weight formats of the one-row figures (those a model's matmuls run in on neon), by activations
GEMV_FORMATS = {"int8": ("Q4_0", "Q4_1", "Q8_0", "F16"), "fp32": ("Q4_1", "Q8_0")}


def measure_gemv(sizes: ProbeSizes, progress=None) -> tuple[dict[str, float], dict[str, float]]:
    """One-row GEMM FLOP/s by weight format, int8 and fp32 activations: ({fmt: FLOP/s}, ...).

    Decode's matmuls are these GEMVs, and their speed is not one FLOP rate: in the fused decode
    step (Zen 5, SmolLM2 shapes) Q8_0's ran 2.0-2.25x Q4_1's time for 1.7x the bytes, and
    Q4_1's 1.5x faster than the curve's one-row figure, timed through neon.matmul, said (its
    Python, ~6 us a call, was counted as GEMM time). Here the library is called straight through
    ctypes with arguments made beforehand, less the same call returning at once (M = 0); each
    call reads another matrix of a set sizes.weight_bytes large, so weights stream from DRAM as
    in decode. fmt keys are lower case (ops.WEIGHT_BYTES)."""
    from . import neon

    lib, pool = neon._lib(), neon.thread_pool()
    K, N = sizes.gemm_k, sizes.gemm_n
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, K)).astype(np.float32)
    y = np.empty((1, N), np.float32)
    scratch = np.empty(lib.el_matmul_scratch(1, K), np.uint8)
    fp = ctypes.POINTER(ctypes.c_float)
    xp, yp = x.ctypes.data_as(fp), y.ctypes.data_as(fp)
    out: dict[str, dict[str, float]] = {"int8": {}, "fp32": {}}
    jobs = [(act, fmt) for act, fmts in GEMV_FORMATS.items() for fmt in fmts]
    for i, (act, fmt) in enumerate(jobs):
        if progress:
            progress(f"{fmt.lower()} gemv, {act} activations", i, len(jobs))
        w = rng.standard_normal((N, K)).astype(np.float32)
        one = w.astype(np.float16).view(np.uint8) if fmt == "F16" else quant.quantize(w, quant.T[fmt])
        count = max(2, math.ceil(sizes.weight_bytes / one.nbytes))
        mats = [neon.QMatrix.from_arrays(fmt, [one.copy()], [N], K) for _ in range(count)]
        fn = lib.el_matmul if act == "int8" else lib.el_matmul_f32act
        tail = (scratch.ctypes.data,) if act == "int8" else ()
        args = [(pool.ptr, m.wtype, m.ptrs, m.rows_c, 1, xp, yp, 1, K, None) + tail for m in mats]
        null = args[0][:7] + (0,) + args[0][8:]     # M = 0: refused before any work
        turn = iter(range(1 << 62))

        def call():
            rc = fn(*args[next(turn) % count])
            if rc != 0:
                raise _GemvFailed(f"{fn.__name__} returned {rc} on {fmt} weights")
        try:
            t = median_seconds(call, sizes)
        except _GemvFailed as e:
            # one format's figure is lost, not the unit's: without it the cost model prices that
            # format by the curve, as before the figures existed (an exception here skipped neon
            # in the whole profile)
            log.warning("edgellm profile: no one-row figure for %s weights, %s activations (%s)", fmt, act, e)
            continue
        # never let a noisy null call eat more than half of a measured time (as the curve's
        # overhead): a difference <= 0 wrote 2 * K * N / 1e-9 FLOP/s into the profile
        secs = max(t - median_seconds(lambda: fn(*null), sizes), 0.5 * t)
        out[act][fmt.lower()] = 2.0 * K * N / secs
    return out["int8"], out["fp32"]


PEAK_KINDS = {"fp32": 0, "fp16": 1, "int8": 2}    # EL_PEAK_* of neon/edgellm_neon.h


def read_bandwidth(nbytes: int, threads: int, sizes: ProbeSizes) -> float | None:
    """bytes/s the neon library's threads stream from memory (el_read_probe over an nbytes
    buffer, its pages written first), the median of the profile's runs; None when the library is
    not available. The first pass's word sum is checked against numpy's: a probe that skipped
    part of the buffer would report a bandwidth it did not read."""
    from . import neon

    ok, _ = neon.available()
    if not ok:
        return None
    lib = neon._lib()
    buf = np.empty(max(1, nbytes // 64) * 8, np.uint64)
    buf[:] = np.arange(buf.size, dtype=np.uint64)     # (written: untouched pages all map to one zero page)
    pool = neon.NativePool(threads, ())                # (its workers inherit the caller's pinning)
    total = ctypes.c_uint64()

    def once():
        rc = lib.el_read_probe(pool.ptr, buf.ctypes.data, buf.nbytes, ctypes.byref(total))
        if rc != 0:
            raise RuntimeError(f"el_read_probe returned {rc}")
    once()
    want = int(buf.sum(dtype=np.uint64))
    if total.value != want:
        raise RuntimeError(f"el_read_probe summed {total.value}, numpy {want}: it did not read the whole buffer")
    return buf.nbytes / median_seconds(once, sizes)


def peak_per_core(seconds: float = 0.02, runs: int = 5) -> tuple[dict[str, float], str] | None:
    """The calling core's arithmetic peak per precision (op/s, multiplies and adds counted as
    GEMM FLOPS are), from el_peak_probe: chains of the widest multiply-accumulate this build
    issues, timed on the calling thread (pin it first), the median of `runs` of ~`seconds`.
    Returns (peaks, note), or None when the neon library is not available. Without fp16 vector
    arithmetic (x86, Armv8.0) fp16 work runs in fp32, so its peak is the fp32 one (said in the note)."""
    from . import neon

    ok, _ = neon.available()
    if not ok:
        return None
    lib = neon._lib()
    peaks, notes = {}, []
    for name, kind in PEAK_KINDS.items():
        ops = ctypes.c_double()

        def once(iters: int) -> tuple[float, float]:
            t = time.perf_counter()
            rc = lib.el_peak_probe(kind, iters, ctypes.byref(ops))
            return rc, time.perf_counter() - t

        rc, _ = once(1)
        if rc != 0:
            notes.append(f"{name}: no native {name} arithmetic, its work runs in fp32")
            continue
        iters = 1 << 10
        while True:   # calibrate: a run of about `seconds`, then the median of `runs`
            _, t = once(iters)
            if t >= seconds / 4 or iters >= 1 << 40:
                break
            iters *= 4
        iters = max(1, int(iters * seconds / max(t, 1e-9)))
        times = sorted(once(iters)[1] for _ in range(runs))
        peaks[name] = ops.value / times[len(times) // 2]
    peaks.setdefault("fp16", peaks["fp32"])
    return peaks, "; ".join(notes)
