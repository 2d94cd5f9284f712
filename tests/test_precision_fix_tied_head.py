"""A tied head is the embedding table: its weight-format sensitivity is measured with the lookup
reading the same quantized table (what the requantized model stores), the search does not
requantize it (the embedding-float rule), and a plan that does is warned about at load."""
from __future__ import annotations

import logging

import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.calibration import load_calibration
from edgellm.precision import load_plan, parse_plan
from edgellm.precision_search import mean_kl, search, teacher_forced_logits
from edgellm.sensitivity import Entry, Sensitivity, analyze
from tests.synthetic import write_tiny_model

HEAD_Q4_0 = "schema: 1\nkv_cache: f16\ndefaults:\n  lm_head: {weights: q4_0}\n"


@pytest.mark.parametrize("tied", [True, False])
def test_head_sensitivity_matches_the_stored_model(tmp_path, monkeypatch, caplog, tied):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.F32, n_layers=2, seed=5, tied_embeddings=tied)
    text = load_calibration("builtin")
    ref = edgellm.load(tm.path, n_ctx=128, threads=1, units=["reference"])
    res = analyze(ref, text, formats=("q4_0",), ops=("lm_head",), activations=(), max_tokens=32, cache=False)
    ids = ref.tokenize(text)[:res.n_tokens]

    def logits(plan):
        e = edgellm.load(tm.path, n_ctx=128, threads=1, units=["reference"], precision=plan)
        return teacher_forced_logits(e, ids, "prefill")

    quality = logits(load_plan("quality"))
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        stored = mean_kl(quality, logits(parse_plan(HEAD_Q4_0, name="head")))
    # the head alone (the old measurement) understated a tied model's change: its embedding is Q4_0 too
    assert res.get(None, "lm_head", "q4_0").kl == pytest.approx(stored, rel=1e-3)
    assert stored > 0
    said = [r.getMessage() for r in caplog.records if "embedding table" in r.getMessage()]
    assert len(said) == (1 if tied else 0), said
    assert res.tied_embeddings == tied


def test_search_keeps_a_tied_head():
    ops = ("qkv", "attn_out", "ffn_gate_up", "ffn_down", "lm_head")
    entries = tuple(Entry(li, op, kind, fmt, 0.001 if op == "lm_head" else 1.0, 30.0)
                    for li in (0, 1, None) for op in ops if (li is None) == (op == "lm_head")
                    for kind, fmt in (("weights", "q4_0"), ("activations", "int8")))
    times = {op: {("gguf", "fp32"): 10.0, ("q4_0", "fp32"): 5.0, ("gguf", "int8"): 9.0, ("q4_0", "int8"): 4.0}
             for op in ops}

    def changes(tied):
        sens = Sensitivity("m", "c", 2, 64, ("q4_0",), ops, ("int8",), entries, tied_embeddings=tied)
        res = search(sens, times, 0.0015, "decode", 2, ("q4_0",))
        return {(c.layer, c.op, c.kind) for c in res.changes}, res.plan

    untied, _ = changes(False)
    assert (None, "lm_head", "weights") in untied
    tied, plan = changes(True)
    assert tied == {(None, "lm_head", "activations")}
    assert plan.weight_format(None, "lm_head", 2) == "gguf" == plan.weight_format(None, "embedding", 2)
