"""A fused projection whose tensors differ in weight format (q Q4_0 with k, v F16)."""
from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as QT

from edgellm.dispatch import Dispatcher
from edgellm.model.loader import open_model
from edgellm.ops import WEIGHT_BYTES, layer_ops, op_cost, weight_formats
from tests.profiles import cpu_only
from tests.synthetic import write_tiny_model


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed") / "mixed.gguf"
    write_tiny_model(path, tensor_type=QT.Q4_0, n_layers=2, d_model=64, n_heads=4, n_kv_heads=1, d_ff=128,
                     tied_embeddings=False, tensor_types={"attn_k.weight": QT.F16, "attn_v.weight": QT.F16,
                                                          "ffn_up.weight": QT.Q8_0, "ffn_down.weight": QT.F32})
    return open_model(path)


def test_a_mixed_projection_counts_each_tensor_at_its_own_format(mixed):
    """Bytes used attn_q's (or ffn_gate's) type for the whole op: decode qkv 4096 B against the
    7040 it reads (q Q4_0, k and v F16)."""
    from edgellm.ops import MixedFormat

    cfg, fm = mixed.config, weight_formats(mixed)
    assert isinstance(fm["qkv"], MixedFormat) and fm["qkv"] == "q4_0"     # reads as its first part's
    assert fm["qkv"].parts == (("q4_0", cfg.q_dim), ("f16", cfg.kv_dim), ("f16", cfg.kv_dim))
    assert fm["ffn_down"] == "f32" and not isinstance(fm["ffn_down"], MixedFormat)
    qkv = next(op for op in layer_ops(cfg) if op.name == "qkv")
    want = cfg.d_model * (cfg.q_dim * WEIGHT_BYTES["q4_0"] + 2 * cfg.kv_dim * WEIGHT_BYTES["f16"])
    assert op_cost(qkv, cfg, 1, 0, fm["qkv"]).weight_bytes == pytest.approx(want)
    gu = next(op for op in layer_ops(cfg) if op.name == "ffn_gate_up")
    want = cfg.d_model * cfg.d_ff * (WEIGHT_BYTES["q4_0"] + WEIGHT_BYTES["q8_0"])
    assert op_cost(gu, cfg, 1, 0, fm["ffn_gate_up"]).weight_bytes == pytest.approx(want)


def test_a_unit_that_runs_one_format_per_call_is_not_given_a_mixed_projection(mixed):
    """plan put qkv and ffn_gate_up on neon; at load neon rejects both ("mix weight types F16,
    Q4_0") and the engine ran them on reference: the plan showed another placement than run."""
    d = Dispatcher(cpu_only(), mixed.config, weight_formats(mixed), probe=False)
    plan = d.plan(prompt_tokens=32, n_ctx=128, memory_budget=2**30)
    for ph in plan.phases().values():
        for p in ph.placements:
            if p.op in ("qkv", "ffn_gate_up"):
                assert p.unit == "reference", (ph.phase, p.op, p.unit)
                assert "one weight format per call" in dict(p.alternatives)["neon"]
    assert plan.prefill.unit("attn_out") in ("neon", "reference")     # one format: either may take it
    ok, _ = d._options(next(op for op in layer_ops(mixed.config) if op.name == "attn_out"), "prefill", 32, 0)
    assert "neon" in ok
