"""`edgellm quantize MODEL --plan PLAN -o OUT.gguf`: the plan's weight formats end up in a GGUF
that edgellm and the gguf package read, with the size the report predicted."""
from __future__ import annotations

import os

import gguf
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

import edgellm
from edgellm.cli import app
from edgellm.model.loader import open_model
from edgellm.precision import load_plan
from tests.synthetic import write_tiny_model


def test_quantize_with_the_fast_preset(tmp_path):
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.F32, n_layers=6, seed=2)
    out = tmp_path / "fast.gguf"
    res = CliRunner().invoke(app, ["quantize", tm.path, "--plan", "fast", "-o", str(out)])
    assert res.exit_code == 0, res.output
    plan = load_plan("fast")
    mf = open_model(out)
    for i in range(6):
        want = plan.weight_format(i, "ffn_down", 6)
        got = mf.tensor_type(f"blk.{i}.ffn_down.weight")
        # int4-32 has no GGUF type: written as Q4_0; "gguf" keeps the source's F32
        assert got == (QT.Q4_0 if want == "int4-32" else QT.F32), (i, want, got)
    assert {plan.weight_format(i, "ffn_down", 6) for i in range(6)} == {"gguf", "int4-32"}
    assert f"written {os.path.getsize(out)} bytes" in res.output and "predicted" in res.output
    assert len(gguf.GGUFReader(str(out)).tensors) == len(gguf.GGUFReader(tm.path).tensors)
    assert edgellm.load(str(out), n_ctx=64, units=["reference"]).generate("hi", max_tokens=3, temperature=0) is not None
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o666 & ~umask      # the usual permissions, not owner-only


def test_quantize_names_a_bad_plan(tmp_path):
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.F32, n_layers=2, seed=2)
    res = CliRunner().invoke(app, ["quantize", tm.path, "--plan", "no-such-plan", "-o", str(tmp_path / "o.gguf")])
    assert res.exit_code == 1
    assert "no-such-plan" in res.output and not (tmp_path / "o.gguf").exists()
