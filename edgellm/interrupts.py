"""Ctrl-C (and the other asynchronous signals apps raise from) held back while the engine's state
is mid-change.

Python raises KeyboardInterrupt (SIGINT's default handler) in the main thread between any two
bytecodes. Raised inside the KV pool's accounting it left blocks that no sequence held and no
clear_cache() returned (3 of 128 lost for good), or a refcount one short, after which every call
failed with KVInvariantError; raised between a sequence's open and the try that closes it, the
sequence leaked. A notebook's interrupt button or a Ctrl-C does exactly that.

Inside `deferred()` (Engine.turn enters it: every change to the KV store happens in a turn) the
Python handlers of SIGINT and of DEFERRED's other signals (an app's SIGALRM timeout raising its
own exception does the same damage) only record the signal; the handler that was installed runs
when the outermost block ends, or earlier at a `checkpoint()`, a point where the state is whole
(between prefill chunks: a long prompt still stops within a chunk). The native kernels never saw
Ctrl-C before either (a signal's Python handler runs when the C call returns), so the delay is
the Python bookkeeping's microseconds, or one chunk at most.

Python runs signal handlers in the main thread only, so elsewhere these are no-ops. Handlers that
are not Python callables (SIG_IGN, SIG_DFL) raise nothing and are left in place.
"""
from __future__ import annotations

import os
import signal
import threading

try:
    # the C module under `signal`: signal.signal / getsignal wrap each handler in an enum lookup
    # that fails (a ValueError caught) for a function, ~6 us a call against ~0.1-1 us here, and
    # a decode step takes a turn per token
    import _signal as _sig
except ImportError:   # (another Python implementation)
    _sig = signal

# The asynchronous signals whose Python handlers wait (when the app installed one): Ctrl-C, and
# the ones apps raise exceptions from: timers (a SIGALRM timeout around generate() landed in the
# KV accounting too: a block's refcount off by one after ~6,000 timed-out calls, in a probe),
# termination requests, and the user signals. Faults (SIGSEGV, ...) are never touched.
DEFERRED = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGVTALRM",
                                              "SIGPROF", "SIGUSR1", "SIGUSR2") if hasattr(signal, n))

_depth = 0                     # nesting of deferred() in the main thread
_saved: dict = {}              # signal -> the Python handler deferred() replaced
_pending: list = []            # (signum, frame) received while deferred, in arrival order


def _record(signum, frame) -> None:
    _pending.append((signum, frame))


def _in_main() -> bool:
    return threading.current_thread() is threading.main_thread()


def _deliver() -> None:
    """Runs the saved handler of the first signal received while deferred (it may raise); the
    same signal's repeats go with it (the OS keeps one of each pending), the others stay."""
    if not _pending:
        return
    signum, frame = _pending[0]
    _pending[:] = [p for p in _pending if p[0] != signum]
    handler = _saved.get(signum)
    if handler is not None:
        handler(signum, frame)


def _swap_in() -> None:
    """The recording handler in place of each deferred signal's Python handler (into _saved
    first: an undo puts back whatever it holds)."""
    for signum in DEFERRED:
        handler = _sig.getsignal(signum)
        if callable(handler) and handler is not _record:
            _saved[signum] = handler
            try:
                _sig.signal(signum, _record)
            except ValueError:       # not the main interpreter: nothing to defer
                del _saved[signum]


def _swap_out() -> list:
    """The saved handlers back; returns the signals received meanwhile (state cleared). Handlers
    first: a signal arriving during this then goes to its own handler, not to a list just read."""
    saved = dict(_saved)
    for signum, handler in saved.items():
        try:
            _sig.signal(signum, handler)
        except ValueError:
            pass
    _saved.clear()
    pending = _pending[:]
    _pending.clear()
    return [p for p in pending if p[0] in saved]


class deferred:
    """Context manager: the Python handlers of DEFERRED signals wait until the outermost block
    ends (or a checkpoint())."""

    __slots__ = ("_active",)

    def __enter__(self):
        global _depth
        self._active = _in_main()
        if not self._active:
            return self
        counted = False
        try:
            if _depth == 0:
                _swap_in()
            _depth += 1
            counted = True
        except BaseException:
            # an exception from another Python handler (one the swap had not reached yet) landed
            # between two of these steps, and the with block never began: undone here, or the
            # recorders stayed for good and Ctrl-C was swallowed outside the engine
            if counted:
                _depth -= 1
            if _depth == 0:
                _swap_out()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        global _depth
        if not self._active:
            return False
        _depth -= 1
        if _depth == 0 and _saved:
            received = _swap_out()
            # each signal received once more, now that its own handler is back: Python runs it at
            # once (raise_signal checks for signals before it returns), as it would have then
            order = list(dict.fromkeys(signum for signum, _ in received))
            for i, signum in enumerate(order):
                try:
                    _sig.raise_signal(signum)
                except BaseException:
                    for rest in order[i + 1:]:   # (after its exception, as Python would)
                        os.kill(os.getpid(), rest)
                    raise
        return False


def checkpoint() -> None:
    """Inside deferred(): delivers a signal received so far, here, where the caller's state is
    whole. The handlers stay deferred for the rest of the block."""
    if _depth and _pending and _in_main():
        _deliver()


def _reset_in_child() -> None:
    """A fork from another thread while the main thread held signals back: the child has no such
    block to end, so it gets the handlers back now."""
    global _depth
    _swap_out()
    _depth = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
