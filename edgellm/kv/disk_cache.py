"""The on-disk prefix cache: session files under EDGELLM_HOME/cache/, one per (model, prefix key).

Entry files are named `<first 16 hex digits of the model sha256>-<key>.edgesess`, so entries of
one model can be found without opening every file. Only files with that suffix (and the temp
files a killed writer may leave, `.<name>.edgesess.*.tmp`, and the entries a run could not read
and renamed aside, `<name>.edgesess.unreadable-<date>-<time>`) are ever listed or removed:
anything else a user keeps in the directory is left alone. Listing reads each file's header
only (at most MAX_HEADER_BYTES + 16 bytes), never the KV data, and reports unusable files with
their reason instead of raising.
"""
from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from ..fileio import remove_if_writer_dead
from ..model.registry import edgellm_home
from . import session_lock
from .session_file import SessionFileError, read_header

__all__ = ["SUFFIX", "CacheEntry", "cache_dir", "entry_path", "list_entries", "clear", "info"]

SUFFIX = ".edgesess"
_SHA_PREFIX = 16  # hex digits of the model sha256 in a file name
_HEX = re.compile(r"[0-9a-f]{16,}")
_KEY = re.compile(r"[A-Za-z0-9_-]{1,128}")
_TEMP = re.compile(r"\..+" + re.escape(SUFFIX) + r"\..+\.tmp")  # write_session's temp names
_TEMP_GRACE_S = 600.0  # a younger temp file may belong to a writer still running: clear() keeps it
# an entry a run could not read, renamed aside rather than saved over (cli._keep_aside)
_ASIDE = re.compile(r".+" + re.escape(SUFFIX) + r"\.unreadable-\d{8}-\d{6}(-\d+)?")


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    size: int  # bytes on disk
    mtime: float  # seconds since the epoch
    model_sha256: str | None  # from the header; None when the file is unusable
    model_name: str | None  # header meta "model_name", when the writer recorded it
    kv_layout: str | None  # from the header
    n_tokens: int | None  # from the header
    reason: str | None = None  # why the file is unusable; None for a valid entry

    @property
    def valid(self) -> bool:
        return self.reason is None

    @property
    def model_short(self) -> str:
        """What a listing shows for the model: its name, else the sha256 prefix."""
        if self.model_name:
            return self.model_name
        if self.model_sha256:
            return self.model_sha256[:_SHA_PREFIX]
        return "?"


def cache_dir(create: bool = False) -> Path:
    """EDGELLM_HOME/cache; made (with parents) when create is true."""
    d = edgellm_home() / "cache"
    if create:
        d.mkdir(parents=True, exist_ok=True)
    return d


def entry_path(model_sha256: str, key: str) -> Path:
    """Where the cache entry for this model and prefix key lives (whether or not it exists).
    model_sha256: lowercase hex (>= 16 digits); key: 1..128 of [A-Za-z0-9_-], e.g. a hex hash of
    the token prefix. Anything else is a programmer error (ValueError): a key must never be able
    to name a path outside the cache directory."""
    if not isinstance(model_sha256, str) or not _HEX.fullmatch(model_sha256):
        raise ValueError(f"entry_path: model_sha256 must be lowercase hex (>= 16 digits), "
                         f"got {model_sha256!r}")
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"entry_path: key must be 1..128 characters of [A-Za-z0-9_-], "
                         f"got {key!r}")
    return cache_dir() / f"{model_sha256[:_SHA_PREFIX]}-{key}{SUFFIX}"


def _candidates() -> list[os.DirEntry]:
    try:
        with os.scandir(cache_dir()) as it:
            return [e for e in it if e.name.endswith(SUFFIX) or _TEMP.fullmatch(e.name) or _ASIDE.fullmatch(e.name)]
    except OSError:   # (absent, not a folder, a link loop: no entries to list)
        return []


def _entry(e: os.DirEntry) -> CacheEntry:
    path = Path(e.path)
    try:
        st = e.stat(follow_symlinks=False)
    except OSError as err:
        return CacheEntry(path, 0, 0.0, None, None, None, None, f"cannot stat: {err.strerror}")

    def bad(reason: str) -> CacheEntry:
        return CacheEntry(path, st.st_size, st.st_mtime, None, None, None, None, reason)

    if _TEMP.fullmatch(e.name):
        return bad("temp file of an interrupted (or still running) write")
    if not stat.S_ISREG(st.st_mode):  # a symlink is not followed: it could point anywhere
        return bad("not a regular file")
    try:
        h = read_header(path)
    except SessionFileError as err:
        return bad(f"kept aside, unreadable: {err.reason}" if _ASIDE.fullmatch(e.name) else err.reason)
    if h is None:  # removed between the listing and the read
        return bad("vanished while listing")
    if _ASIDE.fullmatch(e.name):   # (listed and cleared: they piled up unseen, `clear --all` left them)
        return bad("kept aside by a run that could not read it")
    name = h.meta.get("model_name")
    return CacheEntry(path, st.st_size, st.st_mtime, h.model_sha256,
                      name if isinstance(name, str) else None, h.kv_layout, h.n_tokens)


def list_entries() -> list[CacheEntry]:
    """Every cache file, newest first; unusable ones carry their reason. Never raises for the
    content of the directory (a missing directory is an empty cache)."""
    out = [_entry(e) for e in _candidates()]
    out.sort(key=lambda c: (-c.mtime, c.path.name))
    return out


def clear(model_sha256: str | None = None, in_use: list[Path] | None = None) -> int:
    """Remove cache files: all of them, or those of one model (by header, or by file-name
    prefix for files whose header cannot be read). Temp files whose writer still runs are kept,
    and those without their writer's pid (older edgellm) while younger than _TEMP_GRACE_S; so
    are sessions a running `edgellm run` or `chat` holds (kv.session_lock), listed in in_use
    when given. Returns the number of files removed."""
    if model_sha256 is not None and not isinstance(model_sha256, str):
        raise TypeError(f"clear: model_sha256 must be a str or None, got {model_sha256!r}")
    removed, now = 0, time.time()
    for c in list_entries():
        if model_sha256 is not None:
            mine = (c.model_sha256 == model_sha256 if c.valid
                    else c.path.name.lstrip(".").startswith(model_sha256[:_SHA_PREFIX] + "-"))
            if not mine:
                continue
        if _TEMP.fullmatch(c.path.name):
            # (a dead writer's file goes under its lock: a writer taking the name meanwhile
            # makes another)
            try:
                alive = remove_if_writer_dead(c.path)   # (None: a name without its writer's pid, older files)
            except FileNotFoundError:
                continue
            if alive is False:
                removed += 1
                continue
            if alive or now - c.mtime < _TEMP_GRACE_S:
                continue
        elif session_lock.in_use(c.path):
            if in_use is not None:
                in_use.append(c.path)
            continue
        try:
            c.path.unlink()
        except FileNotFoundError:
            continue
        except IsADirectoryError:  # a directory with our suffix is not ours to delete
            continue
        removed += 1
    return removed


def info() -> dict:
    """Summary for `edgellm cache info`."""
    entries = list_entries()
    valid = [c for c in entries if c.valid]
    return {
        "directory": str(cache_dir()),
        "entries": len(entries),
        "valid": len(valid),
        "invalid": len(entries) - len(valid),
        "total_bytes": sum(c.size for c in entries),
        "tokens": sum(c.n_tokens or 0 for c in valid),
    }
