"""Placement and TTFT: what the dispatcher prices against what the engine runs."""
from __future__ import annotations

from dataclasses import replace

import pytest

from edgellm.costmodel import cpu_unit, gpu_unit, handoff_ms
from edgellm.dispatch import Dispatcher
from tests.profiles import cpu_only, soc
from tests.test_dispatch import CFG, OPS, Q41


def test_attentions_handoff_moves_q_k_and_v():
    """Handing attention's input to a unit that is not zero-copy charged 4 x T x 576 bytes (q
    alone, its output width) though it reads q and the step's new k and v: 4 x T x 960."""
    p = soc(npu=False)
    p = replace(p, gpu=replace(p.gpu, unified_memory=False))
    neon, gpu = cpu_unit("neon", p), gpu_unit(p)
    assert not gpu.zero_copy
    d = Dispatcher(p, CFG, Q41, probe=False, units=[neon, gpu])
    T = 256
    ok, no = d._options(OPS["attention"], "prefill", T, 0)
    placed = d._placement(OPS["attention"], "prefill", T, "opencl", "neon", ok, no)
    qkv_bytes = 4 * T * (CFG.q_dim + 2 * CFG.kv_dim)
    assert placed.transfer_ms == pytest.approx(handoff_ms(neon, gpu, qkv_bytes))
    assert placed.transfer_ms > handoff_ms(neon, gpu, 4 * T * CFG.q_dim)


def _plan(prompt_tokens, profile=None):
    d = Dispatcher(profile or soc(), CFG, Q41, probe=False)
    return d, d.plan(prompt_tokens=prompt_tokens, n_ctx=2048, memory_budget=512 * 2**20)


def test_a_one_token_prompt_is_priced_as_the_decode_step_the_engine_runs():
    """TTFT added up every chunk with the chunk's prefill placement (GPU and NPU on an
    RK3588-like SoC, 33 ms) while the engine runs a 1-token prompt as a decode step (neon, 3.6)."""
    d, plan = _plan(1)
    assert {p.unit for p in plan.prefill.placements} != {p.unit for p in plan.decode.placements}
    assert plan.predicted_ttft_ms == pytest.approx(d.step_ms(plan.decode, 1, 0))
    assert plan.ttft_phase == "decode" and plan.to_json()["ttft_placement"] == "decode"
    assert plan.predicted_ttft_ms < d.step_ms(plan.prefill, 1, 0)


def test_a_short_prompt_is_priced_with_the_short_prefill_placement():
    """A 32-token prompt runs the prefill_short placement (2..short_max tokens) in the engine;
    TTFT priced it with the chunk's (36.5 ms on rk3588 against 14.2 for what runs)."""
    d, plan = _plan(32)
    assert plan.prefill_short is not None and plan.short_max_tokens >= 32
    assert Dispatcher.prompt_phase(32, plan.short_max_tokens) == "prefill_short"
    assert plan.predicted_ttft_ms == pytest.approx(d.step_ms(plan.prefill_short, 32, 0))
    assert plan.predicted_ttft_ms < d.step_ms(plan.prefill, 32, 0)


def test_a_long_prompts_chunks_are_priced_with_the_placement_each_call_runs():
    """The engine picks a placement per forward call, so per chunk: a 300-token prompt's last
    chunk of 300 - chunk tokens runs the short prefill's (checked on an rk3588-profile engine:
    chunks (256, 'prefill'), (10, 'prefill_short')). TTFT priced every chunk with the chunk's."""
    d, plan = _plan(300)
    c = plan.chunk.tokens
    assert Dispatcher.prompt_phase(300, plan.short_max_tokens) == "prefill" and c < 300
    last = {"prefill_short": plan.prefill_short, "prefill": plan.prefill}[
        Dispatcher.prompt_phase(300 - c, plan.short_max_tokens)]
    want = d.step_ms(plan.prefill, c, 0, head=False) + d.step_ms(last, 300 - c, c)
    assert plan.predicted_ttft_ms == pytest.approx(want)


def test_no_chunk_of_one_token_is_priced():
    """Generation cuts chunk + 1 tokens as (chunk - 1, 2), never leaving one token to run alone:
    the plan priced (chunk, 1), that token on the chunk's placement (rk3588: 256 tokens 77.0 ms,
    257 tokens 109.2)."""
    c = _plan(1000)[1].chunk.tokens
    _, at_c = _plan(c)
    d, plan = _plan(c + 1)
    assert plan.chunk.tokens == c
    last = {"prefill_short": plan.prefill_short, "prefill": plan.prefill}[
        Dispatcher.prompt_phase(2, plan.short_max_tokens)]
    want = d.step_ms(plan.prefill, c - 1, 0, head=False) + d.step_ms(last, 2, c - 1)
    assert plan.predicted_ttft_ms == pytest.approx(want)
    assert plan.predicted_ttft_ms < 1.1 * at_c.predicted_ttft_ms


def test_ttft_prices_the_fused_native_step_as_the_table_does():
    """step_ms() charged each op of a fused native step a full call: one full chunk's TTFT was
    45.86 ms against the table's 45.29 per step (Pi 5), and step_ms of the decode plan was not
    its table figure either."""
    p = cpu_only()
    # per-op calls dearer than numpy's (50 us), the fused step one call: the layer is fused
    neon = replace(cpu_unit("neon", p), launch_s=50e-6, fused_decode_s=50e-6)
    d = Dispatcher(p, CFG, Q41, probe=False, units=[neon, cpu_unit("reference", p)])
    chunk = d.plan(prompt_tokens=1, n_ctx=2048, memory_budget=2**30).chunk.tokens
    plan = d.plan(prompt_tokens=chunk, n_ctx=2048, memory_budget=2**30)
    assert all(q.reason.startswith("fused prefill chunk on neon") for q in plan.prefill.placements
               if q.scope == "layer")
    assert plan.predicted_ttft_ms == pytest.approx(plan.prefill.step_ms)
    assert d.step_ms(plan.decode, 1, chunk) == pytest.approx(plan.decode.step_ms)


def test_a_profile_with_no_fp32_figure_is_a_readable_error_naming_each_units_reason():
    """A profile with only an int8 peak passed the schema, then plan failed with a Python dict in
    the message: `op attn_norm: no available unit can run it: {'neon': ...}`."""
    from edgellm.errors import ConfigError

    p = cpu_only()
    p = replace(p, clusters=tuple(replace(c, peak_per_core={"int8": c.peak_per_core["int8"]}) for c in p.clusters))
    with pytest.raises(ConfigError) as e:
        Dispatcher(p, CFG, Q41, probe=False).plan(prompt_tokens=8, n_ctx=256, memory_budget=2**30)
    msg = str(e.value)
    assert "{" not in msg and "'" not in msg, msg
    assert msg.startswith("op attn_norm (rmsnorm): no unit can run it with the test-cpu profile")
    assert "neon: no fp32 throughput figure" in msg and "reference: no fp32 throughput figure" in msg
    assert "opencl: unavailable" in msg and "needs an fp32 peak" in msg


def test_units_does_not_turn_off_the_fused_steps_price_the_engine_still_runs():
    """`--units neon` places every op on neon, as the plan without --units does, and the engine
    runs the same fused native steps (ModelRunner fuses any phase whose layer is on one unit with
    a native step); the dispatcher priced them op by op under --units: `edgellm plan --units neon`
    on this host predicted decode at 163.7 tok/s, 240.5 without --units, for the same run (a probe)."""
    p = soc(npu=False)
    free = Dispatcher(p, CFG, Q41, probe=False).plan(prompt_tokens=512, n_ctx=2048, memory_budget=2**30)
    forced = Dispatcher(p, CFG, Q41, probe=False, override=["neon"]).plan(prompt_tokens=512, n_ctx=2048,
                                                                          memory_budget=2**30)
    assert {q.unit for q in forced.decode.placements} == {q.unit for q in free.decode.placements} == {"neon"}
    assert forced.predicted_decode_tps == pytest.approx(free.predicted_decode_tps)
    assert forced.decode.step_ms == pytest.approx(free.decode.step_ms)
    layer = [q for q in forced.decode.placements if q.scope == "layer"]
    assert all(q.reason.startswith("fused decode step on neon") and "--units order" in q.reason for q in layer), \
        layer[0].reason
    # a --units order that splits the layer over units runs op by op, and is priced so
    split = Dispatcher(p, CFG, Q41, probe=False, override=["opencl", "neon"]).plan(
        prompt_tokens=512, n_ctx=2048, memory_budget=2**30)
    assert not any(q.reason.startswith("fused") for q in split.decode.placements)
