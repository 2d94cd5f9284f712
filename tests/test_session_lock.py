"""Runs on one session take turns (kv.session_lock): a second `run --session` waits for the one
holding the session, says so, then continues what the first saved; where no lock can be taken
the run says why and goes on."""
import os
import subprocess
import sys
import threading
import time

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.cli import app
from edgellm.kv import session_lock
from tests.synthetic import write_tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("lock") / "tiny.gguf", tensor_type=QT.F16, seed=3).path)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_second_holder_waits_for_the_first_and_learns_its_pid(tmp_path, home):
    f = tmp_path / "s.edgesess"
    first, why = session_lock.hold(f, lambda pid: pytest.fail("the first holder waited"))
    assert first is not None and why is None
    waited, got = [], []

    def second():
        lock, _ = session_lock.hold(f, waited.append)
        got.append(lock)

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.3)
    assert waited == [os.getpid()] and not got   # still waiting, told who holds it
    first.release()
    t.join(10)
    assert got and got[0] is not None
    got[0].release()


def test_links_to_one_session_share_its_lock(tmp_path, home):
    f = tmp_path / "s.edgesess"
    f.write_bytes(b"")
    (tmp_path / "link.edgesess").symlink_to(f)
    assert session_lock.lock_path(tmp_path / "link.edgesess") == session_lock.lock_path(f)
    assert session_lock.lock_path(f).parent == home / "locks"


def test_no_lock_where_none_can_be_taken(tmp_path, home):
    home.mkdir()
    (home / "locks").write_text("a file, not a folder")
    lock, why = session_lock.hold(tmp_path / "s.edgesess", lambda pid: None)
    assert lock is None and "locks" in why
    (home / "locks").unlink()
    (home / "locks").mkdir()
    target = tmp_path / "elsewhere"
    session_lock.lock_path(tmp_path / "s.edgesess").symlink_to(target)   # a link planted as the lock file
    lock, why = session_lock.hold(tmp_path / "s.edgesess", lambda pid: None)
    assert lock is None and why and not target.exists()


def test_run_waits_for_the_run_holding_its_session(tiny, tmp_path, home):
    f = str(tmp_path / "talk.edgesess")
    base = ["run", "--model", tiny, "-n", "3", "--temperature", "0", "--no-stats", "--session", f]
    r1 = runner.invoke(app, base + ["hello there"])
    assert r1.exit_code == 0, r1.output
    held, _ = session_lock.hold(f, lambda pid: None)   # this process plays the other run
    env = dict(os.environ, EDGELLM_HOME=str(home))
    p = subprocess.Popen([sys.executable, "-m", "edgellm.cli", *base, " and more"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        assert p.poll() is None   # waiting, not reading the session under the other run
    finally:
        held.release()
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert f"[session: {f} is in use by another edgellm run (pid {os.getpid()}); waiting" in err
    assert "[session: continuing" in err and "[session: saved" in err
    # the lock went with the command: the next run in this process takes it at once
    r3 = runner.invoke(app, base + [" once more"])
    assert r3.exit_code == 0 and "waiting" not in r3.stderr, r3.output


def test_run_goes_on_unserialized_where_no_lock_can_be_taken(tiny, tmp_path, home):
    home.mkdir()
    (home / "locks").write_text("a file, not a folder")
    f = str(tmp_path / "talk.edgesess")
    r = runner.invoke(app, ["run", "--model", tiny, "-n", "2", "--temperature", "0", "--session", f, "hi"])
    assert r.exit_code == 0, r.output
    assert f"edgellm: warning: cannot lock {f} against other runs" in r.stderr
    assert "[session: saved" in r.stderr


def test_cache_clear_keeps_a_session_a_run_holds(tiny, tmp_path, home):
    r = runner.invoke(app, ["run", "--model", tiny, "-n", "2", "--temperature", "0", "--session", "talk", "hi"])
    assert r.exit_code == 0, r.output
    from edgellm.kv import disk_cache
    (entry,) = [c.path for c in disk_cache.list_entries()]
    held, _ = session_lock.hold(entry, lambda pid: None)    # a chat on it, still running
    try:
        r = runner.invoke(app, ["cache", "clear"])
        assert r.exit_code == 0 and "removed 0 session file(s)" in r.stdout, r.output
        assert f"kept {entry.name}: a running edgellm run or chat holds it" in r.stdout
        assert entry.exists()
    finally:
        held.release()
    r = runner.invoke(app, ["cache", "clear"])
    assert "removed 1 session file(s)" in r.stdout and not entry.exists()


def test_cache_clear_removes_the_lock_files_no_run_holds_and_never_hangs_on_a_fifo(tiny, tmp_path, home):
    for name in ("a", "b"):
        r = runner.invoke(app, ["run", "--model", tiny, "-n", "1", "--temperature", "0", "--session", name, "hi"])
        assert r.exit_code == 0, r.output
    from edgellm.kv import disk_cache
    a, b = sorted(c.path for c in disk_cache.list_entries())
    held, _ = session_lock.hold(a, lambda pid: None)
    fifo = session_lock.lock_path(b)
    fifo.unlink()
    os.mkfifo(fifo)                       # (an open of it without O_NONBLOCK waited for a writer)
    try:
        p = subprocess.run([sys.executable, "-m", "edgellm.cli", "cache", "clear"], env=dict(os.environ),
                           capture_output=True, text=True, timeout=60)
    finally:
        held.release()
    assert p.returncode == 0, p.stderr
    assert f"kept {a.name}" in p.stdout and not b.exists()
    assert sorted(os.listdir(home / "locks")) == sorted([session_lock.lock_path(a).name, fifo.name])
    fifo.unlink()
    runner.invoke(app, ["cache", "clear"])
    assert os.listdir(home / "locks") == []   # unheld: removed


def test_a_run_waiting_on_a_lock_file_that_clear_removes_takes_the_new_one(tmp_path, home):
    f = tmp_path / "s.edgesess"
    first, _ = session_lock.hold(f, lambda pid: None)
    got = []
    t = threading.Thread(target=lambda: got.append(session_lock.hold(f, lambda pid: None)[0]))
    t.start()
    time.sleep(0.2)
    session_lock.lock_path(f).unlink()    # as remove_unheld does once it holds the file
    third, _ = session_lock.hold(f, lambda pid: pytest.fail("the path's new file is free"))
    first.release()
    time.sleep(0.2)
    assert not got                         # it woke on the removed file, and now waits on the new one
    third.release()
    t.join(10)
    assert got and got[0] is not None and session_lock._same_file(got[0].fd, session_lock.lock_path(f))
    got[0].release()
