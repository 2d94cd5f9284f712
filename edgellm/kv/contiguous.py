"""A preallocated, contiguous KV cache: one slab per K and V for the whole context.

The block pool (kv/pool.py) will replace it for shared prefixes; this is the simple form the
reference engine starts with. Positions 0..n_tokens-1 are valid; nothing past capacity is
ever written.
"""
from __future__ import annotations

import numpy as np

from ..errors import ContextFull


class ContiguousKV:
    def __init__(self, n_layers: int, n_kv_heads: int, capacity: int, head_dim: int, dtype=np.float32):
        self.capacity = capacity
        self.k = np.zeros((n_layers, n_kv_heads, capacity, head_dim), dtype=dtype)  # (layers, KVH, ctx, hd)
        self.v = np.zeros((n_layers, n_kv_heads, capacity, head_dim), dtype=dtype)  # (layers, KVH, ctx, hd)
        self.n_tokens = 0  # positions committed by finished forward passes
        self.tokens: list[int] = []
        self._reserved = 0

    rotate_on_read = False

    def reserve(self, n_new: int) -> None:
        self.check_room(self.n_tokens, n_new)
        self._reserved = n_new

    def commit(self, n_tokens: int, token_ids=()) -> None:
        self.tokens.extend(int(t) for t in token_ids)
        self.n_tokens = n_tokens

    def truncate(self, n_tokens: int) -> None:
        self.n_tokens = min(n_tokens, self.n_tokens)
        del self.tokens[self.n_tokens :]

    def free(self) -> None:
        self.truncate(0)

    def read(self, layer: int, n: int):
        return self.view(layer, n)

    @staticmethod
    def nbytes_for(n_layers: int, n_kv_heads: int, capacity: int, head_dim: int, itemsize: int = 4) -> int:
        return 2 * n_layers * n_kv_heads * capacity * head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def check_room(self, start: int, count: int) -> None:
        if start + count > self.capacity:
            raise ContextFull(f"{start + count} tokens needed but the KV cache holds {self.capacity} "
                              f"(raise n_ctx / --ctx)")

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """k, v (T, KVH, hd) for positions start..start+T-1."""
        t = k.shape[0]
        self.check_room(start, t)
        self.k[layer, :, start : start + t] = k.transpose(1, 0, 2)
        self.v[layer, :, start : start + t] = v.transpose(1, 0, 2)

    def view(self, layer: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(KVH, n, hd) views of positions 0..n-1."""
        return self.k[layer, :, :n], self.v[layer, :, :n]
