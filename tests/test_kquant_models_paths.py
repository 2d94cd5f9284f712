"""K-quant models (api._runnable) on the paths beside a plain load: `edgellm plan`'s costing, a
norm in a K type, a read-only EDGELLM_HOME, and a precision plan's copy (one copy of the source)."""
import logging
import os

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm import precision_runtime
from edgellm.errors import ConfigError, ModelFormatError
from edgellm.model.loader import open_model
from edgellm.ops import WEIGHT_BYTES, weight_formats
from edgellm.precision import parse_plan

from tests import synthetic
from tests.synthetic import write_kquant_model, write_tiny_model

K_TYPES = {"attn_q.weight": QT.Q4_K, "attn_k.weight": QT.Q2_K, "attn_v.weight": QT.Q6_K,
           "attn_output.weight": QT.Q5_1, "ffn_gate.weight": QT.Q3_K, "ffn_up.weight": QT.Q5_K,
           "ffn_down.weight": QT.Q6_K, "output.weight": QT.Q6_K, "token_embd.weight": QT.Q4_K}


@pytest.fixture(scope="module")
def kmodel(tmp_path_factory):
    d = tmp_path_factory.mktemp("kq")
    return write_kquant_model(d / "k.gguf", K_TYPES)


def test_the_plan_costs_each_kquant_matrix_as_the_type_it_runs_as(kmodel):
    # `edgellm plan -m` a Q4_K_M file: KeyError 'q5_1' / 'q4_k' from ops.weight_bytes
    fmts = weight_formats(open_model(kmodel.path))
    for op, f in fmts.items():
        assert str(f) in WEIGHT_BYTES, (op, f)
    assert fmts["lm_head"] == "q8_0" and fmts["ffn_down"] == "q8_0"     # Q6_K
    assert fmts["embedding"] == "q4_1"                                    # Q4_K


def test_a_norm_in_a_k_type_is_refused_by_the_1d_rule(tmp_path, monkeypatch):
    # it was "type Q4_K is not supported; supported: ..., Q4_K, ..."
    orig = gguf.GGUFWriter.add_tensor

    def add(self, name, w, *a, **k):
        if name == "output_norm.weight":
            raw, _ = synthetic.random_blocks(1, 256, QT.Q4_K, np.random.default_rng(0))
            return orig(self, name, raw.reshape(-1), raw_dtype=QT.Q4_K)
        return orig(self, name, w, *a, **k)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add)
    m = write_tiny_model(tmp_path / "n.gguf", tensor_type=QT.Q8_0, d_model=256, d_ff=512)
    with pytest.raises(ModelFormatError, match="1-D tensor must be F32/F16/BF16, found Q4_K"):
        open_model(m.path)


def test_a_home_that_cannot_be_written_is_a_config_error(kmodel, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    monkeypatch.setenv("EDGELLM_HOME", str(blocker / "home"))   # (mkdir: NotADirectoryError, as EROFS)
    with pytest.raises(ConfigError, match="as Q8_0: cannot write the requantized model.*EDGELLM_HOME"):
        edgellm.load(kmodel.path, units=["reference"], n_ctx=64)


def _plan():
    return parse_plan("schema: 1\nkv_cache: f16\ndefaults:\n  ffn_down: {weights: int4-32, compute: int8}\n",
                      name="p")


def test_a_plan_on_a_kquant_model_is_one_copy_of_the_source(kmodel, home, monkeypatch, caplog):
    cache = precision_runtime.cache_dir()
    e = edgellm.load(kmodel.path, units=["reference"], n_ctx=64, precision=_plan())
    try:
        assert e.model.tensor_type("blk.0.ffn_down.weight") == QT.Q4_0
        assert e.model.tensor_type("blk.0.ffn_up.weight") == QT.Q8_0
        assert e.model.tensor_type("output.weight") == QT.Q8_0
    finally:
        e.close()
    assert len(list(cache.glob("*.gguf"))) == 1, sorted(p.name for p in cache.iterdir())
    # the source touched (re-pulled): its plan copy is replaced, not kept beside the new one
    st = os.stat(kmodel.path)
    os.utime(kmodel.path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    edgellm.load(kmodel.path, units=["reference"], n_ctx=64, precision=_plan()).close()
    assert len(list(cache.glob("*.gguf"))) == 1, sorted(p.name for p in cache.iterdir())


def test_a_plan_on_a_kquant_model_is_a_hit_under_a_bound_that_holds_its_copy(kmodel, home, monkeypatch, caplog):
    # it wrote the Q8_0 copy, then the plan's copy from it, which evicted the first: both again
    # at every load
    monkeypatch.setenv("EDGELLM_PRECISION_CACHE_MB", str(1.5))
    edgellm.load(kmodel.path, units=["reference"], n_ctx=64, precision=_plan()).close()
    with caplog.at_level(logging.INFO, logger="edgellm"):
        edgellm.load(kmodel.path, units=["reference"], n_ctx=64, precision=_plan()).close()
    said = [r.getMessage() for r in caplog.records if "tensors requantized" in r.getMessage()]
    assert said and all("(cached:" in m for m in said), said
