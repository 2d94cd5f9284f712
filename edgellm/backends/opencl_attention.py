"""Host side of opencl_kernels/attention.cl: causal GQA attention on the OpenCL device, over
gathered (KVH, n, hd) K/V (`attention`) or straight from the KV pool's arena through a block
table (`attention_pool`). Same signatures as backends/neon.py with the runtime first; numpy
float32 in and out, the meaning of reference.attention.

Programs are built per (head_dim, K/V storage type): -D HEAD_DIM keeps the per-item query and
accumulator at a compile-time size, -D KV_F16 selects half storage.

Pool arenas and coherency
-------------------------
The arena (kv/pool.py: k, v numpy arrays of (n_blocks, n_layers, bt, KVH, hd)) is written by the
host (PoolSequence.write) between calls and read here in place, never gathered or copied. Each
arena is wrapped once in a cl.Buffer(READ_ONLY | USE_HOST_PTR) over its own memory, cached per
(pool, runtime) and dropped with the pool (a WeakKeyDictionary keyed by the pool; the entry keeps
the arena array it wraps and is rebuilt if the pool's array object changes).

The OpenCL spec lets an implementation cache a USE_HOST_PTR buffer's contents in device memory;
host writes to host_ptr are only guaranteed to reach the device through a map/unmap. So every
call maps the span of blocks it will read with CL_MAP_WRITE_INVALIDATE_REGION and unmaps it
before the kernel is enqueued (same in-order queue):
  - WRITE: on unmap, the implementation takes the host memory as the buffer's contents (a driver
    that keeps a device copy refreshes it from host_ptr then).
  - INVALIDATE: the device never writes K/V, so there is nothing to bring back to the host; a plain
    CL_MAP_WRITE (read-write) would let such a driver copy its stale device copy over host_ptr at
    map time, erasing the host's newest K/V.
On a unified-memory device that uses host_ptr directly (PoCL's CPU device; Mali when the driver
imports the pages) the map/unmap pair moves no data: it is a pointer return and at most a cache
maintenance operation. On a driver that does keep a copy, it costs a copy of the mapped span,
which is the price of correctness there. (Known limit: Mali's driver has historically copied
USE_HOST_PTR allocations rather than importing them; true zero copy on Mali needs the arena
allocated by the driver (ALLOC_HOST_PTR, mapped into numpy) or imported with
cl_arm_import_memory: a kv/pool.py allocation hook, outside this module.)
The opposite hazard, the host writing the arena while a kernel still reads it, cannot happen:
each call reads its result back with a blocking copy, so the kernel has finished on return.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import numpy as np

from .opencl_runtime import ClRuntime, _import_cl, driver_call, round_up

FAMILY = "attention"
MAX_HEAD_DIM = 256
ROWS_WG = 64          # work-group of the *_rows kernels (one item per (t, h) row): four Mali warps
# (rows below which it applies, S items splitting one row's keys, R rows per work-group): with few
# rows (decode: T * H is a few dozen) one item per row would leave most of the GPU idle, so the keys
# of each row are split S ways and merged; S * R = 16, one Mali-G78 warp per work-group.
# The thresholds are a first guess from the G78's size (tens of cores x hundreds of threads), not
# tuned on the hardware: `edgellm bench` on a device should set them.
SPLIT_PLANS = ((128, 16, 1), (512, 4, 4))
KV_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
_INT_MAX = 2**31 - 1


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_q(q) -> np.ndarray:
    arr = np.asarray(q)
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"q must be a numeric array, got dtype {arr.dtype}")
    if arr.ndim != 3:
        raise ValueError(f"q must be (T, H, head_dim), got shape {arr.shape}")
    T, H, hd = arr.shape
    if arr.size > _INT_MAX:
        raise ValueError(f"q {arr.shape} is too large for the kernels' 32-bit indexing")
    if H < 1 or not 1 <= hd <= MAX_HEAD_DIM:
        raise ValueError(f"q {arr.shape}: needs H >= 1 and 1 <= head_dim <= {MAX_HEAD_DIM}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _check_start(start, T: int) -> int:
    if not _is_int(start) or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")
    if start + T > _INT_MAX // 2:
        raise ValueError(f"start + T = {start + T} positions exceed the kernels' 32-bit indexing")
    return int(start)


def _plan(rt: ClRuntime, rows: int, hd: int) -> tuple[int, int] | None:
    """(S, R) of the split kernel for this many query rows, or None for the one-item-per-row kernel."""
    for below, s, r in SPLIT_PLANS:
        if rows < below and 4 * s * r * (hd + 2) <= rt.device.local_mem_size:
            return s, r
    return None


def _defines(hd: int, kv_dtype) -> dict[str, int]:
    return {"HEAD_DIM": hd, "KV_F16": int(np.dtype(kv_dtype) == np.float16)}


def _run(rt: ClRuntime, layout: str, q: np.ndarray, kv_dtype, kbuf, vbuf, layout_args: tuple, start: int
         ) -> np.ndarray:
    """Launch attn_<layout>_{rows,split}; layout_args sit between KVH and start in the signature."""
    cl = _import_cl()
    T, H, hd = q.shape
    rows = T * H
    out = rt.empty(rows * hd * 4)
    scale = np.float32(1.0 / np.sqrt(hd))        # as reference.attention rounds it
    plan = _plan(rt, rows, hd)
    defines = _defines(hd, kv_dtype)
    head = (rt.upload(q), kbuf, vbuf, out, np.int32(T), np.int32(H))
    tail = (np.int32(start), scale)
    if plan is None:
        name = f"attn_{layout}_rows"
        k = rt.kernel(FAMILY, name, defines)
        rt.launch(k, (round_up(rows, ROWS_WG),), (ROWS_WG,), *head, *layout_args, *tail, name=name)
    else:
        s, r = plan
        name = f"attn_{layout}_split"
        k = rt.kernel(FAMILY, name, defines)
        scratch = cl.LocalMemory(4 * s * r * (hd + 2))
        rt.launch(k, (s, round_up(rows, r)), (s, r), *head, *layout_args, *tail, scratch, name=name)
    return rt.read(out, (T, H * hd))


def attention(rt: ClRuntime, q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """q (T, H, hd) at positions start..start+T-1; k, v (KVH, n, hd) with n >= start + T (float32,
    or both float16, read as such) -> (T, H * hd). Head h reads kv head h // (H / KVH)."""
    q = _check_q(q)
    T, H, hd = q.shape
    start = _check_start(start, T)
    k, v = np.asarray(k), np.asarray(v)
    for name, a in (("k", k), ("v", v)):
        if a.dtype.kind not in "fiu":
            raise ValueError(f"{name} must be a numeric array, got dtype {a.dtype}")
        if a.ndim != 3:
            raise ValueError(f"{name} must be (KVH, n, head_dim), got shape {a.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {k.shape}, got {v.shape}")
    KVH, n, khd = k.shape
    if khd != hd:
        raise ValueError(f"k has head_dim {khd}, q has {hd}")
    if KVH < 1 or H % KVH:
        raise ValueError(f"k has {KVH} kv heads, which must divide q's {H} heads")
    if n < start + T:
        raise ValueError(f"k holds {n} positions; start {start} + T {T} needs {start + T}")
    if k.size > _INT_MAX:
        raise ValueError(f"k {k.shape} is too large for the kernels' 32-bit indexing")
    if T == 0:
        return np.empty((0, H * hd), np.float32)
    dtype = np.float16 if (k.dtype == np.float16 and v.dtype == np.float16) else np.float32
    k = np.ascontiguousarray(k, dtype=dtype)
    v = np.ascontiguousarray(v, dtype=dtype)
    return _run(rt, "dense", q, dtype, rt.upload(k), rt.upload(v), (np.int32(KVH), np.int32(n)), start)


def can_read_pool(pool) -> bool:
    """attention_pool reads f32 and f16 arenas with head_dim <= 256; int8 KV (with scales) goes
    through the gathered path."""
    k, v = getattr(pool, "k", None), getattr(pool, "v", None)
    return (isinstance(k, np.ndarray) and isinstance(v, np.ndarray) and k.dtype in KV_DTYPES
            and v.dtype == k.dtype and getattr(pool, "k_scale", None) is None
            and 1 <= getattr(pool, "head_dim", 0) <= MAX_HEAD_DIM)


@dataclass
class _ArenaBuffer:
    arena: np.ndarray     # the host array wrapped (identity checked on every call)
    buf: object           # cl.Buffer(READ_ONLY | USE_HOST_PTR) over arena's memory


# pool -> {id(runtime): (weakref to runtime, k _ArenaBuffer, v _ArenaBuffer)}
_ARENAS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _wrap(rt: ClRuntime, arena: np.ndarray) -> _ArenaBuffer:
    cl = _import_cl()
    if not arena.flags.c_contiguous:
        raise ValueError(f"the pool's arena must be C-contiguous (strides {arena.strides})")
    mf = cl.mem_flags
    with driver_call(f"wrap of a KV arena of {arena.nbytes} bytes"):
        return _ArenaBuffer(arena, cl.Buffer(rt.ctx, mf.READ_ONLY | mf.USE_HOST_PTR, hostbuf=arena))


def _arena_buffers(rt: ClRuntime, pool) -> tuple[_ArenaBuffer, _ArenaBuffer]:
    try:
        per_rt = _ARENAS.setdefault(pool, {})
    except TypeError:               # a pool object that takes no weak reference: wrap per call
        return _wrap(rt, pool.k), _wrap(rt, pool.v)
    entry = per_rt.get(id(rt))
    if entry is None or entry[0]() is not rt or entry[1].arena is not pool.k or entry[2].arena is not pool.v:
        entry = per_rt[id(rt)] = (weakref.ref(rt), _wrap(rt, pool.k), _wrap(rt, pool.v))
    return entry[1], entry[2]


def _publish(rt: ClRuntime, ab: _ArenaBuffer, lo: int, hi: int) -> None:
    """Make the host's writes to blocks lo..hi-1 of the arena visible to the device: map for
    write-invalidate, unmap (see the module docstring for why this flag)."""
    cl = _import_cl()
    block = ab.arena.strides[0]
    with driver_call(f"map of KV blocks {lo}..{hi - 1}"):
        mapped, _ = cl.enqueue_map_buffer(rt.queue, ab.buf, cl.map_flags.WRITE_INVALIDATE_REGION, lo * block,
                                          ((hi - lo) * block,), np.uint8)
        mapped.base.release(rt.queue)


def attention_pool(rt: ClRuntime, q: np.ndarray, pool, table: np.ndarray, layer: int, start: int) -> np.ndarray:
    """Attention straight from the KV pool's blocks (no gather, no fp32 copy of the cache).
    q (T, H, hd) at positions start..start+T-1; table: the sequence's block table (int32; block i
    of the sequence is arena block table[i]), covering positions 0..start+T-1. -> (T, H * hd)."""
    if not can_read_pool(pool):
        what = getattr(getattr(pool, "k", None), "dtype", type(pool).__name__)
        raise ValueError(f"pool: attention_pool reads f32/f16 arenas with head_dim <= {MAX_HEAD_DIM}, "
                         f"got {what} (int8 KV goes through the gathered path)")
    q = _check_q(q)
    T, H, hd = q.shape
    start = _check_start(start, T)
    n_blocks, n_layers, bt, KVH, phd = pool.k.shape
    if pool.v.shape != pool.k.shape:
        raise ValueError(f"pool: v arena {pool.v.shape} differs from k arena {pool.k.shape}")
    if hd != phd:
        raise ValueError(f"q has head_dim {hd}, the pool {phd}")
    if H % KVH:
        raise ValueError(f"q has {H} heads, not a multiple of the pool's {KVH} kv heads")
    if not _is_int(layer) or not 0 <= layer < n_layers:
        raise ValueError(f"layer must be an int in 0..{n_layers - 1}, got {layer!r}")
    tbl = np.asarray(table)
    if tbl.ndim != 1 or tbl.dtype.kind not in "iu":
        raise ValueError(f"table must be a 1-D integer array, got {tbl.dtype} {tbl.shape}")
    n = start + T
    nb = math.ceil(n / bt)
    if tbl.size < nb:
        raise ValueError(f"table has {tbl.size} blocks of {bt} tokens; positions 0..{n - 1} need {nb}")
    if T == 0:
        return np.empty((0, H * hd), np.float32)
    used = tbl[:nb]
    lo, hi = int(used.min()), int(used.max()) + 1
    if lo < 0 or hi > n_blocks:
        raise ValueError(f"table holds block ids {lo}..{hi - 1} outside the pool's 0..{n_blocks - 1}")
    kab, vab = _arena_buffers(rt, pool)
    _publish(rt, kab, lo, hi)
    _publish(rt, vab, lo, hi)
    layout_args = (np.int32(KVH), rt.upload(np.ascontiguousarray(used, dtype=np.int32)), np.int32(bt),
                   np.int32(n_layers), np.int32(layer))
    return _run(rt, "pool", q, pool.k.dtype, kab.buf, vab.buf, layout_args, start)


# ---- warm-up and self-check helpers --------------------------------------------------------------

@dataclass(eq=False)
class SmallPool:
    """A KV pool's arenas and nothing else: what attention_pool reads (opencl._warm_up and the
    probe's self-check run the pool kernels on one without building a kv/pool.py pool)."""
    k: np.ndarray             # (n_blocks, n_layers, bt, KVH, hd), float32 or float16
    v: np.ndarray             # same shape and dtype
    head_dim: int
    k_scale: None = None      # no int8 scales: attention_pool reads f32/f16 arenas only

    @classmethod
    def holding(cls, k: np.ndarray, v: np.ndarray, table, bt: int) -> "SmallPool":
        """A one-layer pool whose blocks `table` hold k, v (KVH, n, hd): position p in block
        table[p // bt], slot p % bt; every other slot holds zeros."""
        KVH, n, hd = k.shape
        shape = (max(table) + 1, 1, bt, KVH, hd)
        ka, va = np.zeros(shape, k.dtype), np.zeros(shape, v.dtype)
        for p in range(n):
            ka[table[p // bt], 0, p % bt] = k[:, p]
            va[table[p // bt], 0, p % bt] = v[:, p]
        return cls(ka, va, hd)


def warm_up(rt: ClRuntime, H: int, KVH: int, hd: int) -> None:
    """Build and run every attention program and kernel the engine may use for a model of these
    heads: the dense (gathered) and pool layouts, float32 and float16 K/V (the default KV pool is
    f16, whose KV_F16=1 program is a build of its own), the split kernel (decode) and the
    one-item-per-row kernel (long prefill chunks). A kernel that fails fails here, at load."""
    rows_T = max(2, -(-SPLIT_PLANS[-1][0] // H))         # enough query rows for the *_rows kernel
    for dtype in KV_DTYPES:
        for T in (1, rows_T):
            q = np.ones((T, H, hd), np.float32)
            kv = np.ones((KVH, T, hd), dtype)
            attention(rt, q, kv, kv, 0)
            pool = SmallPool.holding(kv, kv, [0], T)
            attention_pool(rt, q, pool, np.zeros(1, np.int32), 0, 0)

