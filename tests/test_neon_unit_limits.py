"""Models the neon unit can take only in part: the ops it cannot run move to the next best unit
at load, the plan says why, and the text is the reference unit's. (Both loads failed with an
untyped error before: a ValueError, a DecodeStepError.)"""
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.backends.neon_fused import DecodeStepError
from edgellm.errors import EdgeLLMError
from tests.synthetic import write_tiny_model

GREEDY = dict(max_tokens=12, temperature=0, ignore_eos=True)


def _load_both(path):
    return edgellm.load(path, n_ctx=64, threads=1), edgellm.load(path, n_ctx=64, threads=1, units=["reference"])


@pytest.mark.parametrize("mix, op", [({"attn_v.weight": QT.Q8_0}, "qkv"),
                                     ({"ffn_up.weight": QT.Q4_1}, "ffn_gate_up")])
def test_a_fused_projection_of_mixed_weight_types_runs_elsewhere(tmp_path, mix, op):
    """A Q4_0 file whose attn_v is Q8_0 (the kind of per-tensor mix llama.cpp's quantizers
    write): neon's fused matmul takes one type per call, so that op moves, said so."""
    tm = write_tiny_model(tmp_path / "mix.gguf", tensor_type=QT.Q4_0, seed=4, tensor_types=mix)
    eng, ref = _load_both(tm.path)
    assert {ph[op] for ph in eng.runner.placement.values()} == {"reference"}
    # the plan knows before the load tries (it showed the op on neon, and the load then moved it)
    reasons = [p.reason for ph in (eng.plan.prefill, eng.plan.decode) for p in ph.placements if p.op == op]
    assert all("neon: runs a projection in one weight format per call" in r and "its load rejects it" in r
               for r in reasons), reasons
    assert eng.generate("hello world", **GREEDY) == ref.generate("hello world", **GREEDY)


def test_a_head_dim_above_neons_attention_bound_runs_attention_elsewhere(tmp_path):
    tm = write_tiny_model(tmp_path / "hd.gguf", d_model=64, n_heads=2, n_kv_heads=1, head_dim=640, n_layers=1,
                          seed=5)
    eng, ref = _load_both(tm.path)
    assert {ph["attention"] for ph in eng.runner.placement.values()} == {"reference"}
    assert any("head_dim 640 is above its attention's 512" in w for w in eng.plan.warnings)
    assert eng.generate("hello world", **GREEDY) == ref.generate("hello world", **GREEDY)


def test_the_native_steps_refusals_are_typed():
    assert issubclass(DecodeStepError, EdgeLLMError)   # the CLI prints it as one line


def test_a_prefill_chunk_the_native_step_cannot_take_is_refused_at_load(tmp_path, monkeypatch):
    """A chunk past the native step's int32 buffer sizes (T * 2 ff >= 2^31: SmolLM2-like d_ff
    needs ~700k tokens, a 262k-wide FFN 4096) failed mid-request; it is a ConfigError at load."""
    import ctypes

    from edgellm.backends import neon_fused, neon_lib
    from edgellm.errors import ConfigError

    dims = neon_fused.ElModelDims(32, 2, 1, 16, 262144, 16, 0, 1e-5)
    lib = neon_lib.load()
    assert lib.el_chunk_scratch(ctypes.addressof(dims), 2048) != 0
    assert lib.el_chunk_scratch(ctypes.addressof(dims), 4096) == 0          # the native limit itself
    tm = write_tiny_model(tmp_path / "t.gguf", tensor_type=QT.Q4_0, seed=7)   # (F32 tiny: not fused)
    monkeypatch.setattr(neon_fused.DecodeStep, "chunk_fits", lambda self, T: T <= 16)
    assert edgellm.load(tm.path, n_ctx=64, threads=1, prefill_chunk=16).generate("hello", **GREEDY)
    with pytest.raises(ConfigError, match="prefill_chunk 32: the neon unit's native step cannot take chunks"):
        edgellm.load(tm.path, n_ctx=64, threads=1, prefill_chunk=32)
