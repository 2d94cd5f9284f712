"""Small file-system helpers shared by the writers of models, sessions and profiles."""
from __future__ import annotations

import os
from pathlib import Path


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
