"""Sensitivity measurement (edgellm.sensitivity) on a tiny synthetic F32 model: the harness
measures exactly zero for an exact format, more error for fewer bits, leaves the engine bit-for-bit
as it was, and caches per model."""
import hashlib
import logging
import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm import sensitivity
from edgellm.backends import reference
from edgellm.calibration import load_calibration
from edgellm.errors import ConfigError
from edgellm.sensitivity import Sensitivity, analyze, fake_quant_int8, forward_passes
from tests.synthetic import write_tiny_model

N_LAYERS = 3
FORMATS = ("f32", "q8_0", "q4_0", "int4-32")
TOKENS = 64


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tm = write_tiny_model(tmp_path_factory.mktemp("sens") / "tiny.gguf", tensor_type=QT.F32,
                          n_layers=N_LAYERS, seed=5)
    return edgellm.load(tm.path, n_ctx=128, threads=1, units=["reference"])


@pytest.fixture(scope="module")
def text():
    return load_calibration("builtin")


@pytest.fixture(scope="module")
def result(engine, text):
    """One full analysis (no cache), with the logits and runner entries from before it."""
    ids = engine.tokenize(text)[:TOKENS]
    before = engine.logits(ids)
    ops_before = {ph: dict(t) for ph, t in engine.runner._ops.items()}
    calls = []
    res = analyze(engine, text, formats=FORMATS, max_tokens=TOKENS, cache=False,
                  progress=lambda d, t: calls.append((d, t)))
    return {"res": res, "ids": ids, "before": before, "ops_before": ops_before, "progress": calls}


def _count_forwards(monkeypatch, engine) -> list:
    calls = []
    real = engine.runner.forward

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(engine.runner, "forward", counted)
    return calls


def test_exact_format_measures_zero_and_int4_does_not(result):
    res = result["res"]
    f32 = [e for e in res.entries if e.format == "f32"]
    assert len(f32) == N_LAYERS * 4 + 1
    assert all(e.kl == 0.0 and math.isinf(e.sqnr_db) for e in f32), f32
    int4 = [e for e in res.entries if e.format == "int4-32"]
    assert len(int4) == N_LAYERS * 4 + 1
    assert all(e.kl > 0.0 and 10.0 < e.sqnr_db < 40.0 for e in int4), int4


def test_kl_grows_as_bits_shrink(result):
    res = result["res"]
    for op in res.ops:
        layers = [None] if op == "lm_head" else range(N_LAYERS)
        q8 = np.mean([res.get(li, op, "q8_0").kl for li in layers])
        q4 = np.mean([res.get(li, op, "q4_0").kl for li in layers])
        assert 0.0 < q8 < q4, (op, q8, q4)
        assert all(res.get(li, op, "q8_0").sqnr_db > res.get(li, op, "q4_0").sqnr_db + 15 for li in layers)


def test_activation_fake_quant_increases_kl(result):
    acts = [e for e in result["res"].entries if e.kind == "activations"]
    assert len(acts) == N_LAYERS * 4 + 1
    assert all(e.format == "int8" and e.kl > 0.0 and 25.0 < e.sqnr_db < 60.0 for e in acts), acts
    # only the measured layer's input is quantized: each layer of an op gives its own figure
    for op in ("qkv", "attn_out", "ffn_gate_up", "ffn_down"):
        kls = [e.kl for e in acts if e.op == op]
        assert len(set(kls)) == N_LAYERS, (op, kls)


def test_engine_is_restored_bit_for_bit(engine, result):
    after = engine.logits(result["ids"])
    assert after.dtype == result["before"].dtype
    assert np.array_equal(after, result["before"])
    for ph, table in engine.runner._ops.items():
        for op, entry in table.items():
            assert entry is result["ops_before"][ph][op], (ph, op)


def test_restored_when_interrupted(engine, text):
    saved = {ph: dict(t) for ph, t in engine.runner._ops.items()}

    class Stop(Exception):
        pass

    def progress(done, total):
        if done == 3:
            raise Stop

    with pytest.raises(Stop):
        analyze(engine, text, formats=("q4_0",), ops=("qkv",), max_tokens=16, cache=False, progress=progress)
    assert {ph: dict(t) for ph, t in engine.runner._ops.items()} == saved


def test_cost_and_progress(result):
    res = result["res"]
    assert res.forward_passes == forward_passes(N_LAYERS, res.ops, FORMATS, ("int8",)) == 1 + 13 * 5
    total = (N_LAYERS * 4 + 1) * 5
    assert result["progress"] == [(i, total) for i in range(1, total + 1)]
    assert res.n_tokens == TOKENS


def test_json_round_trip(result):
    res = result["res"]
    back = Sensitivity.from_json(res.to_json())
    assert back == res
    assert math.isinf(back.get(0, "qkv", "f32").sqnr_db)


def test_cache_hit_runs_no_forward_pass(engine, text, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    kw = dict(formats=("q8_0", "q4_0"), ops=("ffn_down",), activations=(), max_tokens=24)
    first = analyze(engine, text, **kw)
    files = list((tmp_path / "cache" / "precision").glob("*.json"))
    assert len(files) == 1
    calls = _count_forwards(monkeypatch, engine)
    again = analyze(engine, text, **kw)
    assert calls == [] and again == first
    # another parameter is another key: computed, not served from the first file
    analyze(engine, text, **{**kw, "formats": ("q8_0",)})
    assert len(calls) == 1 + N_LAYERS
    # another calibration text too
    calls.clear()
    analyze(engine, text + " more", **kw)
    assert len(calls) == 1 + N_LAYERS * 2


@pytest.mark.parametrize("garbage", [b"{not json", b'{"schema": 1}', b"\xff\xfe", b"[]"])
def test_corrupt_cache_warns_and_recomputes(engine, text, tmp_path, monkeypatch, caplog, garbage):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    kw = dict(formats=("q8_0",), ops=("attn_out",), activations=(), max_tokens=24)
    first = analyze(engine, text, **kw)
    (path,) = (tmp_path / "cache" / "precision").glob("*.json")
    path.write_bytes(garbage)
    calls = _count_forwards(monkeypatch, engine)
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        again = analyze(engine, text, **kw)
    assert any("sensitivity cache miss" in r.getMessage() for r in caplog.records)
    assert len(calls) == 1 + N_LAYERS
    assert [e.kl for e in again.entries] == [e.kl for e in first.entries]
    assert Sensitivity.from_json(path.read_text().split("\n", 1)[1]) == again   # rewritten whole (after its sha256)


def test_stale_cache_for_another_model_is_a_miss(engine, text, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    kw = dict(formats=("q8_0",), ops=("attn_out",), activations=(), max_tokens=24)
    first = analyze(engine, text, **kw)
    (path,) = (tmp_path / "cache" / "precision").glob("*.json")
    body = first.to_json().replace(first.model_sha256, "0" * 64).encode()
    path.write_bytes(hashlib.sha256(body).hexdigest().encode() + b"\n" + body)   # (a valid checksum: stale)
    calls = _count_forwards(monkeypatch, engine)
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        analyze(engine, text, **kw)
    assert calls and any("stale" in r.getMessage() for r in caplog.records)


def test_format_that_does_not_divide_k_is_skipped_with_reason(engine, text):
    # d_model = 64: int4-128 groups do not fit a row of 64
    res = analyze(engine, text, formats=("int4-128", "q8_0"), ops=("qkv",), activations=(),
                  max_tokens=16, cache=False)
    assert len(res.skipped) == N_LAYERS and all("128" in s.reason for s in res.skipped)
    assert [e.format for e in res.entries] == ["q8_0"] * N_LAYERS
    assert res.forward_passes == 1 + N_LAYERS


def test_bad_arguments(engine, text):
    with pytest.raises(ConfigError, match="weight format"):
        analyze(engine, text, formats=("q3_k",), cache=False)
    with pytest.raises(ConfigError, match="op"):
        analyze(engine, text, ops=("softmax",), cache=False)
    with pytest.raises(ConfigError, match="activation"):
        analyze(engine, text, activations=("int4",), cache=False)
    with pytest.raises(ConfigError, match="max_tokens"):
        analyze(engine, text, max_tokens=1, cache=False)


def test_refuses_an_op_on_another_unit(engine, text, monkeypatch):
    import types

    other = types.SimpleNamespace(NAME="neon", matmul=reference.matmul)
    table = engine.runner._ops["prefill"]
    monkeypatch.setitem(table, "ffn_down", (other, table["ffn_down"][1]))
    with pytest.raises(ConfigError, match="units=\\['reference'\\]"):
        analyze(engine, text, ops=("ffn_down",), cache=False)


def test_fake_quant_int8_rounds_like_the_neon_kernel():
    x = np.zeros((2, 64), np.float32)
    x[0, 0] = 127.0                      # d = 1: codes are the rounded values themselves
    x[0, 1:5] = [0.5, 1.5, 2.5, -2.5]    # nearest even: 0, 2, 2, -2
    x[0, 32] = 1.0                       # second block: its own scale, exact
    x[1, :32] = np.linspace(-1, 1, 32)
    y = fake_quant_int8(x)
    assert y[0, :5].tolist() == [127.0, 0.0, 2.0, 2.0, -2.0]
    assert y[0, 32] == 1.0 and np.all(y[0, 33:] == 0.0)
    d = np.float32(1.0) / np.float32(127.0)
    assert np.allclose(y[1, :32], np.rint(x[1, :32] * (np.float32(1.0) / d)) * d, atol=0, rtol=1e-6)
    assert np.all(y[1, 32:] == 0.0)
    # a K that is not a multiple of 32 keeps its last partial block
    z = fake_quant_int8(np.full((1, 40), 3.0, np.float32))
    assert z.shape == (1, 40) and np.allclose(z, 3.0)


def test_load_calibration(tmp_path, engine):
    text = load_calibration()
    assert "def moving_average" in text and "harbour" in text
    p = tmp_path / "c.txt"
    p.write_text("hello world")
    assert load_calibration(p) == "hello world"
    with pytest.raises(ConfigError, match="cannot read"):
        load_calibration(tmp_path / "missing.txt")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="UTF-8"):
        load_calibration(tmp_path / "bad.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        load_calibration(tmp_path / "empty.txt")


def test_module_cost_formula():
    # SmolLM2-135M, the defaults: the figure the analyze() docstring states
    assert forward_passes(30, sensitivity.DEFAULT_OPS, sensitivity.DEFAULT_FORMATS, ("int8",)) == 606
