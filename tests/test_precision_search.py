"""The greedy precision search over measured sensitivities and predicted op times, and the
`edgellm precision plan` / `edgellm plan --precision` commands on a tiny model."""
from __future__ import annotations

import json
import re

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.cli import app
from edgellm.errors import ConfigError
from edgellm.precision import dump_plan, parse_plan
from edgellm.precision_search import build_plan, mean_kl, search
from edgellm.sensitivity import Entry, Sensitivity
from tests.synthetic import write_tiny_model

OPS = ("qkv", "attn_out", "ffn_gate_up", "ffn_down", "lm_head")


def _sens(kls: dict) -> Sensitivity:
    """kls: (layer, op, kind, fmt) -> KL; every other site of 2 layers gets a huge KL."""
    entries = []
    for layer in (0, 1, None):
        for op in OPS:
            if (layer is None) != (op == "lm_head"):
                continue
            for kind, fmt in (("weights", "q4_0"), ("activations", "int8")):
                entries.append(Entry(layer, op, kind, fmt, kls.get((layer, op, kind, fmt), 1.0), 30.0))
    return Sensitivity("m", "c", 2, 64, ("q4_0",), OPS, ("int8",), tuple(entries))


def _times(saving: dict) -> dict:
    """op -> {(w, a): ms}: the baseline 10 ms, minus the given savings per change (additive)."""
    out = {}
    for op in OPS:
        sw, sa = saving.get((op, "weights"), 0.0), saving.get((op, "activations"), 0.0)
        out[op] = {("gguf", "fp32"): 10.0, ("q4_0", "fp32"): 10.0 - sw, ("gguf", "int8"): 10.0 - sa,
                   ("q4_0", "int8"): 10.0 - sw - sa}
    return out


def test_greedy_takes_the_best_saving_per_nat_within_the_budget():
    sens = _sens({(0, "ffn_down", "weights", "q4_0"): 0.004, (1, "ffn_down", "weights", "q4_0"): 0.001,
                  (0, "qkv", "activations", "int8"): 0.002, (None, "lm_head", "weights", "q4_0"): 0.02})
    times = _times({("ffn_down", "weights"): 2.0, ("qkv", "activations"): 1.0, ("lm_head", "weights"): 5.0})
    res = search(sens, times, 0.0075, "decode", 2, ("q4_0",))
    got = [(c.layer, c.op, c.kind) for c in res.changes]
    # ratios: blk1 ffn_down 2000/nat, blk0 ffn_down 500, blk0 qkv act 500; the head (250) is over budget
    assert got[0] == (1, "ffn_down", "weights")
    assert set(got) == {(1, "ffn_down", "weights"), (0, "ffn_down", "weights"), (0, "qkv", "activations")}
    assert res.predicted_kl == pytest.approx(0.007) and res.predicted_kl <= 0.0075
    p = res.plan
    assert p.weight_format(1, "ffn_down", 2) == "q4_0" and p.weight_format(0, "attn_out", 2) == "gguf"
    assert p.resolve(0, "qkv", "decode", 2).compute == "int8"
    assert p.resolve(0, "qkv", "prefill", 2).compute == "fp32"      # objective decode: prefill untouched
    assert parse_plan(dump_plan(p), name="searched") == p           # the written plan reads back equal


def test_no_error_without_a_saving_and_bad_arguments():
    sens = _sens({(0, "qkv", "weights", "q4_0"): 1e-6})
    res = search(sens, _times({}), 0.02, "ttft", 2, ("q4_0",))      # nothing saves time: nothing changes
    assert res.changes == () and res.predicted_kl == 0 and not res.plan.layers
    with pytest.raises(ConfigError, match="budget"):
        search(sens, _times({}), -1, "ttft", 2, ("q4_0",))
    with pytest.raises(ConfigError, match="objective"):
        search(sens, _times({}), 0.02, "energy", 2, ("q4_0",))
    with pytest.raises(ConfigError, match="layers"):
        search(sens, _times({}), 0.02, "ttft", 3, ("q4_0",))


def test_build_plan_ttft_changes_prefill_only():
    p = build_plan({(0, "ffn_down"): ("q4_0", "int8"), (None, "lm_head"): ("gguf", "int8")}, "ttft", 0.02, 0.01)
    assert p.resolve(0, "ffn_down", "prefill", 2).compute == "int8"
    assert p.resolve(0, "ffn_down", "decode", 2).compute == "fp32"
    assert p.resolve(None, "lm_head", "prefill", 2).compute == "int8"
    assert p.weight_format(0, "ffn_down", 2) == "q4_0" and p.weight_format(1, "ffn_down", 2) == "gguf"


def test_mean_kl():
    import numpy as np

    a = np.array([[0.0, 1.0, 2.0]])
    assert mean_kl(a, a) == pytest.approx(0.0, abs=1e-12)
    p, q = np.exp(a) / np.exp(a).sum(), np.exp(a[:, ::-1]) / np.exp(a).sum()
    assert mean_kl(a, a[:, ::-1]) == pytest.approx(float((p * np.log(p / q)).sum()))


def test_precision_plan_cli_writes_a_plan_that_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.Q8_0, n_layers=2, seed=1)
    out = tmp_path / "p.yaml"
    res = CliRunner().invoke(app, ["precision", "plan", "--model", tm.path, "--device", "rk3588", "--objective",
                                   "decode", "--budget-kl", "0.05", "--max-tokens", "40", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "predicted decode time per token on rk3588" in res.output and "verified KL" in res.output
    plan = parse_plan(out.read_text(), name="p")
    # the plan runs: `edgellm plan --precision` with it
    shown = CliRunner().invoke(app, ["plan", "--model", tm.path, "--device", "rk3588", "--precision", str(out),
                                     "--json"])
    assert shown.exit_code == 0, shown.output
    d = json.loads(shown.output)
    assert d["precision_plan"] == "p" and plan.kv_precision == "f16"


def test_precision_plan_cli_compares_with_no_plan_and_says_what_the_other_phase_costs(tmp_path, monkeypatch):
    """The speed-up was quality's only, a slower baseline than no plan: a ttft plan decoded at 44
    tok/s where no plan gave 169 (fp32 compute in decode), and nothing said so (a CLI probe)."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.Q8_0, n_layers=2, seed=1)
    res = CliRunner().invoke(app, ["precision", "plan", "--model", tm.path, "--device", "rk3588", "--objective",
                                   "ttft", "--budget-kl", "0.05", "--max-tokens", "40", "-o", str(tmp_path / "p.yaml")])
    assert res.exit_code == 0, res.output
    assert re.search(r"predicted TTFT on rk3588: [\d.]+ ms vs [\d.]+ ms for quality \(speed-up [\d.]+x\) and "
                     r"[\d.]+ ms with no plan \([\d.]+x\)", res.stdout), res.stdout
    note = re.search(r"note: decode keeps quality's fp32 compute in this plan: predicted ([\d.]+) ms per token "
                     r"against ([\d.]+) with no plan; search with --objective decode", res.stdout)
    assert note and float(note[1]) > float(note[2]), res.stdout


def test_plan_cli_precision_preset_and_unknown(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.Q4_1, n_layers=9, seed=1)   # 5 of 9 layers in q4_0
    res = CliRunner().invoke(app, ["plan", "--model", tm.path, "--device", "rk3588", "--precision", "fast", "--json"])
    assert res.exit_code == 0, res.output
    ops = {(o["phase"], o["op"]): o for o in json.loads(res.output)["ops"]}
    assert ops[("decode", "ffn_down")]["weight_format"] == "q4_0"    # most layers: int4-32 stored as Q4_0
    assert ops[("decode", "ffn_down")]["precision"] == "int8"
    bad = CliRunner().invoke(app, ["plan", "--model", tm.path, "--precision", "turbo"])
    assert bad.exit_code == 1 and "turbo" in bad.output and "quality" in bad.output


def test_search_also_starts_from_int8_activations_everywhere():
    """One layer's int8 activations may save nothing alone (a fused decode step runs int8 in every
    layer or none), so the greedy steps never took them, and the search returned a plan that
    `balanced` (all int8) beat in predicted time and KL (a helper's probe, default device). It
    also starts from every site's int8 activations when their KL fits, and keeps the faster;
    and its summed KL keeps SEARCH_MARGIN of the budget free (a plan that filled 99.8% of it
    failed verification at most budgets)."""
    from edgellm.precision_search import SEARCH_MARGIN
    from edgellm.sensitivity import Entry, Sensitivity

    ops = ("qkv", "attn_out", "ffn_gate_up", "ffn_down")
    entries = tuple(Entry(li, op, kind, fmt, 0.01 if kind == "weights" else 0.001, 30.0)
                    for li in (0, 1) for op in ops for kind, fmt in (("weights", "q4_0"), ("activations", "int8")))
    sens = Sensitivity("m", "c", 2, 64, ("q4_0",), ops, ("int8",), entries)

    class Times(dict):
        @staticmethod
        def predict(plan):        # 10 ms a site, 1 saved by q4_0; half the time off when all run int8
            sites = [(li, op) for li in (0, 1) for op in ops]
            ms = sum(10.0 - (plan.weight_format(li, op, 2) == "q4_0") for li, op in sites)
            all8 = all(plan.resolve(li, op, "decode", 2).compute == "int8" for li, op in sites)
            return ms / 2 if all8 else ms

    times = Times({op: {("gguf", "fp32"): 10.0, ("q4_0", "fp32"): 9.0, ("gguf", "int8"): 10.0, ("q4_0", "int8"): 9.0}
                   for op in ops})
    res = search(sens, times, 0.05, "decode", 2, ("q4_0",))
    assert all(res.plan.resolve(li, op, "decode", 2).compute == "int8" for li in (0, 1) for op in ops)
    assert res.predicted_ms < Times.predict(build_plan({(li, op): ("q4_0" if i < 4 else "gguf", "fp32")
                                                       for i, (li, op) in enumerate((li, op) for li in (0, 1)
                                                                                    for op in ops)},
                                                      "decode", 0.05, 0.04))
    assert res.predicted_kl <= 0.05 * SEARCH_MARGIN
    assert sum(c.kind == "weights" for c in res.changes) == 3      # 0.008 of int8, then 3 x 0.01 within 0.0475
