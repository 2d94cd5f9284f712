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
# the ones apps raise exceptions from: SIGALRM timeouts (one around generate() landed in the KV
# accounting too: a block's refcount off by one after ~6,000 timed-out calls, in a probe),
# termination requests, and the user signals. Not SIGPROF / SIGVTALRM: a sampling profiler's
# samples would collapse into one at each block's end, on the wrong frame. Faults (SIGSEGV, ...)
# are never touched.
DEFERRED = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGUSR1",
                                              "SIGUSR2") if hasattr(signal, n))

_depth = 0                     # nesting of deferred() in the main thread
_saved: dict = {}              # signal -> the Python handler deferred() replaced
_pending: list = []            # (signum, frame) received while deferred, in arrival order
_last: dict = {}               # signal -> the handler last replaced (see _record)
_MAIN = threading.main_thread().ident


def _record(signum, frame) -> None:
    if _depth == 0 and signum not in _saved and signum in _last:
        # outside any block: an app that saved getsignal()'s answer inside one put the recorder
        # back itself; its own handler goes back in place, and takes this signal
        handler = _last[signum]
        _sig.signal(signum, handler)
        handler(signum, frame)
        return
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
        if handler is _record:       # left in place by a swap an exception cut short
            if signum in _last:
                _saved[signum] = _last[signum]
        elif callable(handler):
            _saved[signum] = _last[signum] = handler
            try:
                _sig.signal(signum, _record)
            except ValueError:       # not the main interpreter: nothing to defer
                del _saved[signum]


def _restore(items: list, i: int = 0) -> None:
    """items[i:]'s handlers back where the recorder still stands (not where the app installed
    another meanwhile: a handler that switches to the default on a second Ctrl-C); each one even
    when a handler raised as an earlier one went back (those left had stayed recorders)."""
    if i == len(items):
        return
    signum, handler = items[i]
    try:
        if _sig.getsignal(signum) is _record:
            _sig.signal(signum, handler)
    except ValueError:
        pass
    finally:
        _restore(items, i + 1)


def _swap_out(received: list) -> None:
    """The saved handlers back; the signals received meanwhile, each once, into `received`.
    State cleared whatever happens."""
    try:
        _restore(list(_saved.items()))
    finally:
        seen = set()
        for signum, frame in _pending:
            if signum in _saved and signum not in seen:
                seen.add(signum)
                received.append((signum, frame))
        _saved.clear()
        _pending.clear()


def _deliver_all(received: list, i: int = 0) -> None:
    """Each received signal's handler in place now, in arrival order; one raising does not stop
    the next (as Python runs the rest at its next check: the later exception has the earlier as
    its context). Called directly, not re-raised: a second raise wrote a second wakeup byte, and
    asyncio ran its callback twice."""
    if i == len(received):
        return
    signum, frame = received[i]
    try:
        handler = _sig.getsignal(signum)
        if callable(handler):
            handler(signum, frame)
        elif handler != signal.SIG_IGN:      # (the app set the default meanwhile: the OS applies it)
            os.kill(os.getpid(), signum)
    finally:
        _deliver_all(received, i + 1)


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
            # an exception from a handler that ran midway (a signal that arrived just before)
            # and the with block never began: undone here, or the recorders stayed for good and
            # Ctrl-C was swallowed outside the engine
            if counted:
                _depth -= 1
            if _depth == 0:
                received: list = []
                try:
                    _swap_out(received)
                finally:
                    _deliver_all(received)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        global _depth
        if not self._active or _depth == 0:   # (0: a fork inside the block reset the child)
            return False
        _depth -= 1
        if _depth == 0 and _saved:
            received: list = []
            try:
                _swap_out(received)
            finally:
                _deliver_all(received)
        return False


def checkpoint() -> None:
    """Inside deferred(): delivers a signal received so far, here, where the caller's state is
    whole. The handlers stay deferred for the rest of the block."""
    if _depth and _pending and _in_main():
        _deliver()


def _reset_in_child() -> None:
    """A fork from another thread while the main thread held signals back: the child has no such
    block to end, so it gets the handlers back now. (A fork from the main thread inside a block
    leaves the child in that block, which restores them as it ends.)"""
    global _depth
    if threading.get_ident() == _MAIN:
        return
    _swap_out([])
    _depth = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
