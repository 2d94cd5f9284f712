"""Several requests on one engine: a worker thread owns the model and interleaves work.

Priorities are strict: while a request of a higher priority runs (decoding or in prefill), the
lower ones wait, holding their place; the decode steps of a background request had gone on
beside a foreground one's and halved its speed (a probe of the docs). Among the requests of the
highest priority running, each loop iteration gives every one that is decoding one step, then
runs one prefill chunk of one still in prefill: the one with the fewest prompt tokens left
(shortest-remaining-first minimises mean time-to-first-token), then the oldest. So a short chat
turn that arrives during a long prefill of its priority waits for at most one chunk, not the
whole prompt. A prefill passed over for STARVE_S goes next (the one passed over longest first):
under a stream of short requests a long prompt got no chunk at all (a helper's probe: 14 s,
until the stream stopped). policy="fifo" runs requests one after another instead (the baseline
`bench --concurrent` compares against).

Requests come from any thread; only the worker steps them. The engine's own calls from other
threads (generate, stream, warm) take turns with the worker a step at a time (Engine.turn), outside
its priorities.

Admission: a request starts (opens its KV sequence) only when the pool has room for its prompt
plus max_tokens beside what the running requests may still take, counted in blocks as if nothing
were shared; otherwise it waits, in priority order, for one to finish. Started all at once,
requests that each fit alone ran each other out of room: the oldest stopped mid-answer with
stop_reason "context_full" and a later one raised ContextFull. One that does not fit even alone
runs alone, as it would on the engine. What is reserved is max_tokens, not what a request will
use: one with a large max_tokens can hold the whole pool, and every other request, whatever its
priority, then waits for it to finish (give a request the max_tokens its answer needs). Only
this Scheduler's requests are counted: another
Scheduler, or Engine.generate from another thread, on the same engine can still run them out of
room (one Scheduler per engine). A ring store (kv="ring") runs one request at a time: each
sequence on it opens a window of its own, which load() counted once (40 queued requests took
846 MiB).

A request whose every handle the app drops (its Request and the iterators of its stream()) is
cancelled, as Engine.stream ends a stream the app stops reading; it ran on to max_tokens, holding
its KV. A cancelled request ends at the worker's next iteration, whatever its priority.

The prefill chunk is DEFAULT_CHUNK on a pool; on a ring it is the engine's own (_prefill_chunk).
"""
from __future__ import annotations

import itertools
import numbers
import os
import threading
import time
import weakref
from typing import Iterator, Sequence

from .engine import CancelToken
from .errors import ConfigError, ContextFull, EdgeLLMError, shown
from .generation import Generation, GenerationStats
from .model.chat_template import ChatTemplate
from .model.tokenizer import check_unicode
from .threads import start_quietly

DEFAULT_CHUNK = 128   # prefill tokens per step on a pool: a short request waits at most one such chunk


class _Job:
    """A submitted request as the worker sees it; the app holds it through a Request handle."""

    def __init__(self, rid: int, priority: int, prompt: str, chat: bool, config):
        self.id = rid
        self.priority = priority
        self.prompt = prompt
        self.chat = chat
        self.config = config
        self.submitted = time.perf_counter()
        self.cancel_token = CancelToken()
        self._stats = GenerationStats()    # until a Generation runs it (then the live one)
        self.error: BaseException | None = None
        # every piece so far, kept: any number of readers, each from the start, and result()
        # after a stream (a queue let only the first reader see the end: the next one waited
        # forever)
        self._pieces: list[str] = []
        self._cv = threading.Condition()
        self._done = threading.Event()
        self.gen: Generation | None = None
        self.ids: list[int] | None = None   # the prompt's ids, once tokenized
        self.t_tok = 0.0                    # when tokenization ended (the Generation's clock)
        self.tokenize_ms = 0.0
        self.blocks = 0                     # KV blocks it may take: prompt + max_tokens (admission)
        self.last_chunk = 0.0               # when its prefill last got a chunk (or started)
        self.keep = None                    # its Scheduler, held until it ends (Request)

    @property
    def stats(self) -> GenerationStats:
        """The live statistics once the request runs (mid-stream they read 0 before), else its
        own: a request that ended waiting still has its prompt's tokens and tokenize time."""
        return self.gen.stats if self.gen is not None else self._stats

    def cancel(self) -> None:
        self.cancel_token.cancel()

    def stream(self) -> Iterator[str]:
        """Text pieces as the worker produces them, from the first (each call streams them all);
        raises the request's error, if any."""
        i = 0
        while True:
            with self._cv:
                self._cv.wait_for(lambda: i < len(self._pieces) or self._done.is_set())
                new, done = self._pieces[i:], self._done.is_set()
            i += len(new)
            yield from new
            if done and i == len(self._pieces):
                break
        if self.error is not None:
            raise self.error

    def result(self, timeout: float | None = None) -> str:
        """The whole text (again on each call); TimeoutError when not finished within timeout."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                    or timeout != timeout):
            raise ConfigError(f"timeout must be a number of seconds or None, got {timeout!r}")
        if timeout is not None and timeout > threading.TIMEOUT_MAX:
            timeout = None   # (inf, 1e300: an untyped OverflowError from the wait; no end is no timeout)
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return "".join(self._pieces)

    def _put(self, piece: str | None) -> None:
        if piece:
            with self._cv:
                self._pieces.append(piece)
                self._cv.notify_all()

    def _finish(self, error: BaseException | None = None) -> None:
        self.error = error
        st = self.stats
        if self.ids is not None and not st.prompt_tokens:
            st.prompt_tokens, st.tokenize_ms = len(self.ids), self.tokenize_ms
        if error is not None and not st.stop_reason:   # (a ContextFull at start left it "")
            st.stop_reason = "context_full" if isinstance(error, ContextFull) else "error"
        with self._cv:
            self._done.set()
            self._cv.notify_all()
        self.keep = None


class Request:
    """A handle to one submitted request: stream() its text, result(), cancel(), stats. When the
    app drops every handle (this object and its stream() iterators), the request is cancelled."""

    def __init__(self, job: _Job):
        self._job = job
        weakref.finalize(self, job.cancel)

    id = property(lambda self: self._job.id)
    priority = property(lambda self: self._job.priority)
    prompt = property(lambda self: self._job.prompt)
    config = property(lambda self: self._job.config)
    submitted = property(lambda self: self._job.submitted)
    cancel_token = property(lambda self: self._job.cancel_token)
    stats = property(lambda self: self._job.stats)
    error = property(lambda self: self._job.error)
    gen = property(lambda self: self._job.gen)

    def cancel(self) -> None:
        self._job.cancel()

    @property
    def done(self) -> bool:
        return self._job._done.is_set()

    def stream(self) -> Iterator[str]:
        """Text pieces as the worker produces them, from the first (each call streams them all);
        raises the request's error, if any."""
        # (the generator's frame holds self: a stream being read keeps the request going)
        yield from self._job.stream()

    def result(self, timeout: float | None = None) -> str:
        """The whole text (again on each call); TimeoutError when not finished within timeout."""
        return self._job.result(timeout)


class Scheduler:
    """Requests from any thread, one worker thread stepping them (see the module docstring).
    close() it, or use it as a context manager; one dropped without close() stops its worker
    when it is garbage-collected (cancelling what is left), so the worker does not keep the
    engine (and its mapped model) alive."""

    def __init__(self, engine, *, chunk: int | None = None, policy: str = "interleave"):
        from .api import Engine

        if not isinstance(engine, Engine):   # (the worker died on its first request, which then hung)
            raise ConfigError(f"Scheduler needs an edgellm Engine (edgellm.load()), got {type(engine).__name__}")
        if policy not in ("interleave", "fifo"):
            raise ConfigError(f"policy must be 'interleave' or 'fifo', got {policy!r}")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1):
            raise ConfigError(f"chunk must be an integer >= 1, got {chunk!r}")
        engine._check_open()
        self.engine = engine
        self.chunk = _prefill_chunk(engine, None if chunk is None else int(chunk))   # (numpy ints, as load's)
        self.policy = policy
        self._ids = itertools.count(1)
        self._pid = os.getpid()
        # the worker holds no reference to this handle: a dropped handle is collected, and the
        # finaliser stops the worker
        self._worker = _Worker(engine, self.chunk, policy)
        self._thread = threading.Thread(target=self._worker.run, name="edgellm-scheduler", daemon=True)
        start_quietly(self._thread)
        weakref.finalize(self, self._worker.stop, True)

    def submit(self, prompt: str | None = None, *, messages: Sequence[dict] | None = None, priority: int = 0,
               **kwargs) -> Request:
        """Queue a completion of `prompt`, or a chat turn over `messages`. Generation keywords as
        Engine.stream. Higher priority goes first."""
        from .api import generation_config

        if os.getpid() != self._pid:   # (a forked child has no worker thread: its requests waited forever)
            raise ConfigError(f"this Scheduler's worker runs in process {self._pid}; create a Scheduler in this "
                              f"process (pid {os.getpid()})")
        if (prompt is None) == (messages is None):
            raise ConfigError("submit needs exactly one of prompt or messages")
        if isinstance(priority, bool) or not isinstance(priority, numbers.Real) or priority != priority:
            raise ConfigError(f"priority must be a number (higher goes first), got {shown(priority)}")
        if isinstance(priority, numbers.Integral):
            # a Python int: the queue orders by -priority, which wraps for numpy's fixed widths
            # (-np.uint32(5) is 4294967291, -np.int64(-2**63) itself: the wrong end of the queue)
            priority = int(priority)
        if messages is not None:   # (copies: the caller's list may change while it waits)
            messages = ChatTemplate.check_conversation(messages)
        else:
            check_unicode(prompt, "prompt")
        cfg = generation_config(**kwargs)
        job = _Job(next(self._ids), priority, prompt if prompt is not None else messages, messages is not None, cfg)
        # a request keeps its Scheduler until it ends: one created in a helper function and
        # dropped there was collected, and its finaliser cancelled the requests the app still
        # held (result() ''). The job lets go when it ends: a finished request the app keeps no
        # longer keeps the worker thread (30 kept results held 30 threads)
        job.keep = self
        self._worker.add(job)
        return Request(job)

    def close(self, cancel: bool = True) -> None:
        """Stop the worker (cancelling what is left, unless cancel=False: then finish it first)."""
        self._worker.stop(cancel)
        self._thread.join()

    def __enter__(self) -> "Scheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Worker:
    """The worker thread's state and loop: each iteration gives every decoding request one step,
    then one prefill chunk to one request still in prefill."""

    # a prefill passed over this long goes before shorter ones of its priority (module doc)
    STARVE_S = 0.5

    def __init__(self, engine, chunk: int, policy: str):
        self.engine, self.chunk, self.policy = engine, chunk, policy
        self._cv = threading.Condition()
        self._incoming: list[_Job] = []
        self._taken: list[_Job] = []      # taken from _incoming, being tokenized (outside the lock)
        self._starting: _Job | None = None   # between _waiting and _active: its Generation being made
        self._waiting: list[_Job] = []    # tokenized, waiting for KV room (admission)
        self._active: list[_Job] = []
        self._closed = False

    def add(self, req: _Job) -> None:
        with self._cv:
            if self._closed:
                raise ConfigError("the scheduler is closed")
            self._incoming.append(req)
            self._cv.notify()

    def stop(self, cancel: bool) -> None:
        with self._cv:
            self._closed = True
            if cancel:   # (the batch being tokenized too: it was missed, and close() ran it to the end)
                for r in self._incoming + self._taken + self._waiting + [self._starting] + self._active:
                    if r is not None:
                        r.cancel()
            self._cv.notify()

    def run(self) -> None:
        while True:
            with self._cv:
                while not self._incoming and not self._active and not self._waiting and not self._closed:
                    self._cv.wait()
                if self._closed and not self._incoming and not self._active and not self._waiting:
                    return
                new, self._incoming = self._incoming, []
                self._taken = new
            for req in new:
                self._tokenize(req)
            with self._cv:
                self._taken = []
            self._admit()
            self._tick()
            # (a cancelled waiting request ends here, without a sequence)
            for req in [r for r in self._waiting if r.cancel_token.cancelled]:
                self._waiting.remove(req)
                req.stats.stop_reason = "cancelled"
                req._finish()   # (with the prompt's figures: they read 0 before)

    def _tokenize(self, req: _Job) -> None:
        try:
            t_start = time.perf_counter()
            text = self.engine.render_chat(req.prompt) if req.chat else req.prompt
            req.ids = self.engine._prompt_ids(text)
            req.t_tok = time.perf_counter()
            req.tokenize_ms = (req.t_tok - t_start) * 1e3
            req.blocks = self._blocks(len(req.ids) + req.config.max_tokens)
            self._waiting.append(req)
        except BaseException as e:   # one request's failure must not end the worker (all would hang)
            req._finish(_as_error(req, e))

    def _blocks(self, tokens: int) -> int:
        """KV blocks a sequence of this many tokens may take (0: the store has no pool to share)."""
        pool = getattr(self.engine.kv, "pool", None)
        if pool is None:
            return 0
        return -(-min(tokens, self.engine.n_ctx) // pool.block_tokens)

    def _admit(self) -> None:
        """Start waiting requests, by priority then age, while the pool has room for each beside
        the running ones; the first that does not fit stops the rest (no overtaking: a large
        request is not starved by small ones)."""
        pool = getattr(self.engine.kv, "pool", None)
        with self._cv:   # (list.sort empties the list while it runs: a close() then cancelled none of it)
            self._waiting.sort(key=lambda r: (-r.priority, r.id))
        while self._waiting:
            req = self._waiting[0]
            held = sum(r.blocks for r in self._active)
            if pool is not None and self._active and held + req.blocks > pool.n_blocks:
                return
            if pool is None and self._active:   # a ring: one window at a time (module doc)
                return
            with self._cv:    # (in one of the lists stop() cancels at every moment)
                self._waiting.pop(0)
                self._starting = req
            self._start(req)

    def _start(self, req: _Job) -> None:
        try:
            # TTFT runs from submit(), queueing included; tokenize_ms is the tokenizer's own time
            req.gen = Generation(self.engine, req.ids, req.config, req.cancel_token, req.submitted, req.t_tok,
                                 chunk=self.chunk)
            req.gen.stats.tokenize_ms = req.tokenize_ms
            req.last_chunk = time.perf_counter()
            with self._cv:
                self._active.append(req)
        except BaseException as e:
            req._finish(_as_error(req, e))
        finally:
            with self._cv:
                self._starting = None

    def _tick(self) -> None:
        # a cancelled request ends now, not at its next step: a prefill passed over for higher
        # priorities kept running (and its room in the pool) for as long as they came
        for req in [r for r in self._active if r.cancel_token.cancelled]:
            self._active.remove(req)
            try:   # (as cancelled, its KV freed; the text its stop check held back given, as a step gives it)
                req._put(self.engine.end_generation(req.gen))
            except BaseException as e:
                req._finish(_as_error(req, e))
                continue
            req._finish()
        if self.policy == "fifo":
            todo = [min(self._active, key=lambda r: r.id)] if self._active else []
        else:
            top = max((r.priority for r in self._active), default=None)
            running = [r for r in self._active if r.priority == top]   # (strict: the lower ones wait)
            todo = [r for r in running if not r.gen.in_prefill]
            waiting = [r for r in running if r.gen.in_prefill]
            if waiting:
                now = time.perf_counter()

                def order(r):
                    starved = now - r.last_chunk > self.STARVE_S
                    return not starved, r.last_chunk if starved else len(r.gen.pending), r.id

                todo.append(min(waiting, key=order))
        for req in todo:
            try:
                chunk = req.gen.in_prefill
                req._put(req.gen.step())
                if chunk:   # (after the chunk: stamped before it, a chunk over STARVE_S made the
                    req.last_chunk = time.perf_counter()   # request that just had one "starved")
            except BaseException as e:  # a request's failure must not stop the others
                req._finish(_as_error(req, e))
                self._active.remove(req)
                continue
            if req.gen.done:
                req._finish()
                self._active.remove(req)


def _prefill_chunk(engine, chunk: int | None) -> int:
    """The scheduler's prefill chunk: `chunk`, else DEFAULT_CHUNK. On a ring the chunk decides
    what a prompt longer than the window sees (a chunk's first token sees only what the window
    kept), so there the default is the engine's own chunk (load() caps it at half the room): a
    request's text is then Engine.generate's (with 128 against the engine's 98, a 404-token
    prompt on a 200-token window answered otherwise). A chunk past the ring's room is refused, as
    load() refuses such a prefill_chunk."""
    kv = engine.kv.kv
    if kv.kind != "ring":
        return DEFAULT_CHUNK if chunk is None else chunk
    if chunk is None:
        return engine.runner.prefill_chunk
    room = kv.window - kv.sinks
    if chunk > room:
        raise ConfigError(f"chunk {chunk} is more than this engine's ring (window {kv.window} with {kv.sinks} "
                          f"sinks) takes at once ({room} tokens): give at most {room}, or leave chunk unset")
    return chunk


def _as_error(req: _Job, e: BaseException) -> EdgeLLMError:
    """What a request's handle raises for an exception in the worker: ours as they are, any
    other (a KVInvariantError is an AssertionError) wrapped, so that result() raises it."""
    return e if isinstance(e, EdgeLLMError) else EdgeLLMError(f"request {req.id} failed: {e!r}")
