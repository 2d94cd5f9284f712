"""The decode memory floor of `edgellm bench`: weight bytes per token, the bandwidth probe in a
child process, the record fields, and the CLI line."""
import json
import sys

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.bench_floor import decode_weight_bytes, floor_fields, read_bandwidth_gbs
from edgellm.cli import app
from edgellm.model.loader import open_model

from .synthetic import write_tiny_model

runner = CliRunner()
D, H, KVH, FF, LAYERS = 64, 4, 2, 128, 2


def _f32_elements_read(vocab: int) -> int:
    """Elements a decode step reads, counted from the tiny model's shapes (tied head: the whole
    embedding; the lookup's one row aside)."""
    hd = D // H
    per_layer = 2 * D + D * H * hd + 2 * D * KVH * hd + H * hd * D + 3 * D * FF
    return LAYERS * per_layer + D + vocab * D


@pytest.mark.parametrize("tied", [True, False])
def test_decode_weight_bytes_counts_layers_norms_and_head(tmp_path, tied):
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.F32, n_layers=LAYERS, d_model=D, n_heads=H,
                          n_kv_heads=KVH, d_ff=FF, tied_embeddings=tied)
    mf = open_model(tm.path)
    # untied: the head reads output.weight (same shape as the embedding), not the embedding
    assert decode_weight_bytes(mf) == 4 * _f32_elements_read(mf.config.vocab_size)


def test_decode_weight_bytes_uses_the_quantized_sizes(tmp_path):
    f32 = open_model(write_tiny_model(tmp_path / "a.gguf", tensor_type=QT.F32, seed=1).path)
    q8 = open_model(write_tiny_model(tmp_path / "b.gguf", tensor_type=QT.Q8_0, seed=1).path)
    matrix_elems = _f32_elements_read(f32.config.vocab_size) - (2 * LAYERS + 1) * D   # all but the norms
    # Q8_0: 34 bytes per 32 weights; the norms stay fp32
    assert decode_weight_bytes(q8) == matrix_elems // 32 * 34 + 4 * (2 * LAYERS + 1) * D


def test_floor_fields_take_the_median_bandwidth_and_count_the_kv_cache():
    """The fastest of the probes set the floor (one spike of a noisy probe made the ratio 1.4 at
    one length and 2.5 at the next), and the KV cache decode also reads was left out (a probe)."""
    rec = floor_fields(96_570_000, 125.0, [20.0, 22.0, 40.0], kv_bytes=3_430_000)
    assert rec["decode_weight_mb"] == 96.57 and rec["decode_kv_mb"] == 3.43
    assert rec["decode_ms_per_token"] == 8.0
    assert rec["decode_floor_ms"] == pytest.approx(100.0 / 22.0, abs=1e-3)     # MB / (GB/s) = ms
    assert rec["decode_vs_floor"] == pytest.approx(8.0 / (100.0 / 22.0), abs=1e-3)


def test_the_kv_a_decode_token_reads(tiny):
    import edgellm
    from edgellm.bench_floor import decode_kv_bytes

    eng = edgellm.load(tiny, n_ctx=256, threads=1)
    c = eng.config
    per_token = c.n_layers * 2 * c.n_kv_heads * c.head_dim * 2            # f16 K and V
    assert decode_kv_bytes(eng, 100, 20) == per_token * 110


def test_floor_fields_without_a_bandwidth_say_so():
    rec = floor_fields(1_000_000, 100.0, [None, None])
    assert rec["read_bandwidth_gbs"] == [None, None]
    assert rec["decode_floor_ms"] is None and rec["decode_vs_floor"] is None
    assert rec["decode_ms_per_token"] == 10.0


def test_bandwidth_probe_runs_in_a_child():
    gbs = read_bandwidth_gbs(16 << 20)
    assert gbs is not None and 0.1 < gbs < 10_000


def test_bandwidth_probe_failure_is_a_warning_not_an_error(monkeypatch, caplog):
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    assert read_bandwidth_gbs(16 << 20) is None
    assert "bandwidth probe failed" in caplog.text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("floor") / "tiny.gguf", tensor_type=QT.Q8_0, seed=5).path


def test_bench_reports_decode_against_the_floor(tiny, tmp_path):
    out = tmp_path / "b.json"
    r = runner.invoke(app, ["bench", "--model", tiny, "--prompt-tokens", "8", "--gen-tokens", "4", "--runs", "2",
                            "--json", str(out)])
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text())[0]
    assert rec["decode_weight_mb"] == round(decode_weight_bytes(open_model(tiny)) / 1e6, 2)
    assert len(rec["read_bandwidth_gbs"]) == 2 and all(b > 0 for b in rec["read_bandwidth_gbs"])
    assert rec["decode_ms_per_token"] == pytest.approx(1e3 / rec["decode_tps"], rel=1e-3)
    assert rec["decode_vs_floor"] == pytest.approx(rec["decode_ms_per_token"] / rec["decode_floor_ms"], rel=1e-2)
    assert "x the memory floor" in r.stdout
    assert "under 1" not in r.stdout or rec["decode_vs_floor"] < 1


def test_bench_says_when_decode_beats_the_probe(tiny, tmp_path, monkeypatch):
    # a probe that reads slower than the decode kernels stream (the sgemv read 17-28 GB/s here)
    import edgellm.bench_floor as bf
    monkeypatch.setattr(bf, "read_bandwidth_gbs", lambda *a, **k: 1e-3)
    r = runner.invoke(app, ["bench", "--model", tiny, "--prompt-tokens", "8", "--gen-tokens", "4", "--runs", "2"])
    assert r.exit_code == 0, r.output
    assert "under 1: the probe read slower than decode streamed" in r.stdout


def test_bench_without_floor_skips_the_probe(tiny, tmp_path):
    out = tmp_path / "b.json"
    r = runner.invoke(app, ["bench", "--model", tiny, "--prompt-tokens", "8", "--gen-tokens", "3", "--runs", "1",
                            "--no-floor", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "decode_vs_floor" not in json.loads(out.read_text())[0]


def test_an_int8_kv_row_counts_its_scale():
    """int8 K and V rows carry an fp32 scale each: the count was 5.9% low at head_dim 64 (a probe)."""
    from types import SimpleNamespace

    from edgellm.bench_floor import decode_kv_bytes
    from edgellm.kv.store import KVConfig

    cfg = SimpleNamespace(n_layers=30, n_kv_heads=3, head_dim=64)
    eng = lambda prec: SimpleNamespace(config=cfg, kv=SimpleNamespace(kv=KVConfig(precision=prec)))  # noqa: E731
    assert decode_kv_bytes(eng("f16"), 100, 0) == 30 * 2 * 3 * 64 * 2 * 100
    assert decode_kv_bytes(eng("int8"), 100, 0) == 30 * 2 * 3 * (64 + 4) * 100
