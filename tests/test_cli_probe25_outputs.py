"""Outputs that replaced files they should not have (a probing session, session 25): `bench
--json` over a model file replaced the model with 500 bytes of JSON, and `quantize -o` over a
user's text file replaced it with a GGUF, both with exit 0."""
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.cli import app
from tests.cli_checks import one_line_error
from tests.synthetic import write_tiny_model

runner = CliRunner()


def test_bench_json_replaces_only_its_own_records(tmp_path, monkeypatch):
    """Any JSON was replaced too (a later probe): `--json package.json` destroyed the app's file."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    model = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.Q8_0, seed=3).path
    args = ["bench", "-m", model, "--prompt-tokens", "8", "--gen-tokens", "2", "--runs", "1", "--no-floor", "--json"]
    for victim, data in (("copy.gguf", open(model, "rb").read()), ("notes.txt", b"my notes\n"),
                         ("package.json", b'{"name": "my-app", "version": "1.0.0"}\n'), ("list.json", b"[1, 2]\n"),
                         ("other.json", b'[{"prompt_tokens": 8}]\n')):
        f = tmp_path / victim
        f.write_bytes(data)
        r = runner.invoke(app, args + [str(f)])
        one_line_error(r, f"--json {f}: exists and is not bench records edgellm wrote")
        assert f.read_bytes() == data
    out = tmp_path / "bench.json"
    for _ in range(2):                                  # the second run replaces the first one's records
        assert runner.invoke(app, args + [str(out)]).exit_code == 0
        assert out.read_text().lstrip().startswith("[") and '"ttft_ms_p50"' in out.read_text()


def test_analysis_json_recognises_an_analysis_and_nothing_else():
    from edgellm.cli import ANALYSIS_JSON
    from edgellm.sensitivity import Sensitivity

    sens = Sensitivity("0" * 64, "1" * 64, n_layers=2, n_tokens=8, formats=("q4_0",), ops=("qkv",),
                       activations=("int8",), entries=())
    assert ANALYSIS_JSON[0](sens.to_json().encode())
    for other in (b'{"name": "my-app"}', b'{"schema": 2}', b"[]", b'{"calibration_sha256": "x"}'):
        assert not ANALYSIS_JSON[0](other)


def test_quantize_writes_a_new_file_unless_forced(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    model = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.F32, seed=3).path
    f = tmp_path / "notes.txt"
    f.write_bytes(b"my notes\n")
    r = runner.invoke(app, ["quantize", model, "--plan", "fast", "-o", str(f)])
    one_line_error(r, f"--out {f}: exists and is not a file to replace (pass --force to replace it)")
    assert f.read_bytes() == b"my notes\n"
    r = runner.invoke(app, ["quantize", model, "--plan", "fast", "-o", str(f), "--force"])
    assert r.exit_code == 0, r.output
    assert f.read_bytes()[:4] == b"GGUF"


def _run_with_fd2(tmp_path, model, fd2):
    import os
    import subprocess
    import sys

    def setup():
        if fd2 == "closed":
            os.close(2)
        else:                                   # a file the launcher opened, read-only, as fd 2
            fd = os.open(fd2, os.O_RDONLY)
            os.dup2(fd, 2)
            os.close(fd)
    code = ("import sys; sys.argv = ['edgellm', 'run', 'hi', '-m', %r, '-n', '3', '--temperature', '0']; "
            "from edgellm.cli import main; main()" % model)
    env = dict(os.environ, EDGELLM_HOME=str(tmp_path / "home"))
    return subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, preexec_fn=setup, env=env,
                          timeout=120)


def test_a_closed_stderr_still_gives_the_answer(tmp_path):
    """2>&-: `run` printed nothing and exited 1, or printed the answer and exited 1 on EBADF."""
    model = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.Q8_0, seed=3).path
    ro = tmp_path / "ro.txt"
    ro.write_text("x")
    outs = [_run_with_fd2(tmp_path, model, fd2) for fd2 in ("closed", str(ro))]
    for r in outs:
        assert r.returncode == 0 and r.stdout.strip()
    assert outs[0].stdout == outs[1].stdout
    assert ro.read_text() == "x"


def test_model_paths_say_what_is_wrong(tmp_path, monkeypatch):
    """`info ''` blamed '.' for being a directory, a link loop read "no such file", and
    /proc/self/mem gave "[Errno 5] Input/output error" without naming the file."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    (tmp_path / "l1").symlink_to(tmp_path / "l2")
    (tmp_path / "l2").symlink_to(tmp_path / "l1")
    for arg, says in (("", "model: the model path is empty"),
                      (str(tmp_path / "l1"), f"{tmp_path / 'l1'}: is a link that leads to no file"),
                      ("/proc/self/mem", "/proc/self/mem: file: cannot be read: Input/output error")):
        one_line_error(runner.invoke(app, ["info", arg]), says)
