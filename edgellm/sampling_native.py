"""The sampler chain in C (neon/sample.c, el_sample): Sampler's draws where the NEON library
loads and passes its self-check, and the chain a native decode run draws with
(DecodeStep.run_tokens). sampling.draw_numpy is its twin and the path elsewhere."""
from __future__ import annotations

import ctypes
import logging

import numpy as np

from .errors import EdgeLLMError

log = logging.getLogger("edgellm.sampling")

_INT_MAX = 2**31 - 1


class NativeChain:
    """One sampling config's parameters as an el_sampling, and the scratch of its draws. A
    greedy config (temperature 0 or top-k 1) gets temperature 0: a decode run's argmax after
    the repetition penalty."""

    def __init__(self, lib, cfg):
        from .backends.neon_lib import ElSampling
        self._lib = lib
        self.greedy = cfg.greedy
        # top_k and repeat_last_n are C ints: ctypes would wrap 2**32 + 1 to 1 (greedy) without a
        # word; any value past the vocabulary or the history means the same as INT_MAX there
        self.params = ElSampling(min(cfg.top_k, _INT_MAX), cfg.top_p, cfg.min_p,
                                 0.0 if cfg.greedy else cfg.temperature, cfg.repeat_penalty,
                                 min(cfg.repeat_last_n, _INT_MAX))
        self.params_p = ctypes.addressof(self.params)
        self._scratch = np.empty(0, np.uint8)
        self._need: dict[int, int] = {}   # n_vocab -> a draw's scratch bytes

    def scratch(self, n_vocab: int, n_history: int = 0, n_max: int = 0) -> np.ndarray:
        """Scratch for draws from n_vocab logits, and for a decode run's penalty over up to
        n_history + n_max tokens (kept: a draw per token must not allocate)."""
        if n_history or n_max:    # a run: one ctypes call per run (its history grows run by run)
            need = self._lib.el_decode_sample_scratch(n_vocab, n_history, n_max)
        else:                     # a draw: asked once per vocabulary size, not per token
            need = self._need.get(n_vocab)
            if need is None:
                need = self._need[n_vocab] = self._lib.el_decode_sample_scratch(n_vocab, 0, 0)
        if self._scratch.nbytes < need:
            self._scratch = np.empty(need, np.uint8)
        return self._scratch

    def draw(self, x: np.ndarray, u: float) -> int:
        """The id drawn from float32 logits x (finite maximum: Sampler checked) with uniform u."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        s = self.scratch(x.size)
        rc = self._lib.el_sample(x.ctypes.data, x.size, self.params_p, u, s.ctypes.data, s.nbytes)
        if rc < 0:
            from .backends.neon_fused import _ERRORS
            raise EdgeLLMError(f"sampler: el_sample refused {x.size} logits with u = {u!r}: {_ERRORS.get(rc, rc)}")
        return rc


def native_chain(cfg) -> NativeChain | None:
    """A NativeChain for cfg, or None where the NEON library is unavailable (numpy draws then;
    the reason is the neon unit's own, which `edgellm plan` and the dispatcher show)."""
    from .backends import neon
    ok, why = neon.available()
    if not ok:
        log.debug("sampler: numpy chain (the NEON library is unavailable: %s)", why)
        return None
    return NativeChain(neon._lib(), cfg)
