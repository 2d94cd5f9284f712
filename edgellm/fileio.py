"""Small file-system helpers shared by the writers of models, sessions and profiles."""
from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path


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
        with os.fdopen(fd, "wb") as f:
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
    """(fd, name) of a new temporary file beside `path`, named with this writer's pid; first the
    folder's temporary files whose writers are dead are removed (a killed writer, SIGKILL or a
    phone's low-memory killer, cannot clean up: a session's save left 54 MiB in 3 files)."""
    remove_dead_writers(path.parent)
    # the temp name adds ~26 bytes: a valid name of 230-255 bytes failed with "File name too long"
    # after the whole answer (a probe); such a name is cut in the temp name only
    name = cut_name(path.name, _TEMP_NAME_MAX, _TEMP_NAME_MAX // 2)
    return tempfile.mkstemp(dir=path.parent, prefix=f".{name}.{writer_tag()}.", suffix=suffix)


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


# Temporary names carry their writer's pid ("pid1234"), so that one a killed writer left (SIGKILL,
# a phone's low-memory killer: nothing can clean up) is recognised by the next writer and removed.
# Only the exact shapes edgellm makes: a file ".NAME.pidN.RANDOM.tmp|part" (mkstemp), a folder
# ".pull-pidN-RANDOM" (mkdtemp). A looser match ("-pidN-" or ".pidN." anywhere) took a user's
# ".notes.pid999999.txt" and, with rmtree, a ".backup-pid999998-old" folder from the folder
# `quantize -o` wrote to.
_TAGGED_FILE = re.compile(r"^\..+\.pid(\d+)\.[A-Za-z0-9_]+\.(?:tmp|part)$")
_TAGGED_DIR = re.compile(r"^\.pull-pid(\d+)-[A-Za-z0-9_]+$")


def writer_tag() -> str:
    """The mark a temporary name carries: this process's pid."""
    return f"pid{os.getpid()}"


def writer_alive(name: str) -> bool | None:
    """Whether the writer named in a temporary file's name still runs; None when the name
    carries no writer (not a tagged temporary name) or the pid cannot be checked."""
    m = _TAGGED_FILE.match(name) or _TAGGED_DIR.match(name)
    if not m:
        return None
    pid = int(m.group(1))
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
            if not (_TAGGED_DIR if is_dir else _TAGGED_FILE).match(e.name) or writer_alive(e.name) is not False:
                continue
            if is_dir:
                shutil.rmtree(e.path)
            elif e.is_file(follow_symlinks=False):
                os.unlink(e.path)
            else:
                continue
            n += 1
        except OSError:
            pass
    return n
