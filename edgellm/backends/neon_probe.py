"""The neon unit's figures for `edgellm profile`: quantized GEMM throughput by rows (the int8
path the model's Q4_1 matmuls take), fp32 and fp16-weight GEMM throughput, per-call overhead, and
attention over the KV pool's blocks and the elementwise ops (device/op_probe.py).

The shapes, run counts and timing are the profile's own (device.probes.ProbeSizes and
median_seconds): as for the numpy unit, every call reads a different weight matrix out of a set
several times the caches, so one-row GEMVs stream from DRAM as decode does."""
from __future__ import annotations

import math

import numpy as np

from .. import quant
from ..device.probes import ProbeSizes, median_seconds
from ..device.profile import GemmFigure, UnitMeasurement


def probe(sizes: ProbeSizes, threads: int, progress=None) -> UnitMeasurement | None:
    """None when the neon unit is not available here. `sizes` must be resolved (weight_bytes)."""
    from . import neon

    ok, _ = neon.available()
    if not ok:
        return None
    neon.configure(threads=threads, cores=None)
    K, N = sizes.gemm_k, sizes.gemm_n
    rng = np.random.default_rng(0)
    count = max(2, math.ceil(sizes.weight_bytes / (N * quant.bytes_per_row(quant.T.Q4_1, K))))
    one = quant.quantize(rng.standard_normal((N, K)).astype(np.float32), quant.T.Q4_1)   # (N, row bytes)
    mats = [neon.QMatrix.from_arrays("Q4_1", [one.copy()], [N], K) for _ in range(count)]

    a = np.ones((1, 8), np.float32)
    batch = max(1, sizes.overhead_batch)

    def calls():
        for _ in range(batch):
            neon.add(a, a)
    overhead = median_seconds(calls, sizes) / batch
    curve = []
    for i, m in enumerate(sizes.gemm_rows):
        if progress:
            progress(f"q4_1 gemm {m}x{K}x{N}", i, len(sizes.gemm_rows))
        x = rng.standard_normal((m, K)).astype(np.float32)
        turn = iter(range(1 << 62))
        t = median_seconds(lambda: neon.matmul(x, mats[next(turn) % count]), sizes)
        # never let a noisy overhead figure eat more than half of a measured time
        curve.append(GemmFigure(m=m, k=K, n=N, flops=2.0 * m * K * N / max(t - overhead, 0.5 * t)))
    flops = {"int8": max(g.flops for g in curve)}
    x = rng.standard_normal((256, K)).astype(np.float32)
    for prec, typ, dtype in (("fp32", "F32", np.float32), ("fp16", "F16", np.float16)):
        w = rng.standard_normal((N, K)).astype(dtype)
        qm = neon.QMatrix.from_arrays(typ, [w.view(np.uint8)], [N], K)
        flops[prec] = 2.0 * 256 * K * N / median_seconds(lambda: neon.matmul(x, qm), sizes)
    from ..device import op_probe

    def attend(q, seq, layer, start):   # straight from the pool's blocks, as the engine does
        return neon.attention_pool(q, seq.pool, np.asarray(seq.block_table, np.int32), layer, start)
    return UnitMeasurement(precision_flops=flops, gemm=tuple(curve), call_overhead_s=overhead, threads=threads,
                           attention=op_probe.measure_attention(attend, sizes, overhead, progress),
                           elementwise=op_probe.measure_elementwise(neon, sizes, overhead, progress))
