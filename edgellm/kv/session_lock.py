"""One `edgellm run` or `chat` at a time on a session file, across processes.

Two runs continuing one session at once each read it, answered and saved: the last save
replaced the other's turn (with a warning). The CLI holds an advisory lock (flock) on the
session from before it reads the file until the command ends, so a second run waits, then
continues the conversation the first one saved.

The lock file lives under EDGELLM_HOME/locks, named by a hash of the session's real path
(links resolved, so two links to one file share it), never beside the user's file or among
the cache's entries. It holds the holder's pid, for the waiting run's message. The OS releases
the lock when its holder exits, however it ends; the small file stays for the next run, until
`cache clear` removes the ones no run holds (a holder checks, once it has the lock, that its file
is still the one at the path, so a removal cannot let two runs in). Where
no lock can be taken (a read-only EDGELLM_HOME, a file system without flock) hold() says why and
the run goes on unserialized; its save still warns when the file changed since it was read.
The Python API takes no lock: an app serializes its own engines (and a process that holds a
session's lock waits on itself if it asks for it again: flock locks belong to open files).
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path
from typing import Callable

from ..model.registry import edgellm_home

__all__ = ["SessionLock", "hold", "in_use", "lock_path", "remove_unheld"]

_NAME = re.compile(r"[0-9a-f]{32}\.lock")
_FLAGS = os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def lock_path(session: str | os.PathLike) -> Path:
    real = os.path.realpath(os.fspath(session))
    return edgellm_home() / "locks" / (hashlib.sha256(os.fsencode(real)).hexdigest()[:32] + ".lock")


class SessionLock:
    """A held lock; release() (or the process's end) lets the next run in."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)   # (closing the descriptor releases the flock)
            self.fd = -1


def _holder(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def hold(session: str | os.PathLike,
         on_wait: Callable[[int | None], None]) -> tuple[SessionLock | None, str | None]:
    """Takes the session's lock, waiting for another run that holds it (on_wait(its pid or None)
    first). Returns (the lock, None), or (None, why no lock could be taken)."""
    try:
        import fcntl
    except ImportError:
        return None, "this system has no flock"
    path = lock_path(session)
    while True:
        lock, why = _hold_file(fcntl, path, on_wait)
        if lock is not None or why is not None:
            return lock, why


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _hold_file(fcntl, path: Path, on_wait) -> tuple[SessionLock | None, str | None]:
    """hold()'s one try: (None, None) when the file was removed (`cache clear`) while this run
    waited on it: the caller tries again on the path's new file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # (O_NOFOLLOW: a link planted there would make this run create or lock another file;
        # O_NONBLOCK: a FIFO there would block the open)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _FLAGS, 0o600)
    except OSError as e:
        return None, f"{path}: {e.strerror or e}"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None, f"{path} is not a regular file"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait(_holder(fd))
            fcntl.flock(fd, fcntl.LOCK_EX)   # (Ctrl-C raises KeyboardInterrupt here)
        except OSError as e:   # (a file system without flock)
            os.close(fd)
            return None, f"{path}: {e.strerror or e}"
        if not _same_file(fd, path):
            os.close(fd)
            return None, None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except OSError:
            pass   # (only the waiting message reads it)
    except BaseException:
        os.close(fd)
        raise
    return SessionLock(fd, path), None


def _try_lock(path: Path) -> tuple[int | None, bool]:
    """(a descriptor holding path's lock, taken without waiting; the caller closes it, False) or
    (None, whether a run holds it). Creates nothing; a FIFO or other non-file is never held."""
    try:
        import fcntl
        fd = os.open(path, os.O_RDONLY | _FLAGS)
    except (ImportError, OSError):
        return None, False
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd, False
        held = False
    except BlockingIOError:
        held = True
    except OSError:
        held = False
    os.close(fd)
    return None, held


def in_use(session: str | os.PathLike) -> bool:
    """True while a run holds the session's lock (`cache clear` keeps such a file: the chat holding
    it would only save it again). Creates nothing; False where there is no lock to test."""
    fd, held = _try_lock(lock_path(session))
    if fd is not None:
        os.close(fd)
    return held


def remove_unheld() -> int:
    """Removes the lock files no run holds (`cache clear`); returns how many. Each is removed
    while this process holds it, and a run that waited on it tries again on a new file."""
    try:
        names = [n for n in os.listdir(edgellm_home() / "locks") if _NAME.fullmatch(n)]
    except OSError:
        return 0
    removed = 0
    for name in names:
        path = edgellm_home() / "locks" / name
        fd, _ = _try_lock(path)
        if fd is None:
            continue
        try:
            if _same_file(fd, path):
                path.unlink()
                removed += 1
        except OSError:   # (gone meanwhile)
            pass
        finally:
            os.close(fd)
    return removed
