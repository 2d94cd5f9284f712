"""Throughput of a CPU unit's non-GEMM ops as the engine runs them, for `edgellm profile`.

The roofline alone priced numpy's attention at its sgemm peak, ~10x what the gather, masking and
softmax around the two batched products reach, and numpy's elementwise ops at DRAM speed, which
swiglu's exp and rope's strided halves are far from; measuring the ops themselves lets the
dispatcher place them.

Attention: SmolLM2-135M's heads (9 query heads of 64 over 3 kv heads) on an f16 KV pool of
16-token blocks: a decode step at 512 keys, a 32-token turn after a 400-token cached prefix, and a
256-token prefill chunk. Each call reads another layer of a 30-layer pool, so the keys come from
DRAM as in a forward pass rather than staying in cache from the previous call."""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..ops import attention_flops, elementwise_flops
from .probes import ProbeSizes, median_seconds
from .profile import AttentionFigure, ElementwiseFigure

SHAPES = ((1, 512), (32, 400), (256, 0))          # (tokens, keys cached before them)
HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16

# run(q, seq, layer, start) -> (T, H * hd): one attention call of the unit over seq's layer
AttentionCall = Callable[[np.ndarray, object, int, int], np.ndarray]


def measure_attention(run: AttentionCall, sizes: ProbeSizes, call_overhead_s: float, progress=None,
                      label: str = "attention") -> tuple[AttentionFigure, ...]:
    """The unit's call overhead is taken out of each time, as the cost model adds it back per op
    (the same rule as the GEMM curve)."""
    from ..kv.pool import KVPool

    n_max = max(t + c for t, c in SHAPES)
    pool = KVPool(LAYERS, KV_HEADS, HEAD_DIM, n_blocks=-(-n_max // BLOCK) + 1, block_tokens=BLOCK)
    seq = pool.new_sequence()
    seq.reserve(n_max)
    rng = np.random.default_rng(0)
    for layer in range(LAYERS):
        k, v = (rng.standard_normal((n_max, KV_HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2))
        seq.write(layer, 0, k, v)
    figures = []
    for i, (T, start) in enumerate(SHAPES):
        if progress:
            progress(f"{label} {T} tokens after {start}", i, len(SHAPES))
        q = rng.standard_normal((T, HEADS, HEAD_DIM)).astype(np.float32)
        turn = iter(range(1 << 62))
        t = median_seconds(lambda: run(q, seq, next(turn) % LAYERS, start), sizes)
        body = max(t - call_overhead_s, 0.5 * t)
        figures.append(AttentionFigure(tokens=T, context=start,
                                       flops=attention_flops(T, start, HEADS, HEAD_DIM) / body))
    return tuple(figures)


# Elementwise ops at SmolLM2-135M's widths, (tokens, width) per call as the engine makes it:
# rmsnorm and add over d_model, rope over the q and k heads (12 of 64), swiglu over gate|up.
ELEMENTWISE_TOKENS = (1, 32, 256)
D_MODEL, D_FF, ROPE_HEADS = 576, 1536, 12


def measure_elementwise(backend, sizes: ProbeSizes, call_overhead_s: float, progress=None,
                        ) -> tuple[ElementwiseFigure, ...]:
    """backend: a module with the engine's rmsnorm, rope, swiglu and add. The call overhead is
    taken out of each time, as for the other figures."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal(D_MODEL).astype(np.float32)
    figures = []
    for i, T in enumerate(ELEMENTWISE_TOKENS):
        if progress:
            progress(f"elementwise ops, {T} tokens", i, len(ELEMENTWISE_TOKENS))
        x = rng.standard_normal((T, D_MODEL)).astype(np.float32)
        heads = rng.standard_normal((T, ROPE_HEADS, HEAD_DIM)).astype(np.float32)
        ang = rng.standard_normal((T, HEAD_DIM // 2))
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        gu = rng.standard_normal((T, 2 * D_FF)).astype(np.float32)
        calls = {"rmsnorm": (lambda: backend.rmsnorm(x, w, 1e-5), D_MODEL),
                 "rope": (lambda: backend.rope(heads, cos, sin, "neox"), ROPE_HEADS * HEAD_DIM),
                 "swiglu": (lambda: backend.swiglu(gu), D_FF),
                 "add": (lambda: backend.add(x, x), D_MODEL)}
        for op, (call, width) in calls.items():
            t = median_seconds(call, sizes)
            body = max(t - call_overhead_s, 0.5 * t)
            figures.append(ElementwiseFigure(op=op, tokens=T, flops=elementwise_flops(op, T, width) / body))
    return tuple(figures)
