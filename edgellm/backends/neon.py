"""The neon unit: the C kernels of neon/ on the big CPU cores, through ctypes.

Weights stay in their GGUF block formats, read in place from the memory-mapped file (no fp32
copy: resident memory stays near the file size). Fused projections (QKV, gate|up) are passed to
the kernel as row segments of separate tensors. Activations are fp32 numpy arrays; every op is
one native call on a persistent thread pool pinned to the big cores.
"""
from __future__ import annotations

import ctypes
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from .. import quant
from ..errors import KernelError, OpArgumentError
from ..model import layout
from ..model.config import ModelConfig
from . import UnitFailed, neon_lib
from .neon_lib import fptr
from ..device.topology import _thread_ids

NAME = "neon"
MAX_HEAD_DIM = 512   # neon/attention.c EL_ATTN_MAX_HD and decode_step.c EL_DECODE_MAX_HD: stack scratch
KIND = "cpu"
# prepare() keeps views of the memory-mapped file: load() pages the mapping in (model/prefault.py)
MAPS_WEIGHTS = True

_GGML_TO_EL = {"F32": neon_lib.EL_F32, "F16": neon_lib.EL_F16, "Q4_0": neon_lib.EL_Q4_0,
               "Q4_1": neon_lib.EL_Q4_1, "Q8_0": neon_lib.EL_Q8_0}
_OPS = {"embedding", "rmsnorm", "matmul", "rope", "attention", "swiglu", "add", "lm_head"}
_MATMUL_PRECISIONS = {"int8", "fp32", "fp16"}

_state = {"lib": None, "pool": None, "threads": None, "cores": None, "probe": None}
_lock = threading.Lock()


def _lib():
    if _state["lib"] is None:
        _state["lib"] = neon_lib.load()
    return _state["lib"]


class NativePool:
    """A native thread pool (el_pool_create), destroyed when its last holder drops it. An engine's
    fused step holds the pool it was loaded with, and every call holds its pool while it runs:
    configure() for another engine (another thread count) used to destroy the module's one pool
    under a step running on it, which then waited forever on the freed pool."""

    def __init__(self, threads: int, cores: tuple[int, ...]):
        self.threads, self.cores = threads, cores
        self._start()

    def _start(self) -> None:
        lib = _lib()
        before = set(_thread_ids())
        arr = (ctypes.c_int * max(1, len(self.cores)))(*self.cores)
        ptr = lib.el_pool_create(self.threads, arr if self.cores else None, len(self.cores))
        if not ptr:
            raise RuntimeError("el_pool_create failed")
        self._ptr, self._pid = ptr, _process["pid"]
        # its workers' thread ids (pin_threads leaves them on the cores they were given)
        self.worker_tids = frozenset(set(_thread_ids()) - before)
        # (in a forked child the workers do not exist: joining their stale handles hung its exit;
        # there the pool is left to the process's end)
        weakref.finalize(self, _destroy_pool, lib, ptr, self._pid)
        _live_pools.add(self)

    @property
    def ptr(self) -> int:
        """The native pool; in a forked child, one of the child's own, started on first use. The
        parent's pool has no workers there, and a worker that held its mutex at the fork (going
        to sleep after a job) left it locked in the child: the child's first job waited on it
        forever (a fork test hung once in CI, 90 s)."""
        if self._pid != _process["pid"]:   # (a dict read: every op reads ptr, a getpid() is a syscall)
            with _lock:
                if self._pid != _process["pid"]:
                    self._start()
        return self._ptr


_live_pools: "weakref.WeakSet[NativePool]" = weakref.WeakSet()
_process = {"pid": os.getpid()}   # this process's, set again in a forked child (below)


def _destroy_pool(lib, ptr: int, pid: int) -> None:
    if os.getpid() == pid:
        lib.el_pool_destroy(ptr)


def _after_fork_in_child() -> None:
    # the configured pool's workers are the parent's: the child's next op makes its own pool (a
    # pool held elsewhere, by an engine's fused step, starts its own through NativePool.ptr); the
    # module's lock, if another thread held it at the fork, would stay held in the child
    global _lock
    _lock = threading.Lock()
    _process["pid"] = os.getpid()
    _state["pool"] = None
    _live_pools.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def worker_tids() -> frozenset[int]:
    """Thread ids of every live pool's workers."""
    return frozenset().union(*(p.worker_tids for p in list(_live_pools)))


def configure(threads: int | None = None, cores=None) -> None:
    """Thread count and the cores its workers are pinned to (the big cores): the pool of the
    next op and of the next engine's fused step. A pool in use stays until its holders drop it."""
    with _lock:
        if (threads, tuple(cores or ())) != (_state["threads"], _state["cores"]):
            _state.update(pool=None, threads=threads, cores=tuple(cores or ()))


def thread_pool() -> NativePool:
    """The configured pool, created on first use. Hold the object while a call runs on its ptr."""
    p = _state["pool"]
    if p is not None:        # (a dict read: no lock on the path of every op)
        return p
    with _lock:
        p = _state["pool"]
        if p is None:
            p = _state["pool"] = NativePool(_state["threads"] or 1, _state["cores"] or ())
        return p


def pool_affinity(p: NativePool | None = None) -> list[list[int]]:
    """Cores each pool thread may run on, read back from the kernel (thread 0 = the caller);
    p: the configured pool when None."""
    lib, p = _lib(), p or thread_pool()
    out = []
    for t in range(lib.el_pool_threads(p.ptr)):
        buf = (ctypes.c_int * 1024)()
        n = lib.el_pool_affinity(p.ptr, t, buf, 1024)
        out.append(sorted(buf[:n]) if n >= 0 else [])
    return out


def available() -> tuple[bool, str]:
    """The library loads and a numeric self-check passes (a wrong build or a broken CPU feature
    must not produce garbage: the unit is then unavailable and its ops go elsewhere)."""
    if _state["probe"] is None:
        try:
            lib = _lib()
            err = _self_check()
            info = lib.el_build_info().decode()
            _state["probe"] = (False, f"numeric self-check failed: {err}") if err else \
                (True, f"{lib.variant} library ({lib.variant_reason}); {info}"
                       + (f"; {lib.x86_gemv}" if lib.x86_gemv else ""))
        except neon_lib.NeonLibError as e:
            _state["probe"] = (False, str(e))
        except Exception as e:  # a probe must never take the engine down
            _state["probe"] = (False, f"probe failed: {type(e).__name__}: {e}")
    return _state["probe"]


def _check_values(rows: int, cols: int, seed: int) -> np.ndarray:
    """(rows, cols) float32 spread over [-1, 1) by a multiplicative hash: this check runs at
    every load, and numpy.random would pull ~2.6 MB of modules into a process that only decodes
    greedily."""
    i = np.arange(rows * cols, dtype=np.int64) + seed * 1_000_003
    return ((i * 2654435761 % 2**32) / 2**31 - 1.0).astype(np.float32).reshape(rows, cols)


def _self_check() -> str:
    w = _check_values(40, 64, 7)
    raw = quant.quantize(w, quant.T.Q8_0)
    x = _check_values(3, 64, 8)
    ref = x @ quant.dequantize(raw, quant.T.Q8_0, w.shape).T
    got = matmul(x, QMatrix.from_arrays("Q8_0", [raw], [40], 64))
    nmse = float(np.mean((got - ref) ** 2) / np.mean(ref ** 2))
    if not nmse < 5e-4:
        return f"Q8_0 matmul NMSE {nmse:.2e}"
    h = rmsnorm(x, np.ones(64, np.float32), 1e-5)
    ref = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + 1e-5)
    nmse = float(np.mean((h - ref) ** 2) / np.mean(ref ** 2))
    return "" if nmse < 1e-7 else f"rmsnorm NMSE {nmse:.2e}"


def supports(op: str, precision: str = "fp32") -> tuple[bool, str]:
    if op not in _OPS:
        return False, f"the neon library has no {op} kernel"
    if op in ("matmul", "lm_head"):
        if precision in _MATMUL_PRECISIONS:
            return True, f"{precision} GEMV/GEMM kernels"
        return False, f"no {precision} matmul kernel (int8, fp32, fp16 only)"
    if precision != "fp32":
        return False, f"{op} runs in fp32 only"
    return True, "fp32 kernel"


# ---- resident weights --------------------------------------------------------------------------

@dataclass(frozen=True)
class QMatrix:
    """A weight matrix in a GGUF format, as row segments that concatenate along the output."""
    wtype: int                 # EL_* type id
    arrays: tuple              # the segments' bytes (memory-mapped file views), kept alive here
    rows: tuple[int, ...]      # output rows per segment
    k: int                     # input width
    ptrs: object               # (c_void_p * n) of the segments
    rows_c: object             # (c_int * n)

    @property
    def n(self) -> int:
        return sum(self.rows)

    @classmethod
    def from_arrays(cls, type_name: str, arrays, rows, k: int) -> "QMatrix":
        arrays = tuple(np.ascontiguousarray(a) for a in arrays)
        ptrs = (ctypes.c_void_p * len(arrays))(*(a.ctypes.data for a in arrays))
        return cls(_GGML_TO_EL[type_name], arrays, tuple(rows), k, ptrs, (ctypes.c_int * len(rows))(*rows))


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: np.ndarray
    wqkv: QMatrix
    bqkv: np.ndarray | None
    wo: QMatrix
    ffn_norm: np.ndarray
    w_gate_up: QMatrix
    w_down: QMatrix


@dataclass(frozen=True)
class PreparedWeights:
    embedding: object          # reference.EmbeddingTable (rows dequantized on lookup)
    layers: tuple[LayerWeights, ...]
    output_norm: np.ndarray
    lm_head: QMatrix


def _type_name(model, name: str) -> str:
    t = model.tensor_type(name).name
    if t not in _GGML_TO_EL:
        raise ValueError(f"{name}: the neon kernels do not read {t} weights")
    return t


def prepare(model, precision: str = "int8", progress=None, ops=None) -> PreparedWeights:
    """Views of the mapped file's blocks (zero copy; `ops` does not change the cost) and fp32 norms."""
    from .reference import EmbeddingTable

    cfg: ModelConfig = model.config
    d = cfg.d_model

    def f32(name, shape):
        return quant.dequantize(model.raw(name), model.tensor_type(name), shape)

    def mat(*parts: tuple[str, int], k: int, op: str) -> QMatrix:
        types = {_type_name(model, n) for n, _ in parts}
        if len(types) != 1:
            # a fused projection whose parts differ in format (one format per call): the op moves
            # to another unit, said so, instead of the whole load failing
            raise UnitFailed(NAME, f"{', '.join(n for n, _ in parts)} mix weight types {', '.join(sorted(types))}; "
                                   "its fused matmul takes one", ops=(op,))
        return QMatrix.from_arrays(types.pop(), [model.raw(n) for n, _ in parts], [r for _, r in parts], k)

    def proj(i: int, op: str) -> QMatrix | None:
        if ops is not None and op not in ops:
            return None    # placed on another unit (this one may not take it: see mat)
        parts, k = layout.projection(cfg, i, op)
        return mat(*parts, k=k, op=op)

    if ops is None or "attention" in ops:
        if cfg.head_dim > MAX_HEAD_DIM:
            raise UnitFailed(NAME, f"head_dim {cfg.head_dim} is above its attention's {MAX_HEAD_DIM}",
                             ops=("attention",))

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=f32(p + "attn_norm.weight", (d,)), wqkv=proj(i, "qkv"), bqkv=layout.qkv_bias(model, i),
            wo=proj(i, "attn_out"), ffn_norm=f32(p + "ffn_norm.weight", (d,)),
            w_gate_up=proj(i, "ffn_gate_up"), w_down=proj(i, "ffn_down")))
        if progress:
            progress(i + 1, cfg.n_layers + 1)
    head = layout.head_tensor(cfg)
    if progress:
        progress(cfg.n_layers + 1, cfg.n_layers + 1)
    return PreparedWeights(
        embedding=EmbeddingTable(model.raw("token_embd.weight"), model.tensor_type("token_embd.weight"), d),
        layers=tuple(layers), output_norm=f32("output_norm.weight", (d,)),
        lm_head=mat((head, cfg.vocab_size), k=d, op="lm_head"))


def prepared_nbytes(cfg: ModelConfig, ops=None) -> int:
    """Only the fp32 norm vectors are copies; the matrices are pages of the mapped file."""
    return 4 * (2 * cfg.n_layers + 1) * cfg.d_model


# ---- ops ---------------------------------------------------------------------------------------

class ElEmbedding(ctypes.Structure):
    """el_embedding of neon/edgellm_neon.h: a token table in its GGUF type."""
    _fields_ = [("wtype", ctypes.c_int), ("row_len", ctypes.c_int), ("n_rows", ctypes.c_int64),
                ("table", ctypes.c_void_p)]


def embedding_desc(table) -> ElEmbedding:
    """The C description of a reference.EmbeddingTable (the caller keeps `table` alive)."""
    raw = np.asarray(table.raw)
    if not raw.flags.c_contiguous:
        raise ValueError("the embedding table must be C-contiguous (a view of the mapped file)")
    n_rows = raw.nbytes // quant.bytes_per_row(table.qtype, table.d_model)
    return ElEmbedding(_GGML_TO_EL[table.qtype.name], table.d_model, n_rows, raw.ctypes.data)


def embedding(table, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """ids (T,) -> (T, d) float32: the rows dequantized by el_embed_rows, bit-identical to
    reference.embedding (same roundings), without its numpy calls per row block. out: a
    (T, d) float32 C-contiguous buffer to write (a fused step's input), else a new array."""
    ids_in = np.asarray(ids)
    if ids_in.dtype.kind not in "iu":   # (1.7 was truncated to 1)
        raise OpArgumentError(f"embedding ids must be integers, got {ids_in.dtype}")
    ids64 = ids_in.astype(np.int64, copy=False)
    if ids64.ndim != 1 or len(ids64) == 0:
        raise ValueError(f"embedding ids must be a non-empty 1-D array, got shape {ids64.shape}")
    desc = embedding_desc(table)
    bad = ids64[(ids64 < 0) | (ids64 >= desc.n_rows)]
    if len(bad):
        raise ValueError(f"embedding id {int(bad[0])} is outside the table's {desc.n_rows} rows")
    T, d = len(ids64), table.d_model
    if out is None:
        out = np.empty((T, d), np.float32)
    elif out.shape != (T, d) or out.dtype != np.float32 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"embedding out must be a writeable C-contiguous float32 ({T}, {d}) array, got "
                         f"{out.dtype} {out.shape}{'' if out.flags.writeable else ', read-only'}")
    ids32 = ids64.astype(np.int32)
    rc = _lib().el_embed_rows(ctypes.addressof(desc), ids32.ctypes.data, T, out.ctypes.data)
    _check(rc, "embedding")
    return out


# el_matmul's int8 activations, per thread: one module-wide buffer was shared by every engine, and
# two engines stepping in two threads (op by op: an engine's lock serialises only its own callers)
# overwrote each other's x (a helper: 18 of 40 logits calls wrong, most NaN)
_scratch_local = threading.local()
_scratch_sizes: dict[tuple[int, int], int] = {}   # (T, K) -> el_matmul_scratch bytes


_CODES = {-1: "EL_EINVAL: an argument is out of range", -2: "EL_ENOMEM: out of memory",
          -3: "EL_EUNSUPPORTED: a shape the kernel does not take"}


def _check(rc: int, op: str) -> None:
    if rc != 0:
        raise KernelError(f"neon {op} failed: {_CODES.get(rc, f'code {rc}')}")


def _f32(a: np.ndarray) -> np.ndarray:
    return a if (a.dtype == np.float32 and a.flags.c_contiguous) else np.ascontiguousarray(a, dtype=np.float32)


# The op wrappers check what the kernels take on trust: the C side gets bare pointers and
# sizes, so a shape that does not fit reads (or writes) past an array's end. A helper passing
# mismatched arrays crashed the process.
_INT_MAX = 2**31 - 1


def _need(ok: bool, op: str, what) -> None:
    """what: the message, or a callable that makes it (only on failure: formatting every
    message cost several us a call on the op-by-op decode path)."""
    if not ok:
        raise OpArgumentError(f"neon {op}: {what() if callable(what) else what}")


def _f32_nd(a, ndim: int, op: str, name: str) -> np.ndarray:
    a = np.asarray(a)
    _need(a.ndim == ndim, op, lambda: f"{name} must be {ndim}-D, got shape {a.shape}")
    _need(all(n <= _INT_MAX for n in a.shape), op, lambda: f"{name} has a dimension past 2^31-1: {a.shape}")
    return _f32(a)


# compute precisions a precision plan may ask of a matmul with block-quantized weights: int8
# activations (el_matmul, the default) or fp32 ones (el_matmul_f32act); float weights ignore it
QUANT_COMPUTE = ("int8", "fp32")


def matmul(x: np.ndarray, w: QMatrix, b: np.ndarray | None = None, precision: str = "int8") -> np.ndarray:
    """x (T, K) @ w^T (+ b) -> (T, N); precision: "int8" or "fp32" activations (QUANT_COMPUTE)."""
    lib = _lib()
    x = _f32_nd(x, 2, "matmul", "x")
    T, K = x.shape
    _need(K == w.k, "matmul", lambda: f"x has {K} columns, the weights take {w.k}")
    if b is not None:   # (an f64 or strided bias was read as raw f32 on the int8 path)
        b = _f32(b)
        _need(b.shape == (w.n,), "matmul", lambda: f"the bias must have shape ({w.n},), got {b.shape}")
    y = np.empty((T, w.n), dtype=np.float32)
    if precision not in QUANT_COMPUTE:
        raise ValueError(f"neon matmul computes in {' or '.join(QUANT_COMPUTE)}, not {precision!r}")
    if T == 0:
        return y
    if precision == "fp32":
        p = thread_pool()
        _check(lib.el_matmul_f32act(p.ptr, w.wtype, w.ptrs, w.rows_c, len(w.rows), fptr(x), fptr(y), T, K,
                                    fptr(b) if b is not None else None), "matmul")
        return y
    need = _scratch_sizes.get((T, K))
    if need is None:   # a ctypes call per matmul would cost as much as a small decode GEMV
        need = _scratch_sizes[(T, K)] = lib.el_matmul_scratch(T, K)
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.nbytes < need:
        buf = _scratch_local.buf = np.empty(need, np.uint8)
    p = thread_pool()
    rc = lib.el_matmul(p.ptr, w.wtype, w.ptrs, w.rows_c, len(w.rows), fptr(x), fptr(y), T, K,
                       fptr(b) if b is not None else None, buf.ctypes.data)
    _check(rc, "matmul")
    return y


def lm_head(x: np.ndarray, w: QMatrix, precision: str = "fp32") -> np.ndarray:
    """x (T, d) @ w^T -> logits (T, vocab), with x kept in fp32 (el_matmul_f32act).

    The head's near-tied logits decide the token, and x's int8 rounding (el_matmul) flips
    enough of them to matter: with a Q8_0 head (49152 x 576, tied to token_embd) top-1 agreed
    with llama.cpp's fp32 reference on 97.45% of tokens with int8 activations, 98.55% with fp32
    ones (target 98%). It is one memory-bound GEMV per token, so fp32 costs little there;
    `matmul` stays on the int8 path. A precision plan may still ask int8 for the head."""
    return matmul(x, w, precision=precision)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (T, d) -> normalised copy, times w (d,)."""
    x = _f32_nd(x, 2, "rmsnorm", "x")
    w = _f32(w)
    _need(w.shape == (x.shape[1],), "rmsnorm", lambda: f"w must have shape ({x.shape[1]},), got {w.shape}")
    y = np.empty_like(x)
    if x.size == 0:
        return y
    p = thread_pool()
    _check(_lib().el_rmsnorm(p.ptr, fptr(x), fptr(w), fptr(y), x.shape[0], x.shape[1], eps), "rmsnorm")
    return y


ROPE_STYLES = ("norm", "neox")


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """x (T, heads, hd) -> rotated copy; cos/sin (T, rope_dim/2)."""
    _need(style in ROPE_STYLES, "rope", lambda: f"style must be one of {', '.join(ROPE_STYLES)}, got {style!r}")
    x = _f32_nd(x, 3, "rope", "x")
    T, heads, hd = x.shape
    cos, sin = _f32_nd(cos, 2, "rope", "cos"), _f32_nd(sin, 2, "rope", "sin")
    _need(cos.shape == sin.shape and cos.shape[0] == T and 2 * cos.shape[1] <= hd, "rope",
          lambda: f"cos and sin must both be (T={T}, rope_dim/2 <= {hd // 2}), got {cos.shape} and {sin.shape}")
    y = np.empty_like(x)
    if x.size == 0:
        return y
    _check(_lib().el_rope(fptr(x), fptr(y), T, heads, hd, 2 * cos.shape[1], fptr(cos), fptr(sin),
                          1 if style == "neox" else 0), "rope")
    return y


def swiglu(gate_up: np.ndarray) -> np.ndarray:
    """gate_up (T, 2 ff): [gate | up] -> silu(gate) * up (T, ff)."""
    gate_up = _f32_nd(gate_up, 2, "swiglu", "gate_up")
    T, ff2 = gate_up.shape
    _need(ff2 % 2 == 0, "swiglu", lambda: f"gate_up's width must be even (gate | up), got {ff2}")
    y = np.empty((T, ff2 // 2), dtype=np.float32)
    if y.size == 0:
        return y
    p = thread_pool()
    _check(_lib().el_swiglu(p.ptr, fptr(gate_up), fptr(y), T, ff2 // 2), "swiglu")
    return y


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b, b broadcast to a's shape as numpy does."""
    a, b = _f32(a), np.asarray(b)
    if b.shape != a.shape:   # (a shorter b was read past its end)
        try:
            b = np.broadcast_to(b, a.shape)
        except ValueError:
            raise OpArgumentError(f"neon add: b's shape {b.shape} does not broadcast to a's {a.shape}") from None
    b = _f32(b)
    y = np.empty_like(a)
    if a.size:
        _check(_lib().el_add(fptr(a), fptr(b), fptr(y), a.size), "add")
    return y


def _int_arg(v, op: str, name: str, lo: int = 0) -> int:
    _need(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and lo <= v <= _INT_MAX, op,
          lambda: f"{name} must be an integer in {lo}..2^31-1, got {v!r}")
    return int(v)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """q (T, H, hd); k, v (KVH, n, hd) gathered fp32, n >= start + T (positions past start + T
    are not read) -> (T, H * hd)."""
    q = _f32_nd(q, 3, "attention", "q")
    T, H, hd = q.shape
    start = _int_arg(start, "attention", "start")
    k, v = np.asarray(k), np.asarray(v)
    _need(k.ndim == 3 and k.shape == v.shape, "attention", lambda: f"k and v must be (KVH, n, hd) alike, got {k.shape} "
          f"and {v.shape}")
    KVH, n, khd = k.shape
    _need(khd == hd and KVH >= 1 and H % KVH == 0, "attention",
          lambda: f"q {q.shape} and k {k.shape}: head_dim must match and H a multiple of KVH")
    _need(n >= start + T, "attention", lambda: f"k and v hold {n} positions, the chunk needs start + T = {start + T}")
    # the kernel reads (KVH, start + T, hd) densely: longer k, v are cut to that
    k, v = _f32(k[:, :start + T]), _f32(v[:, :start + T])
    out = np.empty((T, H * hd), dtype=np.float32)
    if out.size == 0:
        return out
    p = thread_pool()
    _check(_lib().el_attention_dense(p.ptr, fptr(q), fptr(out), T, H, KVH, hd, start,
                                     fptr(k), fptr(v)), "attention")
    return out


KV_TYPES = {np.dtype(np.float32): neon_lib.EL_F32, np.dtype(np.float16): neon_lib.EL_F16,
            np.dtype(np.int8): neon_lib.EL_KV_I8}   # KV pool arena dtype -> kv_type


def fused_decode(weights: PreparedWeights, cfg: ModelConfig):
    """The fused decode step over these weights (backends/neon_fused.py): every layer of a
    decode token in one native call."""
    from .neon_fused import DecodeStep

    return DecodeStep.build(weights, cfg)


def can_read_pool(pool) -> bool:
    """attention_pool (and the fused step) read f32, f16 and int8 arenas in place."""
    return pool.k.dtype in KV_TYPES


def kv_arena_args(pool) -> tuple:
    """(k, v, keep) as the library's kv pointers take them: the arenas' addresses for f32 and
    f16 pools; for int8, the addresses of two el_kv_i8 (arena + scales) that `keep` holds alive.
    The scales must be C-contiguous f32 (n_blocks, n_layers, block_tokens, kv_heads)."""
    if pool.k.dtype != np.int8:
        return pool.k.ctypes.data, pool.v.ctypes.data, None
    for a in (pool.k_scale, pool.v_scale):
        if a is None or a.dtype != np.float32 or a.shape != pool.k.shape[:-1] or not a.flags.c_contiguous:
            raise ValueError(f"int8 KV pool scales must be C-contiguous float32 {pool.k.shape[:-1]}, got "
                             f"{None if a is None else (a.dtype, a.shape)}")
    keep = (neon_lib.ElKvI8(pool.k.ctypes.data, pool.k_scale.ctypes.data),
            neon_lib.ElKvI8(pool.v.ctypes.data, pool.v_scale.ctypes.data))
    return ctypes.addressof(keep[0]), ctypes.addressof(keep[1]), keep


def attention_pool(q: np.ndarray, pool, table: np.ndarray, layer: int, start: int) -> np.ndarray:
    """Attention straight from the KV pool's blocks: no gather, no fp32 copy of the cache.
    table: the sequence's block table as int32."""
    q = _f32_nd(q, 3, "attention_pool", "q")
    T, H, hd = q.shape
    start = _int_arg(start, "attention_pool", "start")
    layer = _int_arg(layer, "attention_pool", "layer")
    n_blocks, n_layers, _, kvh, pool_hd = pool.k.shape   # (blocks, layers, block_tokens, kv heads, hd)
    _need(hd == pool_hd and H % kvh == 0, "attention_pool", lambda: f"q {q.shape} against the pool's {kvh} kv heads of "
          f"{pool_hd}")
    _need(layer < n_layers, "attention_pool", lambda: f"layer {layer} of a {n_layers}-layer pool")
    table = np.asarray(table)
    _need(table.ndim == 1 and table.dtype.kind in "iu", "attention_pool",
          lambda: f"the block table must be a 1-D integer array, got {table.dtype} {table.shape}")
    need = -(-(start + T) // pool.block_tokens)
    _need(len(table) >= need, "attention_pool", lambda: f"the block table has {len(table)} blocks, positions "
          f"0..{start + T - 1} need {need}")
    used = table[:need]
    _need(not len(used) or (used.min() >= 0 and used.max() < n_blocks), "attention_pool",
          lambda: f"block ids must be in 0..{n_blocks - 1}")
    table = np.ascontiguousarray(used, dtype=np.int32)   # (an int64 table was read as int32 pairs)
    out = np.empty((T, H * hd), dtype=np.float32)
    if out.size == 0:
        return out
    k_arg, v_arg, keep = kv_arena_args(pool)
    p_ = thread_pool()
    rc = _lib().el_attention_pool(p_.ptr, fptr(q), fptr(out), T, H, pool.n_kv_heads, hd, start,
                                  k_arg, v_arg, KV_TYPES[pool.k.dtype],
                                  table.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), pool.block_tokens,
                                  n_layers, layer)
    _check(rc, "attention_pool")
    return out
