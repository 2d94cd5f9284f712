"""`plan --plot`, `profile --out` and `precision plan -o` replaced whatever file was at their path
(a user's drawing, own profile, hand-edited plan) without a word, while `quantize -o` and the
--json outputs refuse to (a helper's probe of the docs). Each now replaces only what edgellm
wrote there before, and refuses anything else before any work."""
from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.cli import PLAN_FILE, PLOT_FILE, PROFILE_FILE, app
from edgellm.device.host import estimate_host_profile
from edgellm.device.profile_yaml import write_profile
from edgellm.precision import dump_plan, load_plan
from tests.synthetic import write_tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ow") / "tiny.gguf", tensor_type=QT.Q8_0, seed=2).path


def _refused(r, path, what):
    assert r.exit_code == 1, r.output
    assert f"{path}: exists and is not {what}; give another path, or remove it first" in r.stderr, r.stderr


@pytest.mark.parametrize("suffix", (".png", ".svg", ".pdf"))
def test_plot_replaces_only_a_plot(tiny, tmp_path, monkeypatch, suffix):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    mine = tmp_path / f"notes{suffix}"
    mine.write_bytes(b"<svg><!-- my drawing --></svg>" if suffix == ".svg" else b"my own file " * 300)
    r = runner.invoke(app, ["plan", "--model", tiny, "--plot", str(mine)])
    _refused(r, mine, PLOT_FILE[1])
    assert mine.read_bytes().startswith((b"<svg><!-- my", b"my own"))
    drawn = tmp_path / f"roofline{suffix}"
    for _ in range(2):    # the second run replaces the first one's plot
        r = runner.invoke(app, ["plan", "--model", tiny, "--plot", str(drawn)])
        assert r.exit_code == 0, r.output
        assert drawn.stat().st_size > 1000


def test_profile_out_replaces_only_a_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    mine = tmp_path / "mine.yaml"
    mine.write_text("my: own\n")
    _refused(runner.invoke(app, ["profile", "--quick", "--out", str(mine)]), mine, PROFILE_FILE[1])
    assert mine.read_text() == "my: own\n"
    ours = write_profile(estimate_host_profile(), tmp_path / "ours.yaml")
    assert PROFILE_FILE[0](ours.read_bytes())


def test_precision_plan_out_replaces_only_a_plan_edgellm_wrote(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    mine = tmp_path / "notes.yaml"
    mine.write_text("schema: 1\n# my hand-edited plan\n")
    r = runner.invoke(app, ["precision", "plan", "--model", tiny, "--budget-kl", "0.02", "-o", str(mine)])
    _refused(r, mine, PLAN_FILE[1])
    assert mine.read_text() == "schema: 1\n# my hand-edited plan\n"
    assert PLAN_FILE[0](dump_plan(load_plan("balanced")).encode())
