"""The embedded Python API: load() -> Engine with generate / stream / chat / logits / tokenize."""
from __future__ import annotations

import contextlib
import errno
import gc
import logging
import math
import numbers
import os
import threading
import time
import weakref
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

import numpy as np

from . import backends, interrupts
from .backends import opencl_child, reference
from .dispatch import Dispatcher
from .ops import weight_formats
from .engine import CancelToken, ModelRunner
from .hashing import file_sha256, sha256
from .heap import release_free_pages
from .procmem import available_bytes, resident_mb
from .generation import Generation, GenerationStats, peak_rss_mb  # noqa: F401 (GenerationStats: part of the API)
from .errors import ConfigError, ContextFull, shown
from .kv.pool import KVPool
from .kv.ring import RingKV
from .kv.session_file import MAX_HEADER_BYTES, foreign_file, read_session, write_session
from .kv.store import KVConfig, make_store
from .model.gguf_file import file_memmap
from .model.chat_plain import RenderedChat, render_plain
from .model.loader import ModelFile, open_model
from .model.prefault import enabled_by_env
from .model.prefault import start as start_prefault
from .model.registry import resolve_model
from .model.chat_template import ChatTemplate
from .model.tokenizer import check_token_ids, check_unicode
from .quality_guard import QualityGuard
from .sampling import SamplingConfig, StopChecker

DEFAULT_CTX = 2048
MAX_THREADS = 256   # the native pool's bound (neon/threadpool.c EL_POOL_MAX_THREADS)
log = logging.getLogger("edgellm")


@dataclass(frozen=True)
class GenerationConfig:
    """How one generation samples and stops: the CLI's sampling flags, with the same defaults.
    generate(), stream() and chat() take these as keywords (or config=GenerationConfig(...));
    each value is checked before any work, a bad one a ConfigError naming it. ignore_eos keeps
    generating past the model's end-of-generation tokens up to max_tokens (what `bench` uses
    for runs of a fixed length)."""
    max_tokens: int = 256                  # tokens to generate at most
    temperature: float = 0.8               # 0 = greedy
    top_k: int = 40                        # 0 = off
    top_p: float = 0.95                    # 1 = off, 0 = the most probable token
    min_p: float = 0.05                    # 0 = off
    repeat_penalty: float = 1.0            # 1 = off
    seed: int | None = None                # None = fresh entropy each call
    stop: tuple[str, ...] = ()             # stop strings; never emitted
    ignore_eos: bool = False               # keep going past end-of-generation tokens (bench)

    def sampling(self) -> SamplingConfig:
        """The sampler's part of this config (sampling.SamplingConfig)."""
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              min_p=self.min_p, repeat_penalty=self.repeat_penalty, seed=self.seed)


class Engine:
    """One loaded model. Its calls may come from several threads: generations take turns a step
    (a prefill chunk, a decode run) at a time under `lock`, each giving the text it gives alone
    while the KV pool holds them all: they share its n_ctx tokens, and one that finds it full
    ends early with last_stats.stop_reason "context_full", as a generation alone does at n_ctx.
    For priorities, and short requests overtaking a long prefill, submit them to
    edgellm.scheduler.Scheduler instead, whose worker takes the same turns."""

    def __init__(self, model: ModelFile, runner: ModelRunner, kv, *, threads: int,
                 load_ms: float):
        self.model = model
        self.config = model.config
        self.tokenizer = model.tokenizer
        self._template: ChatTemplate | None = None   # compiled on first use: see the template property
        self.runner = runner
        self.kv = kv
        self.n_ctx = kv.capacity                   # tokens one conversation may hold
        self._model_sha: str | None = None
        self.session_meta: dict = {}               # meta of the last session loaded
        self.threads = threads
        self.load_ms = load_ms
        self.load_rss_mb = 0.0      # process peak RSS (MB) once loaded: at load()'s return, raised by
                                    # wait_loaded() to the end of the weights' background paging-in
        self.prefault = None        # model.prefault.Prefault: the weights' background paging-in, or None
                                    # (the KV pool's background commit is self.kv.commit)
        self.rss_after_load_mb = 0.0  # resident memory (MB) once loaded: at load()'s return, taken again
                                      # by wait_loaded() once the background paging-in ended (not a peak:
                                      # an NPU load's passing requantization peak was reported as it)
        self._load_rss_final = False
        self._stats_latest = GenerationStats()     # the last generation started, any thread's
        self._stats_mine = threading.local()      # the last one this thread started
        # the tokens of the engine's own requests still running (id -> weakref): engine.cancel()
        # cancels them all. One shared token, reset by each new request, lost a cancel aimed at
        # another thread's generation when a request started before that one's next step
        self._own_cancels: dict = {}
        self.plan = None        # the dispatcher's Plan (set by load): units, placement, chunk, reasons
        self.dispatcher = None  # the Dispatcher that made it (bench asks it for predictions)
        self.profile = None     # the DeviceProfile it planned with
        self.pinning = None     # device.topology.PinResult of the compute threads
        self.precision_plan = None  # the PrecisionPlan loaded (None: each unit's own precision)
        self.quality_guard = None   # a QualityGuard, or None (off)
        # Held (through turn()) while anything uses the runner's buffers or the KV store: a native
        # step's scratch, chunk and logits buffers are the engine's, not a generation's.
        self.lock = threading.RLock()
        self._turn_depth = threading.local()   # .n: this thread's nesting of turn()
        _engines.add(self)
        self._orphans: list = []                # generations dropped inside a turn: ended at the next
        self._closed = False
        self._close_pending = False             # close() asked from inside a step: done at its end

    def close(self) -> None:
        """Frees the engine's memory now (the KV cache, the prepared weights and native pools,
        the model's mapping) rather than when the last reference goes: an app that keeps the
        object (UI state, a registry) while it switches models. Waits for a step in progress;
        any call that needs the model afterwards raises ConfigError. Also `with load(...) as e:`."""
        if getattr(self._turn_depth, "n", 0):
            # this thread is inside a step (a signal handler, a callback): the lock would let it
            # in mid-step, so the close waits for the step's turn to end
            self._close_pending = True
            return
        with self.lock:          # (a step in progress ends first)
            if self._closed:
                return
            self.wait_loaded()   # (the background paging-in and KV commit must not outlive them)
            self._closed = True
            self.kv.release()    # (a Scheduler's or a stream's last request still held the store)
            self.runner = self.kv = self.model = self.prefault = None
            self._template, self._orphans = None, []
        gc.collect()             # (reference cycles hold the arrays until a collection runs)
        # glibc keeps freed heap pages mapped: an NPU engine's onnxruntime sessions left ~1.0-1.4
        # GiB resident after close (94 MiB once trimmed); the OpenCL unit's 258 MiB (142)
        release_free_pages()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("the engine is closed (Engine.close()): load the model again to use it")

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Waits for load()'s background work (paging the mapped weights in, committing the KV
        pool's memory); True once done. Called before any request, it makes load_rss_mb the
        resident memory of the loaded model."""
        if timeout is not None and not (isinstance(timeout, numbers.Real) and not isinstance(timeout, bool)
                                        and 0 <= timeout <= 1e9):   # (10**400 overflowed the deadline's float)
            raise ConfigError(f"wait_loaded: timeout must be None or a number of seconds in 0..1e9, got "
                              f"{shown(timeout)}")
        if self._closed:
            return True
        jobs = [j for j in (self.prefault, self.kv.commit) if j is not None]
        t_end = None if timeout is None else time.perf_counter() + timeout
        done = all(j.wait(None if t_end is None else max(0.0, t_end - time.perf_counter())) for j in jobs)
        if done and not self._load_rss_final:
            self.load_rss_mb = max(self.load_rss_mb, peak_rss_mb())
            self.rss_after_load_mb = resident_mb()
            self._load_rss_final = True
        return done

    # -- turns ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def turn(self):
        """Holds the engine for one unit of work (a generation step, warm, a session's load):
        other threads' work waits. A thread's own nested turns pass."""
        # a Ctrl-C waits for the turn's end (or a checkpoint between prefill chunks): raised
        # inside the KV accounting it lost blocks for good or broke every later call
        with self.lock, interrupts.deferred():
            self._check_open()
            depth = getattr(self._turn_depth, "n", 0)
            self._turn_depth.n = depth + 1
            try:
                while depth == 0 and self._orphans:
                    self._orphans.pop()._end("cancelled")
                yield
            finally:
                self._turn_depth.n = depth
                # and at its end: a stream the collector dropped during this turn's step held its
                # KV until some later call took a turn (an idle engine kept it)
                while depth == 0 and self._orphans:
                    self._orphans.pop()._end("cancelled")
        if self._close_pending and not getattr(self._turn_depth, "n", 0):
            self._close_pending = False
            self.close()

    def end_generation(self, gen) -> str:
        """Ends `gen` as cancelled in a turn of its own; returns the text its stop-string check
        still held back ('' when there is none to give now). Inside a turn of this thread (a
        garbage collector finalising a dropped stream mid-step) it waits for the next turn
        instead: a step must not see the KV store change under it."""
        if not isinstance(gen, Generation):   # (None was an AttributeError, later, in a turn)
            raise ConfigError(f"end_generation: expected the Generation of a stream, found {type(gen).__name__}")
        if getattr(self._turn_depth, "n", 0):
            self._orphans.append(gen)
            return ""
        with self.lock:
            if self._closed:
                # its KV went with the engine: nothing to free, and a generator's close (an app's
                # it.close(), the collector's) must not raise "the engine is closed"
                gen._end_closed()
                return ""
            with self.turn():
                return gen._end("cancelled")

    @property
    def last_stats(self) -> GenerationStats:
        """The statistics of the last generation this thread started, else of the last any
        thread started. (One engine-wide value: a thread read another thread's request, e.g.
        prompt 1 tok and 3 generated after its own 211-token prompt and 40 tokens.)"""
        return getattr(self._stats_mine, "stats", None) or self._stats_latest

    @last_stats.setter
    def last_stats(self, stats: GenerationStats) -> None:
        self._stats_latest = self._stats_mine.stats = stats

    # -- text <-> ids --------------------------------------------------------------------------
    @property
    def template(self) -> ChatTemplate:
        """The model's chat template, built on first use (a bad one raises ModelFormatError
        then): jinja2 costs ~20 ms and ~5 MB resident that completion-only apps never use, and
        a template chat_builtin knows (SmolLM2's, ChatML) never needs it."""
        self._check_open()
        if self._template is None:
            self._template = ChatTemplate.from_metadata(self.model.metadata, self.model.path)
            if self._template.fallback_reason:   # (the markup a model never saw: said, not silent)
                log.warning("chat template: %s", self._template.fallback_reason)
        return self._template

    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of text; add_bos None: the model's own setting (add_bos "no" was taken as True)."""
        if add_bos is not None and not isinstance(add_bos, bool):
            raise ConfigError(f"add_bos: expected True, False or None, found {add_bos!r}")
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ids. The BOS tokenize() adds renders as its text, as in llama.cpp;
        skip_special=True drops every special token (tokenize's inverse for plain text, but for
        the spaces it cleans). Spaces are cleaned where llama_detokenize cleans them for the
        model's vocabulary ("Hi !" is "Hi!" on most byte-level BPE models): generated text, the
        pieces, is not."""
        if not isinstance(skip_special, bool):
            raise ConfigError(f"skip_special: expected True or False, found {skip_special!r}")
        return self.tokenizer.decode(check_token_ids(ids, self.config.vocab_size), skip_special=skip_special)

    def render_chat(self, messages: Sequence[dict]) -> str:
        """The prompt text the model's chat template makes of `messages` ([{"role": "system" |
        "user" | "assistant", "content": str}, ...]; other roles, "tool" say, go to the template
        as they are), ending with the assistant's turn opened (a conversation that ends with an
        assistant message gets a new assistant turn, as in llama.cpp, not a continuation):
        what chat() tokenizes (its BOS text included where the template writes one). A message
        list the template cannot take is a ConfigError naming what is wrong. The text knows
        where the contents lie: tokenized as it is (generate(render_chat(...)) too), a
        special token's text inside a content stays text (model/chat_plain.py)."""
        return self._render_chat(ChatTemplate.check_conversation(messages))

    def _render_chat(self, messages: list) -> RenderedChat:
        return render_plain(messages, self.template.render, self.tokenizer.special_texts)

    # -- generation ----------------------------------------------------------------------------
    def cancel(self) -> None:
        """Cancel the generations in progress (from another thread or a signal handler): every
        one made without a cancel= token, whichever thread runs it; not a Scheduler's requests
        (request.cancel()). To stop one alone, give each its own (cancel=CancelToken())."""
        for ref in list(self._own_cancels.values()):   # (list() of a dict: atomic, a handler may call this)
            tok = ref()
            if tok is not None:
                tok.cancel()

    def stream(self, prompt: str, *, config: GenerationConfig | None = None, cancel: CancelToken | None = None,
               **kwargs) -> Iterator[str]:
        """Yield text pieces as they are produced. Keywords mirror the CLI flags (max_tokens,
        temperature, top_k, top_p, min_p, repeat_penalty, seed, stop). Options are validated
        here, before the first piece is asked for."""
        check_unicode(prompt, "prompt")   # (a lone surrogate raised only at the first piece)
        return self._stream(lambda: prompt, generation_config(config, **kwargs), self._cancel_token(cancel))

    def generate(self, prompt: str, **kwargs) -> str:
        """The whole completion of prompt as one str (stream()'s pieces joined; same keywords)."""
        return "".join(self.stream(prompt, **kwargs))

    def chat_stream(self, messages: Sequence[dict], *, config: GenerationConfig | None = None,
                    cancel: CancelToken | None = None, **kwargs) -> Iterator[str]:
        """messages: [{"role": "system"|"user"|"assistant", "content": str}, ...]. The template is
        rendered inside the TTFT clock, as part of tokenization."""
        cfg = generation_config(config, **kwargs)
        messages = ChatTemplate.check_conversation(messages)   # (a copy: what the app changes later stays out)
        return self._stream(lambda: self._render_chat(messages), cfg, self._cancel_token(cancel))

    def _cancel_token(self, cancel: CancelToken | None) -> CancelToken:
        """The request's token: the caller's as it is (one cancelled before the request starts
        cancels it), else a new one the engine keeps while the request lives, so an
        engine.cancel() from now on (before the first piece is asked for, too) stops it, whatever
        other requests start meanwhile."""
        if cancel is None:
            cancel = CancelToken()
            key, live = id(cancel), self._own_cancels
            live[key] = weakref.ref(cancel, lambda _r, key=key: live.pop(key, None))
        elif not isinstance(cancel, CancelToken):
            raise ConfigError(f"cancel: expected an edgellm.engine.CancelToken, found {type(cancel).__name__}")
        return cancel

    def _stream(self, text_fn, cfg: GenerationConfig, cancel: CancelToken) -> Iterator[str]:
        # the clock starts when the app first asks for a piece, when this body runs (started at
        # the call, the app's time before its first next() counted as tokenizing and TTFT)
        t0 = time.perf_counter()
        ids = self._prompt_ids(text_fn())
        yield from self._generate_ids(ids, cfg, cancel, t0, time.perf_counter())

    def _prompt_ids(self, text: str) -> list[int]:
        """A request's prompt ids (the API's, warm's and the Scheduler's). A prompt that starts
        with the BOS text (a chat template writes {{ bos_token }}; an app passes render_chat()'s
        text to generate) gets no second BOS from the model's add_bos (llama.cpp strips the
        rendered one in a chat, to the same ids). Applied to every request alike: warm() and
        generate() tokenizing one text two ways left the warmed blocks unused."""
        tok = self.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.add_bos and tok.bos_id is not None else ""
        return self.tokenize(text, add_bos=False if bos and text.startswith(bos) else None)

    def chat(self, messages: Sequence[dict], **kwargs) -> str:
        """The assistant's answer to messages as one str (chat_stream()'s pieces joined)."""
        return "".join(self.chat_stream(messages, **kwargs))

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced next-token logits, (len(token_ids), vocab) float32, from an empty cache."""
        try:
            n = len(token_ids)          # (first: 20M ids took 8 s to check one by one before this)
        except Exception:   # noqa: BLE001 - no length: check_token_ids says what it is
            n = 0
        if n > self.n_ctx:
            raise ContextFull(f"logits: {n} token ids but the context holds {self.n_ctx} (raise n_ctx / --ctx)")
        token_ids = check_token_ids(token_ids, self.config.vocab_size)
        if len(token_ids) > self.n_ctx:
            raise ContextFull(f"logits: {len(token_ids)} token ids but the context holds {self.n_ctx} "
                              f"(raise n_ctx / --ctx)")
        ids = np.asarray(token_ids, dtype=np.int64)
        with self.turn():
            for retry in (False, True):
                seq = self._new_sequence()
                try:
                    out = self.runner.forward(seq, ids, all_logits=True).astype(np.float32, copy=False)
                    if not np.isfinite(out).all():   # (NaN weights: generate refuses such rows too)
                        raise _nonfinite_logits(out)
                    return out
                except ContextFull:
                    # the kept conversation holds the room: let it go (its full blocks stay in the
                    # prefix cache) and try once more
                    if retry or not self.kv.release_last():
                        raise
                finally:
                    seq.free()

    def _new_sequence(self):
        return self.kv.new_sequence()

    def _open_sequence(self, ids: list[int]):
        """A KV sequence for a prompt, and how many of its leading tokens already hold KV. Never
        exactly one left to compute where the sequence can give its last one back: computed
        alone, that token would run the decode kernels, and the prompt's logits, then its text,
        would differ from those of the same prompt computed at once (ModelRunner.take_back_last)."""
        seq, n = self.kv.open(ids)
        if len(ids) - n == 1 and self.runner.take_back_last(seq) is not None:
            n -= 1
        return seq, n

    def _close_sequence(self, seq, keep: bool, token_ids=(), cache: bool = False) -> None:
        self.kv.close(seq, keep, token_ids, cache)

    # -- caches and sessions -------------------------------------------------------------------
    def warm(self, text: str) -> int:
        """Precompute the KV of `text` (a system prompt, say) into the prefix cache, so a later
        prompt that starts with it computes only the rest. Returns the text's token count (all of
        them hold KV now, computed or found cached; a ring keeps the last `window` of them); a
        later prompt reuses their whole blocks (block_tokens each) whose tokens it shares, so a
        text whose last token tokenizes otherwise inside the longer prompt gives up that block."""
        # a rendered chat turn starting with the BOS text the template wrote: tokenized as a chat
        # prompt is (one BOS), or the chat that follows never matched the warmed blocks
        ids = self._prompt_ids(text)
        if not ids:
            raise ConfigError("warm needs a non-empty text")
        if len(ids) >= self.n_ctx:
            raise ContextFull(f"warm: the text has {len(ids)} tokens but must be shorter than the context "
                              f"({self.n_ctx} tokens), to leave a position for what follows it (raise n_ctx / --ctx)")
        with self.turn():
            seq, n = self._open_sequence(ids)
            try:
                if n < len(ids):
                    self.runner.forward(seq, ids[n:], logits=False)
            except BaseException:   # (ContextFull beside other requests, a cancel): nothing kept
                self.kv.close(seq, keep=False)
                raise
            self.kv.close(seq, keep=True, token_ids=ids)
            # (not seq.n_tokens: a ring's sequence holds its window, 64 after 3001 tokens)
            return len(ids)

    def clear_cache(self) -> None:
        """Forget every cached prefix and the last conversation, and the tokenizer's memo of the
        text fragments it encoded."""
        with self.turn():
            self.kv.clear()
        self.tokenizer.clear_memo()

    def model_sha256(self) -> str:
        """The model file's sha256 (hex), computed on first call and kept: what a saved session
        records, so that it is loaded only into an engine of the same model."""
        if self._model_sha is None:
            with self.lock:       # (a close() in another thread between the check and the read
                self._check_open()    # was an AttributeError: the model gone)
                path = self.model.path
            self._model_sha = file_sha256(path)
        return self._model_sha

    def _session_keys(self) -> dict:
        with self.lock:           # (as above: save/load_session run these outside their turn)
            self._check_open()
            layout = self.kv.kv.layout
            plan = self.precision_plan
        shape = (self.config, layout)
        if plan is not None:
            # what the plan computes in shapes the K/V as well: a `quality` engine continued, as a
            # hit, a session whose K/V `balanced` had computed from int8 activations (its weight
            # formats are in the model's sha256: a plan that requantizes reads another file)
            from .precision_runtime import ComputeTable
            table = ComputeTable(plan, self.config.n_layers)
            shape += (tuple(tuple(sorted(table.at(phase, t).items())) for phase in ("prefill", "decode")
                            for t in (0, *(p.min_tokens for p in plan.sequence))),)
        cfg_hash = sha256(repr(shape).encode()).hexdigest()[:32]
        return dict(model_sha256=self.model_sha256(), config_hash=cfg_hash, kv_layout=layout)

    def _session_max_bytes(self) -> int:
        """The most a session file of this engine can hold: n_ctx tokens' ids and K/V at 4 bytes a
        value (the widest storage; int8's per-head scales counted too), its header and padding.
        A header declaring more was allocated whole before its checksum failed (2 GB, 8 s)."""
        c = self.config
        per_token = 8 + 2 * c.n_layers * c.n_kv_heads * (c.head_dim + 1) * 4
        return self.n_ctx * per_token + MAX_HEADER_BYTES + (1 << 20)

    def save_session(self, path: str | os.PathLike, meta: dict | None = None) -> int:
        """Write the last conversation (token ids and KV) atomically; returns its token count.
        `meta` (JSON-able, e.g. the chat messages) comes back as session_meta on load. The last
        conversation is the engine's, not the calling thread's: that of the request that ended
        last on any thread or Scheduler (ConfigError when a later request has taken its room)."""
        path = _session_path(path, "save_session")
        if os.path.islink(path):
            # followed, as `run --session` does: the save replaced the link with a file, and its
            # target kept the old conversation (a probe)
            path = os.path.realpath(path)
        if meta is not None and not isinstance(meta, dict):
            raise ConfigError(f"save_session: meta must be a dict (JSON-able), found {type(meta).__name__}")
        why = foreign_file(path)
        if why is not None:   # never replace a user's file given as the session by mistake
            raise ConfigError(f"{path}: {why}; save_session writes only new files or session files")
        with self.turn():
            tokens, arrays = self.kv.snapshot()
        meta = {**(meta or {}), "model_name": self.config.name, "n_tokens": len(tokens)}
        try:
            write_session(path, token_ids=tokens, arrays=arrays, meta=meta, **self._session_keys())
        except (OSError, TypeError, ValueError, RecursionError) as e:   # (RecursionError: a meta nested 10^5 deep)
            raise ConfigError(f"{path}: cannot save the session: {type(e).__name__}: {e}") from None
        return len(tokens)

    def load_session(self, path: str | os.PathLike) -> bool:
        """Restore a saved conversation; the next prompt that extends it continues in place. A
        missing file is a cache miss (False, nothing said); a stale or corrupt one is a miss with
        one warning line; neither is an error."""
        self._check_open()
        path = _session_path(path, "load_session")
        # (n_ctx, not n_ctx - 1: a conversation that ran to the end of the context saved, then was
        # refused here as "more than the capacity")
        data = read_session(path, max_tokens=self.n_ctx, max_bytes=self._session_max_bytes(),
                            **self._session_keys())
        if data is None:
            return False
        ids = data.token_ids.tolist()
        if max(ids, default=0) >= self.config.vocab_size:
            log.warning("session cache miss: %s: token id outside the vocabulary", path)
            return False
        with self.turn():        # (outside the try: an engine closed meanwhile is an error, not a miss)
            try:
                self.kv.restore(ids, data.arrays)
            except (ConfigError, KeyError, ContextFull) as e:   # (ContextFull: live requests hold the room)
                log.warning("session cache miss: %s: %s", path, e)
                return False
        self.session_meta = dict(data.meta)
        return True

    def _generate_ids(self, ids: list[int], cfg: GenerationConfig, cancel: CancelToken,
                      t0: float, t_tok: float) -> Iterator[str]:
        gen = None
        try:
            # a Ctrl-C between the sequence's open (in Generation) and this try leaked its KV
            with interrupts.deferred():
                gen = Generation(self, ids, cfg, cancel, t0, t_tok)
                self.last_stats = gen.stats
            while not gen.done:
                piece = gen.step()
                if piece:
                    yield piece
        finally:
            if gen is not None:
                gen.close()   # a stream the app stopped reading (closed, dropped, an error in its loop)


def _session_path(path, what: str):
    """The session path checked before the OS sees it: a NUL byte raised an untyped ValueError,
    and an empty path (Path('') is '.') a failed rename to '.'."""
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"{what}: expected a file path, found {type(path).__name__}")
    p = os.fspath(path)
    if not isinstance(p, str):   # (a PathLike of bytes)
        raise ConfigError(f"{what}: expected a str file path, found {type(p).__name__} {p!r}")
    if not p:
        raise ConfigError(f"{what}: the session path is empty: give a file name")
    if "\0" in p:
        raise ConfigError(f"{what}: the session path {p!r} contains a NUL byte, which no file name may hold")
    try:
        os.fsencode(p)
    except UnicodeError:   # (a lone surrogate: UnicodeEncodeError from the first stat)
        raise ConfigError(f"{what}: the session path {p!r} cannot be a file name here (not encodable)") from None
    return path


def _nonfinite_logits(x: np.ndarray):
    """The typed error generate raises for non-finite model output (sampling's), for logits()."""
    from .sampling import _nonfinite
    return _nonfinite(x)


_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # a fork while another thread held an engine's turn left its lock held by a thread the child
    # does not have: the child's first request waited forever
    for e in list(_engines):
        e.lock = threading.RLock()
        e._turn_depth = threading.local()
    # and a fork while another thread was inside load() left the load lock held for good: the
    # child's every load() waited forever (a probe forking beside a loading thread)
    global _LOAD_LOCK, _LOADING
    _LOAD_LOCK = threading.Lock()
    _LOADING = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def generation_config(config: GenerationConfig | None = None, **kwargs) -> GenerationConfig:
    """`config` with keyword overrides, validated (ConfigError naming the bad option)."""
    if config is not None and not isinstance(config, GenerationConfig):
        raise ConfigError(f"config: expected an edgellm.GenerationConfig, found {type(config).__name__}")
    cfg = config or GenerationConfig()
    unknown = set(kwargs) - set(GenerationConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
    cfg = replace(cfg, **kwargs)
    # stop as a keyword or inside config alike (config=GenerationConfig(stop=None) was a TypeError)
    s = cfg.stop
    if isinstance(s, str):
        s = (s,)
    elif s is None:
        s = ()
    elif not isinstance(s, (list, tuple, set, frozenset)):
        raise ConfigError(f"stop: expected a string or a list of strings, found {type(s).__name__}")
    cfg = replace(cfg, stop=tuple(s))
    if not _is_int(cfg.max_tokens) or cfg.max_tokens < 1:
        raise ConfigError(f"max_tokens must be an integer >= 1, got {shown(cfg.max_tokens)}")
    cfg = replace(cfg, max_tokens=int(cfg.max_tokens))   # (a numpy integer, as top_k and seed take)
    if not isinstance(cfg.ignore_eos, bool):
        raise ConfigError(f"ignore_eos must be True or False, got {shown(cfg.ignore_eos)}")
    cfg.sampling()  # validates the sampling parameters with named errors
    StopChecker(cfg.stop)  # and the stop strings, here rather than at the first piece
    return cfg


def _is_int(v) -> bool:
    """An integer option: Python's or numpy's (top_k, seed and n_ctx took numpy integers, max_tokens,
    threads and prefill_chunk refused them), never a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def memory_needed(model: ModelFile, n_ctx: int, kv: KVConfig | None = None,
                  placement: dict[str, dict[str, str]] | None = None) -> int:
    """Bytes load() allocates: each unit's resident weights (for the ops the placement gives it;
    None: everything on the fp32 reference unit) + the KV cache. The GGUF itself stays mapped."""
    c, kv = model.config, kv or KVConfig()
    if kv.kind == "ring":
        kv_bytes = RingKV.nbytes_for(c.n_layers, c.n_kv_heads, c.head_dim, kv.window, kv.bytes_per_elem, kv.sinks)
    else:
        kv_bytes = KVPool.nbytes_for(c.n_layers, c.n_kv_heads, c.head_dim, math.ceil(n_ctx / kv.block_tokens),
                                     kv.block_tokens, kv.precision)
    if placement is None:
        return reference.prepared_nbytes(c) + kv_bytes
    runs: dict[str, set[str]] = {}
    for ops in placement.values():
        for op, unit in ops.items():
            runs.setdefault(unit, set()).add(op)
    weights = 0
    for unit, ops in runs.items():
        mod, _ = backends.get(unit)
        size = getattr(mod, "prepared_nbytes", reference.prepared_nbytes)
        weights += size(c, ops)
    return weights + kv_bytes


def _ring_chunk_cap(kv_cfg: KVConfig, prefill_chunk: int | None) -> int | None:
    """The largest prefill chunk the plan may choose on a ring (None: no cap). A ring chunk holds
    at most window - sinks tokens (kv/ring.py), and a chunk's first token sees only what the
    chunk left in the window: a planned chunk past that ran cut without a word (the plan said
    200, 60 ran), and chunks near it left their first tokens a few tokens of context. Planned
    chunks stay within half the room; a prefill_chunk past the room is refused."""
    if kv_cfg.kind != "ring":
        return None
    room = kv_cfg.window - kv_cfg.sinks
    if prefill_chunk is not None:
        if prefill_chunk > room:
            raise ConfigError(f"prefill_chunk {prefill_chunk} is more than a ring of window {kv_cfg.window} with "
                              f"{kv_cfg.sinks} sinks takes at once ({room} tokens): lower prefill_chunk or raise "
                              f"window")
        return None
    return max(1, room // 2)


def ring_chunk_why(kv_cfg: KVConfig) -> str:
    """Why a ring's chunk is _ring_chunk_cap's, as the plan says it."""
    return (f"the ring's cap (ring: at most half the {kv_cfg.window - kv_cfg.sinks} tokens a chunk may take, "
            f"window {kv_cfg.window} less {kv_cfg.sinks} sinks, so a chunk's first tokens keep context)")


def load(model: str | os.PathLike | None = None, device: str | os.PathLike | None = None, *, n_ctx: int | None = None,
         threads: int | None = None, prefill_chunk: int | None = None, kv: str = "pool",
         kv_precision: str | None = None, window: int | None = None, sinks: int | None = None,
         units: Sequence[str] | None = None,
         precision=None, quality_guard=None, prefault: bool | None = None, pin: bool = True,
         progress: Callable[[str, int, int], None] | None = None) -> Engine:
    """Load a model (a GGUF path, a registry name, or None for the default, pulled when missing).

    device: the device profile the dispatcher plans with: None or "host" (this machine's profile
    written by `edgellm profile`, else an estimate), a shipped profile name or a YAML path.
    units: restrict placement to these units, in preference order (e.g. ["opencl", "neon"]);
    an op none of them runs goes to the reference backend with a warning.
    n_ctx: the KV capacity in tokens; None: 2048 (DEFAULT_CTX), or the model's trained context
    when shorter. A larger n_ctx than the trained context is capped there, with a warning.
    prefill_chunk: tokens per prefill step; None lets the roofline model choose. 1 runs every
    prompt token through the decode kernels: its results are not the same bits as other chunk
    sizes' (which are, on the neon unit's fused path).
    kv: "pool" (block pool of n_ctx tokens with a prefix cache) or "ring" (a sliding window of
    `window` tokens, 1024 by default, keeping the first `sinks`, 4 by default, for chats of any
    length in constant memory). A ring's size is its window: n_ctx with kv="ring", like window or
    sinks with a pool, is ignored with a warning.
    kv_precision: "f16", "f32", or "int8"; None: the precision plan's kv_cache, else f16.
    precision: a precision plan: a preset name ("quality", "balanced", "fast"), a plan YAML path or
    a PrecisionPlan (edgellm/precision_presets/README.md). Its weight formats are applied once, into
    a requantized copy of the model cached under $EDGELLM_HOME/cache/precision/models; each op
    computes at the plan's precision or the nearest higher one its unit has (`edgellm plan` shows
    both). None: the file's weights, each unit's own precision (int8 activations on neon's layer
    matmuls, fp32 elsewhere: the `balanced` preset's choices).
    quality_guard: None/False (off), True (default thresholds) or a QualityGuard: in decode, a step
    whose next-token entropy or top-1 probability crosses a threshold switches the next steps'
    compute to the `quality` plan's (fp32), with one log line per switch.
    threads: compute threads; default one per big core.
    pin: True pins every thread of this process to the big cores (the OS then keeps the compute,
    and the app's threads, off the LITTLE cores). False leaves every thread's affinity as the app
    set it, the native pool's workers included: for apps that manage affinity themselves.
    prefault: page the mapped weights in on a background thread when a unit reads them in place
    (neon), so that the first request does not fault them in (model/prefault.py); None: on unless
    EDGELLM_PREFAULT=0. Engine.wait_loaded() waits for it.
    progress(stage, done, total) is called while pulling and while preparing weights.
    A library EDGELLM_NEON_LIB names that cannot be loaded is a ConfigError naming it, as in the CLI.
    """
    # one load at a time: two loads in two threads swapped the neon unit's configured pool
    # between them (an engine's fused step held the other's thread count), and both passed the
    # NPU unit's one-configuration check before either registered
    if getattr(_LOADING, "active", False):   # (a re-entrant lock let it in, and it swapped our pool)
        raise ConfigError("load() was called from inside another load (its progress callback): load the "
                          "other model after this load returns")
    with _LOAD_LOCK:
        _LOADING.active = True
        try:
            return _load(model, device, n_ctx=n_ctx, threads=threads, prefill_chunk=prefill_chunk, kv=kv,
                         kv_precision=kv_precision, window=window, sinks=sinks, units=units, precision=precision,
                         quality_guard=quality_guard, prefault=prefault, pin=pin, progress=progress)
        finally:
            _LOADING.active = False


_LOAD_LOCK = threading.Lock()
_LOADING = threading.local()          # this thread is inside load()
_FIRST_AFFINITY: list = []            # the process's cores before edgellm first pinned them


def _load(model, device, *, n_ctx, threads, prefill_chunk, kv, kv_precision, window, sinks, units, precision,
          quality_guard, prefault, pin, progress) -> Engine:
    from .device.topology import PinResult, current_affinity, detect_clusters, pin_threads, select_big

    from .precision import load_plan
    from .precision_runtime import ComputeTable, plan_model

    plan_notes: list[str] = []
    pplan = load_plan(precision) if precision is not None else None
    if kv_precision is None:
        kv_precision = pplan.kv_precision if pplan is not None else "f16"
    elif pplan is not None and kv_precision != pplan.kv_precision:
        plan_notes.append(f"kv_precision={kv_precision} replaces the precision plan's {pplan.kv_precision}")
    # options the chosen layout does not read are said to be ignored (the CLI said so; the API
    # took n_ctx=100 with kv="ring", or sinks=9 > window=8 with a pool, without a word)
    if kv != "ring" and (window is not None or sinks is not None):
        log.warning("window and sinks size kv='ring'; with kv=%r they are ignored", kv)
    kv_cfg = KVConfig(kind=kv, precision=kv_precision, window=1024 if window is None else window,
                      sinks=4 if sinks is None else sinks)
    if kv_cfg.kind == "ring" and kv_cfg.sinks == 0:
        # StreamingLLM's finding, seen on SmolLM2: with no sink tokens the text degrades once the
        # window slides (a count ran "39, 39, 39" right after the wrap; with 4 sinks it went on)
        log.warning("a ring with 0 sink tokens: text degrades once the window slides; keep a few (sinks, "
                    "--sinks: 4 by default)")
    guard = QualityGuard.from_option(quality_guard)
    if not isinstance(pin, bool):
        raise ConfigError(f"pin must be True or False, got {pin!r}")
    if prefault is not None and not isinstance(prefault, bool):   # ("no" turned it on)
        raise ConfigError(f"prefault must be True, False or None, got {prefault!r}")
    if threads is not None and (not _is_int(threads) or not 1 <= threads <= MAX_THREADS):
        raise ConfigError(f"threads must be an integer in 1..{MAX_THREADS}, got {threads!r}")
    if n_ctx is not None and (not _is_int(n_ctx) or n_ctx < 1):
        raise ConfigError(f"n_ctx must be an integer >= 1, got {n_ctx!r}")
    if kv == "ring" and n_ctx is not None:
        log.warning("n_ctx does not size kv='ring' (its window does): ignored")
        n_ctx = None
    if prefill_chunk is not None and (not _is_int(prefill_chunk) or prefill_chunk < 1):
        raise ConfigError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
    # plain ints from here: the native pool and the plan take them as such
    threads = None if threads is None else int(threads)
    prefill_chunk = None if prefill_chunk is None else int(prefill_chunk)
    # checked here, not when the callback first fires (an untyped TypeError mid-load)
    if progress is not None and not callable(progress):
        raise ConfigError(f"progress must be a callable progress(stage, done, total) or None, got {progress!r}")
    if isinstance(model, str) and not model:   # (it read as the current directory: "found a directory")
        raise ConfigError("model: the model path is empty: give a GGUF path, a registry name, or None for the "
                          "default model")
    if isinstance(units, str):
        units = [u.strip() for u in units.split(",") if u.strip()]
    # a library the user named must load: the neon unit would otherwise be unavailable and the
    # engine run on the numpy reference, which the CLI refuses too
    from .backends import neon_lib
    problem = neon_lib.named_library_problem()
    if problem:
        raise ConfigError(problem)
    profile = device_profile(device)
    if profile.gpu is not None:
        # the dispatcher probes the OpenCL unit (whatever `units` says: the plan shows every unit
        # with its reason); its child process runs meanwhile, started already by edgellm.load
        gpu_mod, _ = backends.get("opencl")
        if hasattr(gpu_mod, "start_probe"):
            gpu_mod.start_probe()
    else:
        opencl_child.discard()   # edgellm.load started it for a GPU this profile does not list
    t0 = time.perf_counter()
    path = resolve_model(model,
                         progress=(lambda done, total: progress("pull", done, total)) if progress else None)
    mf = open_model(path)
    compute = None
    if pplan is not None:
        pplan.check_model(mf.config.n_layers)
        convert, what = _convertible(mf)
        mf, note = plan_model(mf, pplan, progress=(lambda d, t: progress("requantize", d, t)) if progress else None,
                              also=convert, also_what=what)
        log.info("%s", note)
        compute = ComputeTable(pplan, mf.config.n_layers)
    else:
        mf = _runnable(mf, progress)
    if n_ctx is None:
        n_ctx = min(DEFAULT_CTX, mf.config.context_length)
    elif n_ctx > mf.config.context_length:
        log.warning("n_ctx %d is above %s's trained context: using %d", n_ctx, mf.config.name,
                    mf.config.context_length)
        n_ctx = mf.config.context_length
    n_ctx = int(n_ctx)
    if kv_cfg.kind == "ring" and kv_cfg.window > mf.config.context_length:
        # as n_ctx is: positions past the trained context are ones the model never saw (a window
        # of 100000 on an 8192-token model was taken silently, its memory sized for 100000)
        log.warning("window %d is above %s's trained context: using %d", kv_cfg.window, mf.config.name,
                    mf.config.context_length)
        kv_cfg = replace(kv_cfg, window=int(mf.config.context_length))
    # the KV size the memory figures quote: a ring's is its window, whatever n_ctx says
    kv_size = f"window={kv_cfg.window} (kv='ring')" if kv_cfg.kind == "ring" else f"n_ctx={n_ctx}"
    kv_lower = "lower window" if kv_cfg.kind == "ring" else "lower n_ctx"
    ring_cap = _ring_chunk_cap(kv_cfg, prefill_chunk)
    avail = available_bytes()
    if pin and not _FIRST_AFFINITY:   # (a load that pins nothing leaves the app's choice, which may change)
        _FIRST_AFFINITY.append(current_affinity())
    big = select_big(detect_clusters())
    # (against the cores before edgellm pinned the process: a later load saw the big cores only)
    _warn_if_measured_elsewhere(profile, _FIRST_AFFINITY[0] if pin else current_affinity())
    threads = threads or len(big)
    _warn_if_fewer_threads(profile, threads, device)
    dispatcher = Dispatcher(profile, mf.config, weight_formats(mf), probe=True, override=units,
                            kv_bytes=kv_cfg.bytes_per_elem, threads=threads, compute=compute)
    # the chunk's activations may take a quarter of the memory the KV cache leaves free
    plan = dispatcher.plan(prompt_tokens=min(512, n_ctx), n_ctx=n_ctx, chunk=prefill_chunk,
                           memory_budget=max(avail - memory_needed(mf, n_ctx, kv_cfg, {}), 0) / 4)
    chunk_why = "set by the caller"
    if ring_cap and plan.chunk.tokens > ring_cap:
        prefill_chunk, chunk_why = ring_cap, ring_chunk_why(kv_cfg)
        plan = dispatcher.plan(prompt_tokens=min(512, n_ctx), n_ctx=n_ctx, chunk=prefill_chunk, chunk_why=chunk_why,
                               memory_budget=max(avail - memory_needed(mf, n_ctx, kv_cfg, {}), 0) / 4)
    plan_notes += _opencl_on_a_cpu_device(plan, profile)
    plan = replace(plan, warnings=plan.warnings + tuple(plan_notes))
    for note in plan_notes:
        log.warning("%s", note)
    placement = plan.placement()
    need = memory_needed(mf, n_ctx, kv_cfg, placement)
    if need > avail:
        raise ConfigError(f"not enough memory: the model needs {need / 2**20:.0f} MiB at {kv_size} "
                          f"(units {','.join(plan.units_used())}) but {avail / 2**20:.0f} MiB are available; "
                          f"{kv_lower} or use a smaller model")
    from .backends import neon as _neon_unit
    if pin:
        pinning = pin_threads(big, skip=_neon_unit.worker_tids())
    else:
        pinning = PinResult(frozenset(big), 0, current_affinity(), 0, False,
                            "pin=False: every thread keeps the affinity the app gave it")
        log.info("threads not pinned: %s", pinning.reason)
    if threads > len(big):
        log.warning("threads=%d but this process may run on %d big core(s) %s: threads share cores, which slows "
                    "every parallel op", threads, len(big), sorted(big))
    if pin and not pinning.ok:
        log.warning("threads not pinned to the big cores: %s", pinning.reason)
    _limit_blas_threads(threads)   # (the final plan's count: _blas_threads_for, after the runner's build)
    # the allocations: a MemoryError or ENOMEM (a limit the estimate above missed) is the same
    # typed refusal, not a traceback
    # what the tokenizer's build and the planning freed goes back to the OS before the KV pool's
    # commit and the weights' paging-in raise RSS: kept by malloc, it sat in the load's peak when
    # they overlapped (load RSS 182.2 MiB in such runs, 180.6 with this, resident 178.8 after)
    release_free_pages()
    with _memory_refusal(mf.config.name, kv_size, kv_lower):
        store = make_store(mf.config, kv_cfg, n_ctx, background_commit=True)
        described = {"opencl": profile.gpu is not None, "npu": profile.npu is not None}
        for u in plan.units:
            counted_on = u.name in units if units else described.get(u.name, True)
            if not u.available and counted_on:
                # a unit the profile (or --units) counts on is missing: the user must see why.
                # With --units, only the listed ones: the others were ruled out, not probed
                log.warning("unit %s unavailable: %s; its ops run on other units", u.name, u.reason)
            else:
                log.info("unit %s: %s (%s)", u.name, "available" if u.available else "unavailable", u.reason)
        log.info("plan on %s: units %s, prefill chunk %d (%s); `edgellm plan` shows every op and why",
                 profile.name, ",".join(plan.units_used()), plan.chunk.tokens, "; ".join(plan.chunk.derivation))
        for name in plan.units_used():
            mod, _ = backends.get(name)
            if hasattr(mod, "configure"):      # native units run their own pools on the big cores
                mod.configure(threads=threads, cores=big if pin else None)
            if hasattr(mod, "use_plan"):       # a unit whose weight form follows the precision plan
                mod.use_plan(pplan)
        paging = None
        if (prefault if prefault is not None else enabled_by_env()) and \
                any(getattr(backends.get(name)[0], "MAPS_WEIGHTS", False) for name in plan.units_used()):
            paging = start_prefault(file_memmap(mf.gguf), mf.gguf.data_offset, mf.gguf.file_size - mf.gguf.data_offset)
        exclude: dict[tuple[str, str], str] = {}
        while True:
            try:
                runner = ModelRunner(mf, store.max_positions, plan.chunk.tokens, placement=placement, compute=compute,
                                     short_max=plan.short_max_tokens,
                                     progress=(lambda d, t: progress("prepare", d, t)) if progress else None)
                break
            except backends.UnitFailed as e:
                # the unit passed its probe but cannot run (part of) this model: plan again without it
                units_now = dispatcher.units
                if e.unit == "reference" or (e.ops and all((e.unit, op) in exclude for op in e.ops)):
                    raise
                if e.ops:
                    log.warning("%s; these ops move to the next best unit", e)
                    exclude.update({(e.unit, op): e.reason for op in e.ops})
                    note = f"unit {e.unit} rejected {', '.join(e.ops)} at load: {e.reason}"
                else:
                    log.warning("%s; its ops move to the next best unit", e)
                    units_now = tuple(replace(u, available=False, reason=f"failed at load: {e.reason}")
                                      if u.name == e.unit else u for u in units_now)
                    note = f"unit {e.unit} unavailable: failed at load: {e.reason}"
                dispatcher = Dispatcher(profile, mf.config, weight_formats(mf), probe=True, override=units,
                                        kv_bytes=kv_cfg.bytes_per_elem, threads=threads, units=units_now,
                                        exclude=exclude, compute=compute)
                warnings = plan.warnings + (note,)
                plan = dispatcher.plan(prompt_tokens=min(512, n_ctx), n_ctx=n_ctx, chunk=prefill_chunk,
                                       chunk_why=chunk_why, memory_budget=max(avail - memory_needed(mf, n_ctx, kv_cfg, {}), 0) / 4)
                plan = replace(plan, warnings=warnings + tuple(w for w in plan.warnings if w not in warnings))
                placement = plan.placement()
    _limit_blas_threads(_blas_threads_for(plan, threads))   # (a UnitFailed re-plan may have moved ops)
    release_free_pages()
    eng = Engine(mf, runner, store, threads=threads, load_ms=(time.perf_counter() - t0) * 1e3)
    eng.load_rss_mb, eng.rss_after_load_mb = peak_rss_mb(), resident_mb()
    eng.prefault = paging
    eng.plan, eng.profile, eng.pinning, eng.dispatcher = plan, profile, pinning, dispatcher
    if guard is not None and not _guard_can_switch(runner):
        # off, not kept logging switches "to fp32" that changed nothing (a helper's probe)
        log.warning("quality guard: its switches change nothing with this placement: decode's matmuls (%s) "
                    "compute at fp32 already, or on units without a choice of compute precision; the guard "
                    "is off", ", ".join(sorted({runner._ops["decode"][op][0].__name__.rsplit(".", 1)[-1]
                                                for op in ("qkv", "attn_out", "ffn_gate_up", "ffn_down")})))
        guard = None
    eng.precision_plan, eng.quality_guard = pplan, guard
    return eng


def _runnable(mf: ModelFile, progress=None) -> ModelFile:
    """mf, or a copy whose matrices in types no unit computes with (quant.CONVERTIBLE_TYPES: the
    K-quants of a Q4_K_M file, Q5_0/Q5_1) are in ones every unit does (kquant_repack.runs_as):
    Q4_K as Q4_1 (its own values, scales rounded to fp16), the rest as Q8_0. Made once per model
    file, then read from the precision cache; those matrices take more memory than in the file
    (Q4_K 4.5 -> 5 bits a weight, Q6_K 6.6 -> 8.5)."""
    from .precision_runtime import requantized_copy

    formats, what = _convertible(mf)
    if not formats:
        return mf
    out, note = requantized_copy(mf, formats, "runnable", what,
                                 (lambda d, t: progress("requantize", d, t)) if progress else None)
    log.info("%s", note)
    return out


def _convertible(mf: ModelFile) -> tuple[dict[str, str], str]:
    """({tensor name: format} for the tensors of mf that load() converts (kquant_repack.copy_types:
    the K-quants, Q5_0/Q5_1, BF16), the conversions as named in notes ("Q4_K as Q4_1, Q6_K as
    Q8_0"), with the load's warning when there are any."""
    from .kquant_repack import conversions, copy_types

    types = copy_types(mf.gguf.tensors)
    if not types:
        return {}, ""
    formats = {name: t.name.lower() for name, t in types.items()}
    what = conversions(mf.gguf.tensors, types)
    log.warning("%s: %d tensors are in types no edgellm unit computes with: they run from a copy (%s; made "
                "once, then cached)", mf.path, len(formats), what)
    return formats, what


def _opencl_on_a_cpu_device(plan, profile) -> list[str]:
    """The note for a plan that puts ops on the opencl unit costed at the profile's GPU figures
    (a shipped profile's Mali) while the only OpenCL device here is a CPU one (PoCL): the NPU
    says the same of CPU kernels (npu._probe); this unit said nothing, and `bench --device
    tensor-g1` on an x86 host took 15 s for a 512-token prompt predicted at 137 ms. A profile
    whose opencl figures were measured (`edgellm profile` on that device) costs it as it is."""
    if "opencl" not in plan.units_used() or profile.gpu is None:
        return []
    if profile.measured is not None and "opencl" in profile.measured.units:
        return []
    mod, _ = backends.get("opencl")
    report = mod.probe_report() if hasattr(mod, "probe_report") else {}
    if report.get("gpu", True):
        return []
    peaks = ", ".join(f"{p} {v / 1e9:g} {'GOPS' if p.startswith('int') else 'GFLOPS'}"
                      for p, v in profile.gpu.peak.items())
    return [f"opencl: no OpenCL GPU here: its ops run on {report.get('device') or 'a CPU device'}, a CPU "
            f"device, while the plan costs them at the {profile.name} profile's {profile.gpu.name} figures "
            f"({peaks}); `--units` without opencl plans without it"]


def _warn_if_fewer_threads(profile, threads: int, device) -> None:
    """A profile's CPU figures are for all its big cores; with fewer threads here (another
    device's profile on this machine, a restricted cpuset) they are scaled down, and the plan
    differs from what `edgellm plan` shows for that device: said, with the command that shows it."""
    from .costmodel import big_cpu

    n_big = sum(len(c.cores) for c in big_cpu(profile))
    if profile.measured is None and threads < n_big:
        dev = "" if device is None or device == "host" else f" --device {device if isinstance(device, str) else profile.name}"
        log.warning("planning %s's CPU units for %d thread(s), not its %d big cores (`edgellm plan%s -t %d` "
                    "shows this plan)", profile.name, threads, n_big, dev, threads)


def _warn_if_measured_elsewhere(profile, usable: frozenset[int]) -> None:
    """A host profile measured under another cpuset (taskset -c 0, an app's affinity) plans this
    process's threads from another core count's figures: said, not silent."""
    if profile.measured is None:
        return
    from .device.profile import BUSY_SHARE

    share = getattr(profile.measured, "others_cpu_share", None)
    if share is not None and share > BUSY_SHARE:
        # (a profile made beside a busy process predicted decode at half the quiet machine's
        # speed, and load() planned from it without a word: a probe)
        log.warning("profile %s was measured while other processes used %.0f%% of the CPUs: its figures are "
                    "probably low (run `edgellm profile` again on an idle machine)", profile.name, 100 * share)
    measured_on = frozenset(c for cl in profile.clusters for c in cl.cores)
    if measured_on and measured_on != usable:
        log.warning("profile %s was measured on cores %s, but this process may run on %s: its figures may not fit "
                    "(run `edgellm profile` again under this process's cores)", profile.name, sorted(measured_on),
                    sorted(usable))


def _guard_can_switch(runner) -> bool:
    """Whether the quality plan's table changes any decode matmul's compute precision (it logged
    switches to fp32 that changed nothing on npu, reference or opencl placements)."""
    from .quality_guard import _quality_table

    plain = runner._precision_kwargs("decode", 1)
    saved, runner.decode_override = runner.decode_override, _quality_table(runner.cfg.n_layers)
    try:
        return runner._precision_kwargs("decode", 1) != plain
    finally:
        runner.decode_override = saved


@contextlib.contextmanager
def _memory_refusal(model_name: str, kv_size: str, kv_lower: str):
    """kv_size: what sizes the KV ("n_ctx=2048", a ring's "window=512 (kv='ring')"); kv_lower: the
    advice that shrinks it."""
    try:
        yield
    except (MemoryError, OSError) as e:
        if isinstance(e, OSError) and e.errno != errno.ENOMEM:
            raise
        why = e.strerror if isinstance(e, OSError) else (str(e) or "an allocation failed")
        raise ConfigError(f"not enough memory to load {model_name} at {kv_size} ({why}); {kv_lower}, "
                          f"use kv_precision='int8', or a smaller model") from None


def device_profile(device: str | os.PathLike | None):
    """The DeviceProfile for load(device=...): None / "host" -> this machine's."""
    from .device.host import host_profile
    from .device.profile import load_profile

    if device is None or device == "host":
        return host_profile()
    return load_profile(device)


_BLAS_LIMIT = None



def _blas_threads_for(plan, threads: int) -> int:
    """numpy's BLAS threads for a plan: 1 where the reference unit runs attention but none of the
    large GEMMs. Attention's matmuls are small (a kv head's block of queries against the keys),
    and OpenBLAS's caller spin-waits for its workers at each: beside one CPU-bound process, a
    400-token prompt on units npu,reference took 0.9-1.3 s at 2 BLAS threads and 0.44 s at 1 (0.42
    idle). Where reference runs the projections too (units=["reference"]; the quality preset's
    fp32 prefill on a profile whose neon fp32-activation GEMM is slower than BLAS), 2 threads
    were 1.7x faster idle and ~1.9x slower beside a busy process: they keep `threads`, the speed
    a plan prices."""
    from .ops import MATMUL_KINDS

    on_ref = [p for ph in plan.phases().values() for p in ph.placements if p.unit == "reference"]
    if threads > 1 and any(p.op == "attention" for p in on_ref) and not any(p.kind in MATMUL_KINDS for p in on_ref):
        log.info("numpy's BLAS on 1 thread: the reference unit runs attention, whose small matmuls "
                 "spin-wait for BLAS workers when another process takes a core")
        return 1
    return threads

def _limit_blas_threads(n: int) -> None:
    # numpy's BLAS spawns one thread per core by default; the engine's thread count is its cap.
    global _BLAS_LIMIT
    from threadpoolctl import threadpool_limits

    _BLAS_LIMIT = threadpool_limits(limits=n, user_api="blas")
