"""A close() from another thread while save_session / load_session hash the model file (their
first use, outside the engine's turn): the session's keys read the closed engine's KV store and
raised AttributeError ('NoneType' object has no attribute 'kv') instead of the ConfigError every
other call after close() gives (probing session 26)."""
import threading

import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm import api
from edgellm.errors import ConfigError
from tests.synthetic import write_tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("api26") / "m.gguf", tensor_type=QT.Q8_0, seed=3).path


def _closed_while_hashing(monkeypatch, eng):
    """The engine is closed by another thread while the model file is being hashed."""
    sha = api.file_sha256

    def hashing(path):
        t = threading.Thread(target=eng.close)
        t.start()
        t.join(timeout=60)
        assert not t.is_alive()
        return sha(path)
    monkeypatch.setattr(api, "file_sha256", hashing)


def test_save_session_beside_a_close_saves_or_says_closed(model_path, monkeypatch, tmp_path):
    eng = edgellm.load(model_path, n_ctx=256, threads=1, prefault=False)
    eng.generate("hello there", temperature=0, max_tokens=4)
    _closed_while_hashing(monkeypatch, eng)
    # the snapshot was taken before the close: writing it out is as right as refusing
    try:
        n = eng.save_session(tmp_path / "s.bin")
    except ConfigError as e:
        assert "closed" in str(e)
    else:
        assert n > 0 and (tmp_path / "s.bin").stat().st_size > 0
    with pytest.raises(ConfigError, match="the engine is closed"):
        eng.save_session(tmp_path / "t.bin")


def test_load_session_beside_a_close_says_closed(model_path, monkeypatch, tmp_path):
    src = edgellm.load(model_path, n_ctx=256, threads=1, prefault=False)
    src.generate("hello there", temperature=0, max_tokens=4)
    src.save_session(tmp_path / "s.bin")
    src.close()
    eng = edgellm.load(model_path, n_ctx=256, threads=1, prefault=False)
    _closed_while_hashing(monkeypatch, eng)
    with pytest.raises(ConfigError, match="the engine is closed"):
        eng.load_session(tmp_path / "s.bin")
