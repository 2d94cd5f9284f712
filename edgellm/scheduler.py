"""Several requests on one engine: a worker thread owns the model and interleaves work.

Each loop iteration gives every request that is decoding one step, then runs one prefill chunk
of one request still in prefill: the highest priority first, then the one with the fewest prompt
tokens left (shortest-remaining-first minimises mean time-to-first-token), then the oldest. So a
short chat turn that arrives during a long prefill waits for at most one chunk, not the whole
prompt. policy="fifo" runs requests one after another instead (the baseline `bench --concurrent`
compares against).

Requests come from any thread; only the worker steps them. The engine's own calls from other
threads (generate, stream, warm) take turns with the worker a step at a time (Engine.turn), outside
its priorities.
"""
from __future__ import annotations

import itertools
import threading
import time
import weakref
from typing import Iterator, Sequence

from .engine import CancelToken
from .errors import ConfigError, EdgeLLMError
from .generation import Generation, GenerationStats
from .model.chat_template import ChatTemplate
from .model.tokenizer import check_text


class Request:
    """A handle to one submitted request: stream() its text, result(), cancel(), stats."""

    def __init__(self, rid: int, priority: int, prompt: str, chat: bool, config):
        self.id = rid
        self.priority = priority
        self.prompt = prompt
        self.chat = chat
        self.config = config
        self.submitted = time.perf_counter()
        self.cancel_token = CancelToken()
        self.stats = GenerationStats()
        self.error: BaseException | None = None
        # every piece so far, kept: any number of readers, each from the start, and result()
        # after a stream (a queue let only the first reader see the end: the next one waited
        # forever)
        self._pieces: list[str] = []
        self._cv = threading.Condition()
        self._done = threading.Event()
        self.gen: Generation | None = None

    def cancel(self) -> None:
        self.cancel_token.cancel()

    @property
    def done(self) -> bool:
        return self._done.is_set()

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
        if self.gen is not None:
            self.stats = self.gen.stats
        with self._cv:
            self._done.set()
            self._cv.notify_all()


class Scheduler:
    """Requests from any thread, one worker thread stepping them (see the module docstring).
    close() it, or use it as a context manager; one dropped without close() stops its worker
    when it is garbage-collected (cancelling what is left), so the worker does not keep the
    engine (and its mapped model) alive."""

    def __init__(self, engine, *, chunk: int = 128, policy: str = "interleave"):
        if policy not in ("interleave", "fifo"):
            raise ConfigError(f"policy must be 'interleave' or 'fifo', got {policy!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ConfigError(f"chunk must be an integer >= 1, got {chunk!r}")
        self.engine = engine
        self.chunk = chunk
        self.policy = policy
        self._ids = itertools.count(1)
        # the worker holds no reference to this handle: a dropped handle is collected, and the
        # finaliser stops the worker
        self._worker = _Worker(engine, chunk, policy)
        self._thread = threading.Thread(target=self._worker.run, name="edgellm-scheduler", daemon=True)
        self._thread.start()
        weakref.finalize(self, self._worker.stop, True)

    def submit(self, prompt: str | None = None, *, messages: Sequence[dict] | None = None, priority: int = 0,
               **kwargs) -> Request:
        """Queue a completion of `prompt`, or a chat turn over `messages`. Generation keywords as
        Engine.stream. Higher priority goes first."""
        from .api import generation_config

        if (prompt is None) == (messages is None):
            raise ConfigError("submit needs exactly one of prompt or messages")
        if isinstance(priority, bool) or not isinstance(priority, (int, float)) or priority != priority:
            raise ConfigError(f"priority must be a number (higher goes first), got {priority!r}")
        if messages is not None:
            ChatTemplate.check_messages(messages)
        else:
            check_text(prompt, "prompt")
        cfg = generation_config(**kwargs)
        req = Request(next(self._ids), priority, prompt if prompt is not None else messages, messages is not None, cfg)
        self._worker.add(req)
        return req

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

    def __init__(self, engine, chunk: int, policy: str):
        self.engine, self.chunk, self.policy = engine, chunk, policy
        self._cv = threading.Condition()
        self._incoming: list[Request] = []
        self._active: list[Request] = []
        self._closed = False

    def add(self, req: Request) -> None:
        with self._cv:
            if self._closed:
                raise ConfigError("the scheduler is closed")
            self._incoming.append(req)
            self._cv.notify()

    def stop(self, cancel: bool) -> None:
        with self._cv:
            self._closed = True
            if cancel:
                for r in self._incoming + self._active:
                    r.cancel()
            self._cv.notify()

    def run(self) -> None:
        while True:
            with self._cv:
                while not self._incoming and not self._active and not self._closed:
                    self._cv.wait()
                if self._closed and not self._incoming and not self._active:
                    return
                new, self._incoming = self._incoming, []
            for req in new:
                self._start(req)
            self._tick()

    def _start(self, req: Request) -> None:
        try:
            t_start = time.perf_counter()
            text = self.engine.render_chat(req.prompt) if req.chat else req.prompt
            ids = self.engine._prompt_ids(text, req.chat)
            t_tok = time.perf_counter()
            # TTFT runs from submit(), queueing included; tokenize_ms is the tokenizer's own time
            req.gen = Generation(self.engine, ids, req.config, req.cancel_token, req.submitted, t_tok,
                                 chunk=self.chunk)
            req.gen.stats.tokenize_ms = (t_tok - t_start) * 1e3
            self._active.append(req)
        except EdgeLLMError as e:
            req._finish(e)

    def _tick(self) -> None:
        if self.policy == "fifo":
            todo = [min(self._active, key=lambda r: r.id)] if self._active else []
        else:
            todo = [r for r in self._active if not r.gen.in_prefill]
            waiting = [r for r in self._active if r.gen.in_prefill]
            if waiting:
                todo.append(min(waiting, key=lambda r: (-r.priority, len(r.gen.pending), r.id)))
        for req in todo:
            try:
                req._put(req.gen.step())
            except BaseException as e:  # a request's failure must not stop the others
                req._finish(e if isinstance(e, EdgeLLMError) else EdgeLLMError(f"request {req.id} failed: {e!r}"))
                self._active.remove(req)
                continue
            if req.gen.done:
                req._finish()
                self._active.remove(req)
