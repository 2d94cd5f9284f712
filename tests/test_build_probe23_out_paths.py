"""Output paths as a probe gave them: a trailing '/' (the user's mark of a folder) was dropped by
pathlib, so `profile --out dev.yaml/` measured and then wrote the file dev.yaml; a regular file
on the way to `build --out afile/x` was called a folder that does not exist."""
import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.cli import app
from tests.cli_checks import one_line_error
from tests.synthetic import write_tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("probe23") / "tiny.gguf", tensor_type=QT.Q8_0, seed=5).path


def test_profile_out_with_a_trailing_slash_is_refused_before_measuring(tmp_path, monkeypatch):
    import edgellm.device.probes

    def measure(*a, **k):
        raise AssertionError("measured")
    monkeypatch.setattr(edgellm.device.probes, "measure_host", measure)
    out = f"{tmp_path}/dev.yaml/"
    one_line_error(runner.invoke(app, ["profile", "--quick", "--out", out]), f"--out {out}: ends in '/'")
    assert not (tmp_path / "dev.yaml").exists()
    assert "PATH" in runner.invoke(app, ["profile", "--help"]).output   # (taken as a string, shown as a path)


@pytest.mark.parametrize("cmd, flag, name", [
    (["plan", "--device", "rk3588"], "--plot", "p.png"),
    (["quantize", "--plan", "fast"], "-o", "q.gguf"),
    (["precision", "analyze", "--max-tokens", "8"], "--json", "s.json"),
    (["bench", "--runs", "1", "--prompt-tokens", "4", "--gen-tokens", "1", "--no-floor"], "--json", "b.json"),
])
def test_a_trailing_slash_is_refused_for_every_output_flag(tiny, tmp_path, monkeypatch, cmd, flag, name):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    model = [tiny] if cmd[0] == "quantize" else ["--model", tiny]
    out = f"{tmp_path}/{name}/"
    r = runner.invoke(app, [*cmd, *model, flag, out])
    one_line_error(r, f"{out}: ends in '/', which names a folder")
    assert not (tmp_path / name).exists()


def test_a_session_file_with_a_trailing_slash_is_refused(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    out = f"{tmp_path}/s.edgesess/"
    one_line_error(runner.invoke(app, ["run", "hi", "-m", tiny, "-n", "1", "--session", out]),
                    f"--session {out}: ends in '/'")
    assert not (tmp_path / "s.edgesess").exists()


def test_build_out_under_a_file_says_it_is_a_file(tmp_path, monkeypatch):
    import edgellm.toolchain

    def build(*a, **k):
        raise AssertionError("built")
    monkeypatch.setattr(edgellm.toolchain, "build_bundle", build)
    afile = tmp_path / "afile"
    afile.write_text("notes\n")
    for out in (afile / "x", afile / "x" / "y"):
        r = runner.invoke(app, ["build", "--out", str(out)])
        one_line_error(r, f"--out {out}: {afile} is a file, not a folder")
        assert "does not exist" not in r.stderr
    assert afile.read_text() == "notes\n"
    out = tmp_path / "missing" / "bundle"     # (a folder that is missing is still said to be)
    one_line_error(runner.invoke(app, ["build", "--out", str(out)]),
                    f"--out {out}: the folder {out.parent} does not exist")


def test_a_file_out_under_a_file_says_it_is_a_file(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    afile = tmp_path / "afile"
    afile.write_text("notes\n")
    one_line_error(runner.invoke(app, ["plan", "--model", tiny, "--device", "rk3588", "--plot",
                                        str(afile / "p.png")]), f"{afile} is a file, not a folder")
