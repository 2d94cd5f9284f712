"""One request's generation as a step machine: each step() is one unit of model work (one
prefill chunk or one decode step). Engine.stream drives one to completion; the scheduler
interleaves several, so a long prefill does not hold a short chat turn behind it."""
from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass

import numpy as np

from .chunking import chunk_bounds
from .engine import CancelToken
from .errors import Cancelled, ConfigError, ContextFull
from .quality_guard import GuardState
from .sampling import Sampler, StopChecker


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0                 # prompt tokens whose KV came from the prefix cache
    generated_tokens: int = 0
    tokenize_ms: float = 0.0               # text -> ids (template included)
    prefill_ms: float = 0.0                # forward passes over the uncached prompt
    ttft_ms: float = 0.0                   # call -> first token available (tokenize + prefill + sample)
    decode_ms: float = 0.0                 # after the first token, until the last
    decode_tps: float = 0.0                # (generated - 1) / decode time
    peak_rss_mb: float = 0.0               # process peak resident memory so far
    guard_switches: int = 0                # quality guard: times decode switched to the quality precision
    decode_runs: str = ""                  # how decode tokens ran: native runs, or token by token and why
    stop_reason: str = ""                  # eos | stop | max_tokens | context_full | cancelled

    def summary(self) -> str:
        cached = f", {self.cached_tokens} cached" if self.cached_tokens else ""
        runs = f" ({self.decode_runs})" if self.decode_runs else ""
        # (the first token comes from the prefill: a rate needs two; "0.0 tok/s" read as a stall)
        rate = f" at {self.decode_tps:.1f} tok/s{runs}" if self.generated_tokens > 1 else ""
        ttft = f"{self.ttft_ms:.0f} ms" if self.generated_tokens or self.ttft_ms else "- (no token)"
        return (f"prompt {self.prompt_tokens} tok{cached}, TTFT {ttft} (tokenize "
                f"{self.tokenize_ms:.1f}, prefill {self.prefill_ms:.0f}), decode {self.generated_tokens} tok"
                f"{rate}, peak RSS {self.peak_rss_mb:.0f} MiB, stop: {self.stop_reason}")


def peak_rss_mb() -> float:
    """This process's peak resident memory, MB. Linux: VmHWM, the high-water mark of this
    program's address space; getrusage's ru_maxrss would also count the memory of the process it
    was forked from (it survives fork and exec), so a bench started by a large parent reported
    the parent's peak."""
    from .procmem import status_mb

    peak = status_mb(b"VmHWM")
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux and BSD report KiB


class Generation:
    def __init__(self, engine, ids: list[int], cfg, cancel: CancelToken, t0: float, t_tok: float,
                 chunk: int | None = None):
        engine._check_open()   # (a closed engine has no runner: an AttributeError before)
        self.engine = engine
        self.cfg = cfg
        self.cancel = cancel
        self.t0 = t0
        self.t_tok = t_tok
        self.stats = GenerationStats(prompt_tokens=len(ids), tokenize_ms=(t_tok - t0) * 1e3)
        if not ids:
            raise ConfigError("the prompt is empty (it tokenizes to no tokens)")
        if len(ids) >= engine.n_ctx:
            # (equal counts read as if nothing were wrong: "has 1 tokens but the context holds 1")
            raise ContextFull(f"the prompt has {len(ids)} token(s) and the context holds {engine.n_ctx}: no "
                              f"position is left for the answer (raise n_ctx / --ctx, or shorten the prompt)")
        self.chunk = chunk or engine.runner.prefill_chunk
        self.sampler = Sampler(cfg.sampling())
        # the chain decode runs pick with, and why they cannot pick as the sampler does (or None)
        self._chain, self._no_runs = self.sampler.run_chain()
        self.stopper = StopChecker(cfg.stop)
        # generated control tokens (<|im_start|>, <|im_end|> past ignore_eos) give no text, as in
        # llama.cpp's completions (token_to_piece with special=False): they showed as text
        self.decoder = engine.tokenizer.decoder(skip_special=True)
        self.history = list(ids)
        self.last_tok: int | None = None
        self.t_first: float | None = None
        self._decode_s = 0.0                   # the decode steps' own time (after the first token)
        self._t_step: float | None = None      # when the last decode step began (decode runs' length)
        self._run_len = 1
        self._stop_ids = () if cfg.ignore_eos else tuple(sorted(engine.tokenizer.eot_ids))
        self.done = False
        guard = getattr(engine, "quality_guard", None)
        self.guard = GuardState(guard, engine.runner) if guard is not None else None
        # last: nothing after it may fail and leave the sequence open. (A Ctrl-C held back by the
        # turn comes at its end: a caller in the main thread holds interrupts.deferred() until
        # the generation is in its hands, Engine._generate_ids)
        with engine.turn():
            self.seq, cached = engine._open_sequence(ids)
            self.stats.cached_tokens = cached
            self.pending = np.asarray(ids[cached:], dtype=np.int64)   # prompt tokens still to prefill

    @property
    def in_prefill(self) -> bool:
        return not self.done and len(self.pending) > 0

    def step(self) -> str | None:
        """One unit of work. Returns text to show ('' when a token produced none yet), or None
        after a prefill chunk that is not the last. Runs in a turn of the engine (Engine.turn):
        generations of several threads (or a scheduler's) take turns a step at a time."""
        with self.engine.turn():
            runner = self.engine.runner
            runner.decode_override = self.guard.override() if self.guard is not None else None
            t = time.perf_counter()
            try:
                return self._step()
            finally:
                runner.decode_override = None
                # decode time is the steps' own: the app's time between pieces (a UI repaint)
                # counted too when it ran from the first token to the last (18.5 tok/s for 308)
                if self.t_first is not None and t >= self.t_first:
                    self._decode_s += time.perf_counter() - t
                    if self.done:
                        self._set_decode_rate()

    def close(self) -> None:
        """Ends a generation its driver stops stepping (a stream the app stopped reading): as
        cancelled, its KV sequence freed. Nothing when it is done, and nothing but the mark when
        its engine was closed (its KV went with it): a close never raises."""
        if not self.done and not sys.is_finalizing():   # (at exit the interpreter is half torn down)
            self.engine.end_generation(self)

    def _end(self, reason: str) -> str:
        """Ends it (nothing when done); the text its stop-string check still held back."""
        return self._finish(reason) if not self.done else ""

    def _end_closed(self) -> None:
        """Marks it ended as cancelled when its engine was closed under it: no runner, no KV store
        left to close the sequence in (Engine.close released them)."""
        if not self.done:
            self.done = True
            self.stats.stop_reason = "cancelled"
            self._set_decode_rate()

    def _step(self) -> str | None:
        if self.done:
            return ""
        runner = self.engine.runner
        part, n_before = None, self.seq.n_tokens
        try:
            if len(self.pending):
                n = chunk_bounds(len(self.pending), self.chunk, self.seq.max_chunk)[1]   # (no one-token part)
                part, self.pending = self.pending[:n], self.pending[n:]
                # a part that more parts follow stores its K/V only: no head, no last-layer output
                t = time.perf_counter()
                try:
                    logits = runner.forward(self.seq, part, cancel=self.cancel, logits=not len(self.pending))
                finally:
                    # the prompt's own forward time: a scheduler's queue and other requests' steps
                    # between its chunks were counted before. Counted when the forward raises too:
                    # a prefill cancelled (or failed) part-way reported "prefill 0" ms for the
                    # work it did do
                    self.stats.prefill_ms += (time.perf_counter() - t) * 1e3
                if len(self.pending):
                    return None
            else:
                # a decode token looks at the cancel before it is computed (inside a run, after
                # the token before it: _emit_run): looked at after, a cancel between pieces still
                # gave one more piece. (The prefill's forward looks between its chunks and layers.)
                if self.cancel.cancelled:
                    return self._finish("cancelled")
                k = self._run_length()
                if k:
                    n0 = self.seq.n_tokens
                    chain, sc = self._chain, self.sampler.config
                    u = self.sampler.uniforms(k) if chain is not None and not chain.greedy else None
                    # the tokens the penalty covers before this run's first pick
                    hist = () if chain is None or sc.repeat_penalty == 1.0 or sc.repeat_last_n == 0 else \
                        self.history[-sc.repeat_last_n:] if sc.repeat_last_n > 0 else self.history
                    try:
                        ids, logits = runner.decode_run(self.seq, self.last_tok, k, self._stop_ids, chain=chain,
                                                        uniforms=u, history=hist)
                    except ContextFull:
                        ids = []          # no room for k positions: token by token
                    self.sampler.unuse((u or [])[len(ids):])    # a draw each produced token
                    if ids:
                        return self._emit_run(ids, n0)
                logits = runner.forward(self.seq, [self.last_tok])
        except Cancelled:
            return self._finish("cancelled")
        except ContextFull:
            # the conversation the engine keeps for its next turn (another request's, ended) may
            # hold the room: let it go (its full blocks stay in the prefix cache) and go on. It
            # cut a running answer short (stop_reason context_full at 26 of 52 tokens: a probe).
            if self.engine.kv.release_last():
                if part is not None:   # the part's chunks that did not go in (forward's go in whole)
                    self.pending = np.concatenate([part[self.seq.n_tokens - n_before:], self.pending])
                return None if self.t_first is None else ""
            if self.t_first is None:  # the prompt itself does not fit beside other requests
                self._finish("context_full")
                raise
            return self._finish("context_full")
        except BaseException:
            self._finish("error")
            raise
        try:
            return self._emit(logits)
        except BaseException:
            # (the sampler's non-finite logits, a stop check or the guard failing): ended by the
            # stream's close, it read "cancelled", and a ring kept the step's K/V as a cancel's
            if not self.done:
                self._finish("error")
            raise

    # Decode runs several tokens in one native call when the runner can (DecodeStep.run_tokens):
    # ~100 us of Python per token stay out of the loop, and a sampled token's draw runs in C.
    # That takes a pick C makes as the sampler does (Sampler.run_chain): the argmax, or the
    # native chain (sampled, or greedy after a repetition penalty); not under the quality guard. A run is as long as this many seconds of tokens, so text still streams
    # in small steps and cancellation still answers within them. A sampled run draws with the
    # sampler's own uniforms and gives back those it did not use, so a seed gives the same
    # tokens however the runs fall.
    RUN_S = 0.012
    RUN_MAX = 8

    def _run_length(self) -> int:
        """Tokens the next step may produce in one native call (0: token by token)."""
        st = self.stats
        why = self._no_runs or ("the quality guard looks at every token's logits" if self.guard is not None
                                else self.engine.runner.decode_run_blocker(self.seq))
        if not st.decode_runs:
            st.decode_runs = f"token by token: {why}" if why else \
                f"native runs, {'greedy' if self.sampler.config.greedy else 'sampled'}"
        if why:
            return 0
        now = time.perf_counter()
        last, self._t_step = self._t_step, now
        if last is None:
            return 0                       # the first decode token times a step
        k = min(self.RUN_MAX, max(1, int(self.RUN_S / max(now - last, 1e-6) * self._run_len)),
                self.cfg.max_tokens - st.generated_tokens, self.engine.n_ctx - self.seq.n_tokens)
        self._run_len = k
        return k if k > 1 else 0

    def _emit_run(self, ids: list[int], n0: int) -> str:
        """The tokens of a decode run, each taken as _emit takes a sampled one. Where one ends
        generation before the run's end (a stop string, cancellation), the K/V of the tokens fed
        after it are dropped, so the sequence holds what a token-by-token run would."""
        text = ""
        for i, tok in enumerate(ids):
            piece, reason = self._take(tok, n0 + i + 1)
            text += piece
            if reason is None and i + 1 < len(ids) and self.cancel.cancelled:
                reason = "cancelled"     # (the look token by token makes before the next token)
            if reason is not None:
                if self.seq.n_tokens > n0 + i + 1 and self.seq.can_truncate(n0 + i + 1):
                    self.seq.truncate(n0 + i + 1)
                return text + self._finish(reason)
        return text

    def _emit(self, logits: np.ndarray) -> str:
        st = self.stats
        if self.guard is not None:
            self.guard.observe(logits)
        tok = self.sampler.sample(logits, self.history)
        if self.t_first is None:
            self.t_first = time.perf_counter()
            st.ttft_ms = (self.t_first - self.t0) * 1e3
        text, reason = self._take(tok, self.seq.n_tokens)
        return text + self._finish(reason) if reason is not None else text

    def _take(self, tok: int, held: int) -> tuple[str, str | None]:
        """A produced token: its text, and the reason generation ends with it (None: it goes
        on, fed next). held: the positions the sequence holds at this token."""
        st = self.stats
        if tok in self.engine.tokenizer.eot_ids and not self.cfg.ignore_eos:
            return "", "eos"
        self.history.append(tok)
        st.generated_tokens += 1
        hit, text = self.stopper.feed(self.decoder.push(tok))
        if hit:
            return text, "stop"
        for ended, reason in ((st.generated_tokens >= self.cfg.max_tokens, "max_tokens"),
                              (held >= self.engine.n_ctx, "context_full")):
            if ended:
                return text, reason
        self.last_tok = tok
        return text, None

    def _set_decode_rate(self) -> None:
        st = self.stats
        st.decode_ms = self._decode_s * 1e3
        if st.generated_tokens > 1 and st.decode_ms > 0:
            st.decode_tps = (st.generated_tokens - 1) / (st.decode_ms / 1e3)

    def _finish(self, reason: str) -> str:
        st = self.stats
        st.stop_reason = reason
        self.done = True
        if self.guard is not None:
            self.guard.close()
            st.guard_switches = self.guard.switches
        rest = ""
        if reason != "stop":
            # the bytes of a character the last token left unfinished (max_tokens, context_full or
            # a cancel cut it) are dropped, as llama.cpp's Python binding does: they ended the
            # text in U+FFFD (every odd max_tokens after "Emoji list: 😀 😃 😄 😁" on SmolLM2)
            hit, rest = self.stopper.feed(self.decoder.flush(drop_partial=True))
            rest += "" if hit else self.stopper.flush()
        self._set_decode_rate()
        st.peak_rss_mb = peak_rss_mb()
        self.engine._close_sequence(self.seq, keep=reason not in ("cancelled", "error"), token_ids=self.history,
                                    cache=reason == "cancelled")
        return rest
