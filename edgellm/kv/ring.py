"""Ring-buffer KV cache with attention sinks (StreamingLLM): a chat runs indefinitely in a fixed
amount of memory.

Choices, and why:

- `window` is the whole capacity in tokens, sinks included (e.g. 1024 with 4 sinks: 4 sink slots
  and a 1020-slot ring). nbytes is fixed at construction and never grows with the conversation.
- The first `sinks` tokens ever appended stay forever (the attention-sink tokens that softmax
  dumps its mass on); after them, the oldest non-sink token is evicted when room is needed.
- Attention sees the tokens at their *cache positions* (StreamingLLM's choice): sinks at
  0..s-1, then the ring tokens s.. in age order, the newest last, so every relative distance
  inside the window stays within what the model saw in training, however long the chat runs.
  RoPE scores depend only on the distance between a query and a key, and the ring tokens are
  consecutive in the sequence, so between two ring tokens the cache distance IS the sequence
  distance: keys are stored rotated once, at write, by their absolute sequence position
  (`rope_start(T)`), and queries are rotated by theirs. Only the sinks sit closer to the window
  than in the sequence, by `sink_shift` = the tokens evicted so far: before attention the caller
  rotates the sinks' exact stored keys (`sink_keys()`, captured when they were written) on by
  that many positions and puts them back (`set_sink_keys`). That is O(sinks) work per step,
  where rotating every key at read was O(window) per layer, and nothing drifts: a sink is always
  re-rotated from its exact copy, every other key is rotated once. (Rotating all keys at read
  kept the ring off the fused native step, which reads keys rotated in place: ~5x slower decode.)
  `slides = True` tells the engine to take storage positions from `chunk_start(T)` and RoPE
  positions from `rope_start(T)` (equal in a block pool).
- Eviction happens at `reserve`: a chunk of T tokens is attended after the T oldest ring tokens
  have made room, so the chunk's first query sees `window - T + 1` tokens when the ring is full
  (decode, T = 1, sees the full window; keep prefill chunks well below the window). Below the
  window nothing is evicted and the ring is exactly the block pool, whatever the chunking.
- A chunk may hold at most `max_chunk = window - sinks` tokens (constant, so an engine can pick
  one chunk size per forward); a larger `reserve` raises ConfigError.
- Rollback: `reserve` copies the rows of the tokens it evicts (at most T rows per layer, freed at
  commit), so `truncate` can cancel a pending chunk exactly, even after some layers were written.
  Committed tokens can be truncated only where the result is exactly what the shorter sequence
  would hold (`can_truncate`): anything while nothing was ever evicted, the sinks alone, or a
  no-op. Tokens evicted by a committed chunk are gone; truncating past them raises ConfigError
  rather than leave a cache that silently differs from the sequence. truncate counts cache
  positions (like n_tokens), so once the ring is full truncate(n_tokens) undoes only the pending
  chunk: chunks committed earlier in the same forward stay, and total_tokens says how many of the
  sequence's tokens the ring has taken.

Storage: (window, n_layers, n_kv_heads, head_dim) for K and for V, float32, float16 or int8 (with
a float32 scale per (slot, layer, head) row, quantized as the block pool does): the
block pool's arena with blocks of one token, so `pool` (that view) and `block_table` (the slot of
each cache position) let the pool's readers, the fused native step among them, read and write
the ring in place. Slots 0..s-1 hold the sinks; slots s..window-1 are a circular region whose
oldest token sits at slot s + head. `RingIndex` is that slot bookkeeping alone (no arrays), so it
can be tested on its own.

Counts: `n_tokens` = tokens held by committed chunks (<= window, unchanged by reserve, like a
pool sequence); `total_tokens` = tokens ever committed (the sequence length). The per-sequence
protocol the engine drives, per chunk:

    seq.reserve(T)                     # evicts as needed; positions() = the chunk's cache positions
    start = seq.chunk_start(T)         # = held tokens after the reserve - T
    p = seq.rope_start(T)              # the chunk's absolute positions p..p+T-1: rotate q and k by them
    if seq.sinks_at != seq.sink_shift: # rotate the sinks on (see above)
        seq.set_sink_keys(rope(seq.sink_keys(), position seq.sink_shift), seq.sink_shift)
    for layer: seq.write(layer, start, k, v); k_all, v_all = seq.read(layer, start + T)
    seq.commit(seq.n_tokens + T, ids)  # or, on cancel, seq.truncate(seq.n_tokens)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from .pool import quantize_int8

_DTYPES = {"f32": np.float32, "f16": np.float16, "int8": np.int8}


@dataclass(frozen=True)
class RingState:
    """The whole bookkeeping of a ring, small enough to snapshot for an undo."""

    n_sink: int    # sink slots filled (< sinks only while the first tokens arrive; then ring is empty)
    head: int      # ring index (0..capacity-1) of the oldest ring token
    n_ring: int    # ring tokens held
    total: int     # tokens ever appended (sequence length)


class RingIndex:
    """Slot bookkeeping of a ring with sinks, without any arrays.

    Cache position p (0..n_tokens-1) lives in slot p if p < n_sink, else in slot
    sinks + (head + p - n_sink) % capacity."""

    def __init__(self, window: int, sinks: int):
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)):
            raise ConfigError(f"ring window must be an int, found {type(window).__name__}")
        if isinstance(sinks, bool) or not isinstance(sinks, (int, np.integer)):
            raise ConfigError(f"ring sinks must be an int, found {type(sinks).__name__}")
        if sinks < 0:
            raise ConfigError(f"ring sinks must be >= 0, found {sinks}")
        if window < sinks + 1:
            raise ConfigError(f"ring window must exceed the sink count ({sinks}) by >= 1 token "
                              f"(window counts the sinks), found window={window}")
        self.window = int(window)
        self.sinks = int(sinks)
        self.capacity = self.window - self.sinks  # ring slots after the sinks
        self.state = RingState(0, 0, 0, 0)

    @property
    def n_tokens(self) -> int:
        return self.state.n_sink + self.state.n_ring

    def slot(self, p: int) -> int:
        st = self.state
        if not 0 <= p < self.n_tokens:
            raise ConfigError(f"cache position {p} is outside 0..{self.n_tokens - 1}")
        if p < st.n_sink:
            return p
        return self.sinks + (st.head + p - st.n_sink) % self.capacity

    def runs(self, p0: int, count: int) -> list[tuple[int, int, int]]:
        """Cache positions p0..p0+count-1 as contiguous slot runs: [(offset, slot, length)], offset
        counted from p0. At most three runs (sinks, ring tail, ring start after the wrap)."""
        st = self.state
        if count < 0 or p0 < 0 or p0 + count > self.n_tokens:
            raise ConfigError(f"cache positions {p0}..{p0 + count - 1} are outside 0..{self.n_tokens - 1}")
        out = []
        off = 0
        if p0 < st.n_sink and count > 0:
            m = min(count, st.n_sink - p0)
            out.append((0, p0, m))
            off = m
        while off < count:
            i = (st.head + p0 + off - st.n_sink) % self.capacity   # ring slot of the next position
            m = min(count - off, self.capacity - i)
            if out and out[-1][1] + out[-1][2] == self.sinks + i:   # sinks run on into the ring: one run
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + m)
            else:
                out.append((off, self.sinks + i, m))
            off += m
        return out

    def slots(self, p0: int, count: int) -> np.ndarray:
        """(count,) slot index of each cache position p0..p0+count-1."""
        idx = np.empty(count, dtype=np.int64)
        for off, s, m in self.runs(p0, count):
            idx[off : off + m] = np.arange(s, s + m)
        return idx

    def reserve(self, n_new: int) -> list[tuple[int, int, int]]:
        """Append n_new positions (1..capacity); returns the slot runs [(offset, slot, length)] of
        the tokens evicted to make room, in age order. Those are exactly the slots the newest
        evicted-count new tokens take."""
        if isinstance(n_new, bool) or not isinstance(n_new, (int, np.integer)) or not 1 <= n_new <= self.capacity:
            raise ConfigError(f"a ring chunk must hold 1..{self.capacity} tokens (window {self.window} "
                              f"- {self.sinks} sinks), found {n_new!r}")
        st = self.state
        to_sink = min(self.sinks - st.n_sink, n_new)
        to_ring = n_new - to_sink
        evict = max(0, st.n_ring + to_ring - self.capacity)
        evicted = []
        if evict:
            i, off = st.head, 0
            while off < evict:
                m = min(evict - off, self.capacity - i)
                evicted.append((off, self.sinks + i, m))
                off += m
                i = 0
        self.state = RingState(st.n_sink + to_sink, (st.head + evict) % self.capacity,
                               st.n_ring - evict + to_ring, st.total + n_new)
        return evicted

    def can_truncate(self, n: int) -> bool:
        """Whether keeping cache positions 0..n-1 gives exactly what a sequence of those tokens
        would hold: always while nothing was evicted, the sinks alone, or n == n_tokens."""
        st = self.state
        if not 0 <= n <= self.n_tokens:
            return False
        return n == self.n_tokens or st.total == self.n_tokens or n <= st.n_sink

    def truncate(self, n: int) -> None:
        """Keep cache positions 0..n-1 (see can_truncate)."""
        if not self.can_truncate(n):
            raise ConfigError(self._truncate_refusal(n))
        st = self.state
        if n == self.n_tokens:
            return
        if n <= st.n_sink:
            self.state = RingState(n, 0, 0, n)
        else:
            self.state = RingState(st.n_sink, st.head, n - st.n_sink, n)

    def _truncate_refusal(self, n: int) -> str:
        if not 0 <= n <= self.n_tokens:
            return f"cannot truncate the ring to {n} tokens: it holds {self.n_tokens}"
        evicted = self.state.total - self.n_tokens
        return (f"cannot truncate the ring to {n} tokens: {evicted} tokens after the {self.state.n_sink} sinks "
                f"were evicted, so the shorter sequence's window cannot be rebuilt (truncate to <= "
                f"{self.state.n_sink}, or free and prefill again)")

    def clear(self) -> None:
        self.state = RingState(0, 0, 0, 0)


@dataclass
class _Pending:
    """A reserved, not yet committed chunk and what undoes it."""

    count: int                     # tokens reserved
    before: RingState              # bookkeeping before the reserve
    evicted: list                  # [(offset, slot, length)] runs of the evicted tokens' slots
    saved: tuple | None            # their rows of each stored array (K, V; int8: + scales)
    ids_saved: np.ndarray | None   # (evicted,) their token ids


class _PoolView:
    """The ring's arrays as a block pool's arena with one-token blocks (what attention_pool and
    the fused step read): k, v (window, layers, 1, KVH, hd)."""

    block_tokens = 1

    def __init__(self, ring: "RingKV"):
        self.n_blocks, self.n_layers, self.n_kv_heads = ring.window, ring.n_layers, ring.n_kv_heads
        shape = (ring.window, ring.n_layers, 1, ring.n_kv_heads, ring.head_dim)
        self.k, self.v = ring.k.reshape(shape), ring.v.reshape(shape)
        self.k_scale = self.v_scale = None
        if ring.k_scale is not None:   # int8: (window, layers, 1, KVH) per-row scales
            self.k_scale, self.v_scale = ring.k_scale.reshape(shape[:-1]), ring.v_scale.reshape(shape[:-1])


class RingKV:
    """One sequence's ring-buffer KV cache (see the module docstring for the protocol)."""

    slides = True   # storage positions: chunk_start(T); RoPE positions: rope_start(T); sinks shift

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, window: int, sinks: int = 4,
                 precision: str = "f32"):
        for name, val in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
                raise ConfigError(f"ring {name} must be an int >= 1, found {val!r}")
        if precision not in _DTYPES:
            raise ConfigError(f"ring KV precision must be one of {sorted(_DTYPES)}, found {precision!r}")
        self.index = RingIndex(window, sinks)
        self.n_layers, self.n_kv_heads, self.head_dim = int(n_layers), int(n_kv_heads), int(head_dim)
        self.window, self.sinks, self.precision = self.index.window, self.index.sinks, precision
        dt = _DTYPES[precision]
        shape = (self.window, self.n_layers, self.n_kv_heads, self.head_dim)
        self.k = np.zeros(shape, dtype=dt)  # (window, layers, KVH, hd) keys (rotated at write), by slot
        self.v = np.zeros(shape, dtype=dt)  # (window, layers, KVH, hd) values, by slot
        # int8: each (slot, layer, head) row is q * scale, quantized as the block pool does
        self.k_scale = np.zeros(shape[:-1], np.float32) if precision == "int8" else None
        self.v_scale = np.zeros(shape[:-1], np.float32) if precision == "int8" else None
        self._arrays = (self.k, self.v) + ((self.k_scale, self.v_scale) if precision == "int8" else ())
        self.ids = np.full(self.window, -1, dtype=np.int64)  # (window,) token id by slot, -1 unknown
        # the sinks' keys as written (rotated at their positions 0..s-1), and how far the copies
        # in the arena have been rotated on since
        self._sink_k = np.zeros((self.sinks, self.n_layers, self.n_kv_heads, self.head_dim),
                                dtype=np.float32 if precision == "int8" else dt)
        self.sinks_at = 0
        self._pending: _Pending | None = None
        self.pool = _PoolView(self)

    def release(self) -> None:
        """Drops the window's arrays and the pool view's reshapes of them (Engine.close)."""
        for holder in (self, self.pool):
            holder.k = holder.v = holder.k_scale = holder.v_scale = None

    @staticmethod
    def nbytes_for(n_layers: int, n_kv_heads: int, head_dim: int, window: int, itemsize: int = 4,
                   sinks: int = 0) -> int:
        """itemsize 1: int8, with a float32 scale per row and the sinks' keys kept in float32."""
        rows = n_layers * n_kv_heads
        if itemsize == 1:
            return 2 * window * rows * (head_dim + 4) + sinks * rows * head_dim * 4
        return (2 * window + sinks) * rows * head_dim * itemsize

    @property
    def nbytes(self) -> int:
        """K and V storage and the sinks' key copy; fixed at construction. A pending chunk adds a
        transient copy of the rows it evicted (<= chunk rows per layer) until commit or truncate."""
        return sum(a.nbytes for a in self._arrays) + self._sink_k.nbytes

    @property
    def max_chunk(self) -> int:
        return self.index.capacity

    @property
    def n_tokens(self) -> int:
        """Tokens held by committed chunks (<= window)."""
        if self._pending is not None:
            b = self._pending.before
            return b.n_sink + b.n_ring
        return self.index.n_tokens

    @property
    def total_tokens(self) -> int:
        """Tokens ever committed: the sequence's length."""
        return self._pending.before.total if self._pending is not None else self.index.state.total

    @property
    def n_reserved(self) -> int:
        """Tokens of the pending chunk (0 when none)."""
        return self._pending.count if self._pending is not None else 0

    @property
    def tokens(self) -> list[int]:
        """Ids of the held committed tokens in cache order (sinks, then oldest to newest); -1 where
        commit was given no ids. Once total_tokens > n_tokens this is not a prefix of the sequence."""
        committed = self._committed_index()  # a pending chunk's slots still hold the evicted ids
        return np.concatenate([self.ids[s : s + m] for _, s, m in committed.runs(0, committed.n_tokens)]
                              or [self.ids[:0]]).tolist()

    def _committed_index(self) -> RingIndex:
        if self._pending is None:
            return self.index
        probe = RingIndex(self.window, self.sinks)
        probe.state = self._pending.before
        return probe

    # ---- the per-sequence protocol ---------------------------------------------------------

    def reserve(self, n_new: int) -> None:
        """Make room for n_new (1..max_chunk) tokens after the held ones, evicting the oldest
        non-sink tokens; their rows are kept until commit so truncate can undo this chunk."""
        if self._pending is not None:
            raise ConfigError(f"a chunk of {self._pending.count} tokens is already reserved: "
                              f"commit or truncate it first")
        before = self.index.state
        evicted = self.index.reserve(n_new)
        saved = ids_saved = None
        if evicted:   # one or two slot runs; copies, since write will overwrite these slots
            saved = tuple(np.concatenate([a[s : s + m] for _, s, m in evicted]) for a in self._arrays)
            ids_saved = np.concatenate([self.ids[s : s + m] for _, s, m in evicted])
        self._pending = _Pending(int(n_new), before, evicted, saved, ids_saved)

    def chunk_start(self, n_new: int | None = None) -> int:
        """Cache position of the pending chunk's first token: held tokens after reserve - T."""
        p = self._need_pending("chunk_start")
        if n_new is not None and n_new != p.count:
            raise ConfigError(f"chunk_start({n_new}) but the pending chunk holds {p.count} tokens")
        return self.index.n_tokens - p.count

    def positions(self) -> range:
        """Cache positions of the pending chunk (storage positions: the chunk reads keys 0..end-1)."""
        p = self._need_pending("positions")
        end = self.index.n_tokens
        return range(end - p.count, end)

    def rope_start(self, n_new: int | None = None) -> int:
        """Absolute sequence position of the pending chunk's first token: rotate the chunk's
        queries and keys by positions rope_start..rope_start+T-1."""
        p = self._need_pending("rope_start")
        if n_new is not None and n_new != p.count:
            raise ConfigError(f"rope_start({n_new}) but the pending chunk holds {p.count} tokens")
        return p.before.total

    @property
    def sink_shift(self) -> int:
        """Positions the sinks' keys must be rotated on for attention now: the tokens evicted so
        far (the held ring tokens sit that much closer to the sinks than in the sequence)."""
        st = self.index.state
        return st.total - st.n_sink - st.n_ring

    def sink_keys(self) -> np.ndarray:
        """(sinks held, layers, KVH, hd) float32: the sinks' keys as written (rotated at their
        positions 0..s-1; int8: dequantized), the exact copy that set_sink_keys' rotations start
        from."""
        return self._sink_k[: self.index.state.n_sink].astype(np.float32)

    def set_sink_keys(self, k: np.ndarray, shift: int) -> None:
        """Put the held sinks' keys rotated on by `shift` positions (k like sink_keys()) into the
        arena; sinks_at records the shift. Committed rows other than the sinks are untouched."""
        n = self.index.state.n_sink
        if k.shape != (n, self.n_layers, self.n_kv_heads, self.head_dim):
            raise ConfigError(f"set_sink_keys expects ({n}, {self.n_layers}, {self.n_kv_heads}, {self.head_dim}) "
                              f"keys, found {tuple(k.shape)}")
        if self.k_scale is not None:
            self.k[:n], self.k_scale[:n] = quantize_int8(np.asarray(k, np.float32))
        else:
            self.k[:n] = k
        self.sinks_at = int(shift)

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """k, v (T, KVH, hd) float32, keys rotated at the tokens' absolute positions (rope_start),
        for cache positions start..start+T-1, which must lie inside the pending chunk (committed
        tokens are never overwritten)."""
        p = self._need_pending("write")
        self._check_layer(layer)
        want = (self.n_kv_heads, self.head_dim)
        if k.ndim != 3 or k.shape[1:] != want or v.shape != k.shape:
            raise ConfigError(f"ring write expects k, v of shape (T, {want[0]}, {want[1]}), "
                              f"found {tuple(k.shape)} and {tuple(v.shape)}")
        t = k.shape[0]
        end = self.index.n_tokens
        lo = end - p.count
        if t < 1 or start < lo or start + t > end:
            raise ConfigError(f"ring write of positions {start}..{start + t - 1} is outside the pending chunk "
                              f"{lo}..{end - 1}")
        if self.k_scale is not None:
            (k, ks), (v, vs) = quantize_int8(np.asarray(k, np.float32)), quantize_int8(np.asarray(v, np.float32))
        for off, s, m in self.index.runs(start, t):
            self.k[s : s + m, layer] = k[off : off + m]
            self.v[s : s + m, layer] = v[off : off + m]
            if self.k_scale is not None:
                self.k_scale[s : s + m, layer] = ks[off : off + m]
                self.v_scale[s : s + m, layer] = vs[off : off + m]

    @property
    def block_table(self) -> np.ndarray:
        """(n,) int32 slot of each cache position 0..n-1, a pending chunk included: the block
        table of `pool` (one-token blocks)."""
        return self.index.slots(0, self.index.n_tokens).astype(np.int32)

    def read(self, layer: int, n: int, out: tuple[np.ndarray, np.ndarray] | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """(KVH, n, hd) float32 K (as stored: rotated, the sinks as last set) and V of cache
        positions 0..n-1: sinks, then ring tokens oldest to newest, a pending chunk last. Into
        out's (KVH, >= n, hd) float32 buffers when given (views of them are returned), else new
        arrays."""
        self._check_layer(layer)
        runs = self.index.runs(0, n)
        if out is None:
            out = tuple(np.empty((self.n_kv_heads, n, self.head_dim), np.float32) for _ in range(2))
        kb, vb = out[0][:, :n], out[1][:, :n]
        for off, s, m in runs:
            kb[:, off : off + m] = self._values(self.k, self.k_scale, np.s_[s : s + m, layer]).transpose(1, 0, 2)
            vb[:, off : off + m] = self._values(self.v, self.v_scale, np.s_[s : s + m, layer]).transpose(1, 0, 2)
        return kb, vb

    @staticmethod
    def _values(a: np.ndarray, scale: np.ndarray | None, where) -> np.ndarray:
        """The stored rows a[where] as values (int8: q * scale, as the pool reads them)."""
        if scale is None:
            return a[where]
        return a[where].astype(np.float32) * scale[where][..., None]

    def commit(self, n_tokens: int, token_ids=()) -> None:
        """Make the pending chunk part of the sequence. n_tokens must be n_tokens + T (the count
        the engine and the other KV sequences pass); the ring then holds n_tokens + T - evicted.
        token_ids: the chunk's T ids (optional, kept for `tokens`)."""
        p = self._need_pending("commit")
        if n_tokens != self.n_tokens + p.count:
            raise ConfigError(f"commit({n_tokens}) but the ring holds {self.n_tokens} committed tokens "
                              f"and a pending chunk of {p.count}: expected {self.n_tokens + p.count}")
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if len(ids) not in (0, p.count):
            raise ConfigError(f"commit got {len(ids)} token ids for a chunk of {p.count} tokens")
        end = self.index.n_tokens
        for off, s, m in self.index.runs(end - p.count, p.count):
            self.ids[s : s + m] = ids[off : off + m] if len(ids) else -1
        # sinks written by this chunk (no token was evicted before them: their keys are exact)
        first, last = end - p.count, min(end, self.index.state.n_sink)
        if first < last:
            self._sink_k[first:last] = self._values(self.k, self.k_scale, np.s_[first:last])
        self._pending = None

    def can_truncate(self, n_tokens: int) -> bool:
        """Whether truncate(n_tokens) is exact (a pending chunk is always undone first)."""
        return self._committed_index().can_truncate(n_tokens)

    def truncate(self, n_tokens: int) -> None:
        """Undo a pending chunk (restoring the rows it evicted), then keep committed cache
        positions 0..n_tokens-1 (n_tokens counts held tokens, not the sequence: see the module
        docstring). truncate(self.n_tokens) cancels just the pending chunk. Raises ConfigError,
        changing nothing, where the result would not be exact."""
        if not self.can_truncate(n_tokens):
            raise ConfigError(self._committed_index()._truncate_refusal(n_tokens))
        p = self._pending
        if p is not None:
            if p.saved is not None:
                for off, s, m in p.evicted:
                    for a, saved in zip(self._arrays, p.saved):
                        a[s : s + m] = saved[off : off + m]
                    self.ids[s : s + m] = p.ids_saved[off : off + m]
            self.index.state = p.before
            self._pending = None
        self.index.truncate(n_tokens)

    def free(self) -> None:
        """Empty the sequence (pending chunk included). The arrays stay allocated for reuse; they
        go with the object."""
        self._pending = None
        self.index.clear()
        self.ids[:] = -1
        self.sinks_at = 0

    # ---- helpers ---------------------------------------------------------------------------

    def _need_pending(self, what: str) -> _Pending:
        if self._pending is None:
            raise ConfigError(f"ring {what} needs a reserved chunk: call reserve(T) first")
        return self._pending

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.n_layers:
            raise ConfigError(f"layer {layer} is outside 0..{self.n_layers - 1}")
