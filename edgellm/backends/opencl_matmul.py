"""Matrix products on the OpenCL device: host side of opencl_kernels/matmul_quant.cl (Q4_0,
Q4_1, Q8_0 weights) and opencl_kernels/matmul_float.cl (F16, F32 weights).

pack() repacks a matrix given as GGUF row segments (Q|K|V style: separate tensors that
concatenate along the output dimension) into the kernels' structure-of-arrays layout and uploads
it once. matmul() runs y = x @ W^T (+ b) on it: a GEMV for decode (T <= GEMV_MAX_T), a tiled
GEMM for prefill chunks, and, for block formats, an int8-dot variant (activations quantized to
int8 per 32-block on the device, dot products with arm_dot), used when the device has an int8
dot-product extension or when asked for (on a device without one its plain-C twin is compiled:
correct, slow, what the tests check here).

Packed layouts (all rows padded to NP = N rounded up to 32 with zeros, so that a work-item's
TN rows or ROWS rows always exist; each array is its own buffer, so it starts aligned):
  Q4_0, Q4_1   scales (NB, NP) f16, mins (NB, NP) f16 (Q4_1 only), quants (NB, NP, 16) u8
               with NB = K / 32; byte i of a block = element i (low nibble) | element 16+i (high)
  Q8_0         scales (NB, NP) f16, quants (NB, NP, 32) i8
  F32, F16     values (KC, NP, 8) f32 / f16 with KC = ceil(K / 8) (columns padded with zeros)
Block-major rather than GGUF's row-major: at one block the rows lie side by side, so
neighbouring work-items read neighbouring 16-byte pieces, and every 16-byte vector load is
aligned (GGUF's 18/20/34-byte blocks defeat vector loads).

Tiles come from opencl_tune (a per-device search cached on disk); without a tuning result a
default is used. Nothing is compiled per call: kernels are cached per (type, variant, tile).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from .. import quant
from ..errors import EdgeLLMError
from .opencl_runtime import ClRuntime, round_up

QK = quant.QK
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")
FLOAT_TYPES = ("F32", "F16")
TYPES = BLOCK_TYPES + FLOAT_TYPES
ROW_PAD = 32          # NP = N rounded up to this; every TN / ROWS knob must divide it
KC_F = 8              # float weights: values per chunk (one 16-byte F16 load, two F32 loads)
# Largest T that runs as GEMV (one token per global column, the weights re-read per token);
# above it the GEMM's tile reuse wins. Measured on PoCL (Q4_1, K = 576, N = 1536, kernel-time
# medians of 30): at T = 1 the two tie (~450 us), at T = 2 the GEMM (TM = 2) takes ~300 us and
# the GEMV ~600-700 us. Not measured on a Mali GPU yet.
GEMV_MAX_T = 1


class ClMatmulError(EdgeLLMError, ValueError):
    """A matrix or an argument the OpenCL matmul cannot take (type, shape, variant)."""


@dataclass(frozen=True)
class TileConfig:
    """How one matmul launch is cut into work: the GEMV's or the GEMM's knobs."""
    kind: str           # "gemv" (decode) or "gemm" (prefill chunk)
    wg: int             # work-group size in work-items (a multiple of the warp width)
    tm: int = 1         # GEMM: tokens per work-item
    tn: int = 1         # GEMM: output rows per work-item (divides ROW_PAD)
    rows: int = 1       # GEMV: output rows per work-item (divides ROW_PAD)
    split: int = 1      # GEMV: work-items sharing one row's K, summed in local memory at the end

    def check(self) -> "TileConfig":
        """self, or ClMatmulError saying which knob is out of range."""
        def bad(what):
            raise ClMatmulError(f"tile config {self}: {what}")
        if self.kind not in ("gemv", "gemm"):
            bad(f"kind must be 'gemv' or 'gemm', found {self.kind!r}")
        for f in ("wg", "tm", "tn", "rows", "split"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(f"{f} must be a positive int, found {v!r}")
        if self.wg > 1024:
            bad(f"wg {self.wg} exceeds 1024")
        if ROW_PAD % self.tn or ROW_PAD % self.rows:
            bad(f"tn and rows must divide {ROW_PAD}")
        if self.tm > 16:
            bad(f"tm {self.tm} exceeds 16")
        if self.wg % self.split:
            bad(f"split {self.split} does not divide wg {self.wg}")
        return self

    def defines(self) -> dict[str, int]:
        if self.kind == "gemm":
            return {"TM": self.tm, "TN": self.tn}
        d = {"ROWS": self.rows, "SPLIT": self.split}
        if self.split > 1:
            d["WG"] = self.wg         # sizes the local reduction array (reqd_work_group_size)
        return d

    def as_dict(self) -> dict:
        return {"kind": self.kind, "wg": self.wg, "tm": self.tm, "tn": self.tn, "rows": self.rows,
                "split": self.split}


def kind_for(T: int) -> str:
    return "gemv" if T <= GEMV_MAX_T else "gemm"


def default_config(rt: ClRuntime, kind: str) -> TileConfig:
    """Used until opencl_tune has measured this device: four warps per work-group; GEMV two
    rows per work-item (x loaded once for both); GEMM 4 x 4 tiles, the middle of the search
    (16 accumulators, 32 dequantized weights, 16 registers of quants and 8 of x: about the
    64 registers a Valhall thread may hold at full occupancy). Starting points, not measured
    on a Mali GPU: the tuner decides."""
    wg = 4 * warp_width(rt)
    if kind == "gemv":
        return TileConfig("gemv", wg, rows=2, split=1)
    return TileConfig("gemm", wg, tm=4, tn=4)


@dataclass(frozen=True)
class ClMatrix:
    """A weight matrix resident on the device in a packed layout (see the module docstring)."""
    type_name: str        # "Q4_0", "Q4_1", "Q8_0", "F16" or "F32"
    n: int                # output rows (all segments)
    k: int                # input width
    n_pad: int            # NP: rows in the packed arrays (n rounded up to ROW_PAD)
    k_pad: int            # float types: KP = k rounded up to 8; block types: k
    buffers: tuple        # resident buffers, in kernel-argument order:
                          #   block types (scales, mins or a dummy, quants); float types (values,)
    nbytes: int           # device bytes of the buffers


# ---- per-runtime state: kernels, tile choices, device facts -------------------------------------

_STATES: dict[int, tuple] = {}


def _state(rt: ClRuntime) -> dict:
    """Caches that belong to one runtime (ClRuntime is an unhashable dataclass: keyed by id,
    checked through a weak reference so that a new runtime at a recycled id starts afresh)."""
    e = _STATES.get(id(rt))
    if e is None or e[0]() is not rt:
        e = (weakref.ref(rt), {"kernels": {}, "configs": {}, "warp": rt.warp_width, "int8_dot": rt.int8_dot,
                               "dummy": None})
        _STATES[id(rt)] = e
    return e[1]


def warp_width(rt: ClRuntime) -> int:
    """rt.warp_width, asked of the driver once per runtime."""
    return _state(rt)["warp"]


def forget_configs(rt: ClRuntime) -> None:
    """Drop the remembered tile choices (opencl_tune calls this after it has measured)."""
    _state(rt)["configs"].clear()


def program_of(rt: ClRuntime, type_name: str, int8: bool, cfg: TileConfig) -> tuple[str, dict, str]:
    """(kernel family, -D defines, kernel name) of a launch."""
    if type_name in FLOAT_TYPES:
        if int8:
            raise ClMatmulError(f"the int8-dot variant is for block types {BLOCK_TYPES}, not {type_name}")
        return "matmul_float", {"FTYPE": type_name, **cfg.defines()}, f"el_mmf_{cfg.kind}"
    defines = {"QTYPE": type_name, "XQ": int(int8), **cfg.defines()}
    if int8 and not _state(rt)["int8_dot"]:
        defines["EL_DOT_GENERIC"] = 1
    return "matmul_quant", defines, f"el_mm_{cfg.kind}"


def kernels(rt: ClRuntime, type_name: str, int8: bool, cfg: TileConfig):
    """(main kernel, activation-quantizing kernel or None), built once per runtime."""
    st = _state(rt)["kernels"]
    key = (type_name, int8, cfg)
    k = st.get(key)
    if k is None:
        family, defines, name = program_of(rt, type_name, int8, cfg)
        main = rt.kernel(family, name, defines)
        qx = None
        if int8:        # its own program: the same for every weight type and tile
            qdefs = {"QTYPE": "Q8_0", "XQ": 1}
            if "EL_DOT_GENERIC" in defines:
                qdefs["EL_DOT_GENERIC"] = 1
            qx = rt.kernel("matmul_quant", "el_mm_quantize_x", qdefs)
        k = st[key] = (main, qx)
    return k


def _config(rt: ClRuntime, type_name: str, int8: bool, T: int, K: int, N: int) -> TileConfig:
    st = _state(rt)["configs"]
    key = (type_name, int8, T, K, N)
    cfg = st.get(key)
    if cfg is None:
        from . import opencl_tune

        cfg = st[key] = opencl_tune.best_config(rt, type_name, T, K, N, int8=int8)
    return cfg


# ---- packing --------------------------------------------------------------------------------------

def pack(rt: ClRuntime, type_name: str, arrays, rows, k: int, *, build: bool = True) -> ClMatrix:
    """Repack GGUF row segments (raw bytes, e.g. memory-mapped views; rows[i] output rows each)
    into one device-resident matrix. With `build`, the kernels of this type's default tiles are
    built now (from the binary cache after the first time), so that a kernel that cannot build
    fails at load, not mid-request."""
    if type_name not in TYPES:
        raise ClMatmulError(f"the OpenCL matmul does not take {type_name} weights (supported: {', '.join(TYPES)})")
    rows = [int(r) for r in rows]
    arrays = list(arrays)
    if len(arrays) != len(rows) or not rows:
        raise ClMatmulError(f"{type_name} matrix: {len(arrays)} segments with {len(rows)} row counts")
    if any(r < 0 for r in rows) or sum(rows) == 0:
        raise ClMatmulError(f"{type_name} matrix: row counts {rows} must be >= 0 with a positive total")
    if k < 1:
        raise ClMatmulError(f"{type_name} matrix: K = {k} must be positive")
    if type_name in BLOCK_TYPES and k % QK:
        raise ClMatmulError(f"{type_name} matrix: K = {k} is not a multiple of {QK} (the {type_name} block size)")
    qtype = quant.T[type_name]
    row_bytes = quant.bytes_per_row(qtype, k)
    segs = []
    for i, (a, r) in enumerate(zip(arrays, rows)):
        b = np.asarray(a).reshape(-1).view(np.uint8)
        if b.size != r * row_bytes:
            raise ClMatmulError(f"{type_name} segment {i}: expected {r} rows x {row_bytes} bytes = "
                                f"{r * row_bytes} bytes (K = {k}), found {b.size}")
        segs.append(b)
    N = sum(rows)
    NP = round_up(N, ROW_PAD)
    if type_name in BLOCK_TYPES:
        host = _pack_blocks(qtype, segs, rows, k, NP)
        if type_name != "Q4_1":
            host = (host[0], None, host[2])
    else:
        host = _pack_float(type_name, segs, rows, k, NP)
    bufs, nbytes = [], 0
    for a in host:
        if a is None:
            bufs.append(_dummy(rt))
            continue
        bufs.append(rt.resident(a))
        nbytes += a.nbytes
    kp = k if type_name in BLOCK_TYPES else round_up(k, KC_F)
    m = ClMatrix(type_name, N, k, NP, kp, tuple(bufs), nbytes)
    if build:
        for kind in ("gemv", "gemm"):
            kernels(rt, type_name, False, default_config(rt, kind))
            if type_name in BLOCK_TYPES and _state(rt)["int8_dot"]:
                kernels(rt, type_name, True, default_config(rt, kind))
    return m


def _pack_blocks(qtype, segs, rows, k: int, NP: int):
    """(scales (NB, NP) u16 [f16 bits], mins (NB, NP) u16 or None, quants (NB, NP, 16|32) u8)."""
    NB = k // QK
    bdt = quant._BLOCK_DTYPES[qtype]
    nq = bdt["qs"].shape[0]
    d = np.zeros((NB, NP), np.uint16)
    m = np.zeros((NB, NP), np.uint16) if "m" in bdt.names else None
    q = np.zeros((NB, NP, nq), np.uint8)
    r0 = 0
    for b, r in zip(segs, rows):
        if r:
            blocks = b.view(bdt).reshape(r, NB)                      # (rows, NB) records
            d[:, r0:r0 + r] = blocks["d"].view(np.uint16).T
            if m is not None:
                m[:, r0:r0 + r] = blocks["m"].view(np.uint16).T
            q[:, r0:r0 + r, :] = blocks["qs"].view(np.uint8).transpose(1, 0, 2)
        r0 += r
    return d, m, q


def _pack_float(type_name: str, segs, rows, k: int, NP: int):
    """(values (KC, NP, 8) f32 or u16 [f16 bits],)."""
    KP = round_up(k, KC_F)
    dt = np.float32 if type_name == "F32" else np.uint16
    w = np.zeros((KP // KC_F, NP, KC_F), dt)
    r0 = 0
    for b, r in zip(segs, rows):
        if r:
            src = b.view(dt).reshape(r, k)
            if KP != k:
                src = np.concatenate([src, np.zeros((r, KP - k), dt)], axis=1)
            w[:, r0:r0 + r, :] = src.reshape(r, KP // KC_F, KC_F).transpose(1, 0, 2)
        r0 += r
    return (w,)


def _dummy(rt: ClRuntime):
    st = _state(rt)
    if st["dummy"] is None:
        st["dummy"] = rt.resident(np.zeros(8, np.uint8))
    return st["dummy"]


# ---- products -------------------------------------------------------------------------------------

def matmul(rt: ClRuntime, x: np.ndarray, w: ClMatrix, b=None, *,
           int8: bool | None = None, tune: TileConfig | None = None) -> np.ndarray:
    """x (T, K) float32 @ W^T [+ b (N,): an array or an opencl.ResidentVector] -> (T, N) float32.

    int8: None uses the int8-dot variant iff the device has an int8 dot product (block types
    only); True forces it (the plain-C twin of arm_dot where the device lacks it), False never.
    tune: a TileConfig to use as given (its kind picks GEMV or GEMM); None takes opencl_tune's
    result for this device and shape, else the default."""
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != w.k or x.shape[0] < 1:
        raise ClMatmulError(f"{w.type_name} matmul: x must be (T >= 1, K = {w.k}), found {x.shape}")
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    T, K = x.shape
    N = w.n
    st = _state(rt)
    if int8 is None:
        int8 = st["int8_dot"] and w.type_name in BLOCK_TYPES
    elif int8 and w.type_name not in BLOCK_TYPES:
        raise ClMatmulError(f"the int8-dot variant is for block types {BLOCK_TYPES}, not {w.type_name}")
    cfg = tune.check() if tune is not None else _config(rt, w.type_name, int8, T, K, N)
    main, qx = kernels(rt, w.type_name, int8, cfg)
    if w.k_pad != K:              # float weights with K % 8 != 0: zero columns meet zero weights
        xp = np.zeros((T, w.k_pad), np.float32)
        xp[:, :K] = x
        x = xp
    xbuf = rt.upload(x)
    xargs = quantize_x(rt, qx, xbuf, T, K) if int8 else (xbuf,)
    y = rt.empty(4 * T * N)
    if b is not None:
        if not hasattr(b, "buf"):
            b = np.asarray(b, dtype=np.float32)
        if b.shape != (N,):
            raise ClMatmulError(f"{w.type_name} matmul: bias must be ({N},), found {b.shape}")
        # a bias made resident at prepare() (opencl.ResidentVector) is used in place
        bbuf = b.buf if hasattr(b, "buf") else rt.upload(b)
    else:
        bbuf = xbuf               # never read: has_bias = 0
    enqueue(rt, main, cfg, w, xargs, bbuf, b is not None, y, T)
    return rt.read(y, (T, N))


def quantize_x(rt: ClRuntime, qx_kernel, xbuf, T: int, K: int) -> tuple:
    """Device buffers (xq (T, K) i8, xd (T, NB) f32, xs (T, NB) i32) of x quantized per block."""
    NB = K // QK
    xq, xd, xs = rt.empty(T * K), rt.empty(4 * T * NB), rt.empty(4 * T * NB)
    rt.launch(qx_kernel, (round_up(NB, 8), T), None, xbuf, xq, xd, xs, np.int32(T), np.int32(K))
    return xq, xd, xs


def global_size(cfg: TileConfig, T: int, N: int) -> tuple[int, int]:
    if cfg.kind == "gemv":
        row_groups = -(-N // cfg.rows)
        per_group = cfg.wg // cfg.split
        return -(-row_groups // per_group) * cfg.wg, T
    return round_up(-(-N // cfg.tn), cfg.wg), -(-T // cfg.tm)


def enqueue(rt: ClRuntime, kernel, cfg: TileConfig, w: ClMatrix, xargs: tuple, bbuf, has_bias: bool, y, T: int):
    """Launch one GEMV / GEMM; returns its event (opencl_tune times it)."""
    return rt.launch(kernel, global_size(cfg, T, w.n), (cfg.wg, 1), *xargs, *w.buffers, bbuf,
                     np.int32(has_bias), y, np.int32(T), np.int32(w.k_pad), np.int32(w.n), np.int32(w.n_pad))
