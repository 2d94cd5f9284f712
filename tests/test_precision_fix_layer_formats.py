"""The cost model prices each layer of a precision plan at that layer's own weight format: a plan
that changes one layer changes the predicted step by that layer's share, not by nothing (a
minority format) or by every layer's (a majority one)."""
from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as QT

from edgellm.costmodel import Unit, estimate
from edgellm.device.profile import load_profile
from edgellm.dispatch import Dispatcher
from edgellm.model.loader import open_model
from edgellm.ops import OpSpec
from edgellm.precision import load_plan, parse_plan
from edgellm.precision_runtime import ComputeTable, planned_formats
from tests.synthetic import write_tiny_model

N_LAYERS = 6


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    # wide enough that the FFN's weights, not call overheads, set its decode time
    tm = write_tiny_model(tmp_path_factory.mktemp("lf") / "w.gguf", tensor_type=QT.Q4_1, n_layers=N_LAYERS,
                          d_model=1024, d_ff=4096, n_heads=8, n_kv_heads=4, seed=3)
    return open_model(tm.path)


def _plan(layers) -> object:
    body = "".join(f"  {i}: {{ffn_gate_up: {{weights: q8_0}}}}\n" for i in layers)
    return parse_plan("schema: 1\nkv_cache: f16\n" + (f"layers:\n{body}" if body else ""), name="p")


def _decode_ms(mf, plan) -> float:
    d = Dispatcher(load_profile("rk3588"), mf.config, planned_formats(mf, plan), probe=False,
                   compute=ComputeTable(plan, mf.config.n_layers))
    return d.plan(prompt_tokens=64, n_ctx=256, memory_budget=1 << 30).decode.step_ms


def test_one_layers_format_moves_the_prediction_by_its_share(wide):
    quality = _decode_ms(wide, load_plan("quality"))
    every = _decode_ms(wide, _plan(range(N_LAYERS)))
    share = (every - quality) / N_LAYERS
    assert abs(share) > 1e-3 * quality          # q8_0 against Q4_1: a change the model can see
    only0 = _decode_ms(wide, _plan([0]))
    but0 = _decode_ms(wide, _plan(range(1, N_LAYERS)))
    # the old model took the most common format for all layers: only0 == quality, but0 == every
    assert only0 - quality == pytest.approx(share, rel=0.05)
    assert every - but0 == pytest.approx(share, rel=0.05)


def test_layer_formats_pairs_each_layers_format_with_its_ask():
    """Layer 0 q8_0 with an int8 ask, layer 1 q4_1 with fp32: the int8 estimate is layer 0's
    alone and the fp32 one layer 1's (the dispatcher weights each ask by its layers)."""
    from edgellm.costmodel import LayerFormats
    # memory-bound (slow DRAM): each layer's format sets its time
    neon = Unit("neon", "cpu", {"fp32": 4e9, "int8": 8e9}, 1e8, 0.0, quant_precision="int8",
                quant_precisions=("int8", "fp32"), stores_quantized=True)
    op = OpSpec("ffn_down", "matmul", "layer", k=256, n=256)
    plan = parse_plan("schema: 1\nkv_cache: f16\nlayers:\n  0: {ffn_down: {weights: q8_0, compute: int8}}\n",
                      name="p")
    table = ComputeTable(plan, 2)
    lf = LayerFormats(("q8_0", "q4_1"), table)

    def one(fmt, ask):   # (a matmul's cost reads no model config)
        return estimate(neon, op, None, 8, 0, fmt, 2.0, True, ask)

    assert estimate(neon, op, None, 8, 0, lf, 2.0, True, "int8").ms == pytest.approx(one("q8_0", "int8").ms)
    assert estimate(neon, op, None, 8, 0, lf, 2.0, True, "fp32").ms == pytest.approx(one("q4_1", "fp32").ms)
    assert one("q8_0", "int8").ms != pytest.approx(one("q4_1", "int8").ms)    # (so pairing is seen)
    # without a plan's asks: the mean of the layers, each at its own format
    both = estimate(neon, op, None, 8, 0, LayerFormats(("q8_0", "q4_1")), 2.0, True, None)
    assert both.ms == pytest.approx((one("q8_0", None).ms + one("q4_1", None).ms) / 2)
    assert both.cost.weight_bytes == pytest.approx((one("q8_0", None).cost.weight_bytes
                                                    + one("q4_1", None).cost.weight_bytes) / 2)


def test_a_mixed_layer_file_is_costed_as_its_plan(wide, tmp_path):
    """The engine plans a requantized file from the file's own formats (ops.weight_formats), which
    gave each layer op its majority format: `quantize`'s output of a one-layer change predicted
    the unchanged model's time."""
    from edgellm.costmodel import LayerFormats
    from edgellm.ops import weight_formats
    from edgellm.requant import requantize_gguf

    dst = tmp_path / "only0.gguf"
    requantize_gguf(wide.path, dst, {"blk.0.ffn_gate.weight": "q8_0", "blk.0.ffn_up.weight": "q8_0"})
    mf = open_model(dst)
    fmts = weight_formats(mf)
    assert isinstance(fmts["ffn_gate_up"], LayerFormats)
    assert fmts["ffn_gate_up"].layers == ("q8_0",) + ("q4_1",) * (N_LAYERS - 1) and fmts["ffn_gate_up"] == "q4_1"

    def file_ms(m):
        d = Dispatcher(load_profile("rk3588"), m.config, weight_formats(m), probe=False)
        return d.plan(prompt_tokens=64, n_ctx=256, memory_budget=1 << 30).decode.step_ms

    # the file's one changed layer moves its prediction as the plan's did
    share = (_decode_ms(wide, _plan(range(N_LAYERS))) - _decode_ms(wide, load_plan("quality"))) / N_LAYERS
    assert file_ms(mf) - file_ms(wide) == pytest.approx(share, rel=0.05)


def test_a_plan_on_a_mixed_file_keeps_the_files_own_layer_formats(wide, tmp_path):
    """A layer the plan leaves as the file stores it took the op's majority format: planning
    layer 5 on a file whose layer 0 is q8_0 predicted layer 0 as q4_1."""
    from edgellm.requant import requantize_gguf

    dst = tmp_path / "l0.gguf"
    requantize_gguf(wide.path, dst, {"blk.0.ffn_gate.weight": "q8_0", "blk.0.ffn_up.weight": "q8_0"})
    got = planned_formats(open_model(dst), _plan([N_LAYERS - 1]))["ffn_gate_up"]
    assert got.layers == ("q8_0",) + ("q4_1",) * (N_LAYERS - 2) + ("q8_0",)


def _rk3588_plan(mf, plan, prompt_tokens=64, n_ctx=256, **kw):
    """The rk3588 plan of `mf` under `plan` (per-layer formats and compute as the engine takes them)."""
    d = Dispatcher(load_profile("rk3588"), mf.config, planned_formats(mf, plan), probe=False,
                   compute=ComputeTable(plan, N_LAYERS), **kw)
    return d.plan(prompt_tokens=prompt_tokens, n_ctx=n_ctx, memory_budget=1 << 30)


def test_the_plan_says_which_layers_run_what(wide, tmp_path):
    """A plan's row shows one weight format (the most layers') and compute as "int8+fp32": the
    `fast` preset's first and last layers, kept in the file's Q4_1, read as Q4_0 like the rest,
    and a layer's own compute as no layer in particular (a probe). by_layer names them."""
    from edgellm.plan_report import render

    plan = parse_plan("schema: 1\nkv_cache: f16\ndefaults:\n  qkv: {compute: int8}\n  ffn_down: {compute: int8}\n"
                      "layers:\n  0: {ffn_down: {weights: q8_0, compute: fp32}}\n"
                      "  3: {qkv: {decode: {compute: fp32}}}\n", name="p")
    p = _rk3588_plan(wide, plan)
    pre, dec = ({x.op: x for x in ph.placements} for ph in (p.prefill, p.decode))
    # (prefill on rk3588: ffn_down on opencl, which computes fp32 whatever is asked; qkv on the npu,
    # which holds int8 weights of every layer: by_layer is what the unit runs, not what was asked)
    assert (pre["ffn_down"].unit, pre["ffn_down"].by_layer) == ("opencl", "weights q8_0 (layer 0), q4_1 (layers 1-5)")
    assert dec["ffn_down"].by_layer == "weights q8_0 (layer 0), q4_1 (layers 1-5); compute fp32 (layer 0), int8 (layers 1-5)"
    assert pre["qkv"].by_layer == "" and dec["qkv"].by_layer == "compute int8 (layers 0-2, 4-5), fp32 (layer 3)"
    assert all(not x.by_layer for x in p.prefill.placements if x.op != "ffn_down")
    from edgellm.ops import layer_ops, model_ops
    ops = {o.name: o for o in (*layer_ops(wide.config), *model_ops(wide.config))}
    text = render(p, model_name="m", soc="s", ops_by_name=ops)
    assert "q4_1*" in text and "    ffn_down     weights q8_0 (layer 0)" in text
    assert {o["op"]: o["by_layer"] for o in p.to_json()["ops"] if o["phase"] == "decode"}["qkv"].startswith("compute")
    plain = Dispatcher(load_profile("rk3588"), wide.config, planned_formats(wide, load_plan("quality")), probe=False)
    q = plain.plan(prompt_tokens=64, n_ctx=256, memory_budget=1 << 30)
    assert all(not x.by_layer for ph in (q.prefill, q.decode) for x in ph.placements)
    assert "by layer" not in render(q, model_name="m", soc="s", ops_by_name=ops)


def test_by_layer_for_a_layer_no_kernel_computes_as_asked_and_on_the_npu(wide):
    """by_layer said "compute None" for a layer whose f16 weights no kernel computes at the asked
    fp32, and on the npu the file's f32 / plan's f16 names, where npu.prepare holds fp16 for a
    plan's float weights and int8 for the rest (a review)."""
    plan = parse_plan("schema: 1\nkv_cache: f16\ndefaults:\n  qkv: {compute: int8}\n  attn_out: {compute: int8}\n"
                      "layers:\n  0: {qkv: {weights: f32}, attn_out: {weights: f16}}\n", name="p")
    table = ComputeTable(plan, N_LAYERS)
    npu = Dispatcher(load_profile("rk3588"), wide.config, planned_formats(wide, plan), probe=False,
                     compute=table, override=["npu", "neon"])
    p = npu.plan(prompt_tokens=256, n_ctx=512, memory_budget=1 << 30)
    pre = {x.op: x for x in p.prefill.placements}
    assert pre["qkv"].unit == "npu" and pre["qkv"].by_layer.startswith("weights f16 (layer 0), int8 (layers 1-5)")
    plain = parse_plan("schema: 1\nkv_cache: f16\nlayers:\n  0: {attn_out: {weights: f16}}\n", name="q")
    d = Dispatcher(load_profile("rk3588"), wide.config, planned_formats(wide, plain), probe=False,
                   compute=ComputeTable(plain, N_LAYERS))
    q = d.plan(prompt_tokens=256, n_ctx=512, memory_budget=1 << 30)
    said = [x.by_layer for ph in (q.prefill, q.decode) for x in ph.placements]
    assert not any("None" in s for s in said) and any("fp16 below the asked fp32 (layer 0)" in s for s in said), said


def test_by_layer_and_the_asks_follow_sequence_policies_at_the_steps_length(wide):
    """A decode step at context 2048 under "qkv fp32 from 1024 tokens" runs fp32 in every layer
    (the row, the runner): by_layer and the reason resolved the plan at the step's 1 token and
    said "int8 (layers 1-5)" and "asks fp32+int8" (a review)."""
    plan = parse_plan("schema: 1\nkv_cache: f16\ndefaults:\n  qkv: {compute: int8}\n"
                      "sequence:\n  - min_tokens: 1024\n    with:\n      qkv: {compute: fp32}\n"
                      "layers:\n  0: {qkv: {compute: fp32}}\n", name="seq")
    p = _rk3588_plan(wide, plan, prompt_tokens=2048, n_ctx=4096)
    dec = {x.op: x for x in p.decode.placements}["qkv"]
    assert dec.precision == "fp32" and dec.by_layer == "" and "fp32+int8" not in dec.reason, dec
