"""Starting the runtime's background threads so that process signals reach the app's threads.

The kernel hands a process signal (Ctrl-C's SIGINT, SIGTERM) to any thread that does not block
it. Python runs the handler in the main thread, but one delivered to a background thread does not
interrupt the main thread's blocking call: a chat sitting in its prompt's read ignored about one
Ctrl-C in four while the weights were still paging in. Threads started here (and the native pool's
workers, which block every signal themselves) leave them to the app's threads.
"""
from __future__ import annotations

import signal
import threading

_QUIET = {signal.SIGINT, signal.SIGTERM}


def start_quietly(thread: threading.Thread) -> None:
    """thread.start() with SIGINT and SIGTERM blocked in the new thread (it inherits the mask
    in force when it is created: no window in which it could take one)."""
    if not hasattr(signal, "pthread_sigmask"):
        thread.start()
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _QUIET)
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
