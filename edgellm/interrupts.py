"""Ctrl-C held back while the engine's state is mid-change.

Python raises KeyboardInterrupt (SIGINT's default handler) in the main thread between any two
bytecodes. Raised inside the KV pool's accounting it left blocks that no sequence held and no
clear_cache() returned (3 of 128 lost for good), or a refcount one short, after which every call
failed with KVInvariantError; raised between a sequence's open and the try that closes it, the
sequence leaked. A notebook's interrupt button or a Ctrl-C does exactly that.

Inside `deferred()` (Engine.turn enters it: every change to the KV store happens in a turn) the
SIGINT handler only records the signal; the handler that was installed runs when the outermost
block ends, or earlier at a `checkpoint()`, a point where the state is whole (between prefill
chunks: a long prompt still stops within a chunk). The native kernels never saw Ctrl-C before
either (a signal's Python handler runs when the C call returns), so the delay is the Python
bookkeeping's microseconds, or one chunk at most.

Only the main thread receives signals, so elsewhere these are no-ops. Handlers that are not Python
callables (SIG_IGN, SIG_DFL) raise nothing and are left in place.
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

_depth = 0                     # nesting of deferred() in the main thread
_saved = None                  # the handler deferred() replaced (None: nothing replaced)
_pending: list = []            # (signum, frame) received while deferred


def _record(signum, frame) -> None:
    _pending.append((signum, frame))


def _in_main() -> bool:
    return threading.current_thread() is threading.main_thread()


def _deliver() -> None:
    """Runs the saved handler for a signal received while deferred (it may raise)."""
    if _pending and _saved is not None:
        signum, frame = _pending[0]
        _pending.clear()
        _saved(signum, frame)


class deferred:
    """Context manager: SIGINT's Python handler waits until the outermost block ends."""

    __slots__ = ("_active",)

    def __enter__(self):
        global _depth, _saved
        self._active = _in_main()
        if not self._active:
            return self
        if _depth == 0:
            handler = _sig.getsignal(signal.SIGINT)
            if callable(handler) and handler is not _record:
                try:
                    _sig.signal(signal.SIGINT, _record)
                    _saved = handler
                except ValueError:       # not the main interpreter: nothing to defer
                    _saved = None
        _depth += 1
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        global _depth, _saved
        if not self._active:
            return False
        _depth -= 1
        if _depth == 0 and _saved is not None:
            handler = _saved
            _sig.signal(signal.SIGINT, handler)
            try:
                _deliver()
            finally:
                _saved = None
                _pending.clear()
        return False


def checkpoint() -> None:
    """Inside deferred(): delivers a Ctrl-C received so far, here, where the caller's state is
    whole. The handler stays deferred for the rest of the block."""
    if _depth and _pending and _in_main():
        _deliver()


def _reset_in_child() -> None:
    """A fork from another thread while the main thread held Ctrl-C back: the child has no such
    block to end, so it gets the handler back now."""
    global _depth, _saved
    if _saved is not None:
        try:
            _sig.signal(signal.SIGINT, _saved)
        except ValueError:
            pass
    _depth, _saved = 0, None
    _pending.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
