"""Two decode rates the cost model reads out of a measured profile.

- Weight streaming: neon's one-row GEMM figure is measured on CURVE_FORMAT weights streaming from
  DRAM, so it is a rate of their bytes; a format with more bytes per weight takes longer by that
  much (FLOPs alone priced a Q8_0 file's decode the same as a Q4_1 one's; measured 1.3-1.7x
  slower).
- Elementwise ops inside a fused step: their one-row figures, timed as calls from Python, are
  mostly the call; a fused step prices one row at the marginal rate of its larger row counts."""
from __future__ import annotations

import dataclasses

import pytest

from edgellm.backends.neon_probe import CURVE_FORMAT
from edgellm.costmodel import FUSED_OP_S, cpu_unit, estimate, fused_elementwise_curves
from edgellm.device.profile import ElementwiseFigure, GemmFigure, Measured, UnitMeasurement, load_profile
from edgellm.errors import ConfigError
from edgellm.ops import WEIGHT_BYTES, OpSpec
from tests.test_dispatch import CFG, OPS

GEMV = OpSpec("ffn_down", "matmul", "layer", k=576, n=1536)
ONE_ROW = 20e9        # FLOP/s of the measured one-row GEMM
# (rows, FLOP/s) of an rmsnorm as a Python call measures it: 4.8 us at 32 rows, 18.8 at 256,
# 3.6 at one (2304 FLOPs), most of it the call
NORM = ((1, 2304 / 3.6e-6), (32, 32 * 2304 / 4.8e-6), (256, 256 * 2304 / 18.8e-6))


def _neon(bandwidth=1e15, gemm=(GemmFigure(1, 576, 1536, ONE_ROW), GemmFigure(256, 576, 1536, 400e9)), norm=NORM):
    p = load_profile("rk3588")
    um = UnitMeasurement(precision_flops={"int8": 400e9, "fp32": 50e9}, gemm=gemm, call_overhead_s=5e-6,
                         threads=4, elementwise=tuple(ElementwiseFigure("rmsnorm", t, f) for t, f in norm))
    m = Measured(date="2026-11-28", tool="test", memory_read_bandwidth=bandwidth, clusters={}, units={"neon": um})
    return cpu_unit("neon", dataclasses.replace(p, name="host", measured=m), threads=4)


def _decode_ms(unit, fmt):
    e = estimate(unit, GEMV, CFG, 1, 100, fmt, 2.0, prefill=False)
    return e.ms - unit.launch_s * 1e3, e.bound


def test_the_curve_format_is_a_cost_model_format():
    assert CURVE_FORMAT.lower() in WEIGHT_BYTES


def test_a_format_with_more_bytes_streams_longer_at_one_row():
    neon = _neon()
    base, _ = _decode_ms(neon, CURVE_FORMAT.lower())
    q8, bound = _decode_ms(neon, "q8_0")
    assert base == pytest.approx(2 * 576 * 1536 / ONE_ROW * 1e3, rel=1e-9)   # the figure itself
    assert q8 / base == pytest.approx(WEIGHT_BYTES["q8_0"] / WEIGHT_BYTES[CURVE_FORMAT.lower()], rel=1e-9)
    assert bound == "memory"
    # the ridge shown beside it is at the stream rate: the intensity is below it, as the bound says
    e = estimate(neon, GEMV, CFG, 1, 100, "q8_0", 2.0, prefill=False)
    assert e.cost.intensity < e.ridge
    # fewer bytes than the measured format: no faster than the measured FLOP rate
    assert _decode_ms(neon, "q4_0")[0] == pytest.approx(base, rel=1e-9)


def test_many_rows_stay_compute_bound():
    neon = _neon()
    q41 = estimate(neon, GEMV, CFG, 256, 0, CURVE_FORMAT.lower(), 2.0, prefill=True)
    q8 = estimate(neon, GEMV, CFG, 256, 0, "q8_0", 2.0, prefill=True)
    assert q8.ms == q41.ms and q8.bound == "compute"


@pytest.mark.parametrize("gemm", [(GemmFigure(16, 576, 1536, ONE_ROW),), ()], ids=["no one-row figure", "no curve"])
def test_without_a_one_row_figure_formats_cost_alike(gemm):
    neon = _neon(gemm=gemm)
    assert neon.stream_bandwidth == 0.0
    if gemm:
        assert _decode_ms(neon, "q8_0")[0] == pytest.approx(_decode_ms(neon, "q4_1")[0], rel=1e-9)


def test_a_stream_rate_above_the_dram_bandwidth_is_not_used():
    # the figure would stream 20e9 / 2 * 0.625 = 6.25 GB/s; a 5 GB/s DRAM figure is the bound
    assert _neon(bandwidth=5e9).stream_bandwidth == 0.0
    assert _neon(bandwidth=7e9).stream_bandwidth == pytest.approx(ONE_ROW / 2 * WEIGHT_BYTES["q4_1"], rel=1e-9)


def test_a_fused_step_prices_one_row_at_the_marginal_rate():
    neon = _neon()
    op = OPS["attn_norm"]
    marginal = (256 - 32) * 2304 / (18.8e-6 - 4.8e-6)
    alone = estimate(neon, op, CFG, 1, 0, "f32", 2.0, prefill=False)
    fused = estimate(neon.in_fused_step(), op, CFG, 1, 0, "f32", 2.0, prefill=False)
    flops = fused.cost.flops
    assert alone.ms == pytest.approx((flops / NORM[0][1] + neon.launch_s) * 1e3, rel=1e-9)
    assert fused.ms == pytest.approx((max(flops / marginal, fused.cost.bytes / neon.bandwidth) + FUSED_OP_S) * 1e3,
                                     rel=1e-9)
    assert fused.ms < alone.ms / 5
    # the larger row counts keep their measured figures
    big = estimate(neon.in_fused_step(), op, CFG, 256, 0, "f32", 2.0, prefill=True)
    assert big.ms == pytest.approx((big.cost.flops / NORM[2][1] + FUSED_OP_S) * 1e3, rel=1e-9)


def test_no_growth_measured_keeps_the_figures():
    flat = ((1, 1e9), (32, 32e9), (256, 300e9))    # 256 rows took less time than 32: noise
    assert fused_elementwise_curves({"rmsnorm": flat}) == {"rmsnorm": flat}
    # 256 rows 1 ns slower than 32: the marginal rate is capped at twice the best figure
    near = ((1, 1e9), (32, 32 * 2304 / 4.8e-6), (256, 256 * 2304 / (4.8e-6 + 1e-9)))
    got = fused_elementwise_curves({"rmsnorm": near})["rmsnorm"]
    assert got[0] == (1, 2 * near[2][1]) and got[1:] == near[1:]
    # attention is not an elementwise op: its one-row figure is mostly work of its own
    att = ((1, 5e9), (32, 50e9), (256, 60e9))
    assert fused_elementwise_curves({"attention": att}) == {"attention": att}


def test_a_serial_op_in_the_fused_call_pays_no_dispatch():
    neon = _neon()
    assert neon.in_fused_step(dispatch=False).launch_s == 0.0
    assert neon.in_fused_step().launch_s == FUSED_OP_S


def test_layers_of_two_formats_read_their_bound_from_the_mean():
    # a Q4_1 op with a third of its layers in Q8_0 (a Q4_K_M file's Q6_K ffn_down runs as Q8_0):
    # the majority's ridge beside the mean's AI read "compute-bound, AI 2.6 vs ridge 3.2"
    from edgellm.costmodel import LayerFormats
    neon = _neon(bandwidth=30e9)
    lf = LayerFormats(("q4_1",) * 20 + ("q8_0",) * 10)
    e = estimate(neon, GEMV, CFG, 1, 100, lf, 2.0, prefill=False)
    assert e.bound == ("compute" if e.cost.intensity >= e.ridge else "memory") == "memory"
    assert e.ms == pytest.approx((2 * _decode_ms(neon, "q4_1")[0] + _decode_ms(neon, "q8_0")[0]) / 3
                                 + neon.launch_s * 1e3, rel=1e-9)


# ---- measured one-row figures by format (profile `gemv`, `gemv_fp32act`) ------------------------

def _measured(gemv, gemv32=(), threads=4, **kw):
    p = load_profile("rk3588")
    um = UnitMeasurement(precision_flops={"int8": 400e9, "fp32": 50e9}, call_overhead_s=5e-6, threads=threads,
                         gemm=(GemmFigure(1, 576, 1536, ONE_ROW), GemmFigure(256, 576, 1536, 400e9)),
                         gemv=dict(gemv), gemv_fp32act=dict(gemv32))
    m = Measured(date="2026-11-28", tool="test", memory_read_bandwidth=1e15, clusters={}, units={"neon": um})
    return dataclasses.replace(p, name="host", measured=m)


def test_a_format_with_its_own_one_row_figure_runs_at_it():
    neon = cpu_unit("neon", _measured({"q4_1": 150e9, "q8_0": 70e9}), threads=4)
    flops = 2 * 576 * 1536
    for fmt, rate in (("q4_1", 150e9), ("q8_0", 70e9)):
        ms, _ = _decode_ms(neon, fmt)
        assert ms == pytest.approx(flops / rate * 1e3, rel=1e-9)   # no stream term on top
    # q4_0 has none: it streams at the q4_1 figure's byte rate, no faster than the curve
    stream = 150e9 / 2 * WEIGHT_BYTES["q4_1"]
    assert neon.stream_bandwidth == pytest.approx(stream, rel=1e-9)
    assert _decode_ms(neon, "q4_0")[0] == pytest.approx(max(flops / ONE_ROW, 576 * 1536 * WEIGHT_BYTES["q4_0"]
                                                            / stream) * 1e3, rel=1e-9)
    # more rows: the GEMM curve, whatever the format
    big = estimate(neon, GEMV, CFG, 256, 0, "q8_0", 2.0, prefill=True)
    assert big.ms == pytest.approx((big.cost.flops / 400e9 + neon.launch_s) * 1e3, rel=1e-9)


def test_fp32_activations_take_their_own_figure():
    neon = cpu_unit("neon", _measured({"q8_0": 70e9}, {"q8_0": 60e9}), threads=4)
    head = OPS["lm_head"]
    e = estimate(neon, head, CFG, 1, 100, "q8_0", 2.0, prefill=False)
    assert e.precision == "fp32"     # neon's head keeps fp32 activations
    assert e.ms == pytest.approx((e.cost.flops / 60e9 + neon.launch_s) * 1e3, rel=1e-9)


def test_one_row_figures_scale_with_the_threads():
    half = cpu_unit("neon", _measured({"q4_1": 150e9}), threads=2)   # measured with 4
    assert dict(half.gemv)["q4_1"] == pytest.approx(75e9, rel=1e-9)


def test_one_row_figures_round_trip_through_the_profile_file(tmp_path, monkeypatch):
    from edgellm.device.profile import write_profile
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    path = write_profile(_measured({"q4_1": 150e9, "f16": 40e9}, {"q8_0": 60.5e9}),
                         tmp_path / "profiles" / "host.yaml")
    text = path.read_text()
    assert "gemv: {q4_1: 150 GFLOPS, f16: 40 GFLOPS}" in text and "gemv_fp32act: {q8_0: 60.5 GFLOPS}" in text
    back = load_profile("host").measured.units["neon"]
    assert back.gemv == {"q4_1": 150e9, "f16": 40e9} and back.gemv_fp32act == {"q8_0": 60.5e9}
    # a format the cost model has no bytes for is refused, naming the key
    path.write_text(text.replace("f16: 40 GFLOPS", "q5_k: 40 GFLOPS"))
    with pytest.raises(ConfigError, match=r"gemv\.q5_k"):
        load_profile("host")


def test_the_probe_measures_every_format():
    from edgellm.backends.neon_probe import GEMV_FORMATS, measure_gemv
    from edgellm.device.probes import QUICK
    sizes = dataclasses.replace(QUICK, weight_bytes=8 << 20, runs=20, min_runs=3, budget_s=0.05)
    gemv, gemv32 = measure_gemv(sizes)
    assert set(gemv) == {f.lower() for f in GEMV_FORMATS["int8"]}
    assert set(gemv32) == {f.lower() for f in GEMV_FORMATS["fp32"]}
    assert all(1e8 < r < 1e14 for r in (*gemv.values(), *gemv32.values())), (gemv, gemv32)


def test_a_failing_format_loses_its_figure_only(monkeypatch, caplog):
    """el_matmul failing on one format's call drops that figure (a warning), not neon's whole probe."""
    from edgellm.backends import neon, neon_probe
    from edgellm.device.probes import QUICK
    sizes = dataclasses.replace(QUICK, weight_bytes=4 << 20, runs=5, min_runs=3, budget_s=0.02)
    real = neon._lib()

    class Failing:
        def __getattr__(self, name):
            if name == "el_matmul_f32act":
                def fail(*args):
                    return -2
                fail.__name__ = name
                return fail
            return getattr(real, name)
    monkeypatch.setattr(neon, "_lib", lambda: Failing())
    gemv, gemv32 = neon_probe.measure_gemv(sizes)
    assert set(gemv) == {f.lower() for f in neon_probe.GEMV_FORMATS["int8"]} and gemv32 == {}
    assert "no one-row figure for Q4_1" in caplog.text


def test_a_null_call_no_faster_than_the_gemv_cannot_make_a_huge_rate(monkeypatch):
    """A measured time at or below the null call's reads as at most twice the raw rate."""
    from edgellm.backends import neon_probe
    from edgellm.device.probes import QUICK
    sizes = dataclasses.replace(QUICK, weight_bytes=4 << 20, runs=5, min_runs=3, budget_s=0.02)
    monkeypatch.setattr(neon_probe, "median_seconds", lambda call, s: (call(), 1e-5)[1])
    gemv, gemv32 = neon_probe.measure_gemv(sizes)
    K, N = sizes.gemm_k, sizes.gemm_n
    assert all(r == pytest.approx(2.0 * K * N / 0.5e-5) for r in (*gemv.values(), *gemv32.values()))


def test_one_row_figures_under_another_unit_are_refused(tmp_path, monkeypatch):
    from edgellm.device.profile import write_profile
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    p = _measured({"q4_1": 150e9})
    um = p.measured.units["neon"]
    m = dataclasses.replace(p.measured, units={"neon": um, "reference": dataclasses.replace(um, gemv={"f32": 1e9})})
    with pytest.raises(ConfigError, match=r"units\.reference\.gemv: one-row figures by weight format are neon's"):
        write_profile(dataclasses.replace(p, measured=m), tmp_path / "profiles" / "host.yaml")   # (read back)
