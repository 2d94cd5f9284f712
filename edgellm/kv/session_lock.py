"""One `edgellm run` or `chat` at a time on a session file, across processes.

Two runs continuing one session at once each read it, answered and saved: the last save
replaced the other's turn (with a warning). The CLI holds an advisory lock (flock) on the
session from before it reads the file until the command ends, so a second run waits, then
continues the conversation the first one saved.

The lock file lives under EDGELLM_HOME/locks, named by a hash of the session's real path
(links resolved, so two links to one file share it), never beside the user's file or among
the cache's entries. It holds the holder's pid, for the waiting run's message. The OS releases
the lock when its holder exits, however it ends; the small file stays for the next run. Where
no lock can be taken (a read-only EDGELLM_HOME, a file system without flock) hold() says why and
the run goes on unserialized; its save still warns when the file changed since it was read.
The Python API takes no lock: an app serializes its own engines.
"""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Callable

from ..model.registry import edgellm_home

__all__ = ["SessionLock", "hold", "in_use", "lock_path"]


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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # (O_NOFOLLOW: a link planted there would make this run create or lock another file)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o600)
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
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except OSError:
            pass   # (only the waiting message reads it)
    except BaseException:
        os.close(fd)
        raise
    return SessionLock(fd, path), None


def in_use(session: str | os.PathLike) -> bool:
    """True while a run holds the session's lock (`cache clear` keeps such a file: the chat holding
    it would only save it again). Creates nothing; False where there is no lock to test."""
    try:
        import fcntl
        fd = os.open(lock_path(session), os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except (ImportError, OSError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False
