"""Probe 32 (files a user keeps): `cache clear --all` and `quantize -o`."""
from __future__ import annotations

from typer.testing import CliRunner

from edgellm.cli import app

runner = CliRunner()


def test_clear_all_removes_only_edgellm_own_cache_folders(tmp_path, monkeypatch):
    """EDGELLM_HOME set to a folder whose cache/ other programs use (as /var, or
    /data/local/tmp on a phone): `cache clear --all` removed every file in every folder there
    (apt/archives/pkg.deb, fontconfig/, man/: 3 of 3 files gone, exit 0), and `cache info`
    listed them as edgellm's caches (a probe)."""
    home = tmp_path / "home"
    foreign = {home / "cache" / "apt" / "archives" / "pkg.deb", home / "cache" / "mine" / "notes.txt"}
    for f in foreign:
        f.parent.mkdir(parents=True)
        f.write_text("keep me")
    (home / "cache" / "opencl").mkdir()
    (home / "cache" / "opencl" / "k.bin").write_bytes(b"y")
    (home / "cache" / "precision" / "models").mkdir(parents=True)
    (home / "cache" / "precision" / "models" / "m.gguf").write_bytes(b"x")
    (home / "cache" / "npu" / "onnx").mkdir(parents=True)
    (home / "cache" / "npu" / "onnx" / "g.onnx").write_bytes(b"z")
    monkeypatch.setenv("EDGELLM_HOME", str(home))
    r = runner.invoke(app, ["cache", "info"])
    assert r.exit_code == 0, r.output
    assert "apt/" not in r.stdout and "mine/" not in r.stdout, r.stdout
    r = runner.invoke(app, ["cache", "clear", "--all"])
    assert r.exit_code == 0, r.output
    assert all(f.read_text() == "keep me" for f in foreign)
    assert not any((home / "cache" / d).exists() for d in ("opencl", "precision", "npu"))


def _tiny(tmp_path):
    from gguf import GGMLQuantizationType as QT

    from tests.synthetic import write_tiny_model

    return write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.F32, n_layers=6, seed=2).path


def _appears_during_write(monkeypatch, path, content: bytes):
    """Makes `path` (another quantize's output, a user's file) appear while quantize writes."""
    from edgellm import requant

    real = requant.read_tensor

    def read_tensor(*a, **k):
        if not path.exists():
            path.write_bytes(content)
        return real(*a, **k)
    monkeypatch.setattr(requant, "read_tensor", read_tensor)


def test_quantize_without_force_never_replaces_a_file_made_during_the_write(tmp_path, monkeypatch):
    """-o is checked to be a new file before the work, then renamed over whatever was there at
    the end: two quantize on one -o both exited 0 and the one that finished last replaced the
    other's output; a file a user saved there meanwhile was replaced too (a probe)."""
    src, out = _tiny(tmp_path), tmp_path / "o.gguf"
    _appears_during_write(monkeypatch, out, b"the user's file")
    r = runner.invoke(app, ["quantize", src, "--plan", "fast", "-o", str(out)])
    assert r.exit_code == 1, r.output
    assert "--force" in r.output and str(out) in r.output, r.output
    assert out.read_bytes() == b"the user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "o.gguf"]     # no temp file left


def test_quantize_with_force_replaces_a_file_made_during_the_write(tmp_path, monkeypatch):
    src, out = _tiny(tmp_path), tmp_path / "o.gguf"
    _appears_during_write(monkeypatch, out, b"old")
    r = runner.invoke(app, ["quantize", src, "--plan", "fast", "-o", str(out), "--force"])
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "o.gguf"]


def test_quantize_without_force_refuses_a_dangling_link(tmp_path):
    """A link to a missing file at -o (someone's) was replaced by the model without --force."""
    src, out = _tiny(tmp_path), tmp_path / "o.gguf"
    out.symlink_to(tmp_path / "missing.gguf")
    r = runner.invoke(app, ["quantize", src, "--plan", "fast", "-o", str(out)])
    assert r.exit_code == 1 and "--force" in r.output, r.output
    assert out.is_symlink() and not (tmp_path / "missing.gguf").exists()


def test_quantize_without_force_where_the_file_system_has_no_hard_links(tmp_path, monkeypatch):
    """(FAT on a phone's card: os.link fails with EPERM; the file is still written, and one made
    during the write still kept)"""
    import errno

    from edgellm import requant

    def no_link(*a, **k):
        raise PermissionError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(requant.os, "link", no_link)
    src, out = _tiny(tmp_path), tmp_path / "o.gguf"
    assert runner.invoke(app, ["quantize", src, "--plan", "fast", "-o", str(out)]).exit_code == 0
    assert out.read_bytes()[:4] == b"GGUF"
    out2 = tmp_path / "o2.gguf"
    _appears_during_write(monkeypatch, out2, b"mine")
    r = runner.invoke(app, ["quantize", src, "--plan", "fast", "-o", str(out2)])
    assert r.exit_code == 1 and out2.read_bytes() == b"mine", r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "o.gguf", "o2.gguf"]
