"""The thread count a plan is for: a measured profile's CPU figures scale with the threads as a
datasheet profile's peaks do, `edgellm plan -t N` shows the plan `run -t N` gets, and a run that
plans another device's CPU for fewer threads than its big cores says so (the plan then differs
from `edgellm plan --device X`'s, which is for all of them)."""
from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

import edgellm
from edgellm.cli import app
from edgellm.costmodel import cpu_unit
from edgellm.device.profile import AttentionFigure, GemmFigure, Measured, UnitMeasurement
from edgellm.device.profile_yaml import write_profile
from tests.profiles import soc
from tests.synthetic import write_tiny_model


def _measured(threads: int):
    u = UnitMeasurement(precision_flops={"int8": 4e11, "fp32": 1e11}, call_overhead_s=2e-6, threads=threads,
                        gemm=(GemmFigure(m=1, k=64, n=64, flops=2e10), GemmFigure(m=64, k=64, n=64, flops=4e11)),
                        attention=(AttentionFigure(tokens=64, context=0, flops=5e10),))
    return replace(soc(), measured=Measured("2026-11-28", "test", 30e9, {}, {"neon": u}))


def test_measured_figures_scale_with_the_threads_as_peaks_do():
    p = _measured(threads=4)           # soc(): 4 big cores
    full, half = cpu_unit("neon", p, threads=4), cpu_unit("neon", p, threads=2)
    assert full.peak == {"int8": 4e11, "fp32": 1e11} and cpu_unit("neon", p).peak == full.peak
    assert half.peak == {"int8": 2e11, "fp32": 5e10}
    assert half.gemm_curve == ((1, 1e10), (64, 2e11))
    assert dict(half.op_curves)["attention"] == ((64, 2.5e10),)
    assert half.launch_s == full.launch_s                        # a call's overhead is not throughput
    assert "with 4 threads, scaled to 2" in " ".join(half.notes)
    assert cpu_unit("neon", p, threads=8).peak == full.peak      # no more than the big cores


@pytest.fixture()
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.Q8_0, n_layers=2, seed=3)
    prof = write_profile(replace(soc(npu=False), name="four-big"), tmp_path / "four-big.yaml")
    return tm.path, str(prof)


def _placement(doc: dict) -> dict:
    return {(o["phase"], o["op"]): o["unit"] for o in doc["ops"]}


def test_plan_with_threads_is_the_plan_a_run_with_them_gets(setup, caplog):
    path, prof = setup
    runner = CliRunner()
    by_t = {}
    for t in ("1", "4"):
        r = runner.invoke(app, ["plan", "--device", prof, "--model", path, "--ctx", "256", "--json", "-t", t])
        assert r.exit_code == 0, r.output
        by_t[t] = json.loads(r.stdout)
    r = runner.invoke(app, ["plan", "--device", prof, "--model", path, "--ctx", "256", "--json"])
    assert json.loads(r.stdout) == by_t["4"]                  # another device: all its big cores
    assert _placement(by_t["1"]) != _placement(by_t["4"])     # the thread count moves ops here
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        eng = edgellm.load(path, device=prof, n_ctx=256, threads=1)
    got = {(ph, op): u for ph, ops in eng.plan.placement().items() for op, u in ops.items()}
    assert got == _placement(by_t["1"])
    assert eng.plan.chunk.tokens == by_t["1"]["chunk_tokens"]
    assert (f"planning four-big's CPU units for 1 thread(s), not its 4 big cores (`edgellm plan --device {prof} "
            f"-t 1` shows this plan)") in caplog.text


def test_plan_refuses_a_thread_count_below_one(setup):
    path, prof = setup
    r = CliRunner().invoke(app, ["plan", "--device", prof, "--model", path, "-t", "0"])
    assert r.exit_code == 1 and "--threads must be >= 1, got 0" in r.output
