"""`edgellm precision analyze` on a tiny model: the ranked sensitivities, the JSON, the cache."""
from __future__ import annotations

import json

from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.cli import app
from tests.synthetic import write_tiny_model


def test_precision_analyze_ranks_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.F32, n_layers=2, seed=1)
    args = ["precision", "analyze", "--model", tm.path, "--formats", "q8_0,q4_0", "--ops", "qkv,ffn_down",
            "--max-tokens", "48", "--json", str(tmp_path / "s.json")]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    d = json.loads((tmp_path / "s.json").read_text())
    weights = [e for e in d["entries"] if e["kind"] == "weights"]
    assert len(weights) == 2 * 2 * 2                       # layers x ops x formats
    assert "forward passes" in res.output and "KL" in res.output
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "read from the cache" in again.output


def test_precision_analyze_bad_format(tmp_path):
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.F32, n_layers=2, seed=1)
    res = CliRunner().invoke(app, ["precision", "analyze", "--model", tm.path, "--formats", "q3_x"])
    assert res.exit_code == 1 and "q3_x" in res.output


def test_precision_refuses_bad_values_before_any_analysis(tmp_path, monkeypatch):
    """--budget-kl and --prompt-tokens were checked after the whole sensitivity analysis (minutes
    at the default settings); --calib naming a device or pipe read without end or hung."""
    import os

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    tiny = write_tiny_model(tmp_path / "t.gguf", tensor_type=QT.Q8_0, seed=1).path
    fifo = tmp_path / "calib.txt"
    os.mkfifo(fifo)
    for args, needle in ((["plan", "--budget-kl", "-1"], "--budget-kl must be a positive number of nats"),
                         (["plan", "--prompt-tokens", "0"], "--prompt-tokens must be >= 1, got 0"),
                         (["analyze", "--calib", str(fifo)], "calibration text must be a regular file")):
        r = CliRunner().invoke(app, ["precision", *args, "--model", tiny])
        assert r.exit_code == 1 and needle in r.stderr, r.output
        assert not (tmp_path / "home" / "cache").exists()          # nothing was measured
