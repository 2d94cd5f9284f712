"""neon's 4-bit matmuls with fp32 activations (a precision plan's ask for a sensitive layer) are
costed by rows: from the profile's measured curve (gemm_fp32act) where `edgellm profile` took
one, else by the slowdown against the int8 path measured on this project's host
(NEON_FP32ACT_SLOWDOWN: 2.3x at one row, 3.0x at 256). A flat 2x had once priced an fp32 layer's
prefill about 4x too cheap."""
import dataclasses

import pytest

from edgellm.costmodel import NEON_FP32ACT_SLOWDOWN, cpu_unit, estimate
from edgellm.device.profile import GemmFigure, Measured, UnitMeasurement, load_profile, write_profile
from edgellm.ops import OpSpec
from tests.synthetic import write_tiny_model
from edgellm.model.loader import open_model

MATMUL = OpSpec("ffn_down", "matmul", "layer", k=576, n=1536)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return open_model(write_tiny_model(tmp_path_factory.mktemp("c") / "t.gguf").path).config


def _peak(unit, cfg, rows, asked):
    e = estimate(unit, MATMUL, cfg, rows, rows, "q4_1", 2.0, prefill=rows > 1, asked=asked)
    return e.cost.flops / (e.ms / 1e3 - unit.launch_s)


def _host(fp32act=()):
    p = load_profile("rk3588")
    um = UnitMeasurement(precision_flops={"int8": 200e9, "fp32": 50e9},
                         gemm=(GemmFigure(1, 576, 1536, 20e9), GemmFigure(256, 576, 1536, 200e9)),
                         call_overhead_s=0.0, threads=4, gemm_fp32act=fp32act)
    m = Measured(date="2026-11-28", tool="test", memory_read_bandwidth=1e15, clusters={}, units={"neon": um})
    return dataclasses.replace(p, name="host", measured=m)


@pytest.mark.parametrize("rows", [1, 16, 256])
def test_without_a_measurement_the_slowdown_follows_the_rows(cfg, rows):
    neon = cpu_unit("neon", _host(), threads=4)
    factor = dict(NEON_FP32ACT_SLOWDOWN)[rows]
    assert _peak(neon, cfg, rows, "fp32") == pytest.approx(_peak(neon, cfg, rows, "int8") / factor, rel=1e-6)
    assert factor > 2.0   # (above the flat 2x it replaced, at every row count)


def test_a_measured_curve_wins(cfg):
    curve = (GemmFigure(1, 576, 1536, 5e9), GemmFigure(256, 576, 1536, 25e9))
    neon = cpu_unit("neon", _host(curve), threads=4)
    assert _peak(neon, cfg, 1, "fp32") == pytest.approx(5e9, rel=1e-6)
    assert _peak(neon, cfg, 256, "fp32") == pytest.approx(25e9, rel=1e-6)
    assert _peak(neon, cfg, 256, "int8") == pytest.approx(200e9, rel=1e-6)   # the int8 curve as before


def test_the_curve_round_trips_through_the_profile_file(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    curve = (GemmFigure(1, 576, 1536, 5.5e9), GemmFigure(64, 576, 1536, 21e9))
    path = write_profile(_host(curve), tmp_path / "profiles" / "host.yaml")
    assert "gemm_fp32act:\n      - {m: 1, k: 576, n: 1536, flops: 5.5 GFLOPS}" in path.read_text()
    back = load_profile("host").measured.units["neon"].gemm_fp32act
    assert [(g.m, round(g.flops / 1e9, 3)) for g in back] == [(1, 5.5), (64, 21.0)]
    # a profile written before the field existed still loads, with no curve
    path.write_text(path.read_text().replace("      gemm_fp32act:\n      - {m: 1, k: 576, n: 1536, flops: 5.5 GFLOPS}\n"
                                             "      - {m: 64, k: 576, n: 1536, flops: 21 GFLOPS}\n", ""))
    assert "gemm_fp32act" not in path.read_text()
    assert load_profile("host").measured.units["neon"].gemm_fp32act == ()


def test_profile_measures_the_curve():
    from edgellm.backends import neon_probe
    from edgellm.device.probes import QUICK

    sizes = dataclasses.replace(QUICK, gemm_rows=(1, 16), runs=3, min_runs=1, budget_s=0.05, weight_bytes=1 << 20)
    um = neon_probe.probe(sizes, threads=1)
    assert [g.m for g in um.gemm_fp32act] == [1, 16]
    int8 = {g.m: g.flops for g in um.gemm}
    assert all(0 < g.flops < 2 * int8[g.m] for g in um.gemm_fp32act)   # never far above the int8 path


def test_a_row_count_given_twice_is_refused(tmp_path, monkeypatch):
    from edgellm.errors import ConfigError
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    curve = (GemmFigure(1, 576, 1536, 5.5e9), GemmFigure(64, 576, 1536, 21e9))
    path = write_profile(_host(curve), tmp_path / "profiles" / "host.yaml")
    path.write_text(path.read_text().replace("{m: 64, k: 576, n: 1536, flops: 21 GFLOPS}",
                                             "{m: 1, k: 576, n: 1536, flops: 900 GFLOPS}"))
    with pytest.raises(ConfigError, match=r"gemm_fp32act: expected one figure per row count m, found m \[1\]"):
        load_profile("host")


def test_a_row_count_given_twice_in_the_int8_curve_is_refused_too(tmp_path, monkeypatch):
    """The int8 GEMM curve (`gemm`) took a hand-edited row count twice without a word: the cost
    model read the first of the two (by flops), so a host.yaml with m 32 at 1 TFLOPS and at 1
    GFLOPS planned neon at 1 GFLOPS, its matmuls on reference and the chunk at 32 (a probe)."""
    from edgellm.errors import ConfigError
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    path = write_profile(_host(), tmp_path / "profiles" / "host.yaml")
    path.write_text(path.read_text().replace("{m: 256, k: 576, n: 1536, flops: 200 GFLOPS}",
                                             "{m: 1, k: 576, n: 1536, flops: 900 GFLOPS}"))
    with pytest.raises(ConfigError, match=r"units\.neon\.gemm: expected one figure per row count m, found m \[1\]"):
        load_profile("host")
