"""The forward pass over layers: chunked prefill with batched GEMMs, and single-token decode.

Model code does not ask which unit it runs on: every op goes through `self.be`, the backend the
placement chose (today only the reference backend exists; the dispatcher issue adds the plan).
"""
from __future__ import annotations

import threading

import numpy as np

from .backends import reference
from .errors import Cancelled, ConfigError
from .kv.contiguous import ContiguousKV
from .model.loader import ModelFile


class CancelToken:
    """Cancellation handle: checked between layers in prefill and between tokens in decode."""

    def __init__(self):
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def reset(self) -> None:
        self._event.clear()


class ModelRunner:
    def __init__(self, model: ModelFile, n_ctx: int, prefill_chunk: int = 512, progress=None):
        cfg = model.config
        if n_ctx < 1:
            raise ConfigError(f"n_ctx must be >= 1, got {n_ctx}")
        if prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.cfg = cfg
        self.n_ctx = n_ctx
        self.prefill_chunk = prefill_chunk
        self.be = reference
        self.w = reference.prepare(model, progress=progress)
        self.cos, self.sin = reference.rope_tables(cfg, n_ctx, self.w.rope_freqs)
        self.kv = ContiguousKV(cfg.n_layers, cfg.n_kv_heads, n_ctx, cfg.head_dim)

    @property
    def n_past(self) -> int:
        return self.kv.n_tokens

    def reset(self, keep: int = 0) -> None:
        """Forget cached positions from `keep` on (keep=0 empties the cache)."""
        self.kv.n_tokens = min(keep, self.kv.n_tokens)

    def forward(self, ids: np.ndarray | list[int], *, all_logits: bool = False,
                cancel: CancelToken | None = None) -> np.ndarray:
        """Append `ids` after the cached positions and return logits: (vocab,) for the last
        position, or (len(ids), vocab) with all_logits. On cancel the cache is rolled back to
        where it was, so the runner stays usable."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise ConfigError("forward needs a non-empty 1-D list of token ids")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            bad = int(ids[(ids < 0) | (ids >= self.cfg.vocab_size)][0])
            raise ConfigError(f"token id {bad} is outside the vocabulary (0..{self.cfg.vocab_size - 1})")
        start0 = self.kv.n_tokens
        self.kv.check_room(start0, len(ids))
        outs = []
        try:
            for c in range(0, len(ids), self.prefill_chunk):
                chunk = ids[c : c + self.prefill_chunk]
                h = self._layers(chunk, start0 + c, cancel)
                self.kv.n_tokens = start0 + c + len(chunk)
                if all_logits:
                    outs.append(self._head(h))
                elif c + self.prefill_chunk >= len(ids):
                    outs.append(self._head(h[-1:]))
        except Cancelled:
            self.kv.n_tokens = start0
            raise
        logits = np.concatenate(outs) if len(outs) > 1 else outs[0]
        return logits if all_logits else logits[0]

    def _layers(self, ids: np.ndarray, start: int, cancel: CancelToken | None) -> np.ndarray:
        cfg, be, w = self.cfg, self.be, self.w
        T = len(ids)
        cos, sin = self.cos[start : start + T], self.sin[start : start + T]
        x = be.embedding(w.embedding, ids)                                   # (T, d)
        q_end, k_end = cfg.q_dim, cfg.q_dim + cfg.kv_dim
        for li, lw in enumerate(w.layers):
            if cancel is not None and cancel.cancelled:
                raise Cancelled("cancelled during prefill")
            h = be.rmsnorm(x, lw.attn_norm, cfg.norm_eps)
            qkv = be.matmul(h, lw.wqkv, lw.bqkv)                             # (T, q_dim + 2 kv_dim)
            q = be.rope(qkv[:, :q_end].reshape(T, cfg.n_heads, cfg.head_dim), cos, sin, cfg.rope_style)
            k = be.rope(qkv[:, q_end:k_end].reshape(T, cfg.n_kv_heads, cfg.head_dim), cos, sin, cfg.rope_style)
            v = qkv[:, k_end:].reshape(T, cfg.n_kv_heads, cfg.head_dim)
            self.kv.write(li, start, k, v)
            kc, vc = self.kv.view(li, start + T)
            att = be.attention(q, kc, vc, start)                              # (T, q_dim)
            x = be.add(x, be.matmul(att, lw.wo))
            h = be.rmsnorm(x, lw.ffn_norm, cfg.norm_eps)
            x = be.add(x, be.matmul(be.swiglu(be.matmul(h, lw.w_gate_up)), lw.w_down))
        return x

    def _head(self, x: np.ndarray) -> np.ndarray:
        return self.be.lm_head(self.be.rmsnorm(x, self.w.output_norm, self.cfg.norm_eps), self.w.lm_head)
