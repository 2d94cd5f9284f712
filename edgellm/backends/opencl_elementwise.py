"""Host side of opencl_kernels/elementwise.cl: rmsnorm, rope, swiglu, add, softmax on the OpenCL
device, numpy float32 in and out, the same shapes and meaning as backends/reference.py (and the
same signatures as backends/neon.py, with the runtime first).

Each call uploads its inputs, runs one kernel and reads the result back (blocking): these are the
per-op entry points the dispatcher and the conformance tests use. A fused device-resident path
would keep activations in cl.Buffers between ops; it is not this module.
"""
from __future__ import annotations

import numpy as np

from .opencl_runtime import ClRuntime, round_up

FAMILY = "elementwise"
RED_WG = 64        # work-items per row of the reductions (rmsnorm, softmax): four Mali-G78 warps;
                   # a power of two (the tree reduction halves it); compiled in as -D RED_WG
MAP_WG = 64        # work-group of the pure maps (rope, swiglu, add); the global size is padded to it
STYLES = ("norm", "neox")
_DEFINES = {"RED_WG": RED_WG}
_INT_MAX = 2**31 - 1   # the kernels index with int


def _f32(name: str, a, ndim: int | None = None) -> np.ndarray:
    """`a` as a C-contiguous float32 array, or ValueError naming the argument."""
    arr = np.asarray(a)
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"{name} must be a numeric array, got dtype {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size > _INT_MAX:
        raise ValueError(f"{name} has {arr.size} elements; the kernels index with 32-bit ints")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _map_launch(rt: ClRuntime, name: str, n_items: int, *args) -> None:
    k = rt.kernel(FAMILY, name, _DEFINES)
    rt.launch(k, (round_up(n_items, MAP_WG),), (MAP_WG,), *args, np.int32(n_items), name=name)


def rmsnorm(rt: ClRuntime, x: np.ndarray, w, eps: float) -> np.ndarray:
    """x (T, d), w (d,) (an array, or an opencl.ResidentVector) -> x / sqrt(mean(x^2) + eps) * w."""
    x = _f32("x", x, 2)
    wbuf = getattr(w, "buf", None)           # a vector made resident at prepare()
    w = _f32("w", w.host if wbuf is not None else w, 1)
    T, d = x.shape
    if d == 0:
        raise ValueError("x has rows of width 0: rmsnorm of an empty row is undefined")
    if w.shape != (d,):
        raise ValueError(f"w must have shape ({d},) to match x {x.shape}, got {w.shape}")
    if not np.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    if T == 0:
        return np.empty((0, d), np.float32)
    y = rt.empty(x.nbytes)
    k = rt.kernel(FAMILY, "el_rmsnorm", _DEFINES)
    rt.launch(k, (T * RED_WG,), (RED_WG,), rt.upload(x), wbuf if wbuf is not None else rt.upload(w), y,
              np.int32(d), np.float32(eps),
              name="el_rmsnorm")
    return rt.read(y, x.shape)


def rope(rt: ClRuntime, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """x (T, heads, hd), cos/sin (T, rope_dim/2) -> rotated copy. style "norm" rotates adjacent
    pairs (2i, 2i+1), "neox" pairs (i, i + rope_dim/2); dims rope_dim..hd-1 are copied."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    x = _f32("x", x, 3)
    cos = _f32("cos", cos, 2)
    sin = _f32("sin", sin, 2)
    T, heads, hd = x.shape
    if cos.shape[0] != T:
        raise ValueError(f"cos must have one row per token ({T}), got shape {cos.shape}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have the shape of cos {cos.shape}, got {sin.shape}")
    half = cos.shape[1]
    if 2 * half > hd:
        raise ValueError(f"cos/sin have {half} columns: rope_dim {2 * half} exceeds head_dim {hd}")
    if x.size == 0:
        return x.copy()
    n_rot = -(-half // 4)
    n_groups = n_rot + -(-(hd - 2 * half) // 4)
    n_items = T * heads * n_groups
    if n_items > _INT_MAX - MAP_WG:
        raise ValueError(f"x {x.shape} is too large for one launch")
    y = rt.empty(x.nbytes)
    if half == 0:                       # nothing rotates; an empty cos buffer is not allowed by OpenCL
        cos = sin = np.zeros((1, 1), np.float32)
    _map_launch(rt, "el_rope", n_items, rt.upload(x), y, rt.upload(cos), rt.upload(sin), np.int32(heads),
                np.int32(hd), np.int32(half), np.int32(n_rot), np.int32(n_groups), np.int32(style == "neox"))
    return rt.read(y, x.shape)


def swiglu(rt: ClRuntime, gate_up: np.ndarray) -> np.ndarray:
    """gate_up (T, 2*ff) = [gate | up] -> silu(gate) * up, (T, ff)."""
    gu = _f32("gate_up", gate_up, 2)
    T, ff2 = gu.shape
    if ff2 % 2:
        raise ValueError(f"gate_up must have an even width (gate | up halves), got {ff2}")
    ff = ff2 // 2
    if T == 0 or ff == 0:
        return np.empty((T, ff), np.float32)
    n_groups = -(-ff // 4)
    n_items = T * n_groups
    if n_items > _INT_MAX - MAP_WG:
        raise ValueError(f"gate_up {gu.shape} is too large for one launch")
    y = rt.empty(T * ff * 4)
    _map_launch(rt, "el_swiglu", n_items, rt.upload(gu), y, np.int32(ff), np.int32(n_groups))
    return rt.read(y, (T, ff))


def add(rt: ClRuntime, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b, elementwise, same shape (any rank)."""
    a = _f32("a", a)
    b = _f32("b", b)
    if a.shape != b.shape:
        raise ValueError(f"b must have the shape of a {a.shape}, got {b.shape}")
    if a.size == 0:
        return a.copy()
    n = a.size
    if n > _INT_MAX - 4 * MAP_WG:
        raise ValueError(f"a {a.shape} is too large for one launch")
    y = rt.empty(a.nbytes)
    _map_launch(rt, "el_add", -(-n // 4), rt.upload(a), rt.upload(b), y, np.int32(n))
    return rt.read(y, a.shape)


def softmax(rt: ClRuntime, x: np.ndarray) -> np.ndarray:
    """x (rows, n) -> softmax over each row, fp32 with the row max subtracted. -inf entries give
    exactly 0 (a masked score); a row of only -inf gives NaN, as numpy's does."""
    x = _f32("x", x, 2)
    rows, n = x.shape
    if n == 0:
        raise ValueError(f"x has rows of width 0 (shape {x.shape}): softmax of an empty row is undefined")
    if rows == 0:
        return np.empty((0, n), np.float32)
    y = rt.empty(x.nbytes)
    k = rt.kernel(FAMILY, "el_softmax", _DEFINES)
    rt.launch(k, (rows * RED_WG,), (RED_WG,), rt.upload(x), y, np.int32(n), name="el_softmax")
    return rt.read(y, x.shape)
