"""`precision plan` whose verified KL was over the budget printed 'OVER the budget' and exited 0
with the plan written, so a script took it as a plan that keeps the quality asked for. Now: exit 1,
no plan written (README); a plan that is written is a user's file (0644 less the umask, not 0600)."""
import os
import stat

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

import edgellm.precision_search
from edgellm.cli import app
from tests.synthetic import write_tiny_model

runner = CliRunner()
ARGS = ["--device", "rk3588", "--objective", "decode", "--budget-kl", "0.05", "--max-tokens", "40"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("probe23p") / "m.gguf", tensor_type=QT.Q8_0, n_layers=2,
                            seed=1).path


def test_a_verified_kl_over_the_budget_exits_1_and_writes_no_plan(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(edgellm.precision_search, "mean_kl", lambda a, b: 1.0)   # (measured: far over 0.05)
    out = tmp_path / "p.yaml"
    r = runner.invoke(app, ["precision", "plan", "--model", tiny, *ARGS, "-o", str(out)])
    assert r.exit_code == 1, r.output
    assert "OVER the budget" in r.stdout
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("edgellm: error:")]
    assert len(errors) == 1 and "--budget-kl 0.05" in errors[0] and "not written" in errors[0], r.stderr
    assert not out.exists() and "plan written" not in r.output
    default = tmp_path / "home" / "plans"
    assert not default.exists() or not any(default.iterdir())


def test_a_plan_within_the_budget_is_written_0644(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    old = os.umask(0o022)
    try:
        out = tmp_path / "p.yaml"
        r = runner.invoke(app, ["precision", "plan", "--model", tiny, *ARGS, "--no-verify", "-o", str(out)])
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    assert f"plan written to {out}" in r.output
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


def test_readme_documents_the_exit_code():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    row = next(ln for ln in readme.splitlines() if ln.startswith("| `edgellm precision plan"))
    assert "over the budget exits 1" in row and "writes no plan" in row
