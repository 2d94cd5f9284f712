"""The command line on a tiny synthetic model: run, info, bench, errors as one line."""
import json

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.cli import app
from tests.synthetic import write_tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cli") / "tiny.gguf", tensor_type=QT.Q8_0, seed=5).path


def test_run_streams_text_and_stats(tiny):
    r = runner.invoke(app, ["run", "hello", "--model", tiny, "--max-tokens", "5", "--temperature", "0"])
    assert r.exit_code == 0, r.output
    assert "TTFT" in r.stderr and "tok/s" in r.stderr
    r2 = runner.invoke(app, ["run", "hello", "--model", tiny, "--max-tokens", "5", "--temperature", "0", "--no-stats"])
    assert r2.exit_code == 0 and "TTFT" not in r2.stderr
    assert r2.stdout == r.stdout  # greedy is deterministic


def test_run_chat_mode(tiny):
    r = runner.invoke(app, ["run", "hi", "--model", tiny, "--chat", "-n", "3", "--temperature", "0", "--no-stats"])
    assert r.exit_code == 0, r.output


def test_info_prints_architecture_and_memory(tiny):
    r = runner.invoke(app, ["info", tiny])
    assert r.exit_code == 0, r.output
    for word in ("architecture", "llama", "Q8_0", "memory at ctx", "file size", "heads (q / kv)", "KV cache (f16)",
                 "on the neon unit (read in place, quantized)", "where the reference unit runs every op"):
        assert word in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["run", "x", "--model", "/nonexistent/model.gguf"], "no such file"),
    (["run", "x", "--model", "not-a-registry-name"], "not-a-registry-name"),
    (["run", "x", "--temperature", "-1", "--model", "TINY"], "temperature"),
    (["info", "/nonexistent.gguf"], "no such file"),
    (["bench", "--prompt-tokens", "a,b", "--model", "TINY"], "--prompt-tokens"),
])
def test_errors_are_one_line_without_traceback(tiny, args, needle):
    args = [tiny if a == "TINY" else a for a in args]
    r = runner.invoke(app, args)
    assert r.exit_code == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("edgellm: error:") and needle in lines[0], r.stderr
    assert "Traceback" not in r.output


def test_malformed_file_names_file_and_field(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 8)
    r = runner.invoke(app, ["info", str(bad)])
    assert r.exit_code == 1 and str(bad) in r.stderr


def test_bench_writes_json_records(tiny, tmp_path):
    out = tmp_path / "b.json"
    r = runner.invoke(app, ["bench", "--model", tiny, "--prompt-tokens", "8,16", "--gen-tokens", "3",
                            "--runs", "2", "--json", str(out)])
    assert r.exit_code == 0, r.output
    recs = json.loads(out.read_text())
    assert [set(x) >= {"prompt_tokens", "ttft_ms_p50", "ttft_ms_p95", "prefill_tps", "decode_tps",
                       "peak_rss_mb", "load_ms"} for x in recs] == [True, True]
    assert recs[0]["prompt_tokens"] == 8 and recs[0]["ttft_ms_p95"] >= recs[0]["ttft_ms_p50"] > 0


def test_run_session_file_continues_the_conversation(tiny, tmp_path, monkeypatch):
    """`run --session FILE`: the first run saves prompt and answer beside their KV; the next run
    continues them (its stats count them cached) and saves the longer conversation; a bare name
    that is not a valid cache name says how to give a file instead."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    f = str(tmp_path / "talk.edgesess")
    base = ["run", "--model", tiny, "-n", "4", "--temperature", "0", "--session", f]
    r1 = runner.invoke(app, base + ["hello there"])
    assert r1.exit_code == 0, r1.output
    n1 = int(r1.stderr.split("[session: saved ")[1].split(" tokens")[0])
    r2 = runner.invoke(app, base + [" and more"])
    assert r2.exit_code == 0, r2.output
    assert f"[session: continuing {n1} cached tokens from {f}]" in r2.stderr
    assert f" tok, {n1} cached, TTFT" in r2.stderr                # the saved KV, not recomputed
    n2 = int(r2.stderr.split("[session: saved ")[1].split(" tokens")[0])
    assert n2 > n1
    bad = runner.invoke(app, base[:-1] + ["talk.session", "hi"])
    assert bad.exit_code == 1 and "a file is a path (./talk.session) or ends in .edgesess" in bad.stderr
