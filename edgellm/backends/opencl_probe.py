"""The opencl unit's guarded probe: run as `python -m edgellm.backends.opencl_probe` in a child
process by backends/opencl.py, so that a driver that crashes or hangs takes only the child down.

It opens the device, builds the kernels (filling the binary cache the engine's process then
reads), runs a numeric self-check of each op family against backends/reference.py, and loads
every binary in the cache (those the engine built for its own shapes too). It prints
one JSON line: {"ok": bool, "reason": str, "device": str, "build_s": float, "int8_dot": bool,
"gpu": bool}.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from .. import quant
from . import reference
from .opencl_runtime import ClRuntime, KernelBuildError, OpenCLUnavailable

# Bounds of DESIGN.md: elementwise 1e-7, matmul and attention 5e-4 (a broken kernel is off by
# orders of magnitude; these catch a wrong build, not rounding).
NMSE_ELEMENTWISE = 1e-7
NMSE_MATMUL = 5e-4


def nmse(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.mean((np.asarray(y, np.float64) - ref) ** 2) / max(np.mean(np.asarray(ref, np.float64) ** 2), 1e-30))


def self_check(rt: ClRuntime) -> str:
    """'' when every op family matches the reference on a small case, else what failed."""
    from . import opencl_elementwise, opencl_matmul

    # the simplest kernel first: a driver that cannot run it fails (or crashes) here, plainly
    buf = rt.empty(4 * 40)
    rt.launch(rt.kernel("probe_kernels", "el_fill"), (48,), None, buf, np.float32(1.5), np.int32(40))
    if not np.all(rt.read(buf, (40,)) == 1.5):
        return "a trivial fill kernel wrote wrong values"
    rng = np.random.default_rng(7)
    fails = []

    def check(name, got, ref, bound):
        e = nmse(got, ref)
        if not e <= bound:       # NaN fails too
            fails.append(f"{name} NMSE {e:.2e} > {bound:.0e}")

    x = rng.standard_normal((3, 64)).astype(np.float32)
    # every weight type the engine packs: F16 and F32 run matmul_float.cl, programs of their own
    for t in (quant.T.Q4_0, quant.T.Q4_1, quant.T.Q8_0, quant.T.F16, quant.T.F32):
        w = rng.standard_normal((40, 64)).astype(np.float32)
        raw = quant.quantize(w, t)
        m = opencl_matmul.pack(rt, t.name, [raw], [40], 64)
        ref = reference.matmul(x, quant.dequantize(raw, t, w.shape))
        check(f"{t.name} GEMM", opencl_matmul.matmul(rt, x, m), ref, NMSE_MATMUL)
        check(f"{t.name} GEMV", opencl_matmul.matmul(rt, x[:1], m), ref[:1], NMSE_MATMUL)
    nw = rng.standard_normal(64).astype(np.float32)
    check("rmsnorm", opencl_elementwise.rmsnorm(rt, x, nw, 1e-5), reference.rmsnorm(x, nw, 1e-5), NMSE_ELEMENTWISE)
    gu = rng.standard_normal((3, 128)).astype(np.float32)
    check("swiglu", opencl_elementwise.swiglu(rt, gu), reference.swiglu(gu), NMSE_ELEMENTWISE)
    check("add", opencl_elementwise.add(rt, x, nw[None, :] + x), x + (nw[None, :] + x), NMSE_ELEMENTWISE)
    check("softmax", opencl_elementwise.softmax(rt, x), _softmax(x), NMSE_ELEMENTWISE)
    q = rng.standard_normal((3, 4, 16)).astype(np.float32)
    ang = rng.standard_normal((3, 8)).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    check("rope", opencl_elementwise.rope(rt, q, cos, sin, "neox"), reference.rope(q, cos, sin, "neox"),
          NMSE_ELEMENTWISE)
    k = rng.standard_normal((2, 5, 16)).astype(np.float32)
    v = rng.standard_normal((2, 5, 16)).astype(np.float32)
    _check_attention(rt, check, q, k, v)
    return "; ".join(fails)


def _check_attention(rt: ClRuntime, check, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """Attention as the engine runs it: gathered K/V and straight from a pool's blocks (the
    default pool is f16: vload_half and its KV_F16 program), float32 and float16 storage.
    q (3, 4, 16) at positions 2..4; k, v (2, 5, 16)."""
    from . import opencl_attention

    table = np.array([2, 0], np.int32)      # out of order: the kernel must follow the table
    for dtype in opencl_attention.KV_DTYPES:
        kd, vd = k.astype(dtype), v.astype(dtype)
        ref = reference.attention(q, kd.astype(np.float32), vd.astype(np.float32), 2)
        check(f"attention ({dtype.name} K/V)", opencl_attention.attention(rt, q, kd, vd, 2), ref, NMSE_MATMUL)
        pool = opencl_attention.SmallPool.holding(kd, vd, table, 4)
        check(f"pool attention ({dtype.name} K/V)", opencl_attention.attention_pool(rt, q, pool, table, 0, 2),
              ref, NMSE_MATMUL)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def main() -> int:
    t0 = time.perf_counter()
    out = {"ok": False, "reason": "", "device": "", "build_s": 0.0}
    rt = None
    try:
        rt = ClRuntime.create()
        out["device"] = rt.name
        out["int8_dot"] = bool(rt.int8_dot)
        out["gpu"] = rt.is_gpu
        err = self_check(rt)
        out["build_s"] = round(rt.stats.seconds, 3)
        # the engine's own variants too: a binary the driver dies on dies here, not in the engine
        out["binaries_loaded"] = rt.load_cached_binaries()
        out["ok"] = not err
        out["reason"] = f"numeric self-check failed on {rt.name}: {err}" if err else rt.why
    except KernelBuildError as e:
        out["reason"] = f"a kernel failed to build: {e}"
        rt = None           # a source that does not build: no cached binary to blame
    except OpenCLUnavailable as e:
        out["reason"] = str(e)
    except Exception as e:   # report, don't crash: the parent wants a reason
        out["reason"] = f"probe failed: {type(e).__name__}: {e}"
    # programs taken from the binary cache: a failure with any is retried from source (opencl.py)
    out["from_cache"] = rt.stats.from_cache if rt is not None else 0
    out["seconds"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
