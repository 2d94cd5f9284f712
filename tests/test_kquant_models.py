"""Models whose matrices are in block types no unit computes with (the K-quants of a Q4_K_M file,
Q5_0/Q5_1) load from a copy made once (api._runnable), Q4_K as Q4_1 and the rest as Q8_0: they
were refused at open, and most Llama-family GGUFs people download keep output.weight in Q6_K."""
import logging

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm import quant
from edgellm.kquant_repack import runs_as
from edgellm.model.gguf_file import read_tensor
from edgellm.model.loader import open_model

from tests.synthetic import write_kquant_model, write_tiny_model

# (attn_q / attn_k in Q4_K beside a Q6_K attn_v, as a Q4_K_M file's layers have them: one projection,
# so they take Q8_0 with it; ffn_gate / ffn_up both Q4_K: Q4_1)
K_TYPES = {"attn_q.weight": QT.Q4_K, "attn_k.weight": QT.Q4_K, "attn_v.weight": QT.Q6_K,
           "attn_output.weight": QT.Q5_0, "ffn_gate.weight": QT.Q4_K, "ffn_up.weight": QT.Q4_K,
           "ffn_down.weight": QT.Q5_K, "output.weight": QT.Q6_K}


def _raw(mf, info):
    with open(mf.path, "rb", buffering=0) as f:
        return read_tensor(f, mf.gguf, info)


@pytest.fixture(scope="module")
def kmodel(tmp_path_factory):
    d = tmp_path_factory.mktemp("kq")
    return write_kquant_model(d / "k.gguf", K_TYPES)


def test_the_copy_holds_each_matrix_within_what_its_type_rounds(kmodel, home, caplog):
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        e = edgellm.load(kmodel.path, units=["reference"], n_ctx=128)
    try:
        said = [r.getMessage() for r in caplog.records if "no edgellm unit computes with" in r.getMessage()]
        assert len(said) == 1 and "(Q4_K as Q4_1/Q8_0, Q5_0 as Q8_0, Q5_K as Q8_0, Q6_K as Q8_0;" in said[0], said
        src, copy = open_model(kmodel.path), e.model
        assert copy.path != kmodel.path and str(home) in copy.path
        for name, info in src.gguf.tensors.items():
            got = copy.gguf.tensors[name]
            if info.ggml_type not in quant.CONVERTIBLE_TYPES:
                assert got.ggml_type == info.ggml_type, name
                continue
            in_qkv = ".attn_" in name and "output" not in name   # (a Q4_K beside Q6_K attn_v: Q8_0)
            assert got.ggml_type == (QT.Q4_1 if info.ggml_type == QT.Q4_K and not in_qkv else QT.Q8_0), name
            assert got.ggml_type == runs_as(info.ggml_type) or in_qkv
            shape = tuple(reversed(info.shape))
            want = quant.dequantize(_raw(src, info), info.ggml_type, shape)
            np.testing.assert_array_equal(want, kmodel.weights[name])   # the gguf package's reading
            have = quant.dequantize(_raw(copy, got), got.ggml_type, shape).reshape(-1, 32)
            if info.ggml_type == QT.Q5_0:     # its values, exactly
                np.testing.assert_array_equal(have, want.reshape(-1, 32))
                continue
            if got.ggml_type == QT.Q4_1:
                # the same 4-bit values; only the block's d sc and dmin m rounded to fp16: 2^-11 of
                # each, times the largest value (15) for d, or 2^-25 each below fp16's normal range
                blocks = _raw(copy, got).reshape(-1, 20)
                d = np.abs(blocks[:, 0:2].copy().view(np.float16).astype(np.float64))
                m = np.abs(blocks[:, 2:4].copy().view(np.float16).astype(np.float64))
                bound = (15 * d + m) * 2.0 ** -11 + 16 * 2.0 ** -25
                assert np.all(np.abs(have - want.reshape(-1, 32)) <= bound), name
                continue
            # half a step of the block's scale d = max|w| / 127, plus its fp16 rounding times the
            # largest quant, 127: 2^-11 of d (0.062 d), or below fp16's normal range half its
            # subnormal spacing, 2^-25 (a block of tiny weights)
            step = np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
            assert np.all(np.abs(have - want.reshape(-1, 32)) <= step * 0.57 + 127 * 2.0 ** -25), name
    finally:
        e.close()


def test_it_runs_on_neon_as_on_the_reference_and_the_copy_is_made_once(kmodel, home, caplog):
    ids = list(range(3, 40))
    ref = edgellm.load(kmodel.path, units=["reference"], n_ctx=128)
    try:
        want = ref.logits(ids)[-1]
    finally:
        ref.close()
    with caplog.at_level(logging.INFO, logger="edgellm"):
        e = edgellm.load(kmodel.path, units=["neon"], n_ctx=128)
    try:
        assert any("(cached:" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        got = e.logits(ids)[-1]
        assert np.all(np.isfinite(got))
        nmse = float(np.sum((got - want) ** 2) / np.sum(want ** 2))
        # neon's int8 activations against fp32, now in every projection (with q / k or gate / up in
        # two formats, qkv and ffn_gate_up ran on reference): 1.4e-3 here, 1.7e-3 with every matrix
        # Q6_K (all Q8_0 in the copy), 5e-5 with the Q4_K ones Q8_0 in the file (values of other sizes)
        assert nmse < 3e-3, nmse
        assert {p.op: p.unit for p in e.plan.decode.placements}["qkv"] == "neon"
        assert e.generate("hello", max_tokens=8, temperature=0) is not None
    finally:
        e.close()


def test_info_counts_the_copy_load_maps(kmodel, home):
    """info's memory line said the neon unit reads the weights in place: it maps the copy"""
    import re
    from pathlib import Path

    from typer.testing import CliRunner

    from edgellm.cli import app

    r = CliRunner().invoke(app, ["info", kmodel.path])
    assert r.exit_code == 0, r.output
    said = re.search(r"its 15 tensors in types no unit computes with run from a copy of the file \(Q4_K as Q4_1/Q8_0, "
                     r"Q5_0 as Q8_0, Q5_K as Q8_0, Q6_K as Q8_0\), ([0-9.]+) MiB", " ".join(r.output.split()))
    assert said, r.output
    e = edgellm.load(kmodel.path, units=["neon"], n_ctx=128)
    try:
        assert float(said.group(1)) == pytest.approx(Path(e.model.path).stat().st_size / 2**20, abs=0.06)
    finally:
        e.close()


def test_a_large_matrix_is_converted_a_few_rows_at_a_time(tmp_path):
    """The conversion dequantized a whole tensor at once: ~5x its fp32 size in memory (Llama 3.2
    1B's Q6_K token_embd, 128256 x 2048, ~5 GB at a phone's first load; a probe). Here a whole
    conversion peaked at 7-8x the tensor's fp32 size; in row chunks it stays under 3x (most of it
    the source, the output and one chunk's temporaries), and the bytes are a whole conversion's."""
    import tracemalloc

    from edgellm import requant

    name = "blk.0.ffn_up.weight"
    m = write_tiny_model(tmp_path / "big.gguf", tensor_type=QT.Q8_0, n_layers=1, d_model=256, d_ff=16384, n_heads=4,
                         n_kv_heads=2, tensor_types={"ffn_up.weight": QT.Q6_K}, seed=5)
    fp32_bytes = 16384 * 256 * 4
    tracemalloc.start()
    try:
        requant.requantize_gguf(m.path, tmp_path / "q8.gguf", {name: "q8_0"})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * fp32_bytes, (peak, fp32_bytes)
    whole = quant.quantize(m.weights[name], QT.Q8_0)
    copy = open_model(tmp_path / "q8.gguf")
    np.testing.assert_array_equal(_raw(copy, copy.gguf.tensors[name]).reshape(-1), whole.reshape(-1))


def test_a_q4_k_beside_a_q6_k_in_one_projection_takes_q8_0(tmp_path, home, caplog):
    """A Q4_K_M file keeps attn_q / attn_k in Q4_K and attn_v in Q6_K: as Q4_1 beside Q8_0 the layer's
    qkv mixed two formats, which neon and opencl refuse, so qkv ran on reference (numpy, fp32 copies,
    no fused decode step) in every layer: decode 4.4x slower than with the all-Q8_0 copy before."""
    from edgellm.kquant_repack import copy_types
    from edgellm.ops import weight_formats

    m = write_kquant_model(tmp_path / "m.gguf", {"attn_q.weight": QT.Q4_K, "attn_k.weight": QT.Q4_K,
                                                 "attn_v.weight": QT.Q6_K, "ffn_gate.weight": QT.Q4_K,
                                                 "ffn_up.weight": QT.Q4_K})
    mf = open_model(m.path)
    conv = copy_types(mf.gguf.tensors)
    for i in range(2):
        assert conv[f"blk.{i}.attn_q.weight"] == conv[f"blk.{i}.attn_k.weight"] == QT.Q8_0
        assert conv[f"blk.{i}.ffn_gate.weight"] == conv[f"blk.{i}.ffn_up.weight"] == QT.Q4_1
    fmt = weight_formats(mf)
    assert (fmt["qkv"], fmt["ffn_gate_up"]) == ("q8_0", "q4_1")
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        e = edgellm.load(m.path, units=["neon"], n_ctx=64)
    try:
        assert not [r for r in caplog.records if "one weight format per call" in r.getMessage()]
        assert {p.op: p.unit for p in e.plan.decode.placements}["qkv"] == "neon"
        assert e.model.gguf.tensors["blk.0.attn_q.weight"].ggml_type == QT.Q8_0
    finally:
        e.close()


def test_the_q8_0_copy_of_an_older_version_is_removed_when_the_new_copy_is_written(tmp_path, home):
    """Before Q4_K ran as Q4_1 the copy was named "-q8_0-" (every matrix as Q8_0): nothing removed
    it, a whole model's size kept until the cache's bound. Another model's such copy stays."""
    from edgellm.precision_runtime import _identity, cache_dir

    m = write_kquant_model(tmp_path / "m.gguf", {"attn_q.weight": QT.Q4_K, "ffn_down.weight": QT.Q6_K})
    mf = open_model(m.path)
    old_formats = {n: "q8_0" for n, i in mf.gguf.tensors.items() if i.ggml_type in quant.CONVERTIBLE_TYPES}
    d = cache_dir()
    d.mkdir(parents=True)
    old = d / f"m-q8_0-{_identity(m.path, old_formats)}-0123456789abcdef.gguf"
    other = d / f"m-q8_0-{_identity(str(tmp_path / 'elsewhere' / 'm.gguf'), old_formats)}-0123456789abcdef.gguf"
    for f in (old, other, old.with_name(old.name + ".sample-sha256")):
        f.write_bytes(b"old copy")
    edgellm.load(m.path, units=["reference"], n_ctx=64).close()
    assert not old.exists() and not old.with_name(old.name + ".sample-sha256").exists()
    assert other.exists()
    assert [p.name for p in d.glob("m-runnable-*.gguf")]
