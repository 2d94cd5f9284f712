"""The CLI stopped by a signal, and outputs on file systems that refuse files (a helper's probe):

- an interrupted `quantize` (Ctrl-C, SIGTERM) exited 130 with an empty line, or 143 with nothing:
  now one line saying so and what became of --out (nothing written, or left as it was);
- `quantize -o /proc/x.gguf` was "the file needs 89.7 MiB but /proc has 0.0 MiB free": now the
  system's cause (ENOENT, EACCES, EROFS...) and the user's path;
- a Ctrl-C just after `run --session` saved (or during the save) printed "Exception ignored in
  ... KeyboardInterrupt" with a traceback and exited 0: now the save ends whole, then one line
  and exit 130.

The signals are sent while the child is paused at a known point (a patched function prints a
marker and sleeps), so each test interrupts the same moment every time."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import write_tiny_model  # noqa: E402

from edgellm import cli, fileio, requant  # noqa: E402
from edgellm.errors import ConfigError  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# the CLI in a child whose `patch` code runs first; MARK on stderr says it reached the pause
CHILD = """
import sys, time
{patch}
from edgellm.cli import main
sys.argv[0] = "edgellm"
main()
"""

PAUSE_IN_CONVERSION = """
from edgellm import requant
real, calls = requant.read_tensor, []
def paused(*a, **k):
    out = real(*a, **k)
    calls.append(1)
    if len(calls) == 2:      # (the header and a tensor are in the temporary file)
        sys.stderr.write("MARK\\n"); sys.stderr.flush()
        time.sleep(30)
    return out
requant.read_tensor = paused
"""

PAUSE_IN_SESSION_SAVE = """
from edgellm.kv import session_file
real, real_temp, writing = session_file.bulk_sha256, session_file.temp_beside, []
def temp(*a, **k):          # (only write_session makes one: the load's checksum is not paused)
    writing.append(1)
    return real_temp(*a, **k)
session_file.temp_beside = temp
class Slow:
    def __init__(self):
        self.h, self.n = real(), 0
    def update(self, b):
        self.h.update(b)
        self.n += 1
        if writing and self.n == 2:     # the header is written: mid-file
            sys.stderr.write("MARK\\n"); sys.stderr.flush()
            time.sleep(2)
    def digest(self):
        return self.h.digest()
session_file.bulk_sha256 = Slow
"""


def _env(home: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), EDGELLM_HOME=str(home))


def _interrupt_at_mark(patch: str, args: list[str], sig: int, cwd: Path, home: Path) -> tuple[int, str]:
    p = subprocess.Popen([sys.executable, "-c", CHILD.format(patch=patch), *args], cwd=cwd, env=_env(home),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = b""
    try:
        while b"MARK\n" not in err:
            chunk = p.stderr.read1(4096)
            if not chunk:
                break
            err += chunk
        assert b"MARK\n" in err, err.decode(errors="replace")
        p.send_signal(sig)
        _, rest = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, (err + rest).decode(errors="replace")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny.gguf", tensor_type=QT.F32, seed=3).path


@pytest.mark.parametrize("sig,code,words", [(signal.SIGINT, 130, "Ctrl-C (SIGINT)"),
                                            (signal.SIGTERM, 143, "SIGTERM")])
def test_an_interrupted_quantize_says_so_and_leaves_no_output(tiny, tmp_path, sig, code, words):
    out = tmp_path / "out"
    out.mkdir()
    rc, err = _interrupt_at_mark(PAUSE_IN_CONVERSION, ["quantize", tiny, "--plan", "fast", "-o", "q.gguf"],
                                 sig, out, tmp_path / "home")
    assert rc == code, err
    lines = [ln for ln in err.splitlines() if "interrupted" in ln]
    assert lines == [f"edgellm: quantize: interrupted by {words}; nothing was written to --out q.gguf"], err
    assert "Traceback" not in err
    assert sorted(os.listdir(out)) == []          # no output, no temporary file


def test_an_interrupted_quantize_force_leaves_the_old_file(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "q.gguf").write_bytes(b"the old one")
    rc, err = _interrupt_at_mark(PAUSE_IN_CONVERSION, ["quantize", tiny, "--plan", "fast", "-o", "q.gguf",
                                                       "--force"], signal.SIGINT, out, tmp_path / "home")
    assert rc == 130, err
    assert "edgellm: quantize: interrupted by Ctrl-C (SIGINT); --out q.gguf was left as it was" in err, err
    assert sorted(os.listdir(out)) == ["q.gguf"] and (out / "q.gguf").read_bytes() == b"the old one"


def test_a_signal_raised_inside_a_finalizer_is_not_lost(tmp_path):
    """A Ctrl-C that lands in a __del__ or a weakref callback: Python printed 'Exception ignored'
    and the command ran on to exit 0. It comes again in plain code: one line, exit 130."""
    patch = """
import os, signal
class Late:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(100))          # (the handler runs here, inside the finalizer)
def body():
    Late()                       # (collected at once: its __del__ runs in this call)
    for _ in range(300):
        time.sleep(0.01)
    print("ran on")
    return []
from edgellm.kv import disk_cache
disk_cache.list_entries = body     # (what `cache list` calls)
"""
    r = subprocess.run([sys.executable, "-c", CHILD.format(patch=patch), "cache", "list"], cwd=tmp_path,
                       env=_env(tmp_path / "home"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 130, (r.returncode, r.stderr)
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "ran on" not in r.stdout
    assert "edgellm: cache list: interrupted by Ctrl-C (SIGINT)" in r.stderr, r.stderr


def test_a_signal_after_the_command_has_ended_says_so(tmp_path):
    """Between the command's end and the interpreter's teardown a Ctrl-C raised in whatever ran
    there (a weakref callback): a traceback, exit 0. Now recorded: one line, exit 130."""
    patch = """
import os, signal
from edgellm import cli
real = cli.interrupted.hold_late_signals
def then_signal():
    real()
    os.kill(os.getpid(), signal.SIGINT)
    sum(range(100))
cli.interrupted.hold_late_signals = then_signal
"""
    r = subprocess.run([sys.executable, "-c", CHILD.format(patch=patch), "cache", "list"], cwd=tmp_path,
                       env=_env(tmp_path / "home"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 130, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    assert ("edgellm: cache list: interrupted by Ctrl-C (SIGINT); it came as edgellm was exiting, after the "
            "command had finished") in r.stderr, r.stderr


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_the_session_save_ends_with_it_saved_whole(real_model_path, tmp_path, sig, code):
    home = tmp_path / "home"
    args = ["run", "Hello", "-m", real_model_path, "-n", "3", "--temperature", "0", "--ctx", "256",
            "--session", "s.edgesess"]
    first = subprocess.run([sys.executable, "-m", "edgellm", *args], cwd=tmp_path, env=_env(home),
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    before = (tmp_path / "s.edgesess").read_bytes()
    rc, err = _interrupt_at_mark(PAUSE_IN_SESSION_SAVE, args, sig, tmp_path, home)
    assert rc == code, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert "[session: saved" in err, err      # the save ran to its end, then the signal
    lines = [ln for ln in err.splitlines() if "interrupted" in ln]
    assert len(lines) == 1 and lines[0].endswith("--session s.edgesess was written whole before the signal"), err
    assert sorted(os.listdir(tmp_path)) == ["home", "s.edgesess"]     # no temporary file
    after = (tmp_path / "s.edgesess").read_bytes()
    assert after != before
    # whole: the next run continues from it
    again = subprocess.run([sys.executable, "-m", "edgellm", *args], cwd=tmp_path, env=_env(home),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "[session: continuing" in again.stderr, again.stderr


# -- outputs where the file system refuses files ------------------------------------------------

@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_quantize_into_proc_names_the_cause_not_a_full_disk(tiny, tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgellm", "quantize", tiny, "--plan", "fast", "-o",
                        "/proc/edgellm-probe33.gguf"], env=_env(tmp_path / "home"), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "/proc/edgellm-probe33.gguf" in r.stderr and "free" not in r.stderr, r.stderr
    if os.geteuid() == 0:    # (as a user, access() already refuses the folder: "is not writable")
        assert "(ENOENT)" in r.stderr, r.stderr


@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM, errno.EROFS, errno.EINVAL])
def test_requantize_names_the_errno_and_the_path_when_the_folder_refuses_files(tiny, tmp_path, monkeypatch,
                                                                                code):
    def refused(path, suffix=".tmp"):
        raise OSError(code, os.strerror(code), str(path.parent / ".x.tmp"))
    monkeypatch.setattr(requant, "temp_beside", refused)
    monkeypatch.setattr(requant, "_free_bytes", lambda d: 0)     # (a pseudo file system's "0 free")
    dst = tmp_path / "q.gguf"
    with pytest.raises(ConfigError) as e:
        requant.requantize_gguf(tiny, dst, {"blk.0.ffn_up.weight": "q8_0"})
    msg = str(e.value)
    assert str(dst) in msg and f"({errno.errorcode[code]})" in msg and "free" not in msg, msg
    assert os.listdir(tmp_path) == []


def test_a_file_system_without_blocks_gives_no_free_figure(monkeypatch):
    class St:
        f_blocks = f_bavail = 0
        f_frsize = 4096
    monkeypatch.setattr(requant.os, "statvfs", lambda d: St())
    assert requant._free_bytes("/anything") is None


def test_a_write_error_names_the_output_and_its_errno(tiny, tmp_path, monkeypatch):
    """An errno from the write (EIO, EROFS on a remount) named the temporary file, or was a bare
    '[Errno 5]'; now the output's path and the errno's name."""
    def failing(self, *a, **k):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(requant._Writer, "write_tensor_data", failing)
    dst = tmp_path / "q.gguf"
    with pytest.raises(ConfigError) as e:
        requant.requantize_gguf(tiny, dst, {"blk.0.ffn_up.weight": "q8_0"})
    assert str(e.value).startswith(f"{dst}: cannot write it: ") and "(EIO)" in str(e.value), str(e.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("code", [errno.EPERM, errno.EROFS, errno.EINVAL])
def test_out_paths_are_tried_before_the_work(tmp_path, monkeypatch, code):
    """access() passes a folder the file system refuses (root in /proc): a file is made there."""
    def refused(path, suffix=".tmp"):
        raise OSError(code, os.strerror(code), str(path))
    monkeypatch.setattr(fileio, "temp_beside", refused)
    with pytest.raises(ConfigError) as e:
        cli.check_out_path(str(tmp_path / "b.json"), "--json")
    assert str(e.value).startswith(f"--json {tmp_path / 'b.json'}: cannot write a file in {tmp_path}: ")
    assert f"({errno.errorcode[code]})" in str(e.value)


def test_the_tried_file_is_removed(tmp_path):
    cli.check_out_path(str(tmp_path / "b.json"), "--json")
    assert os.listdir(tmp_path) == []
