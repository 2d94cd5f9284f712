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
