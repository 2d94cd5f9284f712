"""The KV block arena: one preallocated pool of fixed-size blocks per model, shared by every
sequence (request, fork, cached prefix) through per-sequence block tables.

Layout (this is what the attention kernels of every backend read):

    k, v      (n_blocks, n_layers, block_tokens, n_kv_heads, head_dim)   f32 | f16 | int8
    k_scale,  (n_blocks, n_layers, block_tokens, n_kv_heads)             f32, int8 only
    v_scale

Block b holds positions [i * block_tokens, (i + 1) * block_tokens) of every layer for the
sequence whose block_table[i] == b. Blocks come first so that one block (all layers) is one
contiguous slab: copy-on-write is a single memcpy, and a session file or a backend can move a
block as a unit. Keys are stored already rotated by RoPE at their absolute position
(`slides = False`): a block's position in the sequence never changes in a pool (the ring buffer
is the structure where it does).

Ownership. A block is in exactly one of three states:
  free        on the free list, refcount 0;
  referenced  refcount = the number of sequences whose block table holds it (> 0);
  cached      refcount 0 but retained by the prefix cache (kv/prefix.py): still resident so
              a later request can reuse it, and evictable.
Eviction policy: an allocation takes free blocks first; only when there are not enough does it
evict cached, unreferenced blocks, least recently used first (a block's "use" ends when the last
sequence holding it lets it go), and tells the prefix cache, which drops it from its index. A
referenced block is never evicted or overwritten: when nothing more can be had, `reserve`
raises ContextFull with the figures and changes nothing.

A block that is shared (refcount > 1) or retained by the prefix cache is immutable: a sequence
that must write into it copies it first (copy-on-write in `reserve`), and `write` refuses a
block that is not exclusively owned (KVInvariantError: a caller bug, not a user error).

The forward pass drives a sequence as:

    seq.reserve(T)                                  # room for positions n_tokens..n_tokens+T-1
    for layer: seq.write(layer, start, k, v); k_all, v_all = seq.read(layer, start + T); ...
    seq.commit(start + T, chunk_ids)                # after all layers; records the token ids
    (on cancel: seq.truncate(seq.n_tokens) drops the uncommitted reservation)

Token ids travel with `commit` (not a separate call) so that `tokens` and `n_tokens` can never
disagree: the prefix cache keys blocks by the ids whose KV they hold.

Not thread-safe: one thread (the engine / scheduler loop) drives a pool and its sequences.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable, Iterable

import numpy as np

from ..errors import ConfigError, ContextFull
from ..model.prefault import commit

PRECISIONS = {"f32": np.float32, "f16": np.float16, "int8": np.int8}
# below this many elements numpy's own float16 cast wins: f16_to_f32's ten passes each cost a
# ufunc call (~1 us) whatever the size
F16_BITS_MIN = 4096


class KVInvariantError(AssertionError):
    """The pool was driven against its contract (a write into a shared, cached or unreserved
    block, a free block handed to a sequence, ...). A bug in the caller, raised explicitly so
    that it survives `python -O`."""


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per (token, head): x (..., head_dim) -> q int8 (..., head_dim), scale f32
    (...,) with scale = amax / 127, so |x - q * scale| <= scale / 2 = amax / 254 per element.
    A row of zeros gets scale 0 (and q 0) rather than a division by zero."""
    amax = np.abs(x).max(axis=-1)
    scale = (amax / np.float32(127.0)).astype(np.float32)
    s = scale[..., None]
    # divide, not multiply by 1/scale: for a subnormal scale (amax < ~1.5e-36) 1/scale overflows
    q = np.divide(x, s, out=np.zeros(x.shape, dtype=np.float32), where=s > 0)
    # |x / scale| <= 127 up to rounding, but a subnormal scale has lost precision: clip
    np.clip(np.rint(q, out=q), -127, 127, out=q)
    return q.astype(np.int8), scale


def f16_to_f32(bits: np.ndarray, out: np.ndarray, scratch: tuple[np.ndarray, np.ndarray]) -> None:
    """out (float32) = the float16 values whose bit patterns (uint16) are `bits`, exactly,
    infinities and NaNs included (tests check all 65536 patterns).

    numpy's float16 cast is a scalar loop (~3 ns an element on x86 and on aarch64 builds without
    native half casts); these whole-array integer passes are about twice as fast: move sign,
    exponent and mantissa to their float32 places, and let one multiply by 2**112 re-bias the
    exponent (15 -> 127), which also normalizes subnormal halves. Exponent 31 (inf/NaN) would come
    out finite, so its float32 exponent is set to all ones instead. scratch: a uint32 and a bool
    array of out's shape."""
    w = out.view(np.uint32)
    sign, special = scratch
    w[...] = bits                    # widen (and lay out as `out`) in one strided copy
    np.bitwise_and(w, 0x8000, out=sign)
    w ^= sign
    np.greater_equal(w, 0x7C00, out=special)
    w <<= 13
    out *= np.float32(2.0**112)
    if special.any():
        np.bitwise_or(w, 0x7F800000, out=w, where=special)
    sign <<= 16
    w |= sign


class KVPool:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_blocks: int,
                 block_tokens: int = 16, precision: str = "f16", background_commit: bool = False):
        KVPool._validate(n_layers, n_kv_heads, head_dim, n_blocks, block_tokens, precision)
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.n_blocks = n_blocks          # blocks in the arena
        self.block_tokens = block_tokens  # token positions per block
        self.precision = precision        # storage type of k and v: "f32" | "f16" | "int8"
        shape = (n_blocks, n_layers, block_tokens, n_kv_heads, head_dim)
        dtype = PRECISIONS[precision]
        # np.zeros would map pages lazily; committing them now takes the memory at load, where a
        # shortage is a clear failure, instead of at some later token. background_commit (the
        # engine's pool): on a thread, where the kernel can do it without writing (prefault.commit)
        alloc = np.zeros if background_commit else np.empty     # zeros: lazily zero pages, or memset
        self.k = alloc(shape, dtype=dtype)  # (blocks, layers, block_tokens, kv_heads, head_dim)
        self.v = alloc(shape, dtype=dtype)  # (blocks, layers, block_tokens, kv_heads, head_dim)
        self.commit = commit((self.k, self.v), background_commit)   # model/prefault.Prefault
        if precision == "int8":
            # Scale per token per head (not per block): appending a token never changes the scale
            # of the tokens already in its block, so they are never requantized (a per-block scale
            # would have to grow with a later outlier and re-round every earlier value), and a
            # write touches only its own rows, which copy-on-write and sharing rely on.
            self.k_scale = np.zeros(shape[:-1], dtype=np.float32)  # (blocks, layers, block_tokens, kv_heads)
            self.v_scale = np.zeros(shape[:-1], dtype=np.float32)  # (blocks, layers, block_tokens, kv_heads)
        else:
            self.k_scale = self.v_scale = None
        self._ref = [0] * n_blocks                     # sequences holding each block
        self._free = list(range(n_blocks - 1, -1, -1))  # stack: pop() hands out low ids first
        self._cached: set[int] = set()                 # blocks the prefix cache retains
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached and unreferenced, LRU first
        self._on_evict: Callable[[int], None] | None = None
        self._live: set[PoolSequence] = set()          # sequences that may hold blocks
        self.evictions = 0                             # cached blocks reclaimed by allocations
        self._scratch_u32 = np.empty(0, dtype=np.uint32)
        self._scratch_bool = np.empty(0, dtype=bool)

    @staticmethod
    def _validate(n_layers, n_kv_heads, head_dim, n_blocks, block_tokens, precision) -> None:
        for name, val in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                          ("n_blocks", n_blocks), ("block_tokens", block_tokens)):
            if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < 1:
                raise ConfigError(f"KV pool: {name} must be an integer >= 1, got {val!r}")
        if precision not in PRECISIONS:
            raise ConfigError(f"KV pool: precision must be one of {sorted(PRECISIONS)}, got {precision!r}")

    def release(self) -> None:
        """Drops the arena (Engine.close): whatever still holds the pool (a finished request in a
        Scheduler, an unread stream) then holds no memory. Nothing may read it after."""
        self.k = self.v = self.k_scale = self.v_scale = None

    @staticmethod
    def nbytes_for(n_layers: int, n_kv_heads: int, head_dim: int, n_blocks: int,
                   block_tokens: int = 16, precision: str = "f16") -> int:
        """Bytes the arena of these dimensions takes (K and V, plus int8 scales), for the
        load-time memory check, before anything is allocated."""
        KVPool._validate(n_layers, n_kv_heads, head_dim, n_blocks, block_tokens, precision)
        rows = n_blocks * n_layers * block_tokens * n_kv_heads
        total = 2 * rows * head_dim * np.dtype(PRECISIONS[precision]).itemsize
        if precision == "int8":
            total += 2 * rows * 4
        return total

    @property
    def nbytes(self) -> int:
        scales = 0 if self.k_scale is None else self.k_scale.nbytes + self.v_scale.nbytes
        return self.k.nbytes + self.v.nbytes + scales

    # ---- block accounting -------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Blocks on the free list (not counting cached blocks that could be evicted)."""
        return len(self._free)

    @property
    def evictable_blocks(self) -> int:
        """Cached blocks no sequence holds: reclaimed, LRU first, when the free list runs out."""
        return len(self._evictable)

    @property
    def available_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def live_sequences(self) -> int:
        return len(self._live)

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def block_state(self, block: int) -> str:
        """"referenced", "cached" (retained by the prefix cache, unreferenced) or "free"."""
        if self._ref[block] > 0:
            return "referenced"
        return "cached" if block in self._cached else "free"

    def new_sequence(self) -> PoolSequence:
        return PoolSequence(self)

    def _alloc(self, n: int) -> list[int]:
        """n blocks with refcount 1: free ones first, then cached ones evicted in LRU order.
        Raises ContextFull, changing nothing, when fewer than n can be had."""
        if n > len(self._free) + len(self._evictable):
            err = ContextFull(
                f"KV pool full: {n} more blocks of {self.block_tokens} tokens needed, "
                f"{len(self._free)} free + {len(self._evictable)} evictable of {self.n_blocks} "
                f"(the rest are held by open sequences: running requests, this one included, and the "
                f"conversation the engine keeps for its next turn; raise n_ctx / the pool size or end a request)")
            err.needed_blocks, err.free_blocks = n, len(self._free) + len(self._evictable)
            err.block_tokens, err.n_blocks = self.block_tokens, self.n_blocks
            raise err
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._cached.discard(b)
                self.evictions += 1
                if self._on_evict is not None:
                    self._on_evict(b)
            self._ref[b] = 1
            out.append(b)
        return out

    def _incref(self, b: int) -> None:
        if self._ref[b] == 0:
            if b not in self._cached:
                raise KVInvariantError(f"block {b} is free; only a held or cached block can be shared")
            del self._evictable[b]
        self._ref[b] += 1

    def _decref(self, b: int) -> None:
        r = self._ref[b] - 1
        if r < 0:
            raise KVInvariantError(f"block {b} released more often than it was held")
        self._ref[b] = r
        if r == 0:
            if b in self._cached:
                self._evictable[b] = None  # most recently used end
            else:
                self._free.append(b)

    def _release(self, blocks: list[int]) -> None:
        # Last block first: the tail of a prompt becomes least recently used, so eviction takes a
        # cached chain from its end and its head (the shared system prompt) survives longest.
        for b in reversed(blocks):
            self._decref(b)

    def _copy_block(self, src: int, dst: int) -> None:
        self.k[dst] = self.k[src]
        self.v[dst] = self.v[src]
        if self.k_scale is not None:
            self.k_scale[dst] = self.k_scale[src]
            self.v_scale[dst] = self.v_scale[src]

    def _scratch(self, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Reused temporaries of the f16 read (grow-only), so a read allocates nothing large."""
        size = math.prod(shape)
        if self._scratch_u32.size < size:
            self._scratch_u32 = np.empty(size, dtype=np.uint32)
            self._scratch_bool = np.empty(size, dtype=bool)
        return self._scratch_u32[:size].reshape(shape), self._scratch_bool[:size].reshape(shape)

    # ---- the prefix cache's side --------------------------------------------------------------

    def set_evict_hook(self, fn: Callable[[int], None] | None) -> None:
        """fn(block) is called when an allocation evicts a cached block (the prefix cache drops
        it from its index)."""
        self._on_evict = fn

    def retain(self, block: int) -> None:
        """Mark a held block as cached: it stays resident when its last holder lets it go, and
        becomes immutable (writers copy it first)."""
        if self._ref[block] == 0 and block not in self._cached:
            raise KVInvariantError(f"block {block} is free; only a held block can be cached")
        self._cached.add(block)

    def unretain(self, block: int) -> None:
        """Drop the cache's hold (cache clear): an unreferenced block goes back to the free list."""
        if block not in self._cached:
            return
        self._cached.discard(block)
        if self._ref[block] == 0:
            del self._evictable[block]
            self._free.append(block)

    def check(self) -> None:
        """Verify the accounting (tests, debugging): refcounts equal the holders among live
        sequences, each block in exactly one state, the LRU holds exactly the cached
        unreferenced blocks."""
        holders = [0] * self.n_blocks
        for seq in self._live:
            if len(set(seq.block_table)) != len(seq.block_table):
                raise KVInvariantError(f"a block table holds a block twice: {seq.block_table}")
            for b in seq.block_table:
                holders[b] += 1
        if holders != self._ref:
            bad = [b for b in range(self.n_blocks) if holders[b] != self._ref[b]]
            raise KVInvariantError(f"refcounts differ from holders for blocks {bad[:8]}")
        free = set(self._free)
        if len(free) != len(self._free):
            raise KVInvariantError("a block is on the free list twice")
        if any(self._ref[b] for b in free) or free & self._cached:
            raise KVInvariantError("a free block is referenced or cached")
        cached_unref = {b for b in self._cached if self._ref[b] == 0}
        if cached_unref != set(self._evictable):
            raise KVInvariantError("the LRU list differs from the cached unreferenced blocks")
        referenced = sum(1 for r in self._ref if r > 0)
        if len(free) + referenced + len(cached_unref) != self.n_blocks:
            raise KVInvariantError(f"{len(free)} free + {referenced} referenced + {len(cached_unref)} "
                                   f"cached != {self.n_blocks} blocks")


class PoolSequence:
    """One sequence's view of the pool: a block table and the token ids whose KV it holds."""

    slides = False  # keys are stored rotated at their absolute positions, which are their cache positions

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.block_table: list[int] = []  # block of positions [i*bt, (i+1)*bt); read-only to others
        self.tokens: list[int] = []       # ids of positions 0..n_tokens-1
        self._n = 0
        self._tbl: np.ndarray | None = None  # block_table as an index array, rebuilt on change

    @property
    def n_tokens(self) -> int:
        """Committed positions (complete in every layer). Changed only by commit / truncate."""
        return self._n

    @property
    def capacity(self) -> int:
        """Positions the block table covers (committed + reserved)."""
        return len(self.block_table) * self.pool.block_tokens

    def _table(self) -> np.ndarray:
        if self._tbl is None:
            self._tbl = np.asarray(self.block_table, dtype=np.intp)
        return self._tbl

    def _writable(self, b: int) -> bool:
        return self.pool._ref[b] == 1 and b not in self.pool._cached

    def reserve(self, n_new: int) -> None:
        """Make room for positions n_tokens..n_tokens+n_new-1: allocate missing blocks and
        copy-on-write any block of that range that is shared or cached. All or nothing: on
        ContextFull the sequence and the pool are unchanged."""
        if n_new < 0:
            raise ValueError(f"reserve needs n_new >= 0, got {n_new}")
        if n_new == 0:
            return
        pool, bt, table = self.pool, self.pool.block_tokens, self.block_table
        first, end = self._n // bt, -(-(self._n + n_new) // bt)
        cow = [i for i in range(first, min(end, len(table))) if not self._writable(table[i])]
        missing = max(0, end - len(table))
        need, have = len(cow) + missing, len(pool._free) + len(pool._evictable)
        if cow and have < need:
            # A copied block this sequence alone holds is given back by the copy: one copy at a
            # time (those first), then the new blocks, fit in a pool one block short of asking
            # for all at once. (A prompt one token past a cached block, on an engine with no
            # other request and a pool of one context, was refused: ContextFull.)
            own = [i for i in cow if pool._ref[table[i]] == 1]
            if have == 0 or have + len(own) < need:
                pool._alloc(need)   # raises ContextFull, changing nothing
            pool._live.add(self)
            for i in own + [i for i in cow if i not in own]:
                b = pool._alloc(1)[0]
                pool._copy_block(table[i], b)
                pool._decref(table[i])
                table[i] = b
            table.extend(pool._alloc(missing))
            self._tbl = None
            return
        fresh = pool._alloc(need)
        pool._live.add(self)
        for i in cow:
            b = fresh.pop()
            pool._copy_block(table[i], b)  # the whole block: its valid rows in every layer
            pool._decref(table[i])
            table[i] = b
        table.extend(fresh)
        self._tbl = None

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """k, v (T, n_kv_heads, head_dim) for positions start..start+T-1, all reserved and in
        blocks this sequence owns alone."""
        self._check_rows("write", k, v)
        if self.pool.k_scale is None:
            self._put(layer, start, k, v)
        else:
            self._put(layer, start, *quantize_int8(np.asarray(k, dtype=np.float32)),
                      *quantize_int8(np.asarray(v, dtype=np.float32)))

    def write_int8(self, layer: int, start: int, kq: np.ndarray, ks: np.ndarray,
                   vq: np.ndarray, vs: np.ndarray) -> None:
        """An int8 pool's rows as they are stored: kq, vq int8 (T, n_kv_heads, head_dim), their
        scales ks, vs float32 (T, n_kv_heads), as read_int8 gives them (a session's restore
        writes them back unchanged: dequantizing and quantizing again could move a value)."""
        pool = self.pool
        if pool.k_scale is None:
            raise ValueError(f"write_int8 on a {pool.precision} pool")
        self._check_rows("write_int8", kq, vq)
        for name, a, want in (("kq", kq, np.int8), ("vq", vq, np.int8), ("ks", ks, np.float32),
                              ("vs", vs, np.float32)):
            if a.dtype != want:
                raise ValueError(f"write_int8 needs {name} of dtype {np.dtype(want)}, got {a.dtype}")
        if ks.shape != kq.shape[:2] or vs.shape != kq.shape[:2]:
            raise ValueError(f"write_int8 needs scales of shape {kq.shape[:2]}, got {ks.shape}, {vs.shape}")
        self._put(layer, start, kq, ks, vq, vs)

    def _check_rows(self, what: str, k: np.ndarray, v: np.ndarray) -> None:
        pool = self.pool
        shape = (pool.n_kv_heads, pool.head_dim)
        if k.ndim != 3 or k.shape[1:] != shape or v.shape != k.shape:
            raise ValueError(f"{what} needs k, v of shape (T, {shape[0]}, {shape[1]}), "
                             f"got {k.shape}, {v.shape}")

    def _put(self, layer: int, start: int, k: np.ndarray, *rest: np.ndarray) -> None:
        """Stores rows at start..: (k, v) on a float pool, (kq, ks, vq, vs) on an int8 one."""
        pool, bt = self.pool, self.pool.block_tokens
        if not 0 <= layer < pool.n_layers:
            raise ValueError(f"layer {layer} outside 0..{pool.n_layers - 1}")
        t = k.shape[0]
        if t == 0:
            return
        if start < 0 or start + t > self.capacity:
            raise KVInvariantError(f"write of positions {start}..{start + t - 1} outside the "
                                   f"{self.capacity} reserved (call reserve first)")
        table = self.block_table
        b0, b1 = start // bt, (start + t - 1) // bt
        for i in range(b0, b1 + 1):
            if not self._writable(table[i]):
                raise KVInvariantError(f"write into block {table[i]} (table slot {i}) that is shared "
                                       f"(refcount {pool._ref[table[i]]}) or cached: reserve copies it first")
        if b0 == b1:  # decode and block-aligned small chunks: plain slices
            b, o = table[b0], start - b0 * bt
            sl = (b, layer, slice(o, o + t))
        else:
            pos = np.arange(start, start + t)
            sl = (self._table()[pos // bt], layer, pos % bt)
        if pool.k_scale is None:
            pool.k[sl] = k
            pool.v[sl] = rest[0]
        else:
            ks, vq, vs = rest
            pool.k[sl], pool.k_scale[sl] = k, ks
            pool.v[sl], pool.v_scale[sl] = vq, vs

    def read_int8(self, layer: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """An int8 pool's positions 0..n-1 as stored: kq, vq int8 (n, n_kv_heads, head_dim) and
        their scales ks, vs float32 (n, n_kv_heads) (copies)."""
        pool, bt = self.pool, self.pool.block_tokens
        if pool.k_scale is None:
            raise ValueError(f"read_int8 on a {pool.precision} pool")
        if n < 0 or n > self.capacity:
            raise KVInvariantError(f"read of {n} positions; {self.capacity} reserved")
        kvh, hd = pool.n_kv_heads, pool.head_dim
        nb = -(-n // bt)
        idx = self._table()[:nb]
        rows = [a[idx, layer].reshape(nb * bt, kvh, hd)[:n] for a in (pool.k, pool.v)]
        scales = [a[idx, layer].reshape(nb * bt, kvh)[:n] for a in (pool.k_scale, pool.v_scale)]
        return rows[0], scales[0], rows[1], scales[1]

    def read(self, layer: int, n: int, out: tuple[np.ndarray, np.ndarray] | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """float32 (n_kv_heads, n, head_dim) K and V of positions 0..n-1, gathered through the
        block table (one fancy-index gather per array) and dequantized.

        out=(k_buf, v_buf), float32 (n_kv_heads, >= n, head_dim), makes the result views
        k_buf[:, :n], v_buf[:, :n]. A caller that reads every layer of every step (the forward
        pass) should pass them: fresh arrays this large (768 KB each at n=1024 for SmolLM2) go
        back to the OS when freed and are page-faulted in again on the next call, which costs
        several times the gather itself."""
        pool = self.pool
        if n < 0 or n > self.capacity:
            raise KVInvariantError(f"read of {n} positions; {self.capacity} reserved")
        shape = (pool.n_kv_heads, n, pool.head_dim)
        if out is None:
            ko, vo = np.empty(shape, dtype=np.float32), np.empty(shape, dtype=np.float32)
        else:
            ko, vo = out
            for o in out:
                if (o.dtype != np.float32 or o.ndim != 3 or o.shape[0] != shape[0]
                        or o.shape[2] != shape[2] or o.shape[1] < n):
                    raise ValueError(f"read out= needs float32 buffers of shape ({shape[0]}, >= {n}, "
                                     f"{shape[2]}); got {o.dtype} {o.shape}")
            ko, vo = ko[:, :n], vo[:, :n]
        self._gather(pool.k, pool.k_scale, layer, n, ko)
        self._gather(pool.v, pool.v_scale, layer, n, vo)
        return ko, vo

    def _gather(self, arena: np.ndarray, scale: np.ndarray | None, layer: int, n: int,
                out: np.ndarray) -> None:
        pool, bt = self.pool, self.pool.block_tokens
        kvh, hd = pool.n_kv_heads, pool.head_dim
        nb = -(-n // bt)
        idx = self._table()[:nb]
        if arena.dtype == np.float16 and out.size >= F16_BITS_MIN:
            g = arena.view(np.uint16)[idx, layer].reshape(nb * bt, kvh, hd)[:n].transpose(1, 0, 2)
            f16_to_f32(g, out, pool._scratch(out.shape))
            return
        g = arena[idx, layer].reshape(nb * bt, kvh, hd)[:n].transpose(1, 0, 2)  # (KVH, n, hd)
        if scale is None:
            out[...] = g
        else:
            s = scale[idx, layer].reshape(nb * bt, kvh)[:n].T  # (KVH, n)
            np.multiply(g, s[:, :, None], out=out)

    def commit(self, n_tokens: int, token_ids: Iterable[int]) -> None:
        """Positions up to n_tokens are now written in every layer; token_ids are the ids of
        the new positions (old n_tokens..n_tokens-1)."""
        ids = [int(t) for t in token_ids]
        if n_tokens < self._n or n_tokens > self.capacity:
            raise KVInvariantError(f"commit to {n_tokens} with {self._n} committed and "
                                   f"{self.capacity} reserved")
        if len(ids) != n_tokens - self._n:
            raise ValueError(f"commit to {n_tokens} from {self._n} needs {n_tokens - self._n} "
                             f"token ids, got {len(ids)}")
        self.tokens.extend(ids)
        self._n = n_tokens

    max_chunk = None  # no limit on the tokens one reserve may take (a ring has one)

    def can_truncate(self, n_tokens: int) -> bool:
        """A pool can always go back to any committed length."""
        return 0 <= n_tokens <= self._n

    def truncate(self, n_tokens: int) -> None:
        """Forget positions >= n_tokens (a cancelled chunk, a reused prefix) and release the
        blocks wholly past the end, reserved ones included."""
        if not 0 <= n_tokens <= self._n:
            raise ValueError(f"truncate to {n_tokens} outside 0..{self._n}")
        keep = -(-n_tokens // self.pool.block_tokens)
        if keep < len(self.block_table):
            self.pool._release(self.block_table[keep:])
            del self.block_table[keep:]
            self._tbl = None
        self._n = n_tokens
        del self.tokens[n_tokens:]

    def fork(self) -> PoolSequence:
        """A sequence sharing every block of this one (refcount +1 each); the first write into a
        shared block by either side copies it."""
        child = PoolSequence(self.pool)
        child.adopt(self.block_table, self.tokens, n_tokens=self._n)
        return child

    def adopt(self, blocks: list[int], token_ids: Iterable[int], n_tokens: int | None = None) -> None:
        """Start this empty sequence on existing held or cached blocks (refcount +1 each): the
        prefix cache's attach and fork. n_tokens defaults to len(token_ids)."""
        ids = [int(t) for t in token_ids]
        n = len(ids) if n_tokens is None else n_tokens
        if self.block_table or self._n:
            raise KVInvariantError("adopt needs an empty sequence")
        if len(ids) != n or n > len(blocks) * self.pool.block_tokens:
            raise KVInvariantError(f"adopt of {n} positions with {len(ids)} ids into {len(blocks)} blocks")
        done = []
        try:
            for b in blocks:
                self.pool._incref(b)
                done.append(b)
        except KVInvariantError:
            self.pool._release(done)
            raise
        self.pool._live.add(self)
        self.block_table = list(blocks)
        self._tbl = None
        self.tokens = ids
        self._n = n

    def free(self) -> None:
        """Release every block (idempotent); the sequence is left empty and reusable."""
        if self.block_table:
            self.pool._release(self.block_table)
        self.block_table = []
        self._tbl = None
        self.tokens = []
        self._n = 0
        self.pool._live.discard(self)
