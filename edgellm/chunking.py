"""Roofline chunk sizing: how many prompt tokens one prefill step processes.

The chunk is the smallest aligned size at which the prefill unit's GEMMs reach its compute roof
(weights are read once per chunk, so a larger chunk raises their arithmetic intensity, until the
unit is compute-bound and more tokens only cost memory and responsiveness). It is then bounded
by the memory budget (activations + KV of the chunk), by the last-level cache (the widest GEMM's
activations should stay cached while the weight tiles stream past), by the context, and, on a
static-shape unit, rounded to one of its buckets.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from .costmodel import Unit
from .model.config import ModelConfig
from .ops import ACT_BYTES, MATMUL_KINDS, layer_ops, op_cost

ALIGN = 32            # quantized activation blocks are 32 wide; Mali warps (16) divide it too
ROOF_FRACTION = 0.95  # "at the roof": attainable compute within 5% of the unit's best
LAUNCH_SHARE = 0.1    # and each GEMM's call overhead at most 10% of its compute time
# A chunk also pays one call per op of every layer (12 here), whatever its size: those fixed
# costs must be small against the layer's GEMM time. Measured with the neon unit on the dev
# machine (10.7 us per call), 512-token TTFT by chunk: 32 -> 1487 ms, 64 -> 1373, 128 -> 1358,
# 256 -> 1302, 512 -> 1281, although its GEMM curve is flat from 32 rows.
LAYER_CALLS_SHARE = 0.02
MAX_TOKENS = 2048


@dataclass(frozen=True)
class ChunkChoice:
    tokens: int                  # the prefill chunk the engine uses
    unit: str                    # the unit whose GEMMs sized it
    roof_tokens: int             # smallest aligned size at the roof, before the bounds
    derivation: tuple[str, ...]  # one line per step, for `edgellm plan`


def chunk_bounds(n: int, step: int, limit: int | None = None) -> list[int]:
    """Where a prompt of n tokens is cut into chunks of step: [0, step, 2 step, ..., n], except
    that no chunk is one token where that can be helped. A chunk of one row runs the decode
    kernels (GEMVs, the decode attention), which sum in another order: a row's result would then
    depend on where its prompt was cut (ModelRunner.forward, Generation and the plan's TTFT all
    cut here). A one-token last chunk takes a token from the chunk before (257 by 256: 0, 255,
    257); with step 2 that left the chunk before it one token (15 by 2: ..., 12, 13, 15; SmolLM2's
    greedy text changed), so the last two are one chunk of 3 (..., 12, 15), unless `limit` (the
    most a chunk may hold: a ring's room) is under 3. With step 1 every chunk is one token."""
    bounds = list(range(0, n, step)) + [n]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1 and step > 1:
        if step > 2:
            bounds[-2] -= 1
        elif limit is None or limit >= 3:
            del bounds[-2]
    return bounds


def per_token_bytes(cfg: ModelConfig, kv_bytes: float) -> float:
    """Memory one more chunk token needs: the live activations of a layer (residual, normed
    input, qkv, attention output, gate|up, swiglu output) plus its KV in every layer."""
    act = ACT_BYTES * (3 * cfg.d_model + 2 * cfg.q_dim + 2 * cfg.kv_dim + 3 * cfg.d_ff)
    return act + cfg.n_layers * 2 * cfg.kv_dim * kv_bytes


def _flat_past_target(fixed_s: float, work_s: float, work_at_limit_s: float, T: int, limit: int,
                      share: float) -> bool:
    """A fixed cost per call (or per layer) that must be at most `share` of the work it comes
    with. A unit so fast that it is over that share even at the largest chunk (a fast GPU's
    launches, an NPU's calls) would send every chunk to the maximum: there the test is met once
    the per-token cost at T is within `share` of its cost at the largest chunk, where growing
    the chunk stops paying. A target the largest chunk meets keeps the plain test."""
    if fixed_s <= share * work_at_limit_s:
        return False
    return (fixed_s + work_s) / T <= (1 + share) * (fixed_s + work_at_limit_s) / limit


def _why_not_roof(unit: Unit, cfg: ModelConfig, formats: Mapping[str, str], T: int, kv_bytes: float,
                  limit: int | None = None) -> str:
    """'' when every GEMM of the layer is at the roof at T tokens, else the first reason not.
    limit: the largest chunk (padded): a test that no chunk up to it can pass passes once T's
    figure is within its tolerance of the figure at limit."""
    limit = max(limit or T, T)
    for op in layer_ops(cfg):
        if op.kind not in MATMUL_KINDS:
            continue
        prec, fmt = unit.precision_for(op, formats.get(op.name, "f32"))
        curve = unit.gemm_curve if (unit.gemm_curve and prec == unit.curve_precision) else ()
        best = max([f for _, f in curve] or [unit.peak.get(prec, 0.0)])
        # rows at which the best was measured: more rows cannot raise the roof, so a measured
        # curve that sags after its best (noise, or a cache effect the cache bound handles) does
        # not push the chunk to the maximum
        best_rows = min((m for m, f in curve if f == best), default=0)
        att = unit.attainable(prec, T)
        if best <= 0:
            return f"{unit.name} has no {prec} peak"
        if att < ROOF_FRACTION * best and not (best_rows and T >= best_rows):
            return f"{op.name} reaches {att / 1e9:.0f} of {best / 1e9:.0f} GFLOPS on its GEMM-by-rows curve"
        c = op_cost(op, cfg, T, 0, fmt, kv_bytes)
        ridge = att / unit.bandwidth
        # fp32 activations in and out cap a GEMM's intensity (qkv: near 180 FLOP/B) however long
        # the chunk: against a higher ridge it is memory-bound at every size. At the roof = its
        # memory-bound rate within ROOF_FRACTION of what it can reach: the compute roof, or the
        # memory-bound rate at the largest chunk when that is under the roof
        reachable = min(att, op_cost(op, cfg, limit, 0, fmt, kv_bytes).intensity * unit.bandwidth)
        if c.intensity * unit.bandwidth < ROOF_FRACTION * reachable:
            return (f"{op.name} is memory-bound (AI {c.intensity:.1f} < ridge {ridge:.1f} FLOP/B: "
                    f"{c.intensity * unit.bandwidth / 1e9:.0f} of the {reachable / 1e9:.0f} GFLOPS it can reach)")
        far_s = op_cost(op, cfg, limit, 0, fmt, kv_bytes).flops / unit.attainable(prec, limit)
        if unit.launch_s > LAUNCH_SHARE * c.flops / att and not _flat_past_target(
                unit.launch_s, c.flops / att, far_s, T, limit, LAUNCH_SHARE):
            return (f"{op.name}'s launch overhead is over {LAUNCH_SHARE:.0%} of its compute"
                    f"{_unreachable(unit.launch_s, far_s, limit, LAUNCH_SHARE)}")
    ops = layer_ops(cfg)
    gemm_s, calls_s = _layer_gemm_s(unit, cfg, formats, T, kv_bytes), len(ops) * unit.launch_s
    far_s = _layer_gemm_s(unit, cfg, formats, limit, kv_bytes)
    if calls_s > LAYER_CALLS_SHARE * gemm_s and not _flat_past_target(
            calls_s, gemm_s, far_s, T, limit, LAYER_CALLS_SHARE):
        return (f"the layer's {len(ops)} calls ({calls_s * 1e6:.0f} us) are over "
                f"{LAYER_CALLS_SHARE:.0%} of its GEMM time ({gemm_s * 1e6:.0f} us)"
                f"{_unreachable(calls_s, far_s, limit, LAYER_CALLS_SHARE)}")
    return ""


def _unreachable(fixed_s: float, work_at_limit_s: float, limit: int, share: float) -> str:
    """The note on a fixed-cost reason whose target no chunk meets (see _flat_past_target)."""
    if fixed_s <= share * work_at_limit_s:
        return ""
    return (f", and still at {limit} tokens: the chunk stops where its per-token cost is within "
            f"{share:.0%} of the {limit}-token one")


def _layer_gemm_s(unit: Unit, cfg: ModelConfig, formats: Mapping[str, str], T: int, kv_bytes: float) -> float:
    """Seconds of compute of the layer's GEMMs on `unit` at T tokens."""
    s = 0.0
    for op in layer_ops(cfg):
        if op.kind in MATMUL_KINDS:
            prec, fmt = unit.precision_for(op, formats.get(op.name, "f32"))
            s += op_cost(op, cfg, T, 0, fmt, kv_bytes).flops / unit.attainable(prec, T)
    return s


def choose_chunk(unit: Unit, cfg: ModelConfig, formats: Mapping[str, str], *, n_ctx: int,
                 memory_budget: float, kv_bytes: float = 2.0, max_tokens: int = MAX_TOKENS) -> ChunkChoice:
    lines = []
    roof, last_why = None, ""
    for T in range(ALIGN, max_tokens + 1, ALIGN):
        why = _why_not_roof(unit, cfg, formats, unit.padded(T), kv_bytes, unit.padded(max_tokens))
        if not why:
            roof = T
            break
        last_why = why
    if roof is None:
        roof = max_tokens
        lines.append(f"roof: {unit.name}'s GEMMs do not reach the roof by {max_tokens} tokens ({last_why})")
    elif roof == ALIGN:
        lines.append(f"roof: {unit.name}'s GEMMs are compute-bound from the smallest aligned chunk, {ALIGN}")
    else:
        lines.append(f"roof: {unit.name}'s GEMMs reach the roof at {roof} tokens "
                     f"(at {roof - ALIGN}: {last_why})")
    T = roof

    per_tok = per_token_bytes(cfg, kv_bytes)
    t_mem = max(ALIGN, int(memory_budget // per_tok) // ALIGN * ALIGN)
    if t_mem < T:
        lines.append(f"memory: {memory_budget / 2**20:.0f} MiB budget / {per_tok / 1024:.1f} KiB per token "
                     f"caps it at {t_mem}")
        T = t_mem
    if unit.kind == "cpu" and unit.cache_bytes > 0:
        widest = max((op.k + op.n for op in layer_ops(cfg) if op.kind in MATMUL_KINDS))
        t_cache = max(ALIGN, int(unit.cache_bytes // (ACT_BYTES * widest)) // ALIGN * ALIGN)
        if t_cache < T:
            lines.append(f"cache: the widest GEMM's activations ({widest} floats per token) fit "
                         f"{unit.cache_bytes / 2**20:.1f} MiB of cache up to {t_cache} tokens")
            T = t_cache
    if n_ctx < T:
        lines.append(f"context: at most n_ctx = {n_ctx}")
        T = n_ctx
    if unit.buckets and T not in unit.buckets:
        # up to the next bucket (padding wastes work); down instead when a bound cut the chunk
        above = [b for b in unit.buckets if b >= T]
        below = [b for b in unit.buckets if b <= T]
        if T < roof:
            b = max(below) if below else unit.buckets[0]
        else:
            b = min(above) if above else unit.buckets[-1]
        if b > n_ctx:   # a chunk past the context: T stays, and the unit pads it to its bucket
            lines.append(f"buckets: {unit.name} runs static shapes {list(unit.buckets)}: {b} is past "
                         f"n_ctx = {n_ctx}, so {T} stays (padded to {b} there)")
        else:
            lines.append(f"buckets: {unit.name} runs static shapes {list(unit.buckets)}: {T} -> {b}")
            T = b
    lines.append(f"chunk = {T} tokens")
    return ChunkChoice(T, unit.name, roof, tuple(lines))
