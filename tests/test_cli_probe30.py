"""A CLI probe's finds (session 30): `python -m edgellm` did not run; `plan -t 1000` gave -t 2's
figures without a word; `precision analyze` said "measuring ..." for a result it then read from
the cache, and --max-tokens past the calibration text asked for a context the model lacks."""
import json
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.cli import app
from tests.synthetic import write_tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cli30") / "m.gguf", tensor_type=QT.Q8_0, seed=3,
                            context_length=512).path


def test_python_dash_m_runs_the_command():
    import edgellm

    r = subprocess.run([sys.executable, "-m", "edgellm", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"edgellm {edgellm.__version__}", r


def test_plan_says_when_threads_are_more_than_the_big_cores(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    r = runner.invoke(app, ["plan", "-m", tiny, "--device", "rk3588", "-t", "64", "--json"])
    assert r.exit_code == 0, r.output
    assert "-t 64: rk3588 has 4 big core(s); the CPU units' figures are for 4 threads" in r.stderr
    assert json.loads(r.stdout)["threads"] == 4
    r = runner.invoke(app, ["plan", "-m", tiny, "--device", "rk3588", "-t", "2", "--json"])
    assert r.exit_code == 0 and "big core" not in r.stderr and json.loads(r.stdout)["threads"] == 2


def test_analyze_says_measuring_only_when_it_measures_and_counts_the_tokens_it_has(tiny, tmp_path, monkeypatch):
    import edgellm

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    asked, real_load = [], edgellm.load

    def load(*a, **kw):
        asked.append(kw["n_ctx"])
        return real_load(*a, **kw)

    monkeypatch.setattr(edgellm, "load", load)
    args = ["precision", "analyze", "-m", tiny, "--top", "0", "--formats", "q8_0", "--ops", "qkv"]
    first = runner.invoke(app, args + ["--max-tokens", "100000"])
    assert first.exit_code == 0, first.output
    assert asked and max(asked) <= 512                       # no context the model lacks was asked for
    (said,) = [ln for ln in first.stderr.splitlines() if ln.startswith("measuring")]
    n_tokens = int(first.stdout.split(" entries over ")[1].split()[0])
    assert said.endswith(f"forward passes of {n_tokens} tokens (cached afterwards)") and n_tokens < 100000
    again = runner.invoke(app, args + ["--max-tokens", "100000"])
    assert again.exit_code == 0 and "read from the cache" in again.stdout and "measuring" not in again.stderr


@pytest.mark.parametrize("lengths,needle", [
    ("32,,64", "--prompt-tokens must be comma-separated integers, got '32,,64'"),
    ("", "--prompt-tokens names no length"),
    (" ", "--prompt-tokens names no length"),
    ("8,0", "--prompt-tokens must be >= 1 each, got '8,0'"),
])
def test_bench_prompt_lengths_are_taken_as_written(tiny, tmp_path, monkeypatch, lengths, needle):
    """An empty item was dropped without a word, and an empty list was 'must be positive'."""
    from tests.cli_checks import one_line_error

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    one_line_error(runner.invoke(app, ["bench", "-m", tiny, "--prompt-tokens", lengths]), needle)


def test_bench_says_concurrent_options_without_concurrent_are_ignored(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    args = ["bench", "-m", tiny, "--prompt-tokens", "8", "--gen-tokens", "2", "--runs", "1", "--no-floor"]
    r = runner.invoke(app, args + ["--short-tokens", "0"])
    assert r.exit_code == 0 and "--short-tokens and --delay-ms shape the --concurrent run" in r.stderr, r.output
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and "--short-tokens" not in r.stderr, r.output


@pytest.mark.parametrize("args,needle", [
    (["--ctx", "0"], "--ctx must be an integer >= 1, got 0"),
    (["-n", "0"], "--max-tokens must be an integer >= 1, got 0"),
    (["--seed", "-1"], "--seed: expected an integer >= 0, found -1"),
    (["--top-k", "-1"], "--top-k: expected an integer >= 0"),
    (["--kv-precision", "q4"], "--kv-precision for --kv pool must be one of"),
])
def test_errors_name_the_flags_not_the_api_parameters(tiny, tmp_path, monkeypatch, args, needle):
    """'n_ctx must be an integer >= 1' answered --ctx 0, 'sampling.seed: expected None or ...' --seed."""
    from tests.cli_checks import one_line_error

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    one_line_error(runner.invoke(app, ["run", "hi", "-m", tiny] + args), needle)


def test_plan_names_no_thread_count_the_user_did_not_give(tiny, tmp_path, monkeypatch):
    """A measured host profile listing fewer cores than the host has (made under taskset) made
    every plain `plan` warn about a '-t 2' nobody passed (a review)."""
    import shutil
    from pathlib import Path

    import edgellm

    home = tmp_path / "home"
    monkeypatch.setenv("EDGELLM_HOME", str(home))
    src = Path(edgellm.__file__).parent.parent / "device_profiles" / "raspberry-pi-5.yaml"
    (home / "profiles").mkdir(parents=True)
    shutil.copy(src, home / "profiles" / "host.yaml")
    monkeypatch.setattr("edgellm.device.topology.select_big", lambda clusters: [0, 1, 2, 3, 4, 5, 6, 7])
    r = runner.invoke(app, ["plan", "-m", tiny])
    assert r.exit_code == 0 and "-t " not in r.stderr, r.output


def test_a_pull_reports_its_progress_through_one_throttle(capsys):
    from edgellm import cli

    report = cli._pull_progress()
    for i in range(1, 201):
        report(i, 200)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "downloading" in ln]
    assert 2 <= len(lines) <= 6, lines


def test_a_prompt_that_fills_the_context_says_what_is_wrong(tiny, tmp_path, monkeypatch):
    """'the prompt has 1 tokens but the context holds 1' read as if nothing were wrong."""
    from tests.cli_checks import one_line_error

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    one_line_error(runner.invoke(app, ["run", "hi", "-m", tiny, "--ctx", "1"]),
                   "and the context holds 1: no position is left for the answer")


def test_info_and_quantize_take_the_model_as_the_other_commands_do(tiny, tmp_path, monkeypatch):
    """`info -m NAME` was 'No such option: -m': only these two took the model as an argument."""
    from tests.cli_checks import one_line_error

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    by_arg, by_opt = runner.invoke(app, ["info", tiny]), runner.invoke(app, ["info", "-m", tiny])
    assert by_arg.exit_code == by_opt.exit_code == 0 and by_arg.stdout == by_opt.stdout
    out = tmp_path / "q.gguf"
    r = runner.invoke(app, ["quantize", "-m", tiny, "--plan", "fast", "-o", str(out)])
    assert r.exit_code == 0 and out.read_bytes()[:4] == b"GGUF", r.output
    one_line_error(runner.invoke(app, ["info", tiny, "-m", "other"]), f"two models given: {tiny} and --model other")


def test_a_file_named_like_a_parameter_keeps_its_name_in_errors(tmp_path, monkeypatch):
    from tests.cli_checks import one_line_error

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "n_ctx").write_bytes(b"GGUF")
    r = runner.invoke(app, ["info", "n_ctx"])
    one_line_error(r, "n_ctx")
    assert "--ctx" not in r.stderr, r.stderr
