"""Small file-system helpers shared by the writers of models, sessions and profiles."""
from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

try:
    import fcntl
except ImportError:   # (Windows: not a target; cleaners go by the pid alone)
    fcntl = None  # type: ignore[assignment]


def write_atomic(path: str | os.PathLike, data: bytes, mode: int | None = None) -> None:
    """Write `data` to `path` so that a reader sees the old file or the whole new one, never a
    part: a temp file in the same directory, fsync, rename, fsync the directory. The directory is
    made if missing; on any failure the temp file is removed and the error raised. mode: the
    file's permissions less the process's umask, as open() gives them (default: the temp file's
    0600, for caches; a user's output wants 0644, which a umask of 077 keeps owner-only)."""
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():
        # the rename would replace a device or a pipe with a regular file (as root: /dev/null)
        raise OSError(errno.EINVAL, "not a regular file (a device, pipe or socket)", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_beside(path)
    try:
        if mode is not None:
            os.fchmod(fd, mode & ~current_umask())
        with os.fdopen(fd, "wb") as f:   # (closing it drops the lock: renamed first)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def os_error_text(e: OSError) -> str:
    """The system's words for an OSError and its errno's name, 'Permission denied (EACCES)': the
    real cause, whichever it is (a refused write in /proc was reported as a full disk)."""
    name = errno.errorcode.get(e.errno) if isinstance(e.errno, int) else None
    text = e.strerror or str(e)
    return f"{text} ({name})" if name else text


def file_state(path: str | os.PathLike) -> tuple | None:
    """(inode, size, mtime) of a file, None where it is not there: whether it changed since."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def temp_beside(path: Path, suffix: str = ".tmp") -> tuple[int, str]:
    """(fd, name) of a new temporary file beside `path`, locked by this writer (locked_temp); first the
    folder's temporary files whose writers are dead are removed (a killed writer, SIGKILL or a
    phone's low-memory killer, cannot clean up: a session's save left 54 MiB in 3 files)."""
    remove_dead_writers(path.parent)
    # the temp name adds ~30 bytes: a valid name of 230-255 bytes failed with "File name too long"
    # after the whole answer (a probe); such a name is cut in the temp name only
    name = cut_name(path.name, _TEMP_NAME_MAX, _TEMP_NAME_MAX // 2)
    return locked_temp(path.parent, f".{name}.{writer_tag()}.", suffix)


def locked_temp(d: str | os.PathLike, prefix: str, suffix: str = "", folder: bool = False) -> tuple[int, str]:
    """(fd, name) of a new temporary file (folder=True: a folder, fd open on it) in `d`, holding
    the lock that tells cleaners its writer is alive (see writer_alive). The lock lasts as long
    as fd stays open: close it only after the rename into place or the removal."""
    for _ in range(_TEMP_TRIES):
        if folder:
            name = tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=d)
            try:
                fd = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            except BaseException:
                os.rmdir(name)
                raise
        else:
            fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=d)
        if _lock_new(fd, name):
            return fd, name
        # a cleaner took it between its creation and the lock (it found it unlocked): another one
        os.close(fd)
        try:
            os.rmdir(name) if folder else os.unlink(name)
        except OSError:
            pass
    raise OSError(errno.EAGAIN, f"no temporary name in {d} could be locked ({_TEMP_TRIES} tries)")


_TEMP_TRIES = 100


def _lock_new(fd: int, name: str) -> bool:
    """Lock a temporary entry just made; False when a cleaner holds it or has removed it already
    (the name no longer leads to fd's inode)."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:     # no flock on this file system (some NFS mounts): cleaners go by the pid
        return True
    try:
        st = os.stat(name, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return _same_inode(st, os.fstat(fd))


def _same_inode(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def cut_name(name: str, longest: int, keep: int) -> str:
    """name, or its first `keep` bytes when it is longer than `longest` bytes: room for what a
    derived name adds (a temp or an aside suffix) within NAME_MAX (a cut character keeps its
    bytes, as the file system would)."""
    raw = os.fsencode(name)
    return os.fsdecode(raw[:keep]) if len(raw) > longest else name


# names longer than this (bytes) are cut in their temp file's name: NAME_MAX is 255
_TEMP_NAME_MAX = 200


def read_capped(path: str | os.PathLike, max_bytes: int) -> bytes:
    """The bytes of a cache file edgellm wrote, read without trusting what is at the path now:
    opened non-blocking (a FIFO planted there hung the read for ever), a regular file only, at
    most max_bytes (a 3 GB sparse file in place of a kernel binary was read whole: 6.4 GB peak
    RSS, 27 s). OSError (FileNotFoundError when absent) otherwise: callers' cache-miss path."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if st.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"{st.st_size:,} bytes, more than the {max_bytes:,} expected", str(path))
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:   # (it grew since the fstat)
        raise OSError(errno.EFBIG, f"more than the {max_bytes:,} bytes expected", str(path))
    return data


# a bundle.json `edgellm build` writes is ~2 KB
BUNDLE_JSON_MAX = 1 << 20


def read_bundle_json(path: str | os.PathLike) -> bytes:
    """A bundle.json's bytes, read as a file someone else may have put there: a FIFO in its place
    hung `build` (and, beside EDGELLM_NEON_LIB, every command) for ever; a link to /dev/zero grew
    it to 24 GB (a probe). OSError for anything but a regular file of at most BUNDLE_JSON_MAX.
    (Here, not in toolchain: the library loader reads it, and importing the toolchain cost every
    run 4.5 MiB of RSS.)"""
    return read_capped(path, BUNDLE_JSON_MAX)


def clear_odd_entry(path: str | os.PathLike) -> None:
    """For a cache about to write `path`: remove what is there if it is not a regular file (a
    FIFO, a device link, a link loop, a folder), which write_atomic would refuse to replace and
    the cache would then reject on every load. Only for paths a cache owns; errors are ignored."""
    p = Path(path)
    try:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.is_symlink() or (p.exists() and not p.is_file()):
            p.unlink()
    except OSError:
        pass


def stat_key(path: str | os.PathLike) -> str:
    """'inode size mtime_ns ctime_ns' of a file: equal as long as nothing wrote to, replaced or
    touched it (a write moves ctime, which no process can set back), for the caches that
    hash a file whole once and then trust it while this stays the same."""
    st = os.stat(path)
    return f"{st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}"


def current_umask() -> int:
    """The process's umask. Read from /proc/self/status where the kernel gives it (Linux 4.7+):
    os.umask can only be read by setting it, and between the set and the restore another
    thread's new file would get the temporary mask."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_dir(d: str | os.PathLike) -> None:
    """Make a rename inside `d` durable. Some platforms and filesystems cannot open or fsync a
    directory (Windows); the file itself is already synced there, so that is not an error."""
    try:
        fd = os.open(Path(d), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# Temporary names carry their writer's pid ("lockpid1234"), so that one a killed writer left (SIGKILL,
# a phone's low-memory killer: nothing can clean up) is recognised by the next writer and removed.
# Only the exact shapes edgellm makes: a file ".NAME.lockpidN.RANDOM.tmp|part" (mkstemp), a folder
# ".pull-lockpidN-RANDOM" (mkdtemp). A looser match ("-pidN-" or ".pidN." anywhere) took a user's
# ".notes.pid999999.txt" and, with rmtree, a ".backup-pid999998-old" folder from the folder
# `quantize -o` wrote to.
#
# Whether the writer lives is told by a lock, not by its pid: the writer holds an exclusive flock
# on its file (on a folder: on the folder) until it has renamed or removed it, and the kernel drops
# it when the writer dies, however it dies. A pid means nothing across PID namespaces (containers
# sharing a models volume): a live writer in another one looked dead, its file was deleted
# mid-write; and a dead writer's pid taken by another process kept its file for good.
# "lockpid" names say their writer locks: unlocked, the writer is gone, whatever the pid. Names
# of older edgellm ("pidN", no lock) are judged by the pid as before (their writers may still
# run during an upgrade); so is a locking name where flock fails (some NFS mounts).
# (Older edgellm matches only ".pidN." and "-pidN-": it leaves "lockpid" names alone.)
_TAGGED_FILE = re.compile(r"^\..+\.(lock)?pid(\d+)\.[A-Za-z0-9_]+\.(?:tmp|part)$")
_TAGGED_DIR = re.compile(r"^\.pull-(lock)?pid(\d+)-[A-Za-z0-9_]+$")


def writer_tag() -> str:
    """The mark a temporary name carries: this writer locks its file, and its pid (a hint for
    people, and the test where flock fails)."""
    return f"lockpid{os.getpid()}"


def writer_alive(path: str | os.PathLike) -> bool | None:
    """Whether the writer of the temporary file or folder at `path` still writes it; None when
    the name carries no writer (not a tagged temporary name) or it cannot be checked (another
    user's file or process)."""
    alive, fd, _ = _judge(path)
    if fd is not None:
        os.close(fd)
    return alive


def remove_if_writer_dead(path: str | os.PathLike) -> bool | None:
    """writer_alive(path), having removed the file or folder when that is False: under the dead
    writer's lock, so that a new writer cannot take the name meanwhile (it makes another).
    OSError from the removal is raised."""
    alive, fd, folder = _judge(path)
    try:
        if alive is False:
            shutil.rmtree(path) if folder else os.unlink(path)
    finally:
        if fd is not None:
            os.close(fd)
    return alive


def _judge(path: str | os.PathLike) -> tuple[bool | None, int | None, bool]:
    """(writer_alive, an fd holding the writer's lock when alive is False and a lock could be
    taken, whether it is a folder). The name must still lead to the inode locked: a writer that
    renamed its file into place and let go of the lock left nothing, or another file, there."""
    name = os.path.basename(os.fspath(path))
    try:
        folder = stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        folder = False
    m = (_TAGGED_DIR if folder else _TAGGED_FILE).match(name)
    if not m:
        return None, None, folder
    pid = int(m.group(2))
    if not m.group(1) or fcntl is None:      # (an older edgellm's name: no lock to look for)
        return _pid_alive(pid), None, folder
    try:   # (non-blocking, no link followed: a FIFO or a link planted under a temp name)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None, None, folder            # gone, a link, or another user's: not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return True, None, folder
    except OSError:         # no flock on this file system (some NFS mounts): the pid is all there is
        os.close(fd)
        return _pid_alive(pid), None, folder
    try:
        st = os.fstat(fd)
        ours = _same_inode(st, os.stat(path, follow_symlinks=False)) and stat.S_ISDIR(st.st_mode) == folder
    except OSError:
        ours = False
    if not ours:
        os.close(fd)
        return None, None, folder
    return False, fd, folder


def _pid_alive(pid: int) -> bool | None:
    """Whether a process of this pid runs, in this PID namespace; None when it cannot be told."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return None     # another user's process (or no such check here): not ours to judge
    return True


def remove_dead_writers(d: str | os.PathLike) -> int:
    """Remove the temporary files and folders in `d` whose writer is gone; returns how many."""
    try:
        entries = list(os.scandir(d))
    except OSError:
        return 0
    n = 0
    for e in entries:
        try:
            is_dir = e.is_dir(follow_symlinks=False)
            if not (is_dir or e.is_file(follow_symlinks=False)) or not (_TAGGED_DIR if is_dir else _TAGGED_FILE).match(e.name):
                continue            # (a name test first: most entries are no temporary of ours)
            if remove_if_writer_dead(e.path) is False:
                n += 1
        except OSError:
            pass
    return n
