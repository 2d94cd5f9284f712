"""The embedded Python API: load() -> Engine with generate / stream / chat / logits / tokenize."""
from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

import numpy as np
import psutil

from .backends import reference
from .engine import CancelToken, ModelRunner
from .errors import Cancelled, ConfigError, ContextFull
from .kv.contiguous import ContiguousKV
from .model.loader import ModelFile, open_model
from .model.registry import resolve_model
from .model.chat_template import ChatTemplate
from .model.tokenizer import Tokenizer
from .sampling import Sampler, SamplingConfig, StopChecker

DEFAULT_CTX = 2048


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


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    tokenize_ms: float = 0.0               # text -> ids (template included)
    prefill_ms: float = 0.0                # forward pass over the prompt
    ttft_ms: float = 0.0                   # call -> first token available (tokenize + prefill + sample)
    decode_ms: float = 0.0                 # after the first token, until the last
    decode_tps: float = 0.0                # (generated - 1) / decode time
    peak_rss_mb: float = 0.0               # process peak resident memory so far
    stop_reason: str = ""                  # eos | stop | max_tokens | context_full | cancelled

    def summary(self) -> str:
        return (f"prompt {self.prompt_tokens} tok, TTFT {self.ttft_ms:.0f} ms (tokenize {self.tokenize_ms:.1f}, "
                f"prefill {self.prefill_ms:.0f}), decode {self.generated_tokens} tok at {self.decode_tps:.1f} tok/s, "
                f"peak RSS {self.peak_rss_mb:.0f} MB, stop: {self.stop_reason}")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class Engine:
    """One loaded model. Not thread-safe: one generation at a time (the scheduler will queue)."""

    def __init__(self, model: ModelFile, tokenizer: Tokenizer, runner: ModelRunner, *, threads: int, load_ms: float):
        self.model = model
        self.config = model.config
        self.tokenizer = tokenizer
        self.template = ChatTemplate.from_metadata(model.metadata, model.path)
        self.runner = runner
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
        self.runner.reset()
        try:
            return self.runner.forward(np.asarray(token_ids, dtype=np.int64), all_logits=True).astype(np.float32)
        finally:
            self.runner.reset()

    def _generate_ids(self, ids: list[int], cfg: GenerationConfig, cancel: CancelToken | None,
                      t0: float, t_tok: float) -> Iterator[str]:
        cancel = cancel or self._cancel
        cancel.reset()
        st = GenerationStats(prompt_tokens=len(ids), tokenize_ms=(t_tok - t0) * 1e3)
        self.last_stats = st
        if not ids:
            raise ConfigError("the prompt is empty (it tokenizes to no tokens)")
        if len(ids) >= self.runner.n_ctx:
            raise ContextFull(f"the prompt has {len(ids)} tokens but the context holds {self.runner.n_ctx} "
                              f"(raise n_ctx / --ctx)")
        sampler = Sampler(cfg.sampling())
        stopper = StopChecker(cfg.stop)
        decoder = self.tokenizer.decoder()
        history = list(ids)
        self.runner.reset()
        try:
            logits = self.runner.forward(ids, cancel=cancel)
        except Cancelled:
            st.stop_reason = "cancelled"
            return
        st.prefill_ms = (time.perf_counter() - t_tok) * 1e3
        t_first = None
        while True:
            tok = sampler.sample(logits, history)
            if t_first is None:
                t_first = time.perf_counter()
                st.ttft_ms = (t_first - t0) * 1e3
            if tok in self.tokenizer.eot_ids and not cfg.ignore_eos:
                st.stop_reason = "eos"
                break
            history.append(tok)
            st.generated_tokens += 1
            hit, text = stopper.feed(decoder.push(tok))
            if text:
                yield text
            if hit:
                st.stop_reason = "stop"
                break
            if st.generated_tokens >= cfg.max_tokens:
                st.stop_reason = "max_tokens"
                break
            if cancel.cancelled:
                st.stop_reason = "cancelled"
                break
            if self.runner.n_past >= self.runner.n_ctx:
                st.stop_reason = "context_full"
                break
            logits = self.runner.forward([tok])
        if st.stop_reason != "stop":
            hit, rest = stopper.feed(decoder.flush())  # bytes of an unfinished UTF-8 character
            rest += "" if hit else stopper.flush()
            if rest:
                yield rest
        t_end = time.perf_counter()
        st.decode_ms = (t_end - t_first) * 1e3 if t_first else 0.0
        if st.generated_tokens > 1 and st.decode_ms > 0:
            st.decode_tps = (st.generated_tokens - 1) / (st.decode_ms / 1e3)
        st.peak_rss_mb = peak_rss_mb()


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


def memory_needed(model: ModelFile, n_ctx: int) -> int:
    """Bytes load() allocates: fp32 resident weights + the KV cache (the GGUF itself stays mapped)."""
    c = model.config
    return reference.prepared_nbytes(c) + ContiguousKV.nbytes_for(c.n_layers, c.n_kv_heads, n_ctx, c.head_dim)


def load(model: str | os.PathLike | None = None, device: str | None = None, *, n_ctx: int = DEFAULT_CTX,
         threads: int | None = None, prefill_chunk: int = 512,
         progress: Callable[[str, int, int], None] | None = None) -> Engine:
    """Load a model (a GGUF path, a registry name, or None for the default, pulled when missing).

    device: None or "cpu" for now; device profiles arrive with the dispatcher.
    progress(stage, done, total) is called while pulling and while preparing weights.
    """
    if device not in (None, "cpu"):
        raise ConfigError(f"device {device!r} is not known; this build runs on 'cpu' (the numpy reference backend)")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"threads must be an integer >= 1, got {threads!r}")
    t0 = time.perf_counter()
    path = resolve_model(None if model is None else os.fspath(model),
                         progress=(lambda done, total: progress("pull", done, total)) if progress else None)
    mf = open_model(path)
    n_ctx = min(int(n_ctx), mf.config.context_length)
    need = memory_needed(mf, n_ctx)
    avail = psutil.virtual_memory().available
    if need > avail:
        raise ConfigError(f"not enough memory: the model needs {need / 2**20:.0f} MiB at n_ctx={n_ctx} "
                          f"but {avail / 2**20:.0f} MiB are available; lower n_ctx or use a smaller model")
    threads = threads or default_threads()
    _limit_blas_threads(threads)
    runner = ModelRunner(mf, n_ctx, prefill_chunk,
                         progress=(lambda d, t: progress("prepare", d, t)) if progress else None)
    return Engine(mf, mf.tokenizer, runner, threads=threads, load_ms=(time.perf_counter() - t0) * 1e3)


_BLAS_LIMIT = None


def _limit_blas_threads(n: int) -> None:
    # numpy's BLAS spawns one thread per core by default; the engine's thread count is its cap.
    global _BLAS_LIMIT
    from threadpoolctl import threadpool_limits

    _BLAS_LIMIT = threadpool_limits(limits=n, user_api="blas")
