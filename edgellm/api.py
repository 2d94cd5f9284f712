"""The embedded Python API: load() -> Engine with generate / stream / chat / logits / tokenize."""
from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

import numpy as np
import psutil

from .backends import reference
from .engine import CancelToken, ModelRunner
from .generation import Generation, GenerationStats  # noqa: F401 (GenerationStats: part of the API)
from .errors import ConfigError
from .kv.pool import KVPool
from .kv.ring import RingKV
from .kv.session_file import read_session, write_session
from .kv.store import KVConfig, make_store
from .model.loader import ModelFile, open_model
from .model.registry import resolve_model
from .model.chat_template import ChatTemplate
from .sampling import SamplingConfig

DEFAULT_CTX = 2048
log = logging.getLogger("edgellm")


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = 256                  # tokens to generate at most
    temperature: float = 0.8               # 0 = greedy
    top_k: int = 40                        # 0 = off
    top_p: float = 0.95                    # 1 = off
    min_p: float = 0.05                    # 0 = off
    repeat_penalty: float = 1.0            # 1 = off
    seed: int | None = None                # None = fresh entropy each call
    stop: tuple[str, ...] = ()             # stop strings; never emitted
    ignore_eos: bool = False               # keep going past end-of-generation tokens (bench)

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              min_p=self.min_p, repeat_penalty=self.repeat_penalty, seed=self.seed)


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class Engine:
    """One loaded model. Not thread-safe: one generation at a time; several requests from an
    app's threads go through edgellm.scheduler.Scheduler, which owns the engine while it runs."""

    def __init__(self, model: ModelFile, runner: ModelRunner, kv, *, threads: int,
                 load_ms: float):
        self.model = model
        self.config = model.config
        self.tokenizer = model.tokenizer
        self.template = ChatTemplate.from_metadata(model.metadata, model.path)
        self.runner = runner
        self.kv = kv
        self.n_ctx = kv.capacity                   # tokens one conversation may hold
        self._model_sha: str | None = None
        self.session_meta: dict = {}               # meta of the last session loaded
        self.threads = threads
        self.load_ms = load_ms
        self.last_stats = GenerationStats()
        self._cancel = CancelToken()

    # -- text <-> ids --------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def render_chat(self, messages: Sequence[dict]) -> str:
        return self.template.render(messages)

    # -- generation ----------------------------------------------------------------------------
    def cancel(self) -> None:
        """Cancel the generation in progress (from another thread or a signal handler)."""
        self._cancel.cancel()

    def stream(self, prompt: str, *, config: GenerationConfig | None = None, cancel: CancelToken | None = None,
               **kwargs) -> Iterator[str]:
        """Yield text pieces as they are produced. Keywords mirror the CLI flags (max_tokens,
        temperature, top_k, top_p, min_p, repeat_penalty, seed, stop). Options are validated
        here, before the first piece is asked for."""
        return self._stream(lambda: prompt, time.perf_counter(), generation_config(config, **kwargs), cancel)

    def generate(self, prompt: str, **kwargs) -> str:
        return "".join(self.stream(prompt, **kwargs))

    def chat_stream(self, messages: Sequence[dict], *, config: GenerationConfig | None = None,
                    cancel: CancelToken | None = None, **kwargs) -> Iterator[str]:
        """messages: [{"role": "system"|"user"|"assistant", "content": str}, ...]. The template is
        rendered inside the TTFT clock, as part of tokenization."""
        t0 = time.perf_counter()
        cfg = generation_config(config, **kwargs)
        self.template.check_messages(messages)
        return self._stream(lambda: self.render_chat(messages), t0, cfg, cancel)

    def _stream(self, text_fn, t0: float, cfg: GenerationConfig, cancel: CancelToken | None) -> Iterator[str]:
        ids = self.tokenize(text_fn())
        yield from self._generate_ids(ids, cfg, cancel, t0, time.perf_counter())

    def chat(self, messages: Sequence[dict], **kwargs) -> str:
        return "".join(self.chat_stream(messages, **kwargs))

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced next-token logits, (len(token_ids), vocab) float32, from an empty cache."""
        seq = self._new_sequence()
        try:
            return self.runner.forward(seq, np.asarray(token_ids, dtype=np.int64), all_logits=True).astype(np.float32)
        finally:
            seq.free()

    def _new_sequence(self):
        return self.kv.new_sequence()

    def _open_sequence(self, ids: list[int]):
        """A KV sequence for a prompt, and how many of its leading tokens already hold KV."""
        return self.kv.open(ids)

    def _close_sequence(self, seq, keep: bool, token_ids=()) -> None:
        self.kv.close(seq, keep, token_ids)

    # -- caches and sessions -------------------------------------------------------------------
    def warm(self, text: str) -> int:
        """Precompute the KV of `text` (a system prompt, say) into the prefix cache, so a later
        prompt that starts with it computes only the rest. Returns the tokens now cached."""
        ids = self.tokenize(text)
        if not ids:
            raise ConfigError("warm needs a non-empty text")
        seq, n = self.kv.open(ids)
        if n < len(ids):
            self.runner.forward(seq, ids[n:])
        self.kv.close(seq, keep=True, token_ids=ids)
        return seq.n_tokens

    def clear_cache(self) -> None:
        """Forget every cached prefix and the last conversation."""
        self.kv.clear()

    def model_sha256(self) -> str:
        if self._model_sha is None:
            h = hashlib.sha256()
            with open(self.model.path, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
            self._model_sha = h.hexdigest()
        return self._model_sha

    def _session_keys(self) -> dict:
        cfg_hash = hashlib.sha256(repr((self.config, self.kv.kv.layout)).encode()).hexdigest()[:32]
        return dict(model_sha256=self.model_sha256(), config_hash=cfg_hash, kv_layout=self.kv.kv.layout)

    def save_session(self, path: str | os.PathLike, meta: dict | None = None) -> int:
        """Write the last conversation (token ids and KV) atomically; returns its token count.
        `meta` (JSON-able, e.g. the chat messages) comes back as session_meta on load."""
        tokens, arrays = self.kv.snapshot()
        meta = {**(meta or {}), "model_name": self.config.name, "n_tokens": len(tokens)}
        try:
            write_session(path, token_ids=tokens, arrays=arrays, meta=meta, **self._session_keys())
        except (OSError, TypeError, ValueError) as e:
            raise ConfigError(f"{path}: cannot save the session: {e}") from None
        return len(tokens)

    def load_session(self, path: str | os.PathLike) -> bool:
        """Restore a saved conversation; the next prompt that extends it continues in place. A
        missing, stale or corrupt file is a cache miss (False, one warning line), never an error."""
        data = read_session(path, max_tokens=self.n_ctx - 1, **self._session_keys())
        if data is None:
            return False
        ids = data.token_ids.tolist()
        if max(ids, default=0) >= self.config.vocab_size:
            log.warning("session cache miss: %s: token id outside the vocabulary", path)
            return False
        try:
            self.kv.restore(ids, data.arrays)
        except (ConfigError, KeyError) as e:
            log.warning("session cache miss: %s: %s", path, e)
            return False
        self.session_meta = dict(data.meta)
        return True

    def _generate_ids(self, ids: list[int], cfg: GenerationConfig, cancel: CancelToken | None,
                      t0: float, t_tok: float) -> Iterator[str]:
        cancel = cancel or self._cancel
        cancel.reset()
        gen = Generation(self, ids, cfg, cancel, t0, t_tok)
        self.last_stats = gen.stats
        while not gen.done:
            piece = gen.step()
            if piece:
                yield piece


def generation_config(config: GenerationConfig | None = None, **kwargs) -> GenerationConfig:
    """`config` with keyword overrides, validated (ConfigError naming the bad option)."""
    cfg = config or GenerationConfig()
    unknown = set(kwargs) - set(GenerationConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
    if "stop" in kwargs:
        s = kwargs["stop"]
        kwargs["stop"] = (s,) if isinstance(s, str) else tuple(s or ())
    cfg = replace(cfg, **kwargs)
    if not isinstance(cfg.max_tokens, int) or cfg.max_tokens < 1:
        raise ConfigError(f"max_tokens must be an integer >= 1, got {cfg.max_tokens!r}")
    cfg.sampling()  # validates the sampling parameters with named errors
    return cfg


def memory_needed(model: ModelFile, n_ctx: int, kv: KVConfig | None = None) -> int:
    """Bytes load() allocates: fp32 resident weights + the KV cache (the GGUF itself stays mapped)."""
    c, kv = model.config, kv or KVConfig()
    if kv.kind == "ring":
        kv_bytes = RingKV.nbytes_for(c.n_layers, c.n_kv_heads, c.head_dim, kv.window,
                                     2 if kv.precision == "f16" else 4)
    else:
        kv_bytes = KVPool.nbytes_for(c.n_layers, c.n_kv_heads, c.head_dim, math.ceil(n_ctx / kv.block_tokens),
                                     kv.block_tokens, kv.precision)
    return reference.prepared_nbytes(c) + kv_bytes


def load(model: str | os.PathLike | None = None, device: str | None = None, *, n_ctx: int = DEFAULT_CTX,
         threads: int | None = None, prefill_chunk: int = 512, kv: str = "pool", kv_precision: str = "f16",
         window: int = 1024, sinks: int = 4, progress: Callable[[str, int, int], None] | None = None) -> Engine:
    """Load a model (a GGUF path, a registry name, or None for the default, pulled when missing).

    device: None or "cpu" for now; device profiles arrive with the dispatcher.
    kv: "pool" (block pool of n_ctx tokens with a prefix cache) or "ring" (a sliding window of
    `window` tokens keeping the first `sinks`, for chats of any length in constant memory).
    kv_precision: "f16" (default), "f32", or "int8" (pool only).
    progress(stage, done, total) is called while pulling and while preparing weights.
    """
    kv_cfg = KVConfig(kind=kv, precision=kv_precision, window=window, sinks=sinks)
    if device not in (None, "cpu"):
        raise ConfigError(f"device {device!r} is not known; this build runs on 'cpu' (the numpy reference backend)")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"threads must be an integer >= 1, got {threads!r}")
    t0 = time.perf_counter()
    path = resolve_model(None if model is None else os.fspath(model),
                         progress=(lambda done, total: progress("pull", done, total)) if progress else None)
    mf = open_model(path)
    n_ctx = min(int(n_ctx), mf.config.context_length)
    need = memory_needed(mf, n_ctx, kv_cfg)
    avail = psutil.virtual_memory().available
    if need > avail:
        raise ConfigError(f"not enough memory: the model needs {need / 2**20:.0f} MiB at n_ctx={n_ctx} "
                          f"but {avail / 2**20:.0f} MiB are available; lower n_ctx or use a smaller model")
    threads = threads or default_threads()
    _limit_blas_threads(threads)
    store = make_store(mf.config, kv_cfg, n_ctx)
    runner = ModelRunner(mf, store.max_positions, prefill_chunk,
                         progress=(lambda d, t: progress("prepare", d, t)) if progress else None)
    return Engine(mf, runner, store, threads=threads, load_ms=(time.perf_counter() - t0) * 1e3)


_BLAS_LIMIT = None


def _limit_blas_threads(n: int) -> None:
    # numpy's BLAS spawns one thread per core by default; the engine's thread count is its cap.
    global _BLAS_LIMIT
    from threadpoolctl import threadpool_limits

    _BLAS_LIMIT = threadpool_limits(limits=n, user_api="blas")
