"""Probe 22: model files that loaded, or failed, with the wrong story.

- rope_freqs.weight (Llama 3.x per-frequency divisors) of zeros, NaN, inf or negatives loaded
  without a word and gave all-NaN logits; now a ModelFormatError naming the tensor and file.
- A Mixtral-style llama file (llama.expert_count > 0, ffn_*_exps tensors, no dense FFN) was
  reported as a malformed file ('required tensor is missing'); now UnsupportedModelError.
"""
import gguf
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType as VT

from edgellm.api import load
from edgellm.errors import ModelFormatError, UnsupportedModelError
from edgellm.model.loader import open_model
from tests.synthetic import write_tiny_model


def _rewrite(src, dst, add_tensors=(), drop_tensors=(), set_meta=None):
    """A copy of the GGUF at src with tensors added or dropped and metadata set."""
    r = GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    set_meta = set_meta or {}
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in set_meta:
            continue
        vt = f.types[0]
        w.add_key_value(name, f.contents(), vt, f.types[-1] if vt == VT.ARRAY else None)
    for k, (v, vt) in set_meta.items():
        w.add_key_value(k, v, vt)
    for t in r.tensors:
        if t.name not in drop_tensors:
            w.add_tensor(t.name, np.asarray(t.data))     # (the tiny model is all F32)
    for name, arr in add_tensors:
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    # d_model 64, 4 heads: head_dim = rope_dim = 16, so rope_freqs holds 8 divisors
    return write_tiny_model(tmp_path_factory.mktemp("p22") / "base.gguf").path


BAD_FREQS = {
    "zeros": np.zeros(8, np.float32),
    "one zero": np.array([1, 1, 1, 0, 1, 1, 1, 1], np.float32),
    "nan": np.full(8, np.nan, np.float32),
    "inf": np.array([1, 1, 1, 1, 1, 1, 1, np.inf], np.float32),
    "negative": -np.ones(8, np.float32),
}


@pytest.mark.parametrize("units", [["reference"], ["neon"]])
@pytest.mark.parametrize("case", list(BAD_FREQS))
def test_bad_rope_freqs_refused_at_load(base, tmp_path, case, units):
    path = _rewrite(base, tmp_path / "rf.gguf", add_tensors=[("rope_freqs.weight", BAD_FREQS[case])])
    with pytest.raises(ModelFormatError) as e:
        load(path, units=units, threads=1, prefault=False)
    assert e.value.path == path and "rope_freqs.weight" in e.value.field
    assert "> 0" in str(e.value)


def test_good_rope_freqs_load_and_one_bad_value_is_named(base, tmp_path):
    f = np.array([1, 1, 1, 2, 4, 8, 8, 8], np.float32)       # Llama 3.x-like
    path = _rewrite(base, tmp_path / "rf_ok.gguf", add_tensors=[("rope_freqs.weight", f)])
    eng = load(path, units=["reference"], threads=1, prefault=False)
    try:
        assert np.isfinite(eng.logits([5, 6, 7])).all()
    finally:
        eng.close()
    f[5] = np.nan
    path = _rewrite(base, tmp_path / "rf_bad.gguf", add_tensors=[("rope_freqs.weight", f)])
    with pytest.raises(ModelFormatError, match="index 5"):
        load(path, units=["reference"], threads=1, prefault=False)


def _experts(n_layers=2, d=64, ff=128, n=4):
    add = []
    for i in range(n_layers):
        add += [(f"blk.{i}.ffn_gate_inp.weight", np.zeros((n, d), np.float32)),
                (f"blk.{i}.ffn_gate_exps.weight", np.zeros((n, ff, d), np.float32)),
                (f"blk.{i}.ffn_up_exps.weight", np.zeros((n, ff, d), np.float32)),
                (f"blk.{i}.ffn_down_exps.weight", np.zeros((n, d, ff), np.float32))]
    return add


DENSE = [f"blk.{i}.ffn_{n}.weight" for i in range(2) for n in ("gate", "up", "down")]
EXPERT_META = {"llama.expert_count": (4, VT.UINT32), "llama.expert_used_count": (2, VT.UINT32)}


@pytest.mark.parametrize("keep_dense", [False, True])
def test_mixture_of_experts_is_unsupported(base, tmp_path, keep_dense):
    # an expert_count of 0 is a dense model
    zero = _rewrite(base, tmp_path / "zero.gguf", set_meta={"llama.expert_count": (0, VT.UINT32)})
    assert open_model(zero).config.n_layers == 2
    path = _rewrite(base, tmp_path / "moe.gguf", add_tensors=_experts(),
                    drop_tensors=() if keep_dense else DENSE, set_meta=EXPERT_META)
    with pytest.raises(UnsupportedModelError) as e:
        open_model(path)
    assert e.value.path == path and e.value.field == "llama.expert_count"
    assert "mixture of experts" in str(e.value) and "required tensor is missing" not in str(e.value)


def test_expert_tensors_without_expert_count_are_unsupported(base, tmp_path):
    path = _rewrite(base, tmp_path / "moe_nokey.gguf", add_tensors=_experts(), drop_tensors=DENSE)
    with pytest.raises(UnsupportedModelError) as e:
        open_model(path)
    assert "mixture of experts" in str(e.value) and "ffn_gate_inp" in e.value.field

