"""BF16 models (a converter's default output for many Hugging Face checkpoints) load from a copy
made once, matrices as F16 and vectors as F32 (kquant_repack.copy_types): they were refused at
open. F16 holds every BF16 value in its normal range exactly, so such a model computes what the
same weights stored as F16 compute."""
import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

import edgellm
from edgellm.cli import app
from edgellm.errors import UnsupportedModelError

from tests.synthetic import write_tiny_model

SHAPE = dict(n_layers=2, d_model=64, d_ff=128, n_heads=4, n_kv_heads=2, tied_embeddings=False, seed=7)


def _write_with(path, tensor_type, rewrite):
    """write_tiny_model (SHAPE), each tensor it writes passed through rewrite(name, data) first."""
    orig = gguf.GGUFWriter.add_tensor

    def add(self, name, w, *a, **k):
        return orig(self, name, rewrite(name, w), *a, **k)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_tensor", add)
        return write_tiny_model(path, tensor_type=tensor_type, **SHAPE)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(a BF16 model, the same bf16 values written as F16 matrices and F32 vectors)."""
    d = tmp_path_factory.mktemp("bf16")
    # (its norms in BF16 too, which llama.cpp's converter never writes, but a file may hold)
    bf = write_tiny_model(d / "bf16.gguf", tensor_type=QT.BF16, tensor_types={"norm.weight": QT.BF16}, **SHAPE)
    # the bf16 values themselves, as F16 matrices and F32 vectors
    f16 = _write_with(d / "f16.gguf", QT.F16,
                      lambda name, w: bf.weights[name].astype(np.float16 if w.ndim == 2 else np.float32))
    return bf, f16


@pytest.mark.parametrize("unit", ["reference", "neon"])
def test_a_bf16_model_computes_what_its_values_as_f16_compute(pair, home, unit):
    bf, f16 = pair
    ids = list(range(3, 30))
    a = edgellm.load(bf.path, units=[unit], n_ctx=64)
    b = edgellm.load(f16.path, units=[unit], n_ctx=64)
    try:
        assert a.model.path != bf.path                         # the copy
        assert a.model.tensor_type("blk.0.ffn_up.weight") == QT.F16
        assert a.model.tensor_type("blk.0.attn_norm.weight") == QT.F32
        np.testing.assert_array_equal(a.logits(ids), b.logits(ids))
        assert a.generate("hello", max_tokens=6, temperature=0) == b.generate("hello", max_tokens=6, temperature=0)
    finally:
        a.close()
        b.close()


def test_info_names_the_conversion(pair, home):
    r = CliRunner().invoke(app, ["info", pair[0].path])
    assert r.exit_code == 0, r.output
    assert "run from a copy of the file (BF16 as F16/F32)" in " ".join(r.output.split()), r.output


def test_a_bf16_value_past_fp16_range_is_refused_by_tensor_name(tmp_path, home):
    def big(name, w):
        if name != "blk.1.ffn_down.weight":
            return w
        return gguf.quants.quantize(np.full((w.size // 2,), 1e6, np.float32), QT.BF16).reshape(w.shape)  # 2 B each
    m = _write_with(tmp_path / "big.gguf", QT.BF16, big)
    with pytest.raises(UnsupportedModelError, match="blk.1.ffn_down.weight.*past what F16"):
        edgellm.load(m.path, units=["reference"], n_ctx=64)
