"""bench --concurrent says when the long prefill ended before the short request came: the ratio
then measures no interleaving, and read 1.02 for a 64-token "long" prompt without a word (a probe)."""
from typer.testing import CliRunner

from edgellm.cli import app
from tests.test_cli_probe30 import tiny  # noqa: F401 - the fixture

runner = CliRunner()


def test_a_concurrent_run_whose_requests_did_not_overlap_says_so(tiny, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    args = ["bench", "-m", tiny, "--prompt-tokens", "16", "--gen-tokens", "2", "--runs", "1", "--no-floor",
            "--concurrent", "--short-tokens", "4"]
    r = runner.invoke(app, args + ["--delay-ms", "300"])
    assert r.exit_code == 0 and "the requests did not overlap" in r.stderr, r.output
    r = runner.invoke(app, args + ["--delay-ms", "0"])
    assert r.exit_code == 0 and "did not overlap" not in r.stderr, r.output
