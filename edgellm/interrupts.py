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
import sys
import threading
import weakref

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

# The main thread's open deferred() blocks, outermost first, as weak references: a block whose
# __exit__ never ran (an exception from another handler landing as it was called: Python checks
# for signals at every call's entry) dies with the frame that held it, and the next block, or a
# signal's recorder, sees no block open and puts the handlers back (a count stayed at 1 for good,
# and every later Ctrl-C outside the engine was recorded and lost).
_blocks: list = []
_saved: dict = {}              # signal -> the Python handler deferred() replaced
_pending: list = []            # (signum, frame) received while deferred, in arrival order
_MAIN = threading.main_thread().ident


def _open() -> int:
    """How many blocks are open (dead ones dropped)."""
    if _blocks and _blocks[-1]() is None:
        _blocks[:] = [b for b in _blocks if b() is not None]
    return len(_blocks)


class _Recorder:
    """What stands in for a handler during a block: records the signal. One per replaced handler,
    so that outside any block it knows the handler it stands for: left in place (a restore cut
    short, or an app that saved getsignal()'s answer inside a block and put it back) it gives way
    to it, and called by an app's handler that chains to what it replaced inside a block, it
    passes the signal on to it (one shared recorder sent two such chains round without end)."""

    __slots__ = ("replaced",)

    def __init__(self, replaced):
        self.replaced = replaced

    def __call__(self, signum, frame) -> None:
        if _open():
            # (not the frame: one kept in this list kept the block of its __exit__ alive, for good)
            _pending.append((signum, None))
            return
        if _sig.getsignal(signum) is self:
            _sig.signal(signum, self.replaced)
        self.replaced(signum, frame)


def _in_main() -> bool:
    return threading.current_thread() is threading.main_thread()


def _deliver() -> None:
    """Runs the saved handler of the first signal received while deferred (it may raise); the
    same signal's repeats go with it (the OS keeps one of each pending), the others stay."""
    global _pending
    if not _pending:
        return
    signum, frame = _pending[0]
    _pending = [p for p in _pending if p[0] != signum]
    handler = _saved.get(signum)
    if handler is not None:
        handler(signum, frame or sys._getframe(1))   # (the frame it is delivered in)


def _swap_in() -> None:
    """The recording handler in place of each deferred signal's Python handler (into _saved
    first: an undo puts back whatever it holds). A recorder already in place (left by a swap an
    exception cut short) stands for the handler it replaced."""
    for signum in DEFERRED:
        handler = _sig.getsignal(signum)
        if isinstance(handler, _Recorder):
            _saved.setdefault(signum, handler.replaced)
        elif callable(handler):
            _saved[signum] = handler
            try:
                _sig.signal(signum, _Recorder(handler))
            except ValueError:       # not the main interpreter: nothing to defer
                del _saved[signum]


def _restore(items: list, i: int = 0) -> None:
    """items[i:]'s handlers back where the recorder still stands (not where the app installed
    another meanwhile: a handler that switches to the default on a second Ctrl-C); each one even
    when a handler raised as an earlier one went back."""
    if i == len(items):
        return
    signum, handler = items[i]
    try:
        if isinstance(_sig.getsignal(signum), _Recorder):
            _sig.signal(signum, handler)
    except ValueError:
        pass
    finally:
        _restore(items, i + 1)


def _swap_out(received: list) -> None:
    """The saved handlers back; the signals received meanwhile, each once, into `received`.
    (`x, _x = _x, new`: no signal check between a load and a store, so a state is taken whole.)"""
    global _saved, _pending
    saved, _saved = _saved, {}
    try:
        _restore(list(saved.items()))
    finally:
        pending, _pending = _pending, []
        seen = set()
        for signum, frame in pending:
            if signum in saved and signum not in seen:
                seen.add(signum)
                received.append((signum, frame))


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
            handler(signum, frame or sys._getframe(1))
        elif handler != signal.SIG_IGN:      # (the app set the default meanwhile: the OS applies it)
            os.kill(os.getpid(), signum)
    finally:
        _deliver_all(received, i + 1)


def _close_all() -> None:
    """The handlers back and the signals received handed over: the outermost block's end."""
    received: list = []
    try:
        _swap_out(received)
    finally:
        _deliver_all(received)


class deferred:
    """Context manager: the Python handlers of DEFERRED signals wait until the outermost block
    ends (or a checkpoint())."""

    __slots__ = ("_active", "__weakref__")

    def __enter__(self):
        self._active = _in_main()
        if not self._active:
            return self
        outermost = not _open()
        try:
            if outermost:
                if _saved:           # the last outermost block died without its exit
                    _close_all()
                _swap_in()
            _blocks.append(weakref.ref(self))
        except BaseException:
            # an exception from a handler that ran midway (a signal that arrived just before)
            # and the with block never began: undone here, or the recorders stayed for good
            if outermost and not _open():
                _close_all()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self._active:
            return False
        for i, b in enumerate(_blocks):
            if b() is self:
                del _blocks[i:]      # (with any inner block that died without its exit)
                break
        else:
            return False             # (a fork reset the child, or a block already closed)
        if not _open():              # (an outer block may have died meanwhile)
            _close_all()
        return False


def checkpoint() -> None:
    """Inside deferred(): delivers a signal received so far, here, where the caller's state is
    whole. The handlers stay deferred for the rest of the block, a handler the delivered one
    installed too (a 'second Ctrl-C quits' handler took the next Ctrl-C inside the KV
    accounting)."""
    if _pending and _in_main() and _open():
        try:
            _deliver()
        finally:
            _swap_in()


def _reset_in_child() -> None:
    """A fork from another thread while the main thread held signals back: the child has no such
    block to end, so it gets the handlers back now. (A fork from the main thread inside a block
    leaves the child in that block, which restores them as it ends.)"""
    if threading.get_ident() == _MAIN:
        return
    _blocks.clear()
    _swap_out([])


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
