"""The on-disk cache and damaged sessions, a CLI probe's finds (session 30): a named session whose
magic was damaged was an error for good ("is not an edgellm session file") until the user found
the file and removed it, while a damaged header is kept aside and the run goes on; and the files
kept aside were invisible to `cache list` and `cache info`, and `cache clear --all` left them."""
import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.cli import app
from tests.synthetic import write_tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("sess30") / "m.gguf", tensor_type=QT.Q8_0, seed=3).path


def _damage_magic(path):
    with open(path, "r+b") as f:
        f.write(b"XXXX")
    return path.read_bytes()


def test_a_named_session_with_a_damaged_magic_is_kept_aside_and_listed_and_cleared(tiny, tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("EDGELLM_HOME", str(home))
    base = ["run", "-m", tiny, "--ctx", "128", "-n", "2", "--session", "notes"]
    assert runner.invoke(app, base + ["one"]).exit_code == 0
    (entry,) = (home / "cache").glob("*-notes.edgesess")
    damaged = _damage_magic(entry)
    r = runner.invoke(app, base + [" two"])
    assert r.exit_code == 0, r.output
    (aside,) = (home / "cache").glob("*-notes.edgesess.unreadable-*")
    assert aside.read_bytes() == damaged and f"kept as {aside.name}" in r.stderr
    assert entry.is_file() and entry.read_bytes()[:4] != b"XXXX"            # the new conversation
    listed = runner.invoke(app, ["cache", "list"])
    assert listed.exit_code == 0 and f"{aside.name}  invalid: kept aside, unreadable: wrong magic" in listed.stdout
    info = runner.invoke(app, ["cache", "info"]).stdout
    assert "entries      2" in info and "invalid      1" in info
    cleared = runner.invoke(app, ["cache", "clear"])
    assert cleared.exit_code == 0 and "removed 2 session file(s)" in cleared.stdout
    assert not list((home / "cache").glob("*notes*"))


def test_a_session_path_with_another_magic_is_still_refused_and_kept(tiny, tmp_path, monkeypatch):
    """A file given by path may be the user's own document: never renamed, never overwritten."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    f = tmp_path / "s.edgesess"
    assert runner.invoke(app, ["run", "one", "-m", tiny, "--ctx", "128", "-n", "2", "--session", str(f)]).exit_code == 0
    damaged = _damage_magic(f)
    r = runner.invoke(app, ["run", "two", "-m", tiny, "--ctx", "128", "-n", "2", "--session", str(f)])
    assert r.exit_code == 1 and "exists and is not an edgellm session file" in r.stderr
    assert f.read_bytes() == damaged and [p.name for p in tmp_path.iterdir() if "unreadable" in p.name] == []


def test_only_edgellm_names_are_listed_as_kept_aside(tmp_path, monkeypatch):
    from edgellm.kv import disk_cache

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    d = disk_cache.cache_dir(create=True)
    ours = d / "0123456789abcdef-x.edgesess.unreadable-20261128-131703-2"
    mine = [d / "notes.edgesess.unreadable-yesterday", d / "x.edgesess.unreadable-20261128"]
    for p in [ours, *mine]:
        p.write_bytes(b"data")
    assert [e.path for e in disk_cache.list_entries()] == [ours]
    assert disk_cache.clear() == 1 and all(p.exists() for p in mine)
