"""The size bound of the npu unit's on-disk graph caches (cache/npu/onnx, cache/npu/tflite).

Each (model x weight format x bucket) subgraph is its own file holding its own copy of the
weights, so the caches grow with every configuration ever loaded (a probe: 1.8 GiB after ten) on
devices with a few GB of storage. After each write, the least recently used files of that folder
are removed until the folder is at most the cap: EDGELLM_NPU_CACHE_MB (MiB, default
DEFAULT_CAP_MB), applied to each of the two folders. A cache hit sets the file's mtime to now,
so mtime orders the files by last use.

What is never removed: the file just written, and any file a live subgraph of this process was
compiled from (a model larger than the cap keeps all of its files while it is loaded: the folder
stays over the cap until a later write finds them unused). Only regular files with the cache's suffix are counted or
removed: a link is neither (it may point anywhere), nor is a writer's temporary file. A file
another process removes meanwhile is simply gone.
"""
from __future__ import annotations

import logging
import math
import os
import stat
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

log = logging.getLogger("edgellm")

CAP_ENV = "EDGELLM_NPU_CACHE_MB"
# 1 GiB a folder: a 135M-parameter model's int8 subgraphs for the four default buckets take about
# 0.5 GiB, so two configurations stay cached, on a phone where a few GB are free.
DEFAULT_CAP_MB = 1024.0


def cap_bytes(env: str = CAP_ENV, default_mb: float = DEFAULT_CAP_MB,
              what: str = "the npu graph caches keep up to {mb} MiB each") -> int:
    """The cap in bytes from the variable `env` (EDGELLM_NPU_CACHE_MB: MiB, a number > 0), else
    default_mb. ConfigError for anything else: 0 would read as "no bound" to some and "no cache"
    to others, and a word or nan must not silently become either. (The requantized-model cache,
    precision_runtime, takes its cap and eviction from here too: its own variable and default.)"""
    raw = os.environ.get(env)
    if raw is None or not raw.strip():
        return int(default_mb * 2**20)
    try:
        mb = float(raw)
    except ValueError:
        mb = math.nan
    if not (math.isfinite(mb) and mb > 0):
        raise ConfigError(f"{env}={raw!r} is invalid: expected a number of MiB > 0 "
                          f"(unset, {what.format(mb=f'{default_mb:.0f}')})")
    return max(1, int(mb * 2**20))


# --- files in use by live subgraphs of this process ---------------------------------------------

_lock = threading.Lock()
_in_use: dict[str, int] = {}        # absolute path -> live subgraphs compiled from it


def _key(path: str | os.PathLike) -> str:
    # abspath, not resolve(): resolving would follow links, and the eviction walk never does
    return os.path.abspath(os.fspath(path))


def hold(owner: object, path: str | os.PathLike) -> None:
    """Keep `path` from eviction while `owner` (a compiled subgraph) is alive."""
    key = _key(path)
    with _lock:
        _in_use[key] = _in_use.get(key, 0) + 1
    weakref.finalize(owner, _release, key)


def _release(key: str) -> None:
    with _lock:
        n = _in_use.get(key, 0) - 1
        if n > 0:
            _in_use[key] = n
        else:
            _in_use.pop(key, None)


def in_use(path: str | os.PathLike) -> bool:
    with _lock:
        return _key(path) in _in_use


# --- use and eviction ---------------------------------------------------------------------------

def touch(path: str | os.PathLike) -> None:
    """Mark a cache hit: mtime = now. On the path itself (never a link's target); a read-only or
    vanished file only costs its place in the order."""
    try:
        os.utime(path, follow_symlinks=False)
    except (OSError, NotImplementedError):
        pass


@dataclass(frozen=True)
class Usage:
    files: int      # regular files with the cache's suffix
    bytes: int      # their total size


def _entries(folder: Path, suffix: str) -> list[tuple[float, str, int]]:
    """(mtime, path, size) of the regular files named *suffix in folder; links are skipped."""
    out = []
    try:
        with os.scandir(folder) as it:
            for e in it:
                if not e.name.endswith(suffix):     # (a writer's temp file ends in .tmp)
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:          # removed by another process meanwhile: gone
                    continue
                if stat.S_ISREG(st.st_mode):
                    out.append((st.st_mtime, e.path, st.st_size))
    except OSError:                      # no folder (nothing cached yet), or unreadable
        return []
    return out


def usage(folder: str | os.PathLike, suffix: str) -> Usage:
    entries = _entries(Path(folder), suffix)
    return Usage(len(entries), sum(size for _, _, size in entries))


def folders() -> list[tuple[Path, str]]:
    """(folder, file suffix) of the two default caches, for `edgellm cache info`."""
    from .npu_onnx import cache_dir_default
    from .npu_tflite import cache_root

    return [(cache_dir_default(), ".onnx"), (cache_root(), ".tflc")]


def evict(folder: str | os.PathLike, suffix: str, keep: str | os.PathLike, label: str = "npu cache",
          env: str = CAP_ENV, default_mb: float = DEFAULT_CAP_MB,
          what: str = "the npu graph caches keep up to {mb} MiB each",
          companion=None) -> int:
    """Remove the least recently used files of `folder` until it holds at most the cap
    (cap_bytes(env, default_mb, what)), never `keep` (the file just written) nor a file in use;
    returns the number removed. companion(path): a file that goes with each removed one (a
    sidecar). One INFO line when any was removed. Never raises for the folder's content."""
    cap = cap_bytes(env, default_mb, what)
    entries = _entries(Path(folder), suffix)
    total = sum(size for _, _, size in entries)
    if total <= cap:
        return 0
    keep = _key(keep)
    n = freed = 0
    for _, path, size in sorted(entries):           # oldest use first
        if total <= cap:
            break
        if _key(path) == keep or in_use(path):
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:                    # another process evicted it: gone all the same
            total -= size
            continue
        except OSError as e:                         # read-only, or no permission: kept
            log.debug("npu cache: cannot remove %s: %s", path, e)
            continue
        total -= size
        n += 1
        freed += size
        if companion is not None:
            try:
                os.unlink(companion(Path(path)))
            except OSError:
                pass
    if n:
        over = f"; {total / 2**20:.1f} MiB in use (or not removable) stays above it" if total > cap else ""
        log.info("%s %s: evicted %d file(s), %.1f MiB, to stay under %.1f MiB (%s)%s",
                 label, folder, n, freed / 2**20, cap / 2**20, env, over)
    return n
