"""The op IR, the roofline cost model, placement and chunk sizing, on profiles built in code."""
from __future__ import annotations

import pytest

from edgellm import backends
from edgellm.chunking import ALIGN, ROOF_FRACTION, choose_chunk
from edgellm.costmodel import cpu_unit, estimate, gpu_unit, handoff_ms, npu_unit
from edgellm.dispatch import Dispatcher, build_units
from edgellm.engine import _LAYER_OPS, _OP_NAMES
from edgellm.errors import ConfigError
from edgellm.model.config import ModelConfig
from edgellm.ops import WEIGHT_BYTES, layer_ops, model_ops, op_cost
from tests import fake_backend
from tests.profiles import cpu_only, soc

# SmolLM2-135M's shapes
CFG = ModelConfig(arch="llama", name="smollm2-shapes", n_layers=30, d_model=576, n_heads=9, n_kv_heads=3,
                  head_dim=64, d_ff=1536, vocab_size=49152, context_length=8192, rope_theta=1e5, rope_dim=64,
                  rope_style="norm", norm_eps=1e-5, tied_embeddings=True, qkv_bias=False, has_rope_freqs=False)
Q41 = {**{op.name: "f32" for op in (*layer_ops(CFG), *model_ops(CFG))},
       "qkv": "q4_1", "attn_out": "q4_1", "ffn_gate_up": "q4_1", "ffn_down": "q4_1",
       "embedding": "q8_0", "lm_head": "q8_0"}
OPS = {op.name: op for op in (*layer_ops(CFG), *model_ops(CFG))}


# ---- op IR ---------------------------------------------------------------------------------

def test_engine_runs_exactly_the_ir_ops():
    assert tuple(op.name for op in layer_ops(CFG)) == _LAYER_OPS
    assert {op.name for op in (*layer_ops(CFG), *model_ops(CFG))} == set(_OP_NAMES)


def test_matmul_cost_counts_flops_and_weights_at_their_format():
    qkv = OPS["qkv"]
    assert (qkv.k, qkv.n) == (576, 576 + 2 * 192)
    c = op_cost(qkv, CFG, 512, 0, "q4_1")
    assert c.flops == 2 * 512 * 576 * 960
    assert c.weight_bytes == pytest.approx(576 * 960 * 20 / 32)
    assert c.act_bytes == 4 * 512 * (576 + 960)
    assert op_cost(qkv, CFG, 512, 0, "f32").weight_bytes == 576 * 960 * 4
    assert WEIGHT_BYTES["q8_0"] == 34 / 32


def test_intensity_grows_with_tokens_for_a_matmul_not_for_elementwise():
    mm = [op_cost(OPS["ffn_gate_up"], CFG, t, 0, "q4_1").intensity for t in (1, 8, 64, 512)]
    assert mm == sorted(mm) and mm[-1] > 50 * mm[0]
    ew = {round(op_cost(OPS["swiglu"], CFG, t, 0).intensity, 6) for t in (1, 8, 64, 512)}
    assert len(ew) == 1


def test_attention_flops_count_exactly_the_visible_keys():
    T, ctx = 7, 5
    visible = sum(ctx + t + 1 for t in range(T))          # brute force over the causal triangle
    c = op_cost(OPS["attention"], CFG, T, ctx, kv_bytes_per_elem=2)
    assert c.flops == visible * CFG.n_heads * (4 * CFG.head_dim + 5)
    assert c.kv_bytes == 2 * CFG.kv_dim * (2 * (ctx + T) + 2 * T)


def test_head_runs_on_one_row_in_prefill():
    full = op_cost(OPS["lm_head"], CFG, 512, 0, "q8_0", prefill=False)
    last = op_cost(OPS["lm_head"], CFG, 512, 0, "q8_0", prefill=True)
    assert last.flops * 512 == full.flops


def test_bad_step_is_rejected():
    with pytest.raises(ValueError):
        op_cost(OPS["qkv"], CFG, 0, 0)


# ---- cost model ----------------------------------------------------------------------------

def test_decode_matmul_is_memory_bound_and_prefill_compute_bound():
    neon = cpu_unit("neon", soc())
    dec = estimate(neon, OPS["ffn_gate_up"], CFG, 1, 100, "q4_1", 2, prefill=False)
    pre = estimate(neon, OPS["ffn_gate_up"], CFG, 512, 0, "q4_1", 2, prefill=True)
    assert dec.bound == "memory" and pre.bound == "compute"
    assert dec.precision == "int8"          # dotprod on every big core
    # predicted = max(compute, memory) + launch, in ms
    c = pre.cost
    assert pre.ms == pytest.approx((max(c.flops / neon.peak["int8"], c.bytes / neon.bandwidth) + neon.launch_s) * 1e3)


def test_cpu_peak_uses_the_big_cores_only():
    p = soc(cpu_fp32=38.4e9)
    assert cpu_unit("neon", p).peak["fp32"] == pytest.approx(4 * 38.4e9)   # not + 4 LITTLE cores


def test_more_bandwidth_makes_memory_bound_ops_faster_only():
    slow, fast = cpu_unit("neon", soc(bandwidth=10e9)), cpu_unit("neon", soc(bandwidth=40e9))
    d = [estimate(u, OPS["qkv"], CFG, 1, 0, "q4_1", 2, False).ms for u in (slow, fast)]
    assert d[1] < d[0] / 3
    p = [estimate(u, OPS["qkv"], CFG, 512, 0, "q4_1", 2, True).ms for u in (slow, fast)]
    assert p[1] == pytest.approx(p[0])


def test_static_shape_unit_pays_for_padding():
    npu = npu_unit(soc())
    e1 = estimate(npu, OPS["qkv"], CFG, 1, 0, "q4_1", 2, False)
    e32 = estimate(npu, OPS["qkv"], CFG, 32, 0, "q4_1", 2, True)
    assert e1.cost.flops == e32.cost.flops          # one token is computed as a 32-token bucket
    assert npu.padded(300) == 512                   # past the largest bucket: whole buckets


def test_handoffs():
    p = soc()
    neon, ref, gpu, npu = cpu_unit("neon", p), cpu_unit("reference", p), gpu_unit(p), npu_unit(p)
    assert handoff_ms(neon, ref, 1e6) == 0                               # same caches
    assert handoff_ms(neon, gpu, 1e6) == pytest.approx(gpu.transfer_s * 1e3)   # zero-copy: fixed cost only
    assert handoff_ms(neon, npu, 1e6) == pytest.approx((npu.transfer_s + 2e6 / npu.bandwidth) * 1e3)


# ---- placement -----------------------------------------------------------------------------

def _plan(profile, **kw):
    return Dispatcher(profile, CFG, Q41, probe=False, **kw).plan(prompt_tokens=512, n_ctx=2048,
                                                                  memory_budget=512 * 2**20)


def test_every_op_gets_a_unit_and_a_reason_with_alternatives():
    plan = _plan(soc())
    for ph in (plan.prefill, plan.decode):
        assert {p.op for p in ph.placements} == set(_OP_NAMES)
        for p in ph.placements:
            assert p.reason and p.predicted_ms > 0
            assert {n for n, _ in p.alternatives} == {"neon", "opencl", "npu", "reference"}
    qkv = plan.decode.placements[[p.op for p in plan.decode.placements].index("qkv")]
    assert " ms (" in dict(qkv.alternatives)["npu"]              # npu could, at a cost
    emb = plan.prefill.placements[0]
    assert "npu runs only matmul" in dict(emb.alternatives)["npu"]


def test_a_fast_gpu_takes_the_prefill_gemms_and_decode_stays_on_the_cpu():
    plan = _plan(soc(gpu_fp32=2000e9, gpu_transfer=20e-6, npu=False))
    assert plan.prefill.unit("ffn_gate_up") == "opencl"
    assert plan.decode.unit("ffn_gate_up") == "neon"      # 1 token: launch + handoff beat the GPU's speed


def test_transfer_cost_can_make_the_locally_fastest_unit_lose():
    from dataclasses import replace

    def plan(transfer_s):
        p = soc(gpu_fp32=2000e9, npu=False)
        # a GPU that runs only matmuls: every GEMM it takes costs a handoff there and back
        gpu = replace(gpu_unit(p), transfer_s=transfer_s, op_kinds=frozenset({"matmul"}))
        units = [cpu_unit("neon", p), gpu]
        return Dispatcher(p, CFG, Q41, probe=False, units=units).plan(prompt_tokens=512, n_ctx=2048,
                                                                      memory_budget=2**30, chunk=128)
    cheap, dear = plan(1e-6), plan(2e-3)
    assert cheap.prefill.unit("ffn_down") == "opencl"
    assert dear.prefill.unit("ffn_down") == "neon"
    p = dear.prefill.placements[[q.op for q in dear.prefill.placements].index("ffn_down")]
    local = {n: float(v.split()[0]) for n, v in p.alternatives if " ms (" in v}
    assert local["opencl"] < local["neon"]                  # the GPU is faster on its own...
    assert "handing data" in p.reason                       # ...and the reason says why it lost


def test_unavailable_units_are_never_chosen_and_say_why():
    plan = _plan(soc(gpu=False, npu=False))
    assert set(plan.units_used()) <= {"neon", "reference"}
    alts = dict(plan.prefill.placements[1].alternatives)
    assert alts["opencl"].startswith("unavailable") and "no OpenCL GPU" in alts["opencl"]


def test_probe_mode_marks_missing_backends_unavailable(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "edgellm.backends.npu", None)    # as if not shipped
    units = {u.name: u for u in build_units(soc(), probe=True)}
    assert units["reference"].available
    assert not units["npu"].available and "not part of this build" in units["npu"].reason


def test_probe_mode_takes_the_backends_own_probe(monkeypatch):
    from edgellm.backends import opencl

    monkeypatch.setattr(opencl, "available", lambda: (False, "injected: the driver said no"))
    units = {u.name: u for u in build_units(soc(), probe=True)}
    assert not units["opencl"].available and units["opencl"].reason == "injected: the driver said no"
    monkeypatch.setattr(opencl, "available", lambda: (True, "injected: fine"))
    assert {u.name: u for u in build_units(soc(), probe=True)}["opencl"].available


def test_override_forces_the_listed_order_and_falls_back_with_a_warning(caplog):
    plan = _plan(soc(), override=["npu", "neon"])
    assert plan.prefill.unit("qkv") == "npu"              # first listed that runs it
    assert plan.prefill.unit("rmsnorm" if False else "attn_norm") == "neon"
    plan = _plan(soc(), override=["npu"])
    assert plan.prefill.unit("attn_norm") == "reference"
    assert any("attn_norm" in w and "reference" in w for w in plan.warnings)
    assert any("none of --units npu" in r.message for r in caplog.records)


def test_override_errors_name_the_unit():
    with pytest.raises(ConfigError, match="unknown unit.*tpu"):
        Dispatcher(soc(), CFG, Q41, probe=False, override=["tpu"])
    with pytest.raises(ConfigError, match="twice"):
        Dispatcher(soc(), CFG, Q41, probe=False, override=["neon", "neon"])


def test_predictions_add_up():
    plan = _plan(soc())
    per_layer = sum(p.predicted_ms for p in plan.decode.placements if p.scope == "layer")
    assert plan.decode.layer_ms == pytest.approx(per_layer, rel=1e-6)
    assert plan.predicted_decode_tps == pytest.approx(1e3 / plan.decode.step_ms)
    assert plan.predicted_ttft_ms > plan.prefill.step_ms        # 512 tokens take several chunks' worth


def test_json_has_the_documented_fields():
    j = _plan(soc()).to_json()
    assert {"predicted_ttft_ms", "predicted_decode_tps", "chunk_tokens", "ops"} <= set(j)
    assert {"layer", "op", "phase", "unit", "precision", "flops", "bytes", "predicted_ms", "reason"} <= set(j["ops"][0])


# ---- chunk sizing --------------------------------------------------------------------------

def _chunk(profile, unit="neon", budget=2**30, n_ctx=4096):
    u = {u.name: u for u in build_units(profile, probe=False)}[unit]
    return choose_chunk(u, CFG, Q41, n_ctx=n_ctx, memory_budget=budget)


def test_chunk_is_aligned_and_explained():
    c = _chunk(soc(l3=64 * 2**20))
    assert c.tokens % ALIGN == 0 and c.tokens == c.roof_tokens
    assert c.derivation[0].startswith("roof:") and c.derivation[-1] == f"chunk = {c.tokens} tokens"


def test_chunk_shrinks_with_more_bandwidth_and_grows_with_more_compute():
    # a bandwidth-starved unit, where arithmetic intensity is what binds
    base = _chunk(soc(l3=64 * 2**20, bandwidth=5e9)).tokens
    assert _chunk(soc(l3=64 * 2**20, bandwidth=6e9)).tokens < base
    assert _chunk(soc(l3=64 * 2**20, bandwidth=5e9, cpu_fp32=2 * 38.4e9)).tokens > base


def test_per_chunk_calls_push_the_chunk_up():
    from dataclasses import replace
    p = soc(l3=64 * 2**20, bandwidth=34e9)
    u = {u.name: u for u in build_units(p, probe=False)}["neon"]
    cheap = choose_chunk(replace(u, launch_s=1e-7), CFG, Q41, n_ctx=4096, memory_budget=2**30)
    dear = choose_chunk(replace(u, launch_s=20e-6), CFG, Q41, n_ctx=4096, memory_budget=2**30)
    assert dear.tokens > cheap.tokens and "calls" in dear.derivation[0]


def test_chunk_is_capped_by_memory_cache_and_context():
    free = _chunk(soc(l3=64 * 2**20, cpu_fp32=8 * 38.4e9))
    tight = _chunk(soc(l3=64 * 2**20, cpu_fp32=8 * 38.4e9), budget=4 * 2**20)
    assert tight.tokens < free.tokens and any(d.startswith("memory:") for d in tight.derivation)
    small_cache = _chunk(soc(l3=512 * 1024, cpu_fp32=8 * 38.4e9))
    assert small_cache.tokens < free.tokens and any(d.startswith("cache:") for d in small_cache.derivation)
    assert _chunk(soc(l3=64 * 2**20, bandwidth=8e9), n_ctx=40).tokens == 40


def test_npu_chunk_is_one_of_its_buckets():
    c = _chunk(soc(), unit="npu")
    assert c.tokens in (32, 64, 128, 256)
    c = _chunk(soc(buckets=(48, 96)), unit="npu", budget=1.5 * 2**20)   # a bound cuts below 96: round down
    assert c.tokens == 48


def test_measured_gemm_curve_sets_the_roof():
    from dataclasses import replace
    u = cpu_unit("reference", cpu_only())
    curve = ((32, 20e9), (128, 60e9), (256, 90e9), (512, 100e9))
    u = replace(u, peak={"fp32": 100e9}, gemm_curve=curve, cache_bytes=64 * 2**20)
    c = choose_chunk(u, CFG, {k: "f32" for k in Q41}, n_ctx=4096, memory_budget=2**30)
    assert u.attainable("fp32", c.tokens) >= ROOF_FRACTION * 100e9 > u.attainable("fp32", c.tokens - ALIGN)
    # a measured curve that sags after its best (noise): the roof is where the best was measured,
    # not "never" (which sent the chunk to its 2048-token maximum)
    sag = replace(u, gemm_curve=((32, 20e9), (128, 60e9), (256, 100e9), (512, 80e9)))
    c = choose_chunk(sag, CFG, {k: "f32" for k in Q41}, n_ctx=4096, memory_budget=2**30)
    assert c.tokens == 256, c.derivation


def test_measured_attention_rate_prices_attention():
    """A unit whose profile measured attention is priced at that rate for the step's tokens, not
    at its GEMM roof."""
    from dataclasses import replace

    from edgellm.ops import attention_flops
    att = next(o for o in layer_ops(CFG) if o.kind == "attention")
    ref = replace(cpu_unit("reference", cpu_only()), peak={"fp32": 100e9})
    flops = op_cost(att, CFG, 256, 0, "f32", 2.0, True).flops
    assert flops == attention_flops(256, 0, CFG.n_heads, CFG.head_dim)
    at_peak = estimate(ref, att, CFG, 256, 0, "f32", 2.0, True)
    assert at_peak.ms == pytest.approx((flops / ref.attainable("fp32", 256) + ref.launch_s) * 1e3)
    slow = replace(ref, op_curves=(("attention", ((1, 1e9), (32, 10e9), (256, 20e9))),))
    measured = estimate(slow, att, CFG, 256, 0, "f32", 2.0, True)
    assert measured.ms == pytest.approx((flops / 20e9 + ref.launch_s) * 1e3)
    swi = next(o for o in layer_ops(CFG) if o.kind == "swiglu")           # a kind it has no curve for:
    assert estimate(slow, swi, CFG, 256, 0, "f32", 2.0, True) == estimate(ref, swi, CFG, 256, 0, "f32", 2.0, True)
    between = estimate(slow, att, CFG, 64, 100, "f32", 2.0, True)        # log-interpolated: 10..20 GFLOPS
    f64 = op_cost(att, CFG, 64, 100, "f32", 2.0, True).flops
    assert (f64 / 20e9 + ref.launch_s) * 1e3 < between.ms < (f64 / 10e9 + ref.launch_s) * 1e3


# ---- the engine follows the plan -----------------------------------------------------------

@pytest.fixture
def fake_unit(monkeypatch):
    # the cost model chooses between the fake unit and reference only: a real native unit would
    # change the arithmetic, and these tests compare outputs bit for bit
    from edgellm.backends import neon
    monkeypatch.setattr(neon, "available", lambda: (False, "kept out of the fake-unit tests"))
    backends.register(fake_backend)
    fake_backend.calls.clear()
    fake_backend.state.update(available=(True, "fake unit for tests"), peak=1e15, transfer_s=1e-7, curve=())
    yield fake_backend
    backends.unregister("fake")


def test_placement_shifts_to_a_second_backend_and_outputs_stay_equal(tmp_path, fake_unit):
    import numpy as np
    from gguf import GGMLQuantizationType as QT

    import edgellm
    from tests.synthetic import write_tiny_model

    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.F32, n_layers=2, seed=5)
    ids = list(range(3, 40))
    ref = edgellm.load(tm.path, n_ctx=128, units=["reference"])
    assert "fake" not in ref.plan.units_used()
    eng = edgellm.load(tm.path, n_ctx=128)
    assert eng.plan.prefill.unit("ffn_gate_up") == "fake"
    assert eng.plan.prefill.unit("attention") == "reference"     # fake does not run it
    # both after both loads: the last one set numpy's BLAS threads for the process (1 here: reference
    # runs attention and no projection), and the count changes the rounding of reference's matmuls
    want, got = ref.logits(ids), eng.logits(ids)
    assert fake_unit.calls["matmul"] > 0 and fake_unit.calls["lm_head"] > 0
    np.testing.assert_array_equal(got, want)


def test_short_prefill_steps_get_their_own_placement(tmp_path, fake_unit):
    """A unit fast at GEMMs of a few rows and slow at a chunk's: a chat turn's short prefill runs
    there, a long prompt's chunks on reference; both give the reference's logits."""
    import numpy as np
    from gguf import GGMLQuantizationType as QT

    import edgellm
    from tests.synthetic import write_tiny_model

    fake_unit.state["curve"] = ((1, 1e15), (32, 1e15), (64, 1e6), (8192, 1e6))
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.F32, n_layers=2, seed=5)
    ref = edgellm.load(tm.path, n_ctx=256, units=["reference"])
    eng = edgellm.load(tm.path, n_ctx=256)
    assert eng.plan.prefill.unit("ffn_gate_up") == "reference"
    assert eng.plan.prefill_short is not None and eng.plan.prefill_short.unit("ffn_gate_up") == "fake"
    assert 8 <= eng.plan.short_max_tokens < 64
    short, long_ = list(range(3, 3 + eng.plan.short_max_tokens)), list(range(3, 150))
    np.testing.assert_array_equal(eng.logits(long_), ref.logits(long_))
    assert fake_unit.calls["matmul"] == 0
    np.testing.assert_array_equal(eng.logits(short), ref.logits(short))
    assert fake_unit.calls["matmul"] > 0


def test_an_unavailable_second_backend_is_skipped_with_its_reason(tmp_path, fake_unit):
    from gguf import GGMLQuantizationType as QT

    import edgellm
    from tests.synthetic import write_tiny_model

    fake_unit.state["available"] = (False, "no fake device here")
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.F32, n_layers=2, seed=5)
    eng = edgellm.load(tm.path, n_ctx=128)
    assert "fake" not in eng.plan.units_used()
    fake = next(u for u in eng.plan.units if u.name == "fake")
    assert not fake.available and fake.reason == "no fake device here"
    assert eng.generate("hi", max_tokens=3, temperature=0)  is not None
    assert fake_unit.calls["matmul"] == 0


def test_a_fused_decode_step_takes_the_whole_layer_when_it_is_cheaper():
    from dataclasses import replace

    p = cpu_only()
    ref = cpu_unit("reference", p)
    # a native unit whose per-op calls cost more than numpy's, but whose fused step costs one call
    neon = replace(cpu_unit("neon", p), launch_s=50e-6, fused_decode_s=50e-6)
    plan = Dispatcher(p, CFG, Q41, probe=False, units=[neon, ref]).plan(prompt_tokens=64, n_ctx=256,
                                                                         memory_budget=2**30)
    layer = [q for q in plan.decode.placements if q.scope == "layer"]
    assert {q.unit for q in layer} == {"neon"}
    assert all(q.reason.startswith("fused decode step on neon") for q in layer)
    unfused = Dispatcher(p, CFG, Q41, probe=False, units=[replace(neon, fused_decode_s=None), ref]).plan(
        prompt_tokens=64, n_ctx=256, memory_budget=2**30)
    assert "reference" in {q.unit for q in unfused.decode.placements if q.scope == "layer"}
    assert plan.decode.step_ms < unfused.decode.step_ms


def fused_and_unfused_plans():
    """Plans with a neon unit whose per-op calls cost more than numpy's (50 us) but whose fused
    step costs one call, and with the same unit lacking the fused step."""
    from dataclasses import replace

    p = cpu_only()
    ref = cpu_unit("reference", p)
    neon = replace(cpu_unit("neon", p), launch_s=50e-6, fused_decode_s=50e-6)
    plans = [Dispatcher(p, CFG, Q41, probe=False, units=[u, ref]).plan(prompt_tokens=64, n_ctx=256,
                                                                       memory_budget=2**30)
             for u in (neon, replace(neon, fused_decode_s=None))]
    return tuple(plans)


def test_the_model_tail_joins_the_fused_step_when_that_is_cheaper():
    """With the layers in a fused native step, the output norm and head run in the same call on
    the last row (no call of their own) when that beats their own best placement; the reason
    says so. Without a fused step they are placed as ops of their own."""
    plan, unfused = fused_and_unfused_plans()
    for phase in (plan.decode, plan.prefill):
        tail = {q.op: q for q in phase.placements if q.op in ("output_norm", "lm_head")}
        assert {q.unit for q in tail.values()} == {"neon"}, tail
        assert all("native call on neon" in q.reason for q in tail.values())
    tail = {q.op: q for q in unfused.decode.placements if q.op in ("output_norm", "lm_head")}
    assert tail["output_norm"].unit == "reference"      # 50 us a call on neon: numpy is cheaper alone
    assert not any("native call" in q.reason for q in tail.values())


def test_the_embedding_joins_the_fused_step_as_its_lead():
    """With the layers in a fused native step, the embedding lookup runs inside the same call
    (serially: no call, no pool dispatch) and the reason says so and why; without a fused step it
    is placed as an op of its own, on the cheaper unit alone (50 us a neon call: reference)."""
    plan, unfused = fused_and_unfused_plans()
    for phase in (plan.decode, plan.prefill):
        (emb,) = [q for q in phase.placements if q.op == "embedding"]
        assert emb.unit == "neon", emb
        assert "native call on neon (the step's token ids looked up there" in emb.reason
        assert "as a separate call" in emb.reason
    (emb,) = [q for q in unfused.decode.placements if q.op == "embedding"]
    assert emb.unit == "reference" and "native call" not in emb.reason


@pytest.mark.parametrize("units", [[None], [1], 5, "neon"])
def test_units_that_are_not_a_list_of_names_are_a_config_error(units):
    """(A TypeError while the error message itself was formatted.)"""
    with pytest.raises(ConfigError, match="units: expected a list of unit names"):
        Dispatcher(soc(), CFG, Q41, probe=False, override=units)


@pytest.mark.parametrize("feats, ok", [({"avx2", "fma", "avx512f", "f16c"}, True), ({"avx2"}, True),
                                       ({"neon", "dotprod"}, True), (set(), False), ({"i8mm"}, False)])
def test_an_unprobed_profile_assumes_neon_on_arm_and_on_x86(feats, ok):
    """`edgellm plan --device FILE` does not probe: a profile `edgellm profile` wrote on an x86
    machine (avx2, fma...) had neon 'unavailable: no NEON' there, while `run` with the same file
    probes and runs every op on neon (SIMDe builds it for x86)."""
    from dataclasses import replace
    p = cpu_only()
    p = replace(p, clusters=tuple(replace(c, features=frozenset(feats)) for c in p.clusters))
    u = {u.name: u for u in build_units(p, probe=False)}["neon"]
    assert u.available is ok, u.reason


def test_a_bucket_the_npu_sizes_but_does_not_run_does_not_set_the_chunk():
    """An NPU whose GEMMs win at 512 tokens sized the chunk to its bucket (1 token) though at 1
    token every GEMM runs on neon: a 1-token chunk (helper: TTFT 1467 ms predicted vs 264). The
    chunk is sized for the unit that runs the GEMMs at it, as without the NPU."""
    p = soc(npu_int8=60e12, buckets=(1,))
    plan = _plan(p)
    at_chunk = {x.unit for x in plan.prefill.placements if x.kind == "matmul"}
    assert "npu" not in at_chunk
    without = Dispatcher(replace_npu_off(p), CFG, Q41, probe=False).plan(prompt_tokens=512, n_ctx=2048,
                                                                          memory_budget=512 * 2**20)
    assert plan.chunk.tokens == without.chunk.tokens > 1
    assert "sized for neon" in plan.chunk.derivation[0]


def replace_npu_off(p):
    from dataclasses import replace
    return replace(p, npu=None)


def test_a_bucket_past_the_context_keeps_the_chunk_within_it():
    """n_ctx 16 under 32-token buckets: the chunk was rounded up to 32, past the context."""
    from edgellm.costmodel import npu_unit
    c = choose_chunk(npu_unit(soc(buckets=(32, 64))), CFG, Q41, n_ctx=16, memory_budget=2**30)
    assert c.tokens == 16 and "past n_ctx = 16" in c.derivation[-2]


def test_an_available_unit_passed_over_says_why_in_the_reason():
    """neon without an int8 figure lost qkv to another unit, and the text plan's reason named
    only the units that could run it: why neon could not was in --json's alternatives alone."""
    from dataclasses import replace
    p = soc(npu=False)
    p = replace(p, clusters=tuple(replace(c, peak_per_core={k: v for k, v in c.peak_per_core.items() if k != "int8"})
                                  for c in p.clusters))
    qkv = next(x for x in _plan(p).prefill.placements if x.op == "qkv")
    assert qkv.unit != "neon" and "neon: " in qkv.reason and "int8" in qkv.reason.split("neon: ")[1]


def test_swiglu_leaves_the_npu_when_only_ffn_gate_up_is_there():
    """A path with ffn_gate_up on the npu and ffn_down elsewhere kept swiglu on the npu (it went
    "where ffn_gate_up is"), so `edgellm plan` showed it there while the npu computed it on the
    host (it runs swiglu only inside its fused FFN subgraph)."""
    d = Dispatcher(soc(), CFG, Q41, probe=False)
    lops = layer_ops(CFG)
    opts = [d._options(op, "prefill", 512, 0) for op in lops]
    path = ["npu" if op.name in ("ffn_gate_up", "swiglu") else "neon" for op in lops]
    new, note = d._swiglu_with_its_ffn(lops, list(path), opts)
    i = [op.name for op in lops].index("swiglu")
    assert new[i] != "npu" and d.unit(new[i]).kind != "npu", new[i]
    assert "only inside its FFN subgraph" in note and f"on {new[i]}" in note


def test_swiglu_off_the_npu_keeps_to_the_units_listed():
    """Under --units npu,reference the same path must move swiglu to a listed unit (reference),
    not to the fastest unit overall (neon, which --units left out)."""
    d = Dispatcher(soc(), CFG, Q41, probe=False, override=("npu", "reference"))
    lops = layer_ops(CFG)
    opts = [d._options(op, "prefill", 512, 0) for op in lops]
    path = ["npu" if op.name in ("ffn_gate_up", "swiglu") else "reference" for op in lops]
    new, note = d._swiglu_with_its_ffn(lops, list(path), opts)
    assert new[[op.name for op in lops].index("swiglu")] == "reference" and note.endswith("on reference")


def test_a_plan_for_another_device_keeps_ops_the_npu_backend_has_no_code_for_off_it():
    """A profile may list NPU ops the npu backend cannot run (attention, norms): planning for that
    device (no probe) must not place them there, or `plan` shows a placement that every run moves
    away without a word. A fast, free NPU would otherwise win them all."""
    from dataclasses import replace

    p = soc(npu_int8=6e15)
    p = replace(p, npu=replace(p.npu, supported_ops=frozenset({"matmul", "attention", "rmsnorm", "add", "rope"}),
                               launch_overhead_s=0.0, transfer_overhead_s=0.0))
    plan = _plan(p)
    placed = {(pp.op, pp.unit) for ph in (plan.prefill, plan.decode) for pp in ph.placements}
    on_npu = {op for op, unit in placed if unit == "npu"}
    assert on_npu and {OPS[op].kind for op in on_npu} <= {"matmul", "lm_head", "swiglu"}, on_npu
    attn = next(pp for pp in plan.prefill.placements if pp.op == "attention")
    assert attn.unit != "npu" and "the NPU takes only the projections" in dict(attn.alternatives)["npu"]


def test_reasons_do_not_contradict_their_numbers():
    """An op inside the NPU's FFN subgraph read "memory-bound, AI 0.4 vs ridge 0.0 FLOP/B" (the
    estimate books no ridge there), and a tie read as a loss: "X alone would take 0.092 ms, but
    handing data across units costs more than the 0.000 ms it saves" (a helper's probe)."""
    import re
    from dataclasses import replace

    p = soc(npu_int8=6e15)
    p = replace(p, npu=replace(p.npu, launch_overhead_s=0.0, transfer_overhead_s=0.0))
    plan = _plan(p)
    reasons = [(pp.op, pp.unit, pp.reason) for ph in (plan.prefill, plan.decode) for pp in ph.placements]
    assert any(op == "swiglu" and u == "npu" and "inside npu's FFN subgraph" in r for op, u, r in reasons), reasons
    for op, u, r in reasons:
        assert "ridge 0.0 " not in r, (op, u, r)
        saved = re.search(r"costs more than the ([\d.]+) ms it saves", r)
        assert not saved or float(saved.group(1)) > 0, (op, u, r)


def test_the_logits_trip_back_to_the_cpu_is_charged():
    """The sampler reads the logits on the CPU; a head on the GPU was costed as if they stayed
    there. On tensor-g1's profile the prefill head went to opencl (0.6315 ms) where, with the
    0.05 ms hand-back, neon is cheaper (a helper's probe): the phase's model_ms now holds the
    trip, and the head stays on the CPU."""
    from edgellm.api import device_profile

    d = Dispatcher(device_profile("tensor-g1"), CFG, Q41, probe=False)
    for t in (64, 384):
        ph = d.place("prefill", t, 0)
        units = {pp.op: pp.unit for pp in ph.placements}
        assert units["lm_head"] == units["output_norm"] == "neon", units
    # a head forced onto the GPU pays the trip in the phase's time
    gpu = Dispatcher(device_profile("tensor-g1"), CFG, Q41, probe=False, override=["opencl", "neon"])
    ph = gpu.place("prefill", 64, 0)
    assert {pp.op: pp.unit for pp in ph.placements}["lm_head"] == "opencl"
    trip = handoff_ms(gpu.unit("opencl"), gpu.unit("neon"), 4 * CFG.vocab_size)
    assert trip > 0
    parts = sum(pp.predicted_ms for pp in ph.placements if pp.op in ("embedding", "output_norm", "lm_head"))
    assert ph.model_ms == pytest.approx(parts + trip, rel=1e-9)
