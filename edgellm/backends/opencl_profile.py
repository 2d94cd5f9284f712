"""The opencl unit's figures for `edgellm profile`: the matmul tiles tuned for this device at the
default model's shapes (backends/opencl_tune.py, cached), GEMM throughput by rows with Q4_1
weights (what the model's matmuls run), the cost of one op call from Python, and the device facts
that make the host profile's `gpu:` section (launch and map/unmap overheads measured here).

Times are host wall-clock around whole op calls (upload, kernel, read-back), the medians of the
profile's own run counts: that is what the engine pays per op on this unit."""
from __future__ import annotations

import numpy as np

import logging

from .. import quant
from ..device.probes import ProbeSizes, median_seconds
from ..device.profile import GemmFigure, Gpu, UnitMeasurement


log = logging.getLogger("edgellm")
TUNE_TOKENS = (1, 128)        # a decode step and a typical prefill chunk (lookups take the nearest T)


def model_shapes(cfg, formats: dict[str, str]) -> dict[str, list[tuple[int, int, int]]]:
    """weight type -> [(T, K, N)] of the model's matmuls at TUNE_TOKENS (the head only at T = 1:
    prefill runs it on the last position)."""
    d, ff = cfg.d_model, cfg.d_ff
    mats = {"qkv": (d, cfg.q_dim + 2 * cfg.kv_dim), "attn_out": (cfg.q_dim, d), "ffn_gate_up": (d, 2 * ff),
            "ffn_down": (ff, d), "lm_head": (d, cfg.vocab_size)}
    out: dict[str, list] = {}
    for op, (k, n) in mats.items():
        for t in (TUNE_TOKENS[:1] if op == "lm_head" else TUNE_TOKENS):
            shape = (t, k, n)
            lst = out.setdefault(formats[op].upper(), [])
            if shape not in lst:
                lst.append(shape)
    return out


def tune_for_default_model(rt, sizes: ProbeSizes, progress=None) -> int:
    """Tune the matmul tiles at the default model's shapes when it is in the cache (it is not
    pulled for this), and at the probe's own GEMM shape. Returns the shapes searched or found."""
    from ..model.loader import open_model
    from ..model.registry import resolve_model
    from ..ops import weight_formats
    from . import opencl_tune

    shapes: dict[str, list] = {"Q4_1": [(t, sizes.gemm_k, sizes.gemm_n) for t in TUNE_TOKENS]}
    try:
        mf = open_model(resolve_model(None, pull_if_missing=False))
        for typ, lst in model_shapes(mf.config, weight_formats(mf)).items():
            shapes.setdefault(typ, []).extend(s for s in lst if s not in shapes.get(typ, []))
    except Exception as e:     # noqa: BLE001 - no default model here: tune the probe's shape only
        log.info("opencl tuning: default model not available (%s); tuning the probe shape only", e)
    n = 0
    for typ, lst in shapes.items():
        if typ not in ("Q4_0", "Q4_1", "Q8_0", "F16", "F32"):
            continue
        if progress:
            progress(f"tuning {typ} matmul tiles at {len(lst)} shapes", 0, 1)
        n += len(opencl_tune.tune(rt, lst, typ))
    return n


def probe(sizes: ProbeSizes, threads: int, progress=None, *, tune: bool = True) -> UnitMeasurement | None:
    """None when the opencl unit is not available here. tune=False skips the tile search (tests)."""
    from . import opencl, opencl_elementwise, opencl_matmul

    ok, _ = opencl.available()
    if not ok:
        return None
    rt = opencl.runtime()
    if tune:
        tune_for_default_model(rt, sizes, progress)
    K, N = sizes.gemm_k, sizes.gemm_n
    rng = np.random.default_rng(0)
    raw = quant.quantize(rng.standard_normal((N, K)).astype(np.float32), quant.T.Q4_1)
    w = opencl_matmul.pack(rt, "Q4_1", [raw], [N], K)
    a = np.ones((1, 8), np.float32)
    batch = max(1, sizes.overhead_batch // 10)

    def calls():
        for _ in range(batch):
            opencl_elementwise.add(rt, a, a)
    overhead = median_seconds(calls, sizes) / batch
    curve = []
    for i, m in enumerate(sizes.gemm_rows):
        if progress:
            progress(f"q4_1 gemm {m}x{K}x{N}", i, len(sizes.gemm_rows))
        x = rng.standard_normal((m, K)).astype(np.float32)
        opencl_matmul.matmul(rt, x, w)       # first launch at a shape JIT-compiles on some drivers
        t = median_seconds(lambda: opencl_matmul.matmul(rt, x, w), sizes)
        curve.append(GemmFigure(m=m, k=K, n=N, flops=2.0 * m * K * N / max(t - overhead, 0.5 * t)))
    from ..device import op_probe

    return UnitMeasurement(precision_flops={"fp32": max(g.flops for g in curve)}, gemm=tuple(curve),
                           call_overhead_s=overhead, threads=threads,
                           elementwise=op_probe.measure_elementwise(opencl, sizes, overhead, progress))


def gpu_section(um: UnitMeasurement, sizes: ProbeSizes) -> Gpu:
    """The host profile's gpu: section, from the device and the measurement `um`."""
    import pyopencl as cl

    from . import opencl

    rt = opencl.runtime()
    k = rt.kernel("probe_kernels", "el_fill")
    buf = rt.empty(4 * 64)

    def launch():
        rt.launch(k, (64,), None, buf, np.float32(1.0), np.int32(64))
        rt.queue.finish()
    launch()
    launch_s = median_seconds(launch, sizes)

    def transfer():
        mapped, _ = cl.enqueue_map_buffer(rt.queue, buf, cl.map_flags.READ, 0, (64,), np.float32)
        mapped.base.release(rt.queue)
        rt.queue.finish()
    transfer_s = median_seconds(transfer, sizes)
    warp = rt.warp_width
    return Gpu(name=rt.name, api="opencl", compute_units=int(rt.device.max_compute_units),
               peak=dict(um.precision_flops), int8_dot=rt.int8_dot, unified_memory=rt.unified_memory,
               launch_overhead_s=launch_s, transfer_overhead_s=transfer_s, warp_width=warp,
               work_group_size=min(int(rt.device.max_work_group_size), 4 * warp))
