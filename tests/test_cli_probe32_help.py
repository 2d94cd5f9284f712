"""`build --help` and `bench --help` say what the probe's fixes rest on: --out is replaced whole and
its folder must be writable; bench times this machine whichever --device plans it; --shared-prefix
counts against the model's context and 0 turns it off."""
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from edgellm.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent


def _help(*cmd: str) -> str:
    r = runner.invoke(app, [*cmd, "--help"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    return " ".join(r.stdout.split())      # (rich wraps and boxes it)


def test_build_help_says_what_out_must_be():
    text = _help("build")
    assert "replaced whole; the folder it goes in must exist and be writable (checked before compiling)" in text
    tool = subprocess.run([sys.executable, str(ROOT / "tools" / "cross_build.py"), "--help"], capture_output=True,
                          text=True, timeout=60, env={"COLUMNS": "400", "PATH": ""})
    assert "must exist and be writable (checked before compiling)" in " ".join(tool.stdout.split()), tool.stderr


def test_bench_help_says_whose_figures_and_what_the_prefix_needs():
    text = _help("bench")
    assert "The runs are timed on this machine, whichever profile plans them" in text
    assert "--shared-prefix N " in text and "must fit the model's context). 0: no shared prefix" in text
