"""Output paths that are not regular files, and precision arguments refused before the work.

Every writer writes beside the target and renames over it: `quantize -o /dev/null` run as root
replaced the device with a 94 MB regular file (and /dev/full "took" the write), a FIFO became a
file. Such paths are now a one-line error and stay what they were. `precision plan --device
bogus` was refused only after the whole sensitivity analysis; `analyze --formats bogus` after
the model loaded, and `--ops ""` measured nothing without a word."""
from __future__ import annotations

import os
import stat

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.cli import app
from edgellm.errors import ConfigError
from edgellm.fileio import write_atomic
from edgellm.requant import requantize_gguf
from tests.synthetic import write_tiny_model


@pytest.fixture
def fifo(tmp_path):
    p = tmp_path / "pipe"
    os.mkfifo(p)
    return p


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_model(tmp_path / "t.gguf", tensor_type=QT.Q8_0, seed=1).path


def _still_a_fifo(p) -> bool:
    return stat.S_ISFIFO(os.lstat(p).st_mode)


def test_quantize_and_analyze_refuse_a_fifo(tmp_path, monkeypatch, fifo, tiny):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    for args in (["quantize", tiny, "--plan", "fast", "-o", str(fifo)],
                 ["precision", "analyze", "--model", tiny, "--json", str(fifo)]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 1, r.output
        assert "is not a regular file" in r.output and "Traceback" not in r.output
        assert _still_a_fifo(fifo)


def test_the_writers_themselves_refuse_it(fifo, tiny):
    with pytest.raises(OSError, match="not a regular file"):
        write_atomic(fifo, b"x")
    with pytest.raises(ConfigError, match="is not a regular file"):
        requantize_gguf(tiny, fifo, {})
    assert _still_a_fifo(fifo)
    assert not [p for p in fifo.parent.iterdir() if p.name.startswith(".pipe")]   # no temp file left


def test_precision_arguments_are_refused_before_any_analysis(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))    # a cold sensitivity cache
    cases = ((["precision", "plan", "--model", tiny, "--device", "bogus-phone", "--no-verify"], "bogus-phone"),
             (["precision", "analyze", "--model", tiny, "--formats", "bogus"], "unknown weight format 'bogus'"),
             (["precision", "analyze", "--model", tiny, "--ops", ""], "--ops names no op"),
             (["precision", "analyze", "--model", tiny, "--max-tokens", "1"], "--max-tokens must be >= 2"),
             (["precision", "plan", "--model", tiny, "--formats", "q9"], "unknown weight format 'q9'"))
    for args, says in cases:
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 1 and says in r.output, (args, r.output)
        assert "forward passes" not in r.output, args


def test_requantizing_onto_a_directory_says_directory(tmp_path, tiny):
    (tmp_path / "outdir").mkdir()
    with pytest.raises(ConfigError, match="outdir: is a directory; give a file path"):
        requantize_gguf(tiny, tmp_path / "outdir", {})


def test_an_empty_path_and_a_suffix_alone_say_what_is_missing(tmp_path):
    """`--out ""` said "--out .: is a directory"; `--out dir/.yaml` "expected a file ending in .yaml"."""
    from edgellm.cli import check_out_path

    with pytest.raises(ConfigError, match="--out: the path is empty"):
        check_out_path("", "--out", (".yaml",))
    with pytest.raises(ConfigError, match=r"the file name before \.yaml is missing"):
        check_out_path(str(tmp_path / ".yaml"), "--out", (".yaml", ".yml"))
    assert check_out_path(str(tmp_path / "a.yaml"), "--out", (".yaml",)) == tmp_path / "a.yaml"
