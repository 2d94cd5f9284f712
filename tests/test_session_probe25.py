"""Session files as a probing session crafted them (session 25): a header that declares a data
section of gigabytes was allocated whole before its checksum failed (2 GB, 8 s); K/V of the
wrong dtype or holding NaN loaded, and the next prompt failed blaming the model; a conversation
meta that is not a conversation ("text": 5, "messages": [1, 2]) was a traceback in `run` and
`chat`; an array with a zero dimension could be written but not read back."""
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

import edgellm
from edgellm.cli import app
from edgellm.kv.session_file import read_session, write_session
from tests.synthetic import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("sess25") / "m.gguf", tensor_type=QT.Q8_0, seed=3).path


@pytest.fixture
def eng(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    e = edgellm.load(tiny, n_ctx=128, threads=1)
    e.generate("hello there", max_tokens=4, temperature=0)
    return e


def _write(eng, path, arrays=None, meta=None):
    tokens, snap = eng.kv.snapshot()
    write_session(path, token_ids=tokens, arrays=arrays(snap) if arrays else snap, meta=meta or {"text": "hello there"},
                  **eng._session_keys())
    return snap


def test_a_file_larger_than_the_engine_can_hold_is_a_quick_miss(eng, tmp_path, caplog):
    f = tmp_path / "big.edgesess"
    _write(eng, f)
    with open(f, "r+b") as out:
        out.truncate(eng._session_max_bytes() + 1)      # (sparse: nothing written)
    t = time.perf_counter()
    assert not eng.load_session(f)
    assert time.perf_counter() - t < 1.0
    assert "over the cap of" in caplog.text


@pytest.mark.parametrize("bad", ["nan", "inf", "int32", "float32"])
def test_kv_of_another_dtype_or_not_finite_is_a_miss(eng, tmp_path, caplog, bad):
    def damage(snap):
        k = snap["k"].copy()
        if bad in ("nan", "inf"):
            k.flat[3] = np.nan if bad == "nan" else np.inf
        else:
            k = k.astype(bad)
        return {"k": k, "v": snap["v"]}
    f = tmp_path / "bad.edgesess"
    _write(eng, f, arrays=damage)
    assert not eng.load_session(f)
    assert ("non-finite" if bad in ("nan", "inf") else "expected float16") in caplog.text
    eng.generate("hello there, again", max_tokens=2, temperature=0)    # the engine goes on


def test_a_session_without_a_readable_conversation_starts_a_new_one(eng, tiny, tmp_path):
    runner = CliRunner()
    for meta, chat in (({"text": 5}, False), ({"messages": [1, 2]}, True), ({"messages": "abc"}, True)):
        f = tmp_path / "odd.edgesess"
        _write(eng, f, meta=meta)
        args = ["run", "hi", "-m", tiny, "--ctx", "128", "-n", "1", "--session", str(f)] + (["--chat"] if chat else [])
        r = runner.invoke(app, args)
        assert r.exit_code == 0, (meta, r.output, r.exception)
        assert "holds no readable conversation beside its KV; starting a new one" in r.stderr
        if chat:
            r = runner.invoke(app, ["chat", "-m", tiny, "--ctx", "128", "-n", "1", "--session", str(f)], input="hello\n")
            assert r.exit_code == 0, (meta, r.output, r.exception)


def test_an_array_with_a_zero_dimension_reads_back(tmp_path):
    f = tmp_path / "zero.edgesess"
    keys = dict(model_sha256="ab" * 32, config_hash="cd" * 16, kv_layout="pool/f16/block16")
    write_session(f, token_ids=[], arrays={"k": np.zeros((2, 0, 2, 16), np.float16)}, meta={}, **keys)
    data = read_session(f, max_tokens=10, **keys)
    assert data is not None and data.arrays["k"].shape == (2, 0, 2, 16)


def test_a_cache_folder_that_is_a_link_loop_is_one_error_line(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / "cache").symlink_to(home / "cache2")
    (home / "cache2").symlink_to(home / "cache")
    monkeypatch.setenv("EDGELLM_HOME", str(home))
    from edgellm.kv import disk_cache
    assert disk_cache.list_entries() == []          # (an OSError escaped the API)
    r = CliRunner().invoke(app, ["cache", "list"])
    assert r.exit_code == 1 and "is a link that leads to no folder" in r.stderr


def test_cache_list_keeps_one_entry_on_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    from edgellm.kv import disk_cache
    d = disk_cache.cache_dir()
    d.mkdir(parents=True)
    (d / f"odd\nname{disk_cache.SUFFIX}").write_bytes(b"not a session")
    r = CliRunner().invoke(app, ["cache", "list"])
    assert r.exit_code == 0 and len(r.stdout.strip().splitlines()) == 1, r.stdout
    assert "'odd\\nname" in r.stdout
