"""Faults of the npu unit: a provider or delegate that is missing, a subgraph the runtime rejects,
a numeric self-check that fails. The unit falls back with its reason shown in `edgellm plan` and
the log, and generation completes on the CPU with the tokens a CPU-only engine produces; a
subgraph rejected at load moves only its ops, with the reason in the plan."""
from __future__ import annotations

import logging
from dataclasses import replace

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

import edgellm
from edgellm.backends import npu
from edgellm.cli import app
from edgellm.device.host import estimate_host_profile
from edgellm.device.profile import Npu
from edgellm.device.profile_yaml import load_profile, write_profile
from tests.synthetic import write_tiny_model


def _home(tmp_path, monkeypatch, *, providers=("CPUExecutionProvider",), delegate=None):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    n = Npu("test npu", {"int8": 4e12}, tuple(providers), delegate, True, (32,), frozenset({"matmul"}), 300e-6, 100e-6)
    path = write_profile(replace(estimate_host_profile(), name="host", npu=n),
                         tmp_path / "home" / "profiles" / "host.yaml")
    npu.reset()
    npu.use_profile(load_profile(path))       # as the dispatcher does before it probes


@pytest.fixture(autouse=True)
def _fresh():
    npu.reset()
    yield
    npu.reset()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tm = write_tiny_model(tmp_path_factory.mktemp("m") / "tiny.gguf", tensor_type=QT.Q8_0, n_layers=2, seed=4)
    ref = edgellm.load(tm.path, n_ctx=128, units=["reference"])
    return tm.path, ref.generate("hello", max_tokens=6, temperature=0)


def _check_fallback(path, cpu_text, expect, caplog):
    ok, why = npu.available()
    assert not ok and expect in why, why
    res = CliRunner().invoke(app, ["plan", "--model", path, "--prompt-tokens", "32", "--ctx", "128"])
    assert res.exit_code == 0, res.output
    assert expect in " ".join(res.output.split()), res.output
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        eng = edgellm.load(path, n_ctx=128, units=["npu", "reference"])
    assert "npu" not in eng.plan.units_used()
    assert "unit npu unavailable" in caplog.text and expect in caplog.text
    assert eng.generate("hello", max_tokens=6, temperature=0) == cpu_text


def test_missing_provider(tmp_path, monkeypatch, tiny, caplog):
    _home(tmp_path, monkeypatch, providers=("QNNExecutionProvider",))
    monkeypatch.setenv("EDGELLM_NPU_RUNTIME", "onnx")
    _check_fallback(*tiny, "none of the profile's providers ['QNNExecutionProvider']", caplog)


def test_missing_delegate(tmp_path, monkeypatch, tiny, caplog):
    _home(tmp_path, monkeypatch, delegate=str(tmp_path / "no_such_delegate.so"))
    monkeypatch.setenv("EDGELLM_NPU_RUNTIME", "tflite")
    _check_fallback(*tiny, "no_such_delegate.so", caplog)


def test_failed_self_check(tmp_path, monkeypatch, tiny, caplog):
    from edgellm.backends import npu_onnx

    _home(tmp_path, monkeypatch)
    monkeypatch.setenv("EDGELLM_NPU_RUNTIME", "onnx")
    real = npu_onnx.compile

    class Wrong:                      # a provider that runs but computes garbage
        def __init__(self, sub):
            self.sub = sub

        def run(self, x):
            return self.sub.run(x) * 1.5
    monkeypatch.setattr(npu_onnx, "compile", lambda g, **kw: Wrong(real(g, **kw)))
    _check_fallback(*tiny, "numeric self-check failed", caplog)


def test_subgraph_rejected_at_load_moves_only_its_ops(tmp_path, monkeypatch, tiny, caplog):
    """A subgraph the runtime rejects while preparing the model: its ops (the FFN here) move to
    the CPU for every layer, with the reason in the plan; the npu keeps the others."""
    from edgellm.backends import npu_onnx

    _home(tmp_path, monkeypatch)
    monkeypatch.setenv("EDGELLM_NPU_RUNTIME", "onnx")
    path, _ = tiny
    assert npu.available()[0]
    real = npu_onnx.compile

    def picky(g, **kw):
        if g.name == "blk.1.ffn":
            raise npu_onnx.NpuGraphError(g.name, "the provider rejected MatMulInteger (injected)")
        return real(g, **kw)
    monkeypatch.setattr(npu_onnx, "compile", picky)
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        eng = edgellm.load(path, n_ctx=128, units=["npu", "reference"])
    pre = {p.op: p for p in eng.plan.prefill.placements}
    assert pre["qkv"].unit == pre["attn_out"].unit == "npu"
    for op in ("ffn_gate_up", "swiglu", "ffn_down"):
        assert pre[op].unit == "reference"
        assert "rejected at load" in dict(pre[op].alternatives)["npu"]
    assert any("blk.1.ffn" in w for w in eng.plan.warnings)
    assert "rejected" in caplog.text
    ref = edgellm.load(path, n_ctx=128, units=["reference"])
    ids = ref.tokenize("hello there, a test of the npu")
    got, want = eng.logits(ids), ref.logits(ids)
    assert float(((got - want) ** 2).mean() / (want ** 2).mean()) < 1e-2
    assert eng.generate("hello", max_tokens=6, temperature=0)


@pytest.mark.parametrize("runtime", ["onnx", "tflite"])
def test_healthy_unit_runs_the_projections(tmp_path, monkeypatch, tiny, runtime):
    _home(tmp_path, monkeypatch)
    monkeypatch.setenv("EDGELLM_NPU_RUNTIME", runtime)
    path, _ = tiny
    ok, why = npu.available()
    assert ok, why
    eng = edgellm.load(path, n_ctx=128, units=["npu", "reference"])
    used = {p.op: p.unit for p in eng.plan.prefill.placements}
    assert {used[op] for op in ("qkv", "attn_out", "ffn_gate_up", "swiglu", "ffn_down")} == {"npu"}, used
    # the FFN runs as one subgraph per bucket; its projections were not compiled separately
    layer = eng.runner._ops["prefill"]["ffn_gate_up"][1].layers[0]
    assert layer.ffn is not None and layer.ffn.graphs and not layer.w_gate_up.graphs
    ref = edgellm.load(path, n_ctx=128, units=["reference"])
    ids = ref.tokenize("hello there, a test of the npu")
    got, want = eng.logits(ids), ref.logits(ids)
    nmse = float(((got - want) ** 2).mean() / (want ** 2).mean())
    # int8 weights per channel and int8 activations per row: ~1e-4 per projection, compounding
    print(f"\n[npu {runtime}] logits NMSE vs the fp32 reference: {nmse:.2e}")
    assert nmse < 1e-2, nmse


def _profile(tmp_path, name, **npu_kw):
    kw = dict(peaks={"int8": 4e12}, providers=("CPUExecutionProvider",), buckets=(32,))
    kw.update(npu_kw)
    n = Npu(name, kw["peaks"], kw["providers"], None, True, kw["buckets"], frozenset({"matmul"}), 300e-6, 100e-6)
    return str(write_profile(replace(estimate_host_profile(), name=name, npu=n), tmp_path / f"{name}.yaml"))


def test_a_second_engine_with_another_npu_leaves_the_first_one_working(tmp_path, monkeypatch, tiny, caplog):
    """The unit's state is the process's: a second engine whose profile names another NPU used to
    switch it under the first, whose every later request then failed. The second engine now sees
    the unit unavailable, with the reason, and runs on the CPU."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EDGELLM_NPU_RUNTIME", "onnx")
    path, cpu_text = tiny
    a = edgellm.load(path, device=_profile(tmp_path, "first"), n_ctx=128, units=["npu", "reference"])
    assert "npu" in a.plan.units_used()
    text_a = a.generate("hello", max_tokens=6, temperature=0)
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        b = edgellm.load(path, device=_profile(tmp_path, "second", buckets=(64,)), n_ctx=128, units=["npu", "reference"])
    assert "npu" not in b.plan.units_used()
    assert "it serves one NPU configuration per process" in caplog.text
    assert b.generate("hello", max_tokens=6, temperature=0) == cpu_text
    assert a.generate("hello", max_tokens=6, temperature=0) == text_a


def test_a_float_projection_the_int8b_form_cannot_hold_moves_alone(tmp_path, monkeypatch):
    """ONNX's int8b blocks need K a multiple of 32; an F16 model of width 40 raised a ValueError
    from load. Now those ops move, said so, and the text is the CPU's."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EDGELLM_NPU_RUNTIME", "onnx")
    tm = write_tiny_model(tmp_path / "oddk.gguf", tensor_type=QT.F16, n_layers=1, d_model=40, n_heads=5,
                          n_kv_heads=5, d_ff=72, seed=6)
    prof = _profile(tmp_path, "fp16npu", peaks={"int8": 4e12, "fp16": 2e12})
    eng = edgellm.load(tm.path, device=prof, n_ctx=64, units=["npu", "reference"])
    assert any("int8b weights need K a multiple of 32" in w for w in eng.plan.warnings), eng.plan.warnings
    ref = edgellm.load(tm.path, n_ctx=64, units=["reference"])
    assert eng.generate("hi", max_tokens=4, temperature=0) == ref.generate("hi", max_tokens=4, temperature=0)


def test_swiglu_is_planned_where_it_runs_when_the_npu_takes_no_ffn_projection(tmp_path, monkeypatch):
    """An int8-only NPU and a float model: the NPU takes no projection, so swiglu (which it runs
    only inside its FFN subgraph) is planned beside ffn_gate_up, with the reason; the plan said
    npu while it ran on the host."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    tm = write_tiny_model(tmp_path / "f32.gguf", tensor_type=QT.F32, n_layers=2, seed=3)
    eng = edgellm.load(tm.path, device=_profile(tmp_path, "int8npu"), n_ctx=128, units=["npu", "reference"])
    for phase in (eng.plan.prefill, eng.plan.decode):
        at = {p.op: p for p in phase.placements}
        assert at["ffn_gate_up"].unit == at["swiglu"].unit == "reference"
        assert "npu runs swiglu only inside its FFN subgraph" in at["swiglu"].reason


@pytest.mark.parametrize("runtime, providers, delegate, where", [
    ("onnx", ("CPUExecutionProvider",), None, "ONNX Runtime's CPU kernels (CPUExecutionProvider)"),
    ("tflite", ("CPUExecutionProvider",), None, "LiteRT's CPU kernels (no delegate)"),
])
def test_an_npu_reached_only_through_cpu_kernels_is_said_once(tmp_path, monkeypatch, caplog, runtime, providers,
                                                             delegate, where):
    """A profile whose NPU no provider or delegate here reaches (rk3588: RKNN is neither) still
    plans the NPU at its figures; the unit works on CPU kernels, and the user is told so: one
    warning line and the unit's reason, not a silent plan at NPU speed."""
    monkeypatch.setenv("EDGELLM_NPU_RUNTIME", runtime)
    _home(tmp_path, monkeypatch, providers=providers, delegate=delegate)
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        ok, why = npu.available()
        assert npu.available() == (ok, why)               # probed once
    assert ok, why
    assert why.endswith(f"; on {where}, not the NPU"), why
    lines = [r.getMessage() for r in caplog.records if "no provider or delegate here reaches" in r.getMessage()]
    assert lines == [f"npu: no provider or delegate here reaches test npu: its subgraphs run on {where}, while "
                     f"the plan costs them at the NPU's figures (int8 4 TOPS); `--units` without npu plans "
                     f"without it"], caplog.text


@pytest.mark.parametrize("runtime", ["onnx", "tflite"])
def test_a_load_says_how_many_subgraphs_came_from_the_graph_cache(tmp_path, monkeypatch, caplog, tiny, runtime):
    """A warm load's cache hits showed only in its time (a helper's probe of the units on
    SmolLM2): one INFO line per prepare says what was read and what was built."""
    monkeypatch.setenv("EDGELLM_NPU_RUNTIME", runtime)
    _home(tmp_path, monkeypatch)
    said = []
    for _ in range(2):
        npu.reset()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="edgellm"):
            edgellm.load(tiny[0], n_ctx=128, units=["npu", "reference"]).close()
        said += [r.getMessage() for r in caplog.records if "subgraph models read from the graph cache" in r.getMessage()]
    assert len(said) == 2, said
    first, second = ([int(w) for w in m.replace(",", "").split() if w.isdigit()] for m in said)
    assert first[0] == 0 and first[1] > 0, said          # cold: all built
    assert second == [first[1], 0], said                 # warm: all read, none built
