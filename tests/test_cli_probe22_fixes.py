"""The command line's fixes from a probe: links in the cache never followed, a cache path that
is a file, a chat line without end, a context-full cut that exits 0, arguments checked only
after the model was resolved, flags named as the user typed them, --version, README vs --help."""
import io
import os
import re
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm import cli
from edgellm.cli import app
from edgellm.errors import ConfigError
from tests.cli_checks import one_line_error
from tests.synthetic import write_tiny_model

runner = CliRunner()
README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("probe22") / "tiny.gguf", tensor_type=QT.Q8_0, seed=5).path


def test_cache_links_are_never_followed(tmp_path, monkeypatch):
    """`cache clear --all` removed the files of a folder a link in the cache pointed to, outside
    EDGELLM_HOME, and `cache info` counted them."""
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("a", "b"):
        (outside / name).write_bytes(b"keep me")
    home = tmp_path / "home"
    (home / "cache" / "opencl").mkdir(parents=True)
    (home / "cache" / "opencl" / "k.bin").write_bytes(b"y" * 10)
    os.symlink(outside, home / "cache" / "mylink")
    os.symlink(outside, home / "cache" / "opencl" / "dirlink")
    os.symlink(outside / "a", home / "cache" / "opencl" / "filelink")
    monkeypatch.setenv("EDGELLM_HOME", str(home))
    r = runner.invoke(app, ["cache", "info"])
    assert r.exit_code == 0, r.output
    assert "mylink" not in r.stdout and "opencl/      3 file(s)" in r.stdout, r.stdout   # k.bin and 2 links
    r = runner.invoke(app, ["cache", "clear", "--all"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in outside.iterdir()) == ["a", "b"] and (outside / "a").read_bytes() == b"keep me"
    assert not (home / "cache" / "opencl").exists()   # its own files and links went


def test_a_cache_path_or_home_that_is_a_file_is_one_error(tmp_path, monkeypatch, tiny):
    home = tmp_path / "home"
    home.mkdir()
    (home / "cache").write_text("not a folder")
    monkeypatch.setenv("EDGELLM_HOME", str(home))
    for cmd in (["cache", "list"], ["cache", "info"], ["cache", "clear", "--all"]):
        one_line_error(runner.invoke(app, cmd), "cache")
        assert "is not a folder" in runner.invoke(app, cmd).stderr
    r = runner.invoke(app, ["run", "hi", "-m", tiny, "-n", "1", "--session", "s"])
    one_line_error(r, "--session s: EDGELLM_HOME/cache")
    monkeypatch.setenv("EDGELLM_HOME", str(home / "cache"))   # the home itself a file
    one_line_error(runner.invoke(app, ["info"]), "is not a folder")


def test_a_chat_line_is_capped(monkeypatch):
    """`edgellm chat < /dev/zero` read one endless line until memory ran out. A line over the cap
    is skipped, read to its end (it ended the chat, the lines after it unanswered: a later probe);
    one with no end in sight ends the chat."""
    class Zeros(io.RawIOBase):
        def readable(self):
            return True

        def readinto(self, b):
            b[:] = bytes(len(b))
            return len(b)

    monkeypatch.setattr(cli, "MAX_SKIP_BYTES", 8 * 2**20)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(Zeros())))
    with pytest.raises(ConfigError, match="longer than 1 MiB, chat's limit for a turn, and has no end"):
        cli._read_line()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"x" * (3 * 2**20) + b"\nnext\n")))
    with pytest.raises(cli.LineTooLong, match="longer than 1 MiB, chat's limit for a turn; it was skipped"):
        cli._read_line()
    assert cli._read_line() == "next"
    line = b"y" * 2**20   # (1 MiB and its newline: taken; with CRLF too, and at the end without one)
    for end in (b"\n", b"\r\n"):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(line + end + b"next\n")))
        assert cli._read_line() == line.decode() and cli._read_line() == "next"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(line)))
    assert cli._read_line() == line.decode()
    for over in (line + b"z\n", line + b"z\r\n", line + b"z"):   # one byte more: skipped, and only it
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(over + b"next\n")))
        with pytest.raises(cli.LineTooLong):
            cli._read_line()
        if over.endswith(b"\n"):
            assert cli._read_line() == "next"


def test_an_answer_cut_by_a_full_context_exits_1(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    r = runner.invoke(app, ["run", "hello", "-m", tiny, "-n", "50", "--ctx", "12", "--temperature", "0",
                            "--no-stats"])
    assert r.exit_code == 1 and r.stdout.strip(), r.output
    assert r.stderr.count("\n") == 1 and "edgellm: warning: the answer was cut" in r.stderr and "--ctx" in r.stderr
    r = runner.invoke(app, ["chat", "-m", tiny, "-n", "50", "--ctx", "60", "--temperature", "0"], input="hi\n")
    assert r.exit_code == 1 and "[context full" in r.stderr, r.output


@pytest.mark.parametrize("args,needle", [
    (["run", "x", "--session", "bad name!"], "--session 'bad name!'"),
    (["run", "x", "--units", "bogus"], "--units: unknown unit(s) bogus"),
    (["chat", "--session", "bad name!"], "--session 'bad name!'"),
    (["quantize", "--plan", "bogus", "-o", "OUT/q.gguf"], "--plan bogus"),
    (["plan", "--prompt-tokens", "0"], "--prompt-tokens must be >= 1, got 0"),
    (["bench", "--units", "bogus"], "--units: unknown unit(s) bogus"),
    (["run", "x", "--units", ","], "--units ',' names no unit"),
])
def test_arguments_are_checked_before_the_model_is_resolved(tmp_path, monkeypatch, args, needle):
    """With no model in EDGELLM_HOME these printed the download's error (or started it)."""
    import edgellm.api
    import edgellm.model.registry

    def resolve(*a, **k):
        raise ConfigError("RESOLVED THE MODEL")
    monkeypatch.setattr(edgellm.model.registry, "resolve_model", resolve)
    monkeypatch.setattr(edgellm.api, "resolve_model", resolve)
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "empty"))
    one_line_error(runner.invoke(app, [a.replace("OUT", str(tmp_path)) for a in args], input=""), needle)


def test_memory_advice_names_the_flags(tiny, tmp_path, monkeypatch):
    """A ring too big for memory said "lower n_ctx": --ctx does not size a ring, --window does."""
    import edgellm.api

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(edgellm.api, "available_bytes", lambda: 1)
    r = runner.invoke(app, ["run", "hi", "-m", tiny, "-n", "1", "--kv", "ring", "--window", "64"])
    one_line_error(r, "lower --window")
    assert "n_ctx" not in r.stderr
    r = runner.invoke(app, ["run", "hi", "-m", tiny, "-n", "1", "--ctx", "64"])
    one_line_error(r, "lower --ctx")


def test_build_refuses_a_missing_out_folder(tmp_path, monkeypatch):
    import edgellm.toolchain

    def build(*a, **k):
        raise AssertionError("built")
    monkeypatch.setattr(edgellm.toolchain, "build_bundle", build)
    out = tmp_path / "missing" / "bundle"
    one_line_error(runner.invoke(app, ["build", "--out", str(out)]),
                    f"--out {out}: the folder {out.parent} does not exist")
    assert not out.parent.exists()


def test_an_empty_prompt_is_refused_with_chat_too(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    for extra in ([], ["--chat"]):
        one_line_error(runner.invoke(app, ["run", "", "-m", tiny, "-n", "1", *extra]), "the prompt is empty")


def test_version():
    from edgellm import __version__

    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"edgellm {__version__}", r.output


def test_readme_names_the_flags_help_shows():
    text = README.read_text()
    section = text[text.index("### Command line"):text.index("### Python")]
    for flag in ("--short-tokens", "--delay-ms", "--runs", "--gen-tokens", "--prompt-tokens", "--force",
                 "--out FILE.yaml", "--api", "--stats", "--version", ".svg", "1 MiB"):
        assert flag in section, flag
    r = runner.invoke(app, ["plan", "--help"], env={"COLUMNS": "200"})
    assert "this PNG" not in r.stdout and re.search(r"\.png, \.pdf or \.svg", r.stdout), r.stdout
