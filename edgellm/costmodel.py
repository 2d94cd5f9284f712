"""The roofline cost model: each compute unit as the dispatcher sees it, and an op's predicted time.

predicted(op on unit) = max(FLOPs / attainable compute, bytes / bandwidth) + launch overhead,
where attainable compute is the unit's peak at the op's precision, or, for a unit whose GEMM
throughput was measured by `edgellm profile`, the measured figure at that token count (BLAS on a
few rows is far from its peak; the measurement says by how much). Attention and the elementwise
ops, where the profile measured them on the unit, run at their measured rate for the step's token
count (numpy's gather, mask and softmax keep attention far below the sgemm peak; swiglu's exp is
far from DRAM speed). A one-row matmul runs at the unit's measured figure for its weight format
where the profile has one (neon's gemv); otherwise its weights stream no faster than the measured
one-row GEMM read its own (a FLOP rate, in bytes of the format it was measured on), so a format
with more bytes per weight decodes slower. Inside a fused native step an op pays no call of its own, and an
elementwise op's one-row figure, timed as a call, is replaced by its call-free marginal rate.
Handing an activation to a unit of another kind adds a fixed transfer overhead plus a copy unless
the memory is shared zero-copy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping

from .device.profile import CpuCluster, DeviceProfile
from .ops import ELEMENTWISE_FLOPS, MATMUL_KINDS, WEIGHT_BYTES, OpCost, OpSpec, op_cost
from .model.config import ModelConfig

# Per-call cost of one numpy op from Python (dispatch, temporaries): 4-6 us measured on the
# development machine; used where a profile carries no measurement of its own.
REFERENCE_CALL_S = 5e-6
# A ctypes call into a native kernel, barrier of a pinned pool included.
NATIVE_CALL_S = 2e-6
# Inside a fused native decode step an op costs only its thread-pool dispatch (~0.2 us measured
# for el_parallel_for with 2 threads), not a Python call.
FUSED_OP_S = 0.3e-6
# BLAS sgemm on few rows is far below its peak. Without a measured curve for the reference unit,
# this shape is used: fraction of the best throughput at (rows), measured with numpy + OpenBLAS
# at K=576, N=1536 on the 2-core x86 development machine (median of 30 runs each).
BLAS_ROWS_EFFICIENCY = ((1, 0.16), (8, 0.35), (16, 0.53), (32, 0.54), (64, 0.84), (128, 0.83),
                        (256, 0.92), (512, 0.95), (1024, 1.0))


# op kinds an NPU runs only inside its fused FFN subgraph, between two projections it also runs
FFN_INNER_KINDS = frozenset({"swiglu"})


@dataclass(frozen=True)
class Unit:
    name: str                                  # backend name: reference, neon, opencl, npu
    kind: str                                  # cpu | gpu | npu: units of one kind share data freely
    peak: Mapping[str, float]                  # precision -> FLOP/s (op/s for int8)
    bandwidth: float                           # bytes/s the unit streams from DRAM
    launch_s: float                            # fixed cost per op call
    transfer_s: float = 0.0                    # fixed cost of a handoff to/from another kind
    zero_copy: bool = True                     # a handoff needs no copy (unified memory, mapped)
    buckets: tuple[int, ...] = ()              # static token counts it runs (NPU); () = any
    op_kinds: frozenset[str] | None = None     # op kinds it runs; None = all
    gemm_curve: tuple[tuple[int, float], ...] = ()   # measured (tokens, FLOP/s) of GEMM...
    curve_precision: str = "fp32"              # ...at this precision
    cache_bytes: int = 0                       # last-level cache the GEMM working set should fit in
    quant_precision: str = "fp32"              # compute precision for GGUF-quantized weights
    quant_precisions: tuple[str, ...] = ()     # every precision it computes quantized weights in
                                               # (a precision plan picks among them); () = quant_precision
    stores_quantized: bool = False             # keeps GGUF block formats resident (else dequantizes)
    head_precision: str | None = None          # compute precision of lm_head, when not quant_precision
    quant_fp32_slowdown: tuple[tuple[int, float], ...] = ()
                                               # fp32 activations against 4-bit block weights (a plan's
                                               # ask) run at curve / this (tokens, factor), interpolated;
                                               # (): at the fp32 peak
    quant_fp32_curve: tuple[tuple[int, float], ...] = ()
                                               # ... or at these measured (tokens, FLOP/s), when the
                                               # profile has them (they win over the factor)
    fused_kv_bytes: frozenset = frozenset({1.0, 2.0, 4.0})   # KV element sizes its fused step reads in place
    fused_decode_s: float | None = None        # cost of one call running every layer of a decode
                                               # step or a prefill chunk natively (None: no such call)
    stream_bandwidth: float = 0.0              # bytes/s its matmuls read weights at from DRAM (a GEMV),
                                               # when measured below `bandwidth` (0: `bandwidth`)
    gemv: tuple[tuple[str, float], ...] = ()   # measured one-row FLOP/s by weight format (weights
                                               # streaming): what a one-row matmul in it runs at
    gemv_fp32act: tuple[tuple[str, float], ...] = ()   # ... with fp32 activations
    op_curves: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
                                               # (op kind, measured (tokens, FLOP/s)) of attention and
                                               # the elementwise ops as the engine runs them on this
                                               # unit; a kind not here runs at the roofline
    fused_op_curves: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
                                               # op_curves as the ops cost inside its fused step
                                               # (in_fused_step); () = op_curves
    available: bool = True
    reason: str = ""                           # why it is (un)available
    notes: tuple[str, ...] = field(default=(), compare=False)

    def in_fused_step(self, dispatch: bool = True) -> "Unit":
        """This unit as an op costs inside its fused native step: no call of its own, only a pool
        dispatch (none for one the call runs serially), and the elementwise rates without what a
        call from Python left in their one-row figures (fused_elementwise_curves)."""
        return replace(self, launch_s=FUSED_OP_S if dispatch else 0.0,
                       op_curves=self.fused_op_curves or self.op_curves)

    def gemv_rate(self, precision: str, weight_format: str) -> float:
        """Measured FLOP/s of a one-row matmul at `precision` on `weight_format` weights (0: none):
        fp32 against block weights is the fp32-activation path, anything else the unit's own."""
        table = self.gemv_fp32act if precision == "fp32" and weight_format in ("q4_0", "q4_1", "q8_0") else self.gemv
        return dict(table).get(str(weight_format), 0.0)

    def padded(self, tokens: int) -> int:
        """Tokens actually computed: a static-shape unit pads up to its next bucket, and runs
        a longer step as several full buckets."""
        if not self.buckets:
            return tokens
        for b in self.buckets:
            if tokens <= b:
                return b
        top = self.buckets[-1]
        return top * math.ceil(tokens / top)

    def attainable(self, precision: str, tokens: int) -> float:
        """FLOP/s this unit reaches at `precision` on a GEMM of `tokens` rows."""
        if self.gemm_curve and precision == self.curve_precision:
            return _interpolate(self.gemm_curve, tokens)
        return self.peak.get(precision, 0.0)

    def precision_for(self, op: OpSpec, weight_format: str, asked: str | None = None) -> tuple[str | None, str]:
        """(compute precision, resident weight format) of `op` on this unit. asked: what a
        precision plan asks for (None: the unit's own choice); the answer is then `asked` or the
        nearest higher precision the unit has a kernel for, or None when it has none."""
        from .precision_runtime import effective

        fmt = self._resident_format(op, weight_format)
        own = self._own_precision(op, weight_format)
        if asked is None:
            return own, fmt
        return effective(asked, self.computes(op, weight_format)), fmt

    def keeps_file_format(self, op: OpSpec, weight_format: str) -> bool:
        """Whether op's weights stay resident in the file's own format here: such a unit (neon,
        opencl) runs a fused projection in one format per call, so its load rejects one whose
        tensors mix formats (ops.MixedFormat), and the op runs elsewhere."""
        return op.kind in MATMUL_KINDS and self.stores_quantized \
            and self._resident_format(op, weight_format) == weight_format

    def computes(self, op: OpSpec, weight_format: str) -> tuple[str, ...]:
        """The compute precisions this unit has kernels for, for `op` with weights in `weight_format`."""
        if op.kind not in MATMUL_KINDS:
            return ("fp32",)
        own = self._own_precision(op, weight_format)
        if weight_format in ("f32", "f16") or not self.stores_quantized:
            return (own,)
        return tuple(dict.fromkeys((own,) + (self.quant_precisions or (self.quant_precision,))))

    def _own_precision(self, op: OpSpec, weight_format: str) -> str:
        if op.kind not in MATMUL_KINDS:
            return "fp32"
        if op.kind == "lm_head" and self.head_precision and self.stores_quantized:
            return self.head_precision
        if weight_format in ("f32", "f16") or not self.stores_quantized:
            fmt = weight_format if self.stores_quantized else "f32"
            return "fp16" if fmt == "f16" and "fp16" in self.peak else "fp32"
        return self.quant_precision

    def _resident_format(self, op: OpSpec, weight_format: str) -> str:
        if op.kind not in MATMUL_KINDS:
            return "f32" if op.kind != "embedding" else weight_format
        if op.kind == "lm_head" and self.head_precision and self.stores_quantized:
            return weight_format
        if weight_format in ("f32", "f16") or not self.stores_quantized:
            return weight_format if self.stores_quantized else "f32"
        return "int8" if self.kind == "npu" else weight_format


def _interpolate(curve: tuple[tuple[int, float], ...], tokens: int) -> float:
    """Piecewise linear in log(tokens), clamped at both ends."""
    if tokens <= curve[0][0]:
        return curve[0][1]
    for (t0, f0), (t1, f1) in zip(curve, curve[1:]):
        if tokens <= t1:
            a = (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0))
            return f0 + a * (f1 - f0)
    return curve[-1][1]


class LayerFormats(str):
    """The weight format of a layer op whose layers store it in different formats (a precision
    plan that requantizes some layers only). It reads as its most common format wherever one name
    is needed (a unit's kernel choice, the format a placement shows); estimate() costs the op as
    the mean over its layers, each at its own format (bytes per weight and kernel): the layer's
    time is multiplied by n_layers, so one name for all layers priced a plan changing a minority
    of layers as if it changed none, and one changing all but one as if it changed all."""

    layers: tuple[str, ...]                # the format of each layer, in layer order
    compute: object                        # the plan's precision_runtime.ComputeTable, or None:
                                           # pairs each layer's format with that layer's ask

    def __new__(cls, layers: tuple[str, ...], compute=None) -> "LayerFormats":
        layers = tuple(layers)
        obj = super().__new__(cls, max(dict.fromkeys(layers), key=layers.count))
        obj.layers, obj.compute = layers, compute
        return obj

    def __getnewargs__(self):   # pickle and copy rebuild it from its layers, not its name
        return (self.layers, self.compute)


@dataclass(frozen=True)
class Estimate:
    ms: float                  # predicted time of the op on the unit, transfers excluded
    precision: str
    weight_format: str
    cost: OpCost               # at the padded token count
    bound: str                 # "compute", "memory" or "launch": what the time is made of
    ridge: float               # the unit's ridge point (FLOP/byte) at that precision
    terms: tuple[float, float] = (0.0, 0.0)   # (compute, memory) seconds the body is the larger of


def estimate(unit: Unit, op: OpSpec, cfg: ModelConfig, tokens: int, context: int, weight_format: str,
             kv_bytes: float, prefill: bool, asked: str | None = None) -> Estimate | None:
    """Predicted time of `op` on `unit` (at the precision a plan `asked` for, if given); None when
    the unit has no figure for its precision or cannot compute at or above `asked`."""
    if isinstance(weight_format, LayerFormats):
        return _layers_mean(unit, op, cfg, tokens, context, weight_format, kv_bytes, prefill, asked)
    prec, fmt = unit.precision_for(op, weight_format, asked)
    if prec is None:
        return None
    t = unit.padded(tokens)
    cost = op_cost(op, cfg, t, context, fmt, kv_bytes, prefill)
    if unit.kind == "npu" and op.kind in FFN_INNER_KINDS:
        # inside the FFN subgraph (gate/up, swiglu, down in one graph): no call of its own, and
        # its intermediate stays in the accelerator's memory; booked as one pass over it
        ms = cost.bytes / unit.bandwidth * 1e3
        return Estimate(ms, prec, fmt, cost, "memory", 0.0)
    rows = 1 if (op.last_row_only and prefill) else t
    op_curve = dict(unit.op_curves).get(op.kind)
    if op_curve:
        # at the rows it computes: a last-row op (the output norm) in a chunk runs one row
        peak = _interpolate(op_curve, rows)
    else:
        peak = unit.attainable(prec, rows)
    if prec == "fp32" and fmt in ("q4_0", "q4_1") and unit.quant_fp32_curve:
        peak = _interpolate(unit.quant_fp32_curve, rows)
    elif prec == "fp32" and fmt in ("q4_0", "q4_1") and unit.quant_fp32_slowdown:
        peak = unit.attainable(unit.curve_precision, rows) / _interpolate(unit.quant_fp32_slowdown, rows)
    gemv = unit.gemv_rate(prec, fmt) if op.kind in MATMUL_KINDS and rows == 1 else 0.0
    if gemv:
        peak = gemv      # measured on this format with its weights streaming: memory is in it
    if peak <= 0:
        return None
    compute_s, memory_s = cost.flops / peak, cost.bytes / unit.bandwidth
    if unit.stream_bandwidth and op.kind in MATMUL_KINDS and not gemv:
        # the measured GEMV rate is a FLOP rate of one weight format: a format with more bytes per
        # weight streams proportionally longer (a Q8_0 file decoded ~1.7x slower than Q4_1 here,
        # where FLOPs alone priced both the same)
        memory_s = max(memory_s, cost.weight_bytes / unit.stream_bandwidth)
    body = max(compute_s, memory_s)
    bound = "launch" if unit.launch_s > body else ("compute" if compute_s >= memory_s else "memory")
    # the ridge at the bandwidth the memory term used (a stream rate below the DRAM figure), so
    # that "AI vs ridge" reads the same way as the bound
    bw = cost.bytes / memory_s if memory_s > 0 else unit.bandwidth
    return Estimate((body + unit.launch_s) * 1e3, prec, fmt, cost, bound, peak / bw, (compute_s, memory_s))


def _layers_mean(unit: Unit, op: OpSpec, cfg: ModelConfig, tokens: int, context: int, lf: LayerFormats,
                 kv_bytes: float, prefill: bool, asked: str | None) -> Estimate | None:
    """estimate() of a layer op whose layers differ in format: the mean over the layers of each
    layer's own estimate (None when the unit cannot run the majority format). With the plan's
    compute table, only the layers asking `asked` are averaged: the dispatcher weights each ask
    by the layers asking it, so the pair (format, ask) of every layer is costed together."""
    layers = lf.layers
    if asked is not None and lf.compute is not None:
        asks = lf.compute.asked("prefill" if prefill else "decode", op.name, context + tokens)
        layers = tuple(f for f, a in zip(lf.layers, asks) if a == asked) or lf.layers
    main_e = estimate(unit, op, cfg, tokens, context, str(lf), kv_bytes, prefill, asked)
    if main_e is None:
        return None
    parts = []
    for f in dict.fromkeys(layers):
        # a layer format the unit has no figure for is costed as the majority's, as all layers
        # were before: it does not take the op from a unit that runs it (an NPU's fp16 layer)
        e = estimate(unit, op, cfg, tokens, context, f, kv_bytes, prefill, asked) or main_e
        parts.append((e, layers.count(f)))
    n = len(layers)
    main = max(parts, key=lambda p: p[1])[0]
    mean = OpCost(*(sum(getattr(e.cost, k) * c for e, c in parts) / n
                    for k in ("flops", "weight_bytes", "act_bytes", "kv_bytes", "in_bytes")))
    comp, mem = (sum(e.terms[i] * c for e, c in parts) / n for i in (0, 1))
    out = replace(main, ms=sum(e.ms * c for e, c in parts) / n, cost=mean, terms=(comp, mem),
                  precision="+".join(dict.fromkeys(e.precision for e, _ in parts)))
    if len(parts) > 1 and comp > 0 and mem > 0 and out.bound != "launch":
        # the bound and ridge of the mean terms, beside the mean AI: the majority's read
        # "compute-bound, AI 2.5 vs ridge 3.1" for a Q4_1 op with a Q8_0 layer (review)
        out = replace(out, bound="compute" if comp >= mem else "memory", ridge=mean.intensity * mem / comp)
    return out


def handoff_ms(src: Unit, dst: Unit, nbytes: float) -> float:
    """Moving an activation of `nbytes` from src to dst. CPU units share caches: free. Otherwise
    each accelerator side pays its fixed overhead (map/unmap, cache maintenance, fence), and a
    side that is not zero-copy pays a copy through DRAM (write + read)."""
    if src.name == dst.name or (src.kind == "cpu" and dst.kind == "cpu"):
        return 0.0
    s = 0.0
    for u in (src, dst):
        if u.kind != "cpu":
            s += u.transfer_s
            if not u.zero_copy:
                s += 2 * nbytes / u.bandwidth
    return s * 1e3


# ---- units from a profile ----------------------------------------------------------------------

def big_cpu(profile: DeviceProfile) -> tuple[CpuCluster, ...]:
    """The clusters compute threads run on (the same rule as device.topology.select_big)."""
    from .device.topology import DetectedCluster, select_big

    det = [DetectedCluster(c.cores, c.max_freq_hz, c.capacity) for c in profile.clusters]
    big = set(select_big(tuple(det)))
    return tuple(c for c in profile.clusters if set(c.cores) <= big) or profile.clusters


def cpu_peak(clusters: tuple[CpuCluster, ...], precision: str) -> float:
    """Peak of the big cores when work is split evenly: the slowest core sets the pace, so
    cores x the smallest per-core figure, not the sum."""
    per_core = [c.peak_per_core.get(precision, 0.0) for c in clusters]
    return min(per_core) * sum(len(c.cores) for c in clusters) if per_core else 0.0


# the weight format neon's GEMM curve is measured on (backends/neon_probe.py); its one-row figure
# is turned into the rate a GEMV streams weight bytes at (_stream_bandwidth)
NEON_CURVE_FORMAT = "q4_1"
# neon's fp32-activation GEMM time over its int8 path's, by rows, where no profile measured it
# (see cpu_unit)
NEON_FP32ACT_SLOWDOWN = ((1, 2.3), (4, 4.2), (16, 3.7), (64, 3.3), (256, 3.1))


def cpu_unit(name: str, profile: DeviceProfile, *, threads: int | None = None) -> Unit:
    """reference (numpy) or neon on the big cores. The host's measured figures win over peaks."""
    clusters = big_cpu(profile)
    n_big = sum(len(c.cores) for c in clusters)
    scale = min(threads, n_big) / n_big if threads else 1.0
    peak = {p: cpu_peak(clusters, p) * scale for p in ("fp32", "fp16", "int8")}
    bw = profile.memory_bandwidth
    curve: tuple = ()
    launch = REFERENCE_CALL_S if name == "reference" else NATIVE_CALL_S
    m = profile.measured
    notes = []
    op_curves: dict = {}
    fp32act_curve: tuple = ()
    gemv: dict = {}
    gemv32: dict = {}
    if m is not None:
        bw = m.memory_read_bandwidth
        um = m.units.get(name)
        if um is not None:
            # measured with um.threads threads; another count scales the compute figures as the
            # peaks above are (`run -t 1` planned with two threads' figures)
            ms = min(threads, n_big) / um.threads if threads and um.threads else 1.0
            peak = {p: f * ms for p, f in um.precision_flops.items()}
            curve = tuple(sorted((g.m, g.flops * ms) for g in um.gemm))
            launch = um.call_overhead_s
            op_curves = {k: tuple((t, f * ms) for t, f in c) for k, c in _op_curves(um).items()}
            fp32act_curve = tuple((g.m, g.flops * ms) for g in sorted(um.gemm_fp32act, key=lambda g: g.m))
            if name == "neon":   # (neon_probe measures them)
                gemv = {f: r * ms for f, r in um.gemv.items()}
                gemv32 = {f: r * ms for f, r in um.gemv_fp32act.items()}
            notes.append(f"measured by {m.tool} on {m.date}"
                         + (f" with {um.threads} threads, scaled to {min(threads, n_big)}" if ms != 1.0 else ""))
    if name == "reference":
        # numpy has a fast GEMM only in fp32 (BLAS sgemm): weights are dequantized at load
        peak = {"fp32": peak.get("fp32", 0.0)}
        if not curve:
            curve = tuple((m, f * peak["fp32"]) for m, f in BLAS_ROWS_EFFICIENCY)
            notes.append("GEMM efficiency by rows: nominal BLAS curve (not measured here)")
    llc = max((c.l3_bytes or c.l2_bytes * len(c.cores)) for c in clusters)
    # (the format without a one-row figure of its own streams at the measured format's rate)
    one_row = ((1, gemv[NEON_CURVE_FORMAT]),) if NEON_CURVE_FORMAT in gemv else curve
    stream = _stream_bandwidth(one_row, bw) if name == "neon" else 0.0
    # neon quantizes activations to int8 blocks with or without dotprod (SDOT or widening MLA)
    qprec = "int8" if name == "neon" else "fp32"
    return Unit(name, "cpu", peak, bw, launch, gemm_curve=curve, curve_precision=qprec, cache_bytes=llc,
                quant_precision=qprec, stores_quantized=(name != "reference"),
                # neon also keeps activations fp32 against quantized weights (el_matmul_f32act).
                # `edgellm profile` measures it (gemm_fp32act); without that, its time against the
                # int8 path's as measured on this project's x86 host (Zen 5, 2 threads, SmolLM2's
                # four layer GEMM shapes, 2026-11-28): 2.3x at 1 row, 4.2x at 4, 3.7x at 16, 3.3x
                # at 64, 3.1x at 256 (the GEMM form of matmul_bqpanel.c from 2 rows; the 4 x 4
                # tile before it, which widened each weight again per 4 rows of x, took 3.5x at 4
                # rows but 8-12x from 16). Q8_0 needs no nibble unpacking: its fp32 head GEMV
                # measured no slower than int8
                quant_precisions=("int8", "fp32") if name == "neon" else (),
                quant_fp32_slowdown=NEON_FP32ACT_SLOWDOWN if name == "neon" else (),
                quant_fp32_curve=fp32act_curve if name == "neon" else (),
                # neon's head keeps fp32 activations against its quantized weights (accuracy of
                # the near-ties that pick the token; memory-bound either way)
                head_precision="fp32" if name == "neon" else None,
                fused_decode_s=launch if name == "neon" else None, op_curves=tuple(op_curves.items()),
                stream_bandwidth=stream, gemv=tuple(gemv.items()), gemv_fp32act=tuple(gemv32.items()),
                fused_op_curves=tuple(fused_elementwise_curves(op_curves).items()),
                notes=tuple(notes))


def _stream_bandwidth(curve: tuple[tuple[int, float], ...], bandwidth: float) -> float:
    """bytes/s neon's measured one-row GEMM read its weights at: `edgellm profile` times it on
    NEON_CURVE_FORMAT weights streaming from DRAM, so its FLOP rate is a rate of those bytes.
    0 without a one-row figure, or where it is no lower than the DRAM bandwidth."""
    if not curve or curve[0][0] != 1:
        return 0.0
    rate = curve[0][1] / 2.0 * WEIGHT_BYTES[NEON_CURVE_FORMAT]   # FLOP/s -> weights/s -> bytes/s
    return rate if rate < bandwidth else 0.0


def fused_elementwise_curves(op_curves: Mapping[str, tuple[tuple[int, float], ...]]) -> dict:
    """op_curves with each elementwise op's one-row figure replaced by its marginal rate.

    `edgellm profile` times an elementwise op as a call from Python and takes the unit's call
    overhead out; at one row what is left is still mostly the call (its wrapper's own checks),
    not the op: an rmsnorm over 576 values measured 3.6 us where the fused decode step spends
    ~0.3 us on it (el_prof timings, Zen 5), and a decode step's six such ops were priced 22 us a
    layer against ~2 us run. The growth between the two largest row counts has no call in it:
    (t_b - t_a) rows' FLOPs over the time they added. The larger row counts keep their own
    figures (within ~10% of the fused prefill's measured times)."""
    out = dict(op_curves)
    for kind, curve in op_curves.items():
        if kind not in ELEMENTWISE_FLOPS or len(curve) < 3 or curve[0][0] != 1:
            continue
        (ta, ra), (tb, rb) = curve[-2], curve[-1]
        added = tb / rb - ta / ra          # the time the extra rows took, per FLOP of one row
        if added <= 0:
            continue                       # (noise: no growth measured) the figures as they are
        # (at most twice the best measured rate: two near-equal times made it 5e14 FLOP/s, review;
        # on this project's host the marginal rates were 0.98-1.23x the 256-row ones)
        marginal = min((tb - ta) / added, 2 * max(f for _, f in curve))
        out[kind] = ((1, max(curve[0][1], marginal)),) + tuple(curve[1:])
    return out


def _op_curves(um) -> dict:
    """op kind -> measured (tokens, FLOP/s) of a unit's non-GEMM ops (profile.UnitMeasurement)."""
    out = {}
    if um.attention:
        out["attention"] = tuple(sorted((a.tokens, a.flops) for a in um.attention))
    for kind in dict.fromkeys(e.op for e in um.elementwise):
        out[kind] = tuple(sorted((e.tokens, e.flops) for e in um.elementwise if e.op == kind))
    return out


def gpu_unit(profile: DeviceProfile) -> Unit | None:
    g = profile.gpu
    if g is None or g.api != "opencl":
        return None
    peak = dict(g.peak)
    bw, launch, curve, notes, op_curves = profile.memory_bandwidth, g.launch_overhead_s, (), [], {}
    m = profile.measured
    um = m.units.get("opencl") if m is not None else None
    if um is not None:
        # measured whole op calls (upload, kernel, read-back): what the engine pays per op
        bw, launch = m.memory_read_bandwidth, um.call_overhead_s
        curve = tuple(sorted((f.m, f.flops) for f in um.gemm))
        op_curves = _op_curves(um)
        notes.append(f"measured by {m.tool} on {m.date}")
    qprec = "int8" if (g.int8_dot and "int8" in peak) else "fp32"
    return Unit("opencl", "gpu", peak, bw, launch, g.transfer_overhead_s, zero_copy=g.unified_memory,
                gemm_curve=curve, curve_precision="fp32", quant_precision=qprec, stores_quantized=True,
                op_curves=tuple(op_curves.items()), notes=tuple(notes))


def npu_unit(profile: DeviceProfile) -> Unit | None:
    n = profile.npu
    if n is None:
        return None
    return Unit("npu", "npu", dict(n.peak), profile.memory_bandwidth, n.launch_overhead_s, n.transfer_overhead_s,
                zero_copy=False, buckets=n.chunk_buckets if n.static_shapes else (),
                op_kinds=frozenset(n.supported_ops), quant_precision="int8" if "int8" in n.peak else "fp16",
                stores_quantized=True)
