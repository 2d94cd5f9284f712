"""Causal attention throughput of a CPU unit, as the engine runs it, for `edgellm profile`.

The roofline alone priced numpy's attention at its sgemm peak, ~10x what the gather, masking and
softmax around the two batched products reach; measuring the op itself lets the dispatcher place
it. Shapes are SmolLM2-135M's heads (9 query heads of 64 over 3 kv heads) on an f16 KV pool of
16-token blocks: a decode step at 512 keys, a 32-token turn after a 400-token cached prefix, and a
256-token prefill chunk. Each call reads another layer of a 30-layer pool, so the keys come from
DRAM as in a forward pass rather than staying in cache from the previous call."""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..ops import attention_flops
from .probes import ProbeSizes, median_seconds
from .profile import AttentionFigure

SHAPES = ((1, 512), (32, 400), (256, 0))          # (tokens, keys cached before them)
HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 9, 3, 64, 30, 16

# run(q, seq, layer, start) -> (T, H * hd): one attention call of the unit over seq's layer
AttentionCall = Callable[[np.ndarray, object, int, int], np.ndarray]


def measure(run: AttentionCall, sizes: ProbeSizes, call_overhead_s: float, progress=None,
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
