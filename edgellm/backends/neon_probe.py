"""The neon unit's figures for `edgellm profile`: quantized GEMM throughput by rows (the int8
path the model's Q4_1 matmuls take), fp32 and fp16-weight GEMM throughput, per-call overhead.

As for the numpy unit, every call reads a different weight matrix out of a set several times
the last-level cache, so one-row GEMVs stream from DRAM as decode does."""
from __future__ import annotations

import math
import statistics
import time

import numpy as np

from .. import quant
from ..device.profile import GemmFigure, UnitMeasurement

K, N = 576, 1536                                 # SmolLM2's d_model x a projection width
ROWS = {True: (1, 16, 32, 64, 128, 256, 512), False: (1, 8, 16, 32, 64, 128, 256, 512, 1024)}


def _median(call, budget_s: float, max_runs: int = 301) -> float:
    call()
    t0 = time.perf_counter()
    call()
    runs = max(3, min(max_runs, int(budget_s / max(time.perf_counter() - t0, 1e-9))))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe(quick: bool, threads: int, progress=None, *, cache_bytes: int = 64 << 20) -> UnitMeasurement | None:
    from . import neon

    ok, _ = neon.available()
    if not ok:
        return None
    neon.configure(threads=threads, cores=None)
    budget = 1.0 if quick else 3.0
    rng = np.random.default_rng(0)
    row_bytes = quant.bytes_per_row(quant.T.Q4_1, K)
    count = max(2, math.ceil(3 * cache_bytes / (N * row_bytes)))
    one = quant.quantize(rng.standard_normal((N, K)).astype(np.float32), quant.T.Q4_1)   # (N, row bytes)
    mats = [neon.QMatrix.from_arrays("Q4_1", [one.copy()], [N], K) for _ in range(count)]

    a = np.ones((1, 8), np.float32)
    overhead = _median(lambda: [neon.add(a, a) for _ in range(100)], budget) / 100
    curve = []
    for i, m in enumerate(ROWS[quick]):
        if progress:
            progress(f"q4_1 gemm {m}x{K}x{N}", i, len(ROWS[quick]))
        x = rng.standard_normal((m, K)).astype(np.float32)
        turn = iter(range(1 << 62))
        t = _median(lambda: neon.matmul(x, mats[next(turn) % count]), budget)
        curve.append(GemmFigure(m=m, k=K, n=N, flops=2.0 * m * K * N / max(t - overhead, 0.5 * t)))
    flops = {"int8": max(g.flops for g in curve)}
    x = rng.standard_normal((256, K)).astype(np.float32)
    for prec, typ, dtype in (("fp32", "F32", np.float32), ("fp16", "F16", np.float16)):
        w = rng.standard_normal((N, K)).astype(dtype)
        qm = neon.QMatrix.from_arrays(typ, [w.view(np.uint8)], [N], K)
        flops[prec] = 2.0 * 256 * K * N / _median(lambda: neon.matmul(x, qm), budget)
    return UnitMeasurement(precision_flops=flops, gemm=tuple(curve), call_overhead_s=overhead, threads=threads)
