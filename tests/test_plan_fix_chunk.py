"""Chunk sizing when a unit can never meet the 'at the roof' test by the largest chunk."""
from __future__ import annotations

from dataclasses import replace

from edgellm.chunking import ALIGN, LAYER_CALLS_SHARE, MAX_TOKENS, ROOF_FRACTION, choose_chunk
from edgellm.dispatch import build_units
from edgellm.ops import layer_ops, op_cost
from tests.profiles import soc
from tests.test_dispatch import CFG, Q41


def _neon(profile):
    return {u.name: u for u in build_units(profile, probe=False)}["neon"]


def _slowest_share(unit, T):
    """The lowest, over the layer's GEMMs, of its roofline rate at T tokens (min of compute roof
    and intensity x bandwidth) as a share of that rate at the largest chunk."""
    def rate(op, t):
        return min(unit.attainable("int8", t), op_cost(op, CFG, t, 0, Q41[op.name], 2.0).intensity * unit.bandwidth)
    return min(rate(op, T) / rate(op, MAX_TOKENS) for op in layer_ops(CFG) if op.kind == "matmul")


def test_a_ridge_above_the_gemms_capped_intensity_does_not_send_the_chunk_to_the_maximum():
    """fp32 activations cap qkv's intensity near 180 FLOP/B; a unit whose ridge is above that
    (here 246) failed the strict 'intensity < ridge' test at every size, and the chunk went to
    2048 though qkv is within 95% of its 2048-token rate far earlier."""
    u = _neon(soc(l3=64 * 2**20, bandwidth=5e9, cpu_fp32=2 * 38.4e9))
    assert u.attainable("int8", 1) / u.bandwidth > 200
    c = choose_chunk(u, CFG, Q41, n_ctx=4096, memory_budget=2**30)
    assert c.tokens < MAX_TOKENS, c.derivation
    assert "reach the roof at" in c.derivation[0]
    assert _slowest_share(u, c.tokens) >= ROOF_FRACTION > _slowest_share(u, c.tokens - ALIGN)


def test_calls_that_stay_over_their_share_at_every_chunk_stop_where_the_gain_flattens():
    """A unit whose layer calls (11 x 300 us) are over 2% of its GEMM time even at 2048 tokens
    sent the chunk to 2048; it stops where the per-token cost is within 2% of the 2048-token one."""
    u = replace(_neon(soc(l3=64 * 2**20)), launch_s=300e-6)
    c = choose_chunk(u, CFG, Q41, n_ctx=4096, memory_budget=2**30)
    assert ALIGN < c.tokens < MAX_TOKENS, c.derivation

    def per_token(T):
        gemm = sum(op_cost(op, CFG, T, 0, Q41[op.name], 2.0).flops / u.attainable("int8", T)
                   for op in layer_ops(CFG) if op.kind == "matmul")
        return (len(layer_ops(CFG)) * u.launch_s + gemm) / T

    assert per_token(c.tokens) <= (1 + LAYER_CALLS_SHARE) * per_token(MAX_TOKENS)
    assert per_token(c.tokens - ALIGN) > (1 + LAYER_CALLS_SHARE) * per_token(MAX_TOKENS)


def test_calls_whose_share_the_largest_chunk_meets_keep_the_plain_test():
    """The fallback applies only to a target no chunk can meet: where 2% is reachable the chunk
    is still the first size that meets it."""
    u = replace(_neon(soc(l3=64 * 2**20, bandwidth=100e9)), launch_s=20e-6)
    c = choose_chunk(u, CFG, Q41, n_ctx=4096, memory_budget=2**30)
    gemm = sum(op_cost(op, CFG, c.tokens, 0, Q41[op.name], 2.0).flops / u.attainable("int8", c.tokens)
               for op in layer_ops(CFG) if op.kind == "matmul")
    assert len(layer_ops(CFG)) * u.launch_s <= LAYER_CALLS_SHARE * gemm, c.derivation
    assert "calls" in c.derivation[0]
