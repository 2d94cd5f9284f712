"""The engine's KV state: a block pool with its prefix cache, or a ring buffer. It hands the
generation a sequence for a prompt (reusing what is cached) and takes it back afterwards."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..model.config import ModelConfig
from .pool import PRECISIONS, KVPool
from .prefix import PrefixCache
from .ring import RingKV


@dataclass(frozen=True)
class KVConfig:
    kind: str = "pool"          # "pool": block pool + prefix cache; "ring": sliding window + sinks
    precision: str = "f16"      # f32 | f16 | int8 (pool and ring)
    block_tokens: int = 16      # pool: tokens per block (prefix reuse is per whole block)
    window: int = 1024          # ring: capacity in tokens, sinks included
    sinks: int = 4              # ring: first tokens kept forever (attention sinks)

    def __post_init__(self):
        if self.kind not in ("pool", "ring"):
            raise ConfigError(f"kv must be 'pool' or 'ring', got {self.kind!r}")
        allowed = tuple(PRECISIONS)
        if self.precision not in allowed:
            raise ConfigError(f"kv_precision for kv={self.kind!r} must be one of {', '.join(allowed)}, "
                              f"got {self.precision!r}")
        if not 1 <= self.block_tokens <= 4096:
            raise ConfigError(f"block_tokens must be in 1..4096, got {self.block_tokens}")
        if self.kind == "ring":   # (a float or str window raised a TypeError below, or in the plan)
            for name, v in (("window", self.window), ("sinks", self.sinks)):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise ConfigError(f"ring {name} must be an int, found {v!r}")
                # a Python int: a numpy int32 window or sinks carried its fixed width into the
                # memory figures (an untyped OverflowError at load, np.int32(2) sinks included)
                object.__setattr__(self, name, int(v))
        if self.kind == "ring" and not 0 <= self.sinks < self.window:
            raise ConfigError(f"ring needs 0 <= sinks < window, got sinks={self.sinks}, window={self.window}")

    @property
    def bytes_per_elem(self) -> int:
        """Bytes one K or V element takes (int8's per-row scales are not counted)."""
        return np.dtype(PRECISIONS[self.precision]).itemsize

    @property
    def layout(self) -> str:
        if self.kind == "pool":
            return f"pool/{self.precision}/block{self.block_tokens}"
        return f"ring/{self.precision}/window{self.window}/sinks{self.sinks}"


def make_store(cfg: ModelConfig, kv: KVConfig, n_ctx: int, background_commit: bool = False):
    """background_commit: the pool's arena is committed on a thread (model/prefault.py: commit)."""
    return PoolStore(cfg, kv, n_ctx, background_commit) if kv.kind == "pool" else RingStore(cfg, kv)


_SCALE_MAX = float(np.finfo(np.float32).max) / 127   # the largest scale quantize_int8 gives


class PoolStore:
    """One pool of n_ctx tokens shared by every sequence; full blocks of finished sequences stay
    in the prefix cache (evicted LRU when a new sequence needs room). The last finished sequence
    is kept whole, so the next turn of a conversation continues without recomputing anything."""

    def __init__(self, cfg: ModelConfig, kv: KVConfig, n_ctx: int, background_commit: bool = False):
        self.kv = kv
        self.capacity = n_ctx                      # tokens one sequence may hold
        self.max_positions = n_ctx                 # RoPE positions needed
        self.pool = KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, math.ceil(n_ctx / kv.block_tokens),
                           kv.block_tokens, kv.precision, background_commit)
        self.prefix = PrefixCache(self.pool)
        self.last = None                           # the last finished sequence, kept whole

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    @property
    def commit(self):
        """The arena's commit (model/prefault.Prefault): Engine.wait_loaded waits for it."""
        return self.pool.commit

    def new_sequence(self):
        return self.pool.new_sequence()

    def open(self, ids: list[int]):
        """(sequence, positions of ids it already holds). The last conversation continues in
        place when ids extend it; otherwise the prefix cache supplies whole matching blocks."""
        last, self.last = self.last, None
        if last is not None:
            n = last.n_tokens
            if 0 < n < len(ids) and last.tokens[:n] == list(ids[:n]):
                return last, n
            last.free()
        seq = self.pool.new_sequence()
        return seq, self.prefix.lookup(seq, ids)

    def close(self, seq, keep: bool, token_ids=(), cache: bool = False) -> None:
        """keep: the conversation the next turn continues in place; else freed, its full blocks
        left in the prefix cache with cache (a cancelled answer: a chat's next turn, which
        holds the answer so far, recomputed the whole conversation: 148 tokens, 0 cached)."""
        if keep and seq.n_tokens:
            self.prefix.register(seq)
            if self.last is not None and self.last is not seq:
                self.last.free()
            self.last = seq
        else:
            if cache and seq.n_tokens:
                self.prefix.register(seq)
            seq.free()

    def clear(self) -> None:
        self.release_last()
        self.prefix.clear()

    def release(self) -> None:
        """Frees the arena now (Engine.close)."""
        self.pool.release()

    def release_last(self) -> bool:
        """Frees the kept last conversation (its full blocks stay in the prefix cache, evictable);
        True when there was one."""
        if self.last is None:
            return False
        self.last.free()
        self.last = None
        return True

    def snapshot(self) -> tuple[list[int], dict[str, np.ndarray]]:
        """The last conversation's token ids and KV, (layers, n, kv_heads, head_dim) each, as the
        pool stores it, so a restore is bit-exact: f16 stays f16, int8 stays int8 with its
        per-(token, head) scales in k_scale and v_scale, (layers, n, kv_heads) float32."""
        seq = self.last
        if seq is None or not seq.n_tokens:
            raise ConfigError("there is no conversation to save yet: generate first")
        n, layers = seq.n_tokens, range(self.pool.n_layers)
        if self.kv.precision == "int8":
            rows = [seq.read_int8(layer, n) for layer in layers]   # kq, ks, vq, vs each
            names = ("k", "k_scale", "v", "v_scale")
            return list(seq.tokens[:n]), {name: np.stack([r[i] for r in rows]) for i, name in enumerate(names)}
        store = PRECISIONS[self.kv.precision]
        ks, vs = [], []
        for layer in layers:
            k, v = seq.read(layer, n)                                  # (KVH, n, hd) f32
            ks.append(k.transpose(1, 0, 2).astype(store))
            vs.append(v.transpose(1, 0, 2).astype(store))
        return list(seq.tokens[:n]), {"k": np.stack(ks), "v": np.stack(vs)}

    def restore(self, token_ids: list[int], arrays: dict[str, np.ndarray]) -> None:
        k, v = arrays["k"], arrays["v"]
        n = len(token_ids)
        want = (self.pool.n_layers, n, self.pool.n_kv_heads, self.pool.head_dim)
        if k.shape != want or v.shape != want:
            raise ConfigError(f"session KV has shape {k.shape}, expected {want}")
        # what snapshot() writes: the storage precision's dtype, finite values. A NaN K loaded, and
        # the next prompt failed blaming the model's weights; int32 arrays overflowed in the pool.
        # An int8 pool also takes the float32 KV that edgellm wrote for it before it kept int8.
        native = self.kv.precision == "int8" and k.dtype == np.int8
        store = np.dtype(np.int8 if native else np.float32 if self.kv.precision == "int8"
                         else PRECISIONS[self.kv.precision])
        for name, a in (("k", k), ("v", v)):
            if a.dtype != store:
                raise ConfigError(f"session KV {name} is {a.dtype}, expected {store}")
            if native and (a == -128).any():      # (quantize_int8 keeps |q| <= 127)
                raise ConfigError(f"session KV {name} holds -128, which int8 KV never stores")
            if not native and not np.isfinite(a).all():
                raise ConfigError(f"session KV {name} holds non-finite values")
        if native:
            scales = [arrays.get(name) for name in ("k_scale", "v_scale")]
            for name, a in zip(("k_scale", "v_scale"), scales):
                if a is None or a.dtype != np.float32 or a.shape != want[:3]:
                    got = "none" if a is None else f"{a.dtype} {a.shape}"
                    raise ConfigError(f"session KV {name}: expected float32 {want[:3]}, found {got}")
                # (a scale is max |x| / 127 of a finite row: >= 0, and q * scale stays finite; a
                # larger one loaded, and every prompt on the session failed with NaN logits)
                if not ((a >= 0) & (a <= _SCALE_MAX)).all():
                    raise ConfigError(f"session KV {name} holds a scale no int8 KV row has (negative, "
                                      f"non-finite or over {_SCALE_MAX:.3g})")
        # the prefix cache stays: prompts an app warmed keep their blocks, evicted (least recently
        # used first) only as far as the session needs the room (it emptied the cache before)
        self.release_last()
        seq = self.pool.new_sequence()
        try:
            seq.reserve(n)      # ContextFull when live requests hold the room
            for layer in range(self.pool.n_layers):
                if native:
                    seq.write_int8(layer, 0, k[layer], scales[0][layer], v[layer], scales[1][layer])
                else:
                    seq.write(layer, 0, k[layer].astype(np.float32), v[layer].astype(np.float32))
        except BaseException:
            seq.free()
            raise
        seq.commit(n, token_ids)
        self.close(seq, keep=True)


class RingStore:
    """One ring buffer holding the conversation: each turn appends only what the ring has not
    seen, so a chat runs on in constant memory. Prompts longer than the window slide through."""

    commit = None      # the ring's arrays are np.zeros, committed page by page as the ring fills

    def __init__(self, cfg: ModelConfig, kv: KVConfig):
        self.kv = kv
        self.capacity = sys.maxsize                # the ring never fills: it slides
        self.max_positions = kv.window             # RoPE rows tabled; later positions are computed
        self.ring = RingKV(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, kv.window, kv.sinks, kv.precision)
        # every token id the ring has taken, in order: int32, 4 bytes a token (a list of Python
        # ints took ~35, and a chat's history grows without bound while the ring stays flat)
        self.history = np.zeros(0, np.int32)
        self.ring_open = False                     # a request holds self.ring (opened, not closed)
        self._forget = False                       # clear() while held: forget the ring at close
        self._cfg = cfg

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes

    def new_sequence(self):
        return RingKV(self._cfg.n_layers, self._cfg.n_kv_heads, self._cfg.head_dim, self.kv.window,
                      self.kv.sinks, self.kv.precision)

    def open(self, ids: list[int]):
        """(sequence, positions of ids it already holds): the conversation's ring, continued when
        ids extend its history; while another request holds it (the scheduler interleaves
        requests), a ring of its own, which close() frees (freeing the held one would corrupt
        the other request's cache)."""
        if self.ring_open:
            return self.new_sequence(), 0
        self.ring_open = True
        n = len(self.history)
        if 0 < n < len(ids) and np.array_equal(self.history, np.asarray(ids[:n], dtype=np.int64)):
            return self.ring, n
        # a prompt that shares only a prefix with the history (a warmed system prompt whose last
        # pre-token the message extends, an edited last turn): the ring keeps that prefix where
        # it still holds it exactly (nothing evicted), instead of starting over
        m = min(n, len(ids) - 1)
        same = self.history[:m] == np.asarray(ids[:m], dtype=np.int64)
        c = m if same.all() else int(np.argmin(same))      # the first position that differs
        if c and self.ring.n_tokens == n and self.ring.can_truncate(c):
            self.ring.truncate(c)
            self.history = self.history[:c]
            return self.ring, c
        self.ring.free()
        self.history = self.history[:0]
        return self.ring, 0

    def close(self, seq, keep: bool, token_ids=(), cache: bool = False) -> None:
        """token_ids: the prompt and generated ids of the finished request; the ring took the
        first total_tokens of them (the last sampled token is never fed back)."""
        if seq is not self.ring:
            seq.free()
            return
        self.ring_open = False
        # cache (a cancelled answer): the ring holds exactly the tokens it committed (a pending
        # chunk was undone), so the next turn continues it; freeing it made that turn recompute
        # the whole conversation through the window (1.5 s after 800 tokens, growing with the chat)
        keep, self._forget = (keep or cache) and not self._forget, False
        self.history = np.asarray(token_ids[: seq.total_tokens] if keep else [], dtype=np.int32)
        if not keep:
            seq.free()

    def release_last(self) -> bool:
        return False   # (a second sequence is a ring of its own: it takes no room from this one)

    def clear(self) -> None:
        """Forget the conversation. While a request holds the ring it finishes on its KV, and the
        ring is forgotten when it closes (freeing it under the request corrupted its answer)."""
        if self.ring_open:
            self._forget = True
            return
        self.ring.free()
        self.history = self.history[:0]

    def release(self) -> None:
        """Frees the window now (Engine.close)."""
        self.ring.release()

    def snapshot(self):
        raise ConfigError("sessions are saved from the block pool (kv='pool'); the ring buffer has none yet")

    restore = snapshot
