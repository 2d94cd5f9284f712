"""Session files across processes and faults, a probe's finds (session 28): a session whose
header cannot be read (one flipped byte, a newer format after a downgrade) was replaced by the
run's save, and the conversation it held was lost."""
import struct

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.cli import app
from tests.synthetic import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("sess28") / "m.gguf", tensor_type=QT.Q8_0, seed=3).path


@pytest.mark.parametrize("damage", ["version", "header byte"])
def test_an_unreadable_session_is_kept_aside_not_replaced(tiny, tmp_path, monkeypatch, damage):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    runner = CliRunner()
    f = tmp_path / "s.edgesess"
    for prompt in ("one", " two"):
        r = runner.invoke(app, ["run", prompt, "-m", tiny, "--ctx", "128", "-n", "2", "--session", str(f)])
        assert r.exit_code == 0, r.output
    with open(f, "r+b") as out:
        if damage == "version":
            out.seek(8)
            out.write(struct.pack("<I", 99))
        else:
            out.seek(20)
            b = out.read(1)
            out.seek(20)
            out.write(bytes([b[0] ^ 0xFF]))
    damaged = f.read_bytes()
    r = runner.invoke(app, ["run", "three", "-m", tiny, "--ctx", "128", "-n", "2", "--session", str(f)])
    assert r.exit_code == 0, r.output
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("s.edgesess.unreadable-")]
    assert len(aside) == 1 and aside[0].read_bytes() == damaged
    assert f"kept as {aside[0].name}" in r.stderr and "changed since this run read it" not in r.stderr
    assert f.is_file() and f.read_bytes() != damaged     # the new conversation


def test_a_chat_whose_save_fails_goes_on(tiny, tmp_path, monkeypatch):
    """A full disk at the first answer's save ended `chat` (exit 1, the next line never read)."""
    import errno

    import edgellm.api

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))

    def full(self, path, meta=None):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(edgellm.api.Engine, "save_session", full)
    f = tmp_path / "c.edgesess"
    r = CliRunner().invoke(app, ["chat", "-m", tiny, "--ctx", "128", "-n", "2", "--session", str(f)],
                           input="first\nsecond\n")
    assert r.exit_code == 1, r.output                      # failed turns: exit 1, as documented
    assert r.stderr.count("the conversation goes on here, unsaved") == 2, r.stderr


def test_a_long_valid_file_name_can_be_written_atomically(tmp_path):
    """A 247-byte name is valid, but its temp name (+26 bytes) was not: 'File name too long'."""
    from edgellm.fileio import write_atomic

    for name in ("a" * 238 + ".edgesess", "é" * 115 + ".edgesess"):
        p = tmp_path / name
        write_atomic(p, b"data")
        assert p.read_bytes() == b"data"
    assert sorted(len(n.encode()) for n in __import__("os").listdir(tmp_path)) == [239, 247]


def test_a_session_removed_meanwhile_is_said_to_be_removed(tiny, tmp_path, monkeypatch):
    """`cache clear` (or rm) during a run was reported as 'another run saved to it'."""
    import edgellm.api as api

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    f = tmp_path / "s.edgesess"
    base = ["run", "-m", tiny, "--ctx", "128", "-n", "2", "--session", str(f)]
    assert CliRunner().invoke(app, base + ["one"]).exit_code == 0
    real_stream = api.Engine.stream

    def stream_while_removed(self, *a, **k):
        out = list(real_stream(self, *a, **k))
        f.unlink()
        return iter(out)

    monkeypatch.setattr(api.Engine, "stream", stream_while_removed)
    r = CliRunner().invoke(app, base + [" two"])
    assert r.exit_code == 0 and "was removed since this run read it" in r.stderr
    assert "another run saved to it" not in r.stderr and f.is_file()


def test_a_session_link_is_followed_for_the_save_too(tiny, tmp_path, monkeypatch):
    """--session link.edgesess loaded the target, then replaced the link with a file: the target
    kept the old conversation."""
    import os

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    target, link = tmp_path / "t.edgesess", tmp_path / "link.edgesess"
    base = ["run", "-m", tiny, "--ctx", "128", "-n", "2"]
    assert CliRunner().invoke(app, base + ["one", "--session", str(target)]).exit_code == 0
    before = target.read_bytes()
    link.symlink_to(target)
    r = CliRunner().invoke(app, base + [" two", "--session", str(link)])
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and os.path.realpath(link) == str(target)
    assert target.read_bytes() != before


def test_a_link_in_the_cache_is_refused_as_a_session_name(tiny, tmp_path, monkeypatch):
    from edgellm.kv import disk_cache

    import edgellm
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    entry = disk_cache.entry_path(edgellm.load(tiny, n_ctx=64, threads=1).model_sha256(), "mine")
    entry.parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "elsewhere.edgesess").write_bytes(b"")
    entry.symlink_to(tmp_path / "elsewhere.edgesess")
    r = CliRunner().invoke(app, ["run", "x", "-m", tiny, "--ctx", "128", "-n", "1", "--session", "mine"])
    assert r.exit_code == 1 and "follows no links" in r.stderr, r.output


def test_a_save_landing_after_the_load_is_warned_about(tiny, tmp_path, monkeypatch):
    """With the file's state taken after the load, another run's save that landed after the
    load's read was replaced without a word (a review probe)."""
    import os

    import edgellm.api as api

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    f, other = tmp_path / "s.edgesess", tmp_path / "o.edgesess"
    base = ["run", "-m", tiny, "--ctx", "128", "-n", "2"]
    assert CliRunner().invoke(app, base + ["one", "--session", str(f)]).exit_code == 0
    assert CliRunner().invoke(app, base + ["other", "--session", str(other)]).exit_code == 0
    real_load = api.Engine.load_session

    def load_then_another_save(self, path):
        ok = real_load(self, path)
        os.replace(other, f)                    # another run's save, just after this run read
        return ok

    monkeypatch.setattr(api.Engine, "load_session", load_then_another_save)
    r = CliRunner().invoke(app, base + [" two", "--session", str(f)])
    assert r.exit_code == 0 and "changed since this run read it" in r.stderr, r.stderr


def test_an_unreadable_session_with_a_long_name_is_kept_aside_too(tiny, tmp_path, monkeypatch):
    """The aside name's 27 more bytes failed past 228 bytes, silently, and the save overwrote the
    file; two asides in one second replaced each other."""
    from edgellm import cli

    f = tmp_path / ("s" * 231 + ".edgesess")
    kept = []
    for _ in range(2):
        f.write_bytes(b"EDGESESS" + b"\xff" * 64)
        cli._keep_aside(f, "damaged")
        assert not f.exists()
        kept = [p for p in tmp_path.iterdir() if ".unreadable-" in p.name]
    assert len(kept) == 2 and all(len(p.name.encode()) <= 255 for p in kept)


def test_quantize_writes_a_long_output_name(tmp_path):
    """requantize's own temp name failed for output names past ~225 bytes (a review probe)."""
    from gguf import GGMLQuantizationType as QT

    from edgellm.requant import requantize_gguf

    src = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.F32, seed=2).path
    out = tmp_path / ("q" * 240 + ".gguf")
    requantize_gguf(src, out, {"blk.0.ffn_down.weight": "q8_0"})
    assert out.read_bytes()[:4] == b"GGUF"
