"""`edgellm bench` sets the plan's predictions beside what it measures: the dispatcher's TTFT and
decode figures for each length (and, with --shared-prefix, for the turn after the cached prefix),
in the JSON records and, when the profile is this machine's, in one line per length. The plan
printed one prediction, for 512 tokens, that nothing compared with a run."""
import json

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

import edgellm
from edgellm.cli import app
from edgellm.device import host

from .synthetic import write_tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("pred") / "tiny.gguf", tensor_type=QT.Q8_0, seed=7,
                            context_length=512).path


@pytest.fixture(scope="module")
def engine(tiny):
    eng = edgellm.load(tiny, n_ctx=512, threads=1)
    yield eng
    eng.close()


def test_predict_is_the_plans_own_pricing(engine):
    """For the prompt its plan was made for, predict() gives the plan's figures to the bit."""
    d, plan = engine.dispatcher, engine.plan
    ttft, tps = d.predict(plan.prompt_tokens, plan.chunk.tokens)
    assert (ttft, tps) == (plan.predicted_ttft_ms, plan.predicted_decode_tps)


def test_a_turn_after_a_cached_prefix_costs_more_than_the_same_tokens_alone(engine):
    d, chunk = engine.dispatcher, engine.plan.chunk.tokens
    alone, _ = d.predict(32, chunk)
    after, tps_after = d.predict(32, chunk, context=400)
    whole, tps_whole = d.predict(432, chunk)
    assert alone < after < whole          # attention over the cached keys, not their prefill
    assert tps_after == tps_whole         # decode at the same context either way


def test_predict_says_nothing(engine, caplog):
    warnings = list(engine.dispatcher.warnings)
    engine.dispatcher.predict(64, engine.plan.chunk.tokens)
    assert engine.dispatcher.warnings == warnings and not caplog.records


@pytest.mark.parametrize("shared", [0, 16])
def test_bench_sets_the_predictions_beside_the_measurements(tiny, tmp_path, monkeypatch, shared):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))   # the estimated host profile
    out = tmp_path / "b.json"
    r = runner.invoke(app, ["bench", "--model", tiny, "--prompt-tokens", "8", "--gen-tokens", "3", "--runs", "1",
                            "--no-floor", "--json", str(out), "--shared-prefix", str(shared)])
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text())[0]
    assert rec["predicted_ttft_ms"] > 0 and rec["predicted_decode_tps"] > 0
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("plan's prediction at"))
    assert f"TTFT {rec['predicted_ttft_ms']:.1f} ms (measured {rec['ttft_ms_p50']:.1f})" in line
    if shared:
        assert 0 < rec["predicted_ttft_ms_cached"] < rec["predicted_ttft_ms"]
        assert f"cached prefix: TTFT {rec['predicted_ttft_ms_cached']:.1f} ms" in line
    else:
        assert "predicted_ttft_ms_cached" not in rec and "cached" not in line


def test_another_devices_predictions_are_not_set_beside_this_machines_runs(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(host, "_cpuinfo", lambda: "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: avx2 fma\n")
    out = tmp_path / "b.json"
    r = runner.invoke(app, ["bench", "--model", tiny, "--prompt-tokens", "8", "--gen-tokens", "2", "--runs", "1",
                            "--no-floor", "--units", "neon,reference", "--json", str(out), "--device", "rk3588"])
    assert r.exit_code == 0, r.output
    assert "plan's prediction" not in r.stdout
    assert json.loads(out.read_text())[0]["predicted_ttft_ms"] > 0   # (the record names its profile)


def test_predict_prices_the_loaded_plans_placements(real_model_path):
    """bench's predictions price the placements the engine runs: the plan's short-step placement
    and bound, chosen at the plan's length, not the ones another length would get (a 32-token
    prompt on exynos2100 was priced on a short-step placement its engine never runs: 11.3 ms
    against 15.3)."""
    import logging

    from edgellm.device.profile_yaml import load_profile
    from edgellm.dispatch import Dispatcher
    from edgellm.model.loader import open_model
    from edgellm.ops import weight_formats

    from edgellm.chunking import chunk_bounds

    logging.disable(logging.WARNING)
    try:
        mf = open_model(real_model_path)   # (the tiny model's plans have no short-step placement)
        root = __import__("pathlib").Path(__file__).resolve().parent.parent
        for name in ("exynos2100", "rk3588", "tensor-g1", "raspberry-pi-5"):
            d = Dispatcher(load_profile(root / "device_profiles" / f"{name}.yaml"), mf.config, weight_formats(mf),
                           probe=False)
            plan = d.plan(prompt_tokens=512, n_ctx=2048, memory_budget=1e9)
            chunk, sm = plan.chunk.tokens, (plan.short_max_tokens if plan.prefill_short is not None else 0)
            assert d.predict(512, chunk, plan=plan) == (plan.predicted_ttft_ms, plan.predicted_decode_tps)
            for n, ctx in ((8, 0), (32, 0), (128, 0), (16, 300)):
                b = chunk_bounds(n, chunk)
                own = sum(d.step_ms(plan.phase(d.prompt_phase(c1 - c0, sm)), c1 - c0, ctx + c0, head=c1 >= n)
                          for c0, c1 in zip(b, b[1:]))
                assert d.predict(n, chunk, ctx, plan=plan)[0] == pytest.approx(own, rel=1e-9), (name, n, ctx)
    finally:
        logging.disable(logging.NOTSET)
