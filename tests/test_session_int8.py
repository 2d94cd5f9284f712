"""int8 KV sessions keep the pool's int8 rows and their scales (about a quarter of the float32
copy they were saved as before), restore them bit for bit, and still read the float32 files
earlier versions wrote. A file whose checksum holds but whose int8 KV no pool could have
written is a miss with one warning, like any damaged session."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.kv.session_file import read_session, write_session
from tests.synthetic import write_tiny_model

GREEDY = dict(temperature=0, ignore_eos=True)
PROMPT = "alpha beta gamma delta eps zeta theta kappa mu " * 5


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("s8") / "tiny.gguf", tensor_type=QT.F16, seed=8,
                            context_length=4096).path


def load(path):
    return edgellm.load(path, n_ctx=512, threads=1, kv_precision="int8")


def _saved(tiny_path, path):
    """An int8 engine after a greedy answer, its session saved at path; the follow-up prompt and
    the answer a process that never stopped gives it."""
    a = load(tiny_path)
    ans = a.generate(PROMPT, max_tokens=10, **GREEDY)
    n = a.save_session(path)
    follow = PROMPT + ans + " beta beta gamma"
    return a, n, follow, a.generate(follow, max_tokens=12, **GREEDY)


def _read(engine, path):
    return read_session(path, max_tokens=engine.n_ctx, max_bytes=engine._session_max_bytes(),
                        **engine._session_keys())


def test_int8_session_is_stored_as_int8_and_continues_identically(tiny_path, tmp_path):
    path = tmp_path / "s.edgesess"
    a, n, follow, never_stopped = _saved(tiny_path, path)
    data = _read(a, path)
    assert data.arrays["k"].dtype == np.int8 and data.arrays["v"].dtype == np.int8
    cfg = a.config
    assert data.arrays["k_scale"].shape == (cfg.n_layers, n, cfg.n_kv_heads)
    # the rows as the pool holds them: what read_int8 gives for the kept conversation
    seq = a.kv.last
    for layer in range(cfg.n_layers):
        kq, ks, vq, vs = seq.read_int8(layer, n)
        np.testing.assert_array_equal(data.arrays["k"][layer], kq[:n])
        np.testing.assert_array_equal(data.arrays["v_scale"][layer], vs[:n])
    b = load(tiny_path)
    assert b.load_session(path)
    assert b.generate(follow, max_tokens=12, **GREEDY) == never_stopped
    assert b.last_stats.cached_tokens >= n - 16
    # against the float32 copy it used to write: hd + 4 bytes a (token, head) row instead of 4 hd
    # (a quarter at SmolLM2's head_dim 64, plus the scale; this tiny model's head_dim is small)
    legacy = tmp_path / "legacy.edgesess"
    write_session(legacy, token_ids=data.token_ids, arrays=_dequantized(data.arrays), meta={},
                  **a._session_keys())
    rows = 2 * cfg.n_layers * n * cfg.n_kv_heads
    saved = legacy.stat().st_size - path.stat().st_size
    assert abs(saved - rows * (4 * cfg.head_dim - (cfg.head_dim + 4))) < 4096, (saved, rows, cfg.head_dim)


def _dequantized(arrays):
    return {name: (arrays[name].astype(np.float32) * arrays[name + "_scale"][..., None]).astype(np.float32)
            for name in ("k", "v")}


def test_a_float32_int8_session_from_an_earlier_version_still_loads(tiny_path, tmp_path):
    path = tmp_path / "s.edgesess"
    a, n, follow, never_stopped = _saved(tiny_path, path)
    data = _read(a, path)
    legacy = tmp_path / "legacy.edgesess"
    write_session(legacy, token_ids=data.token_ids, arrays=_dequantized(data.arrays), meta={},
                  **a._session_keys())
    b = load(tiny_path)
    assert b.load_session(legacy)
    assert b.generate(follow, max_tokens=12, **GREEDY) == never_stopped


def _bad(arrays, what):
    a = {k: v.copy() for k, v in arrays.items()}
    if what == "negative scale":
        a["k_scale"][0, 0, 0] = -a["k_scale"][0, 0, 0] - 1
    elif what == "nan scale":
        a["v_scale"][-1, -1, -1] = np.nan
    elif what == "inf scale":
        a["k_scale"][0, 1, 0] = np.inf
    elif what == "scale past float32 / 127":
        a["v_scale"][0, 2, 0] = 1e38
    elif what == "-128":
        a["v"][0, 0, 0, 0] = -128
    elif what == "no scales":
        del a["k_scale"]
    elif what == "scales of another shape":
        a["v_scale"] = a["v_scale"][:, :-1]
    elif what == "scales as float16":
        a["k_scale"] = a["k_scale"].astype(np.float16)
    elif what == "int8 v beside float32 k":
        a["k"] = a["k"].astype(np.float32)
    return a


@pytest.mark.parametrize("what", ["negative scale", "nan scale", "inf scale", "scale past float32 / 127", "-128", "no scales",
                                  "scales of another shape", "scales as float16", "int8 v beside float32 k"])
def test_int8_kv_no_pool_could_hold_is_a_miss(tiny_path, tmp_path, caplog, what):
    path = tmp_path / "s.edgesess"
    a, n, follow, never_stopped = _saved(tiny_path, path)
    data = _read(a, path)
    bad = tmp_path / "bad.edgesess"
    write_session(bad, token_ids=data.token_ids, arrays=_bad(data.arrays, what), meta={}, **a._session_keys())
    b = load(tiny_path)
    caplog.clear()
    assert b.load_session(bad) is False
    assert any("session cache miss" in r.getMessage() for r in caplog.records)
    b.kv.pool.check()
    assert b.generate(follow, max_tokens=12, **GREEDY) == never_stopped   # and the engine is unharmed


def test_write_int8_refuses_what_the_pool_does_not_store(tiny_path):
    e = load(tiny_path)
    e.generate("alpha beta", max_tokens=2, **GREEDY)
    seq = e.kv.pool.new_sequence()
    seq.reserve(4)
    cfg = e.config
    q = np.zeros((4, cfg.n_kv_heads, cfg.head_dim), np.int8)
    s = np.zeros((4, cfg.n_kv_heads), np.float32)
    with pytest.raises(ValueError, match="dtype"):
        seq.write_int8(0, 0, q.astype(np.int16), s, q, s)
    with pytest.raises(ValueError, match="scales of shape"):
        seq.write_int8(0, 0, q, s[:3], q, s)
    seq.write_int8(0, 0, q, s, q, s)
    seq.free()
    f16 = edgellm.load(tiny_path, n_ctx=512, threads=1)
    seq = f16.kv.pool.new_sequence()
    seq.reserve(4)
    with pytest.raises(ValueError, match="f16 pool"):
        seq.write_int8(0, 0, q, s, q, s)
    with pytest.raises(ValueError, match="f16 pool"):
        seq.read_int8(0, 4)
    seq.free()
