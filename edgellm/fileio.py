"""Small file-system helpers shared by the writers of models, sessions and profiles."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees the old file or the whole new one, never a
    part: a temp file in the same directory, fsync, rename, fsync the directory. The directory is
    made if missing; on any failure the temp file is removed and the error raised."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


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
