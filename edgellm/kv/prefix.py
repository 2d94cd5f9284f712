"""Prefix cache: full KV blocks keyed by a hash chained over the tokens before them, so a new
request reuses every full block of its prompt that an earlier sequence already computed.

Key of block i of a sequence: h_i = blake2b(h_{i-1} || int32-LE ids of the block's tokens),
h_{-1} = blake2b("edgellm-prefix-v1" || salt). A block's KV depends on every earlier token, so
the key covers the whole prefix, not only the block's own ids. blake2b (not Python's hash(),
which is salted per process) keeps keys stable across processes for on-disk caches.

Only full blocks are cached, and a cached block is immutable (the pool copies it before any
write). The cache holds no reference: a cached block that no sequence holds stays resident
until an allocation needs it, and the pool then evicts the least recently used one and tells
the cache (`_evicted`). See kv/pool.py for the policy.

Use, per request (match and attach with no pool allocation in between; `lookup` does both):

    n = cache.lookup(seq, prompt_ids)        # seq holds the cached prefix; compute ids[n:]
    ... forward pass over prompt_ids[n:] ...
    cache.register(seq)                      # offer its full blocks to later requests
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import ConfigError
from ..hashing import blake2b
from .pool import KVInvariantError, KVPool, PoolSequence

_DIGEST = 16  # bytes: 128-bit keys, collisions out of reach for any realistic cache


@dataclass(frozen=True)
class PrefixStats:
    lookups: int        # match() calls
    hits: int           # lookups that reused at least one block
    misses: int         # lookups that reused nothing
    hit_tokens: int     # positions reused over all lookups
    cached_blocks: int  # blocks in the index now (held or not)
    evictions: int      # cached blocks the pool reclaimed for allocations


def _ids_array(token_ids: Sequence[int]) -> np.ndarray:
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError(f"token ids must be a flat list, got shape {ids.shape}")
    if len(ids) and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must be in 0..2**31-1")
    return ids.astype("<i4")


class PrefixCache:
    def __init__(self, pool: KVPool, salt: bytes = b""):
        """salt separates key spaces (e.g. a model hash for a cache persisted to disk)."""
        if pool._on_evict is not None:
            raise ConfigError("this KV pool already has a prefix cache")
        self.pool = pool
        self._root = blake2b(b"edgellm-prefix-v1" + salt, digest_size=_DIGEST).digest()
        self._index: dict[bytes, int] = {}         # chained hash -> block
        self._key_of: dict[int, bytes] = {}        # block -> its chained hash
        self._ids_of: dict[int, np.ndarray] = {}   # block -> its token ids (int32, block_tokens)
        self._lookups = self._hits = self._hit_tokens = self._evictions = 0
        pool.set_evict_hook(self._evicted)

    def _chain(self, parent: bytes, block_ids: np.ndarray) -> bytes:
        return blake2b(parent + block_ids.tobytes(), digest_size=_DIGEST).digest()

    def match(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """The longest chain of cached full blocks that prefixes token_ids, capped so that at
        least one token is left to compute (its logits are the reason for the request):
        (blocks, n_tokens) with n_tokens = len(blocks) * block_tokens < len(token_ids)."""
        ids = _ids_array(token_ids)
        bt = self.pool.block_tokens
        blocks: list[int] = []
        h = self._root
        for i in range(max(0, len(ids) - 1) // bt):
            h = self._chain(h, ids[i * bt : (i + 1) * bt])
            b = self._index.get(h)
            if b is None:
                break
            blocks.append(b)
        self._lookups += 1
        if blocks:
            self._hits += 1
            self._hit_tokens += len(blocks) * bt
        return blocks, len(blocks) * bt

    def attach(self, seq: PoolSequence, blocks: list[int], n_tokens: int) -> None:
        """Start the empty `seq` on the blocks match() returned (refcount +1 each; they leave
        the LRU list until the last holder lets them go, which makes them most recently used)."""
        bt = self.pool.block_tokens
        if n_tokens != len(blocks) * bt:
            raise KVInvariantError(f"attach of {n_tokens} tokens with {len(blocks)} blocks of {bt}")
        h = self._root
        for b in blocks:  # still cached, and a chain from the root (no allocation since match)
            ids = self._ids_of.get(b)
            if ids is None:
                raise KVInvariantError(f"block {b} is not cached (evicted since match?)")
            h = self._chain(h, ids)
            if self._key_of[b] != h:
                raise KVInvariantError(f"block {b} does not continue the matched chain")
        token_ids = np.concatenate([self._ids_of[b] for b in blocks]).tolist() if blocks else []
        seq.adopt(blocks, token_ids)

    def lookup(self, seq: PoolSequence, token_ids: Sequence[int]) -> int:
        """match + attach in one step; returns the number of positions `seq` now holds."""
        blocks, n = self.match(token_ids)
        self.attach(seq, blocks, n)
        return n

    def register(self, seq: PoolSequence) -> int:
        """Index every full committed block of `seq` under its chained hash; returns how many
        blocks were newly cached. A key already cached under another block keeps that block."""
        bt = self.pool.block_tokens
        ids = _ids_array(seq.tokens[: seq.n_tokens])
        h, added = self._root, 0
        for i in range(seq.n_tokens // bt):
            block_ids = ids[i * bt : (i + 1) * bt]
            h = self._chain(h, block_ids)
            b = seq.block_table[i]
            have = self._index.get(h)
            if have is not None:
                continue  # this block, or an equal one another sequence computed
            if b in self._key_of:
                # a cached block is immutable and sits at one place in one chain
                raise KVInvariantError(f"block {b} is cached under another prefix")
            self._index[h] = b
            self._key_of[b] = h
            self._ids_of[b] = block_ids.copy()
            self.pool.retain(b)
            added += 1
        return added

    def _evicted(self, b: int) -> None:
        h = self._key_of.pop(b)
        del self._index[h]
        del self._ids_of[b]
        self._evictions += 1

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def stats(self) -> PrefixStats:
        return PrefixStats(lookups=self._lookups, hits=self._hits, misses=self._lookups - self._hits,
                           hit_tokens=self._hit_tokens, cached_blocks=len(self._index),
                           evictions=self._evictions)

    def clear(self) -> None:
        """Forget every cached block; unreferenced ones return to the pool's free list."""
        for b in list(self._key_of):
            self.pool.unretain(b)
        self._index.clear()
        self._key_of.clear()
        self._ids_of.clear()

    def check(self) -> None:
        """Index and pool agree (tests, debugging)."""
        if set(self._key_of) != self.pool._cached:
            raise KVInvariantError("the cache index and the pool's cached set differ")
        if len(self._index) != len(self._key_of) or any(self._index[h] != b for b, h in self._key_of.items()):
            raise KVInvariantError("the hash index and the block -> hash map differ")
