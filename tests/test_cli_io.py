"""The command line when its input and output fail (from a helper's probe of files, pipes and the
terminal): closed descriptors, a full disk under stdout, bytes that are not UTF-8, a locale
that cannot show the answer, outputs that fail half-way, a home that is not a folder. Each gets
one `edgellm: error:` line and exit 1, and nothing half-written."""
import os
import subprocess
import sys
from collections import Counter

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm import fileio
from edgellm.cli import app
from edgellm.errors import ConfigError
from tests.synthetic import write_tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cli_io") / "tiny.gguf", tensor_type=QT.Q8_0, seed=5).path


def _cli(tmp_path, *args, env=None, **kw):
    """`edgellm ARGS` through main() in a child process."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.run([sys.executable, "-c", "from edgellm.cli import main; main()", *args],
                          env={**os.environ, "EDGELLM_HOME": str(tmp_path / "home"), **(env or {})}, timeout=120,
                          **kw)


def test_a_bad_line_on_a_strict_stdin_costs_that_line_only(tiny, tmp_path):
    """Under a strict UTF-8 stdin (a UTF-8 locale), one bad byte lost the whole buffered chunk
    and the next read looked like the end: no line piped with it was answered."""
    r = _cli(tmp_path, "chat", "-m", tiny, "-n", "1", "--temperature", "0", input=b"Hello\nhi\xff there\nWhat?\n",
             env={"PYTHONIOENCODING": "utf-8:strict"})
    assert r.returncode == 1 and r.stderr.decode().count("not valid UTF-8") == 1, r.stderr
    assert r.stdout == b"\n\n" * 2          # two answers (the tiny model's greedy "\n", then the newline)


def test_closed_descriptors_are_one_line_errors(tiny, tmp_path):
    def closing(fd):
        return lambda: os.close(fd)
    r = _cli(tmp_path, "chat", "-m", tiny, preexec_fn=closing(0))
    assert r.returncode == 1 and b"stdin is closed" in r.stderr and b"Traceback" not in r.stderr, r.stderr
    r = _cli(tmp_path, "run", "hi", "-m", tiny, "-n", "2", preexec_fn=closing(1))
    assert r.returncode == 1 and b"stdout is closed" in r.stderr and b"Traceback" not in r.stderr, r.stderr


def test_a_full_disk_under_stdout_is_named(tiny, tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    for args in (["run", "hi", "-m", tiny, "-n", "2"], ["info", tiny]):
        with open("/dev/full", "w") as full:
            r = _cli(tmp_path, *args, stdout=full, stderr=subprocess.PIPE)
        assert r.returncode == 1 and b"cannot write to stdout: No space left on device" in r.stderr, r.stderr


def test_text_the_locale_cannot_show_is_replaced_not_a_traceback(tmp_path):
    """LC_ALL=C without Python's UTF-8 mode: an answer with an e-acute died mid-way with a
    UnicodeEncodeError (and a --session was not saved)."""
    code = ("import sys; from edgellm import cli; sys.argv = ['edgellm', '--help']\n"
            "try:\n    cli.main()\nexcept SystemExit:\n    pass\nsys.stdout.write('caf\\u00e9\\n')")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONIOENCODING", "LANG", "LC_CTYPE")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60,
                       env={**env, "LC_ALL": "C", "PYTHONUTF8": "0", "EDGELLM_HOME": str(tmp_path / "home")})
    assert r.returncode == 0 and r.stdout.endswith(b"caf?\n"), (r.stdout[-40:], r.stderr[-300:])


def test_arguments_that_are_not_utf8_are_refused_by_name(tiny, tmp_path):
    """A prompt with a stray byte failed inside the chat template with the API's advice about a
    position in the rendered text; a --stop of such bytes was taken and could never match."""
    r = _cli(tmp_path, "run", os.fsencode("hi\udcff"), "--chat", "-m", tiny, "-n", "2")
    assert r.returncode == 1 and b"the prompt is not valid UTF-8 (byte 0xff at character 3)" in r.stderr, r.stderr
    r = _cli(tmp_path, "run", "hi", "--stop", os.fsencode("\udcff"), "-m", tiny, "-n", "2")
    assert r.returncode == 1 and b"--stop is not valid UTF-8" in r.stderr, r.stderr


def test_each_fallback_warning_is_printed_once(tiny, tmp_path):
    """`run --units npu` printed every 'none of --units npu runs it' line twice: bare through
    Python's last-resort log handler, then again as the plan's warning."""
    r = _cli(tmp_path, "run", "hi", "-m", tiny, "-n", "1", "--units", "npu")
    lines = [ln for ln in r.stderr.decode().splitlines() if "none of --units npu runs" in ln]
    assert r.returncode == 0 and lines and max(Counter(lines).values()) == 1, r.stderr
    assert all(ln.startswith("edgellm: warning: ") for ln in lines)


def test_a_failed_output_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    """bench --json (and precision analyze --json, plan --plot) wrote in place: a write that
    failed half-way left a good file cut short, or a new one empty."""
    from edgellm.cli import write_output
    out = tmp_path / "b.json"
    out.write_text('{"good": true}\n')

    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(fileio.os, "fsync", full)
    with pytest.raises(ConfigError, match=r"--json .*b.json: cannot write it: No space left on device"):
        write_output(out, "--json", b"[" * 100000)
    assert out.read_text() == '{"good": true}\n' and os.listdir(tmp_path) == ["b.json"]
    monkeypatch.undo()
    write_output(out, "--json", b"[]\n")
    assert out.read_text() == "[]\n" and oct(out.stat().st_mode & 0o777) == "0o644"


def test_cache_commands_say_when_home_is_not_a_folder_or_a_file_stays(tmp_path, monkeypatch):
    home = tmp_path / "homefile"
    home.write_text("not a folder")
    monkeypatch.setenv("EDGELLM_HOME", str(home))
    for cmd in (["cache", "list"], ["cache", "info"], ["cache", "clear"], ["profile", "--quick"]):
        r = runner.invoke(app, cmd)
        assert r.exit_code == 1 and "homefile" in r.stderr and "not a" in r.stderr.lower(), (cmd, r.output)
    # `cache clear --all` on files it cannot remove said "removed 0 file(s)" and exit 0
    real = tmp_path / "home"
    monkeypatch.setenv("EDGELLM_HOME", str(real))
    stuck = real / "cache" / "opencl" / "prog.bin"
    stuck.parent.mkdir(parents=True)
    stuck.write_bytes(b"x")
    real_unlink = type(stuck).unlink

    def read_only(self, *a, **k):
        if self.name == "prog.bin":
            raise PermissionError(30, "Read-only file system")
        return real_unlink(self, *a, **k)
    monkeypatch.setattr(type(stuck), "unlink", read_only)
    r = runner.invoke(app, ["cache", "clear", "--all"])
    assert r.exit_code == 1 and "could not remove 1 file(s)" in r.stderr and "Read-only file system" in r.stderr
    assert stuck.exists()
