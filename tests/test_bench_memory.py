"""`edgellm bench`'s memory record: RSS right after load beside its bound, 1.5x the model file
plus the KV cache (the bound of a runtime whose weights stay quantized and mapped)."""
import json
import os

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.cli import app

from .synthetic import write_tiny_model

runner = CliRunner()
LAYERS, D, H, KVH = 2, 64, 4, 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("mem") / "tiny.gguf", tensor_type=QT.Q8_0, n_layers=LAYERS,
                            d_model=D, n_heads=H, n_kv_heads=KVH, seed=3, context_length=4096).path


def _kv_cache_bytes(n_ctx: int, block_tokens: int = 16) -> int:
    """The default fp16 KV pool of n_ctx tokens, from the model's shapes: K and V, every layer."""
    blocks = -(-n_ctx // block_tokens)
    return 2 * LAYERS * blocks * block_tokens * KVH * (D // H) * 2


@pytest.mark.parametrize("extra", [[], ["--shared-prefix", "16"]])
def test_bench_records_rss_after_load_and_its_bound(tiny, tmp_path, extra):
    out = tmp_path / "b.json"
    r = runner.invoke(app, ["bench", "--model", tiny, "--prompt-tokens", "8", "--gen-tokens", "3", "--runs", "1",
                            "--no-floor", "--json", str(out), *extra])
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text())[0]
    file_mb = os.path.getsize(tiny) / 2**20
    kv_mb = _kv_cache_bytes(2048) / 2**20      # bench loads a 2048-token context (the model allows 4096)
    assert rec["model_file_mb"] == round(file_mb, 1)
    assert rec["kv_cache_mb"] == round(kv_mb, 1)
    assert rec["rss_bound_mb"] == round(1.5 * file_mb + kv_mb, 1)
    # (a length's peak is its own, since the mark is reset before its runs: it may be below load's)
    assert rec["rss_after_load_mb"] > 0 and rec["peak_rss_mb"] >= rec["rss_model_mapped_mb"]
    # resident after load, not the load's peak (an NPU load's requantization passed ~90 MiB above
    # what stayed, and "right after load" read above the run's own peak: a probe)
    assert rec["rss_load_peak_mb"] >= rec["rss_after_load_mb"] - 0.5
    # the breakdown: the file's pages mapped in (the bench waits for the weights to page in)
    assert 0 < rec["rss_model_mapped_mb"] <= file_mb + 0.01
    rest = rec["rss_after_load_mb"] - rec["rss_model_mapped_mb"] - kv_mb
    assert rec["rss_runtime_mb"] == pytest.approx(rest, abs=0.15)
    assert f"(model file {rec['rss_model_mapped_mb']:.1f} MiB mapped, KV cache {rec['kv_cache_mb']:.1f} MiB" in r.stdout
    assert f"bound 1.5 x {rec['model_file_mb']:.1f} MiB file" in r.stdout
    if not extra:   # the cold start: load, then the engine's first request (before the warm runs)
        assert rec["first_request_ttft_ms"] > 0 and rec["first_request_tokens"] == rec["prompt_tokens"]
        assert f"first request's TTFT {rec['first_request_ttft_ms']:.0f} ms" in r.stdout


def test_p95_is_numpys_without_numpy():
    """The bench's p95 (numpy.percentile's linear rule, computed without numpy so its code pages
    stay out of the peak RSS the bench reports)."""
    import numpy as np

    from edgellm.bench import percentile
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 5, 8, 13):
        xs = list(rng.uniform(5, 500, n))
        for q in (0, 50, 95, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), abs=1e-9)


def test_a_lengths_peak_rss_is_its_own():
    """Every row showed the process's peak (VmHWM), set at load or by an earlier length; the
    bench resets the mark before each length (clear_refs 5)."""
    import numpy as np

    from edgellm.generation import peak_rss_mb
    from edgellm.procmem import reset_peak_rss
    a = np.ones(64 * 2**20 // 8)          # 64 MiB resident, then freed: the peak stays up
    del a
    before = peak_rss_mb()
    assert reset_peak_rss()
    assert peak_rss_mb() < before - 32


def test_a_peak_over_the_bound_is_said(tiny, monkeypatch):
    """The peak went over the bound (186.3 against 185.7 MiB) with the bound printed beside it
    as if it held (a probe)."""
    import edgellm.bench as b

    real = b.memory_fields

    def bench_with_bound(mb: float) -> str:
        monkeypatch.setattr(b, "memory_fields", lambda engine: {**real(engine), "rss_bound_mb": mb})
        r = runner.invoke(app, ["bench", "--model", tiny, "--prompt-tokens", "8", "--gen-tokens", "3", "--runs", "1",
                                "--no-floor"])
        assert r.exit_code == 0, r.output
        return r.stdout

    assert "MiB OVER the bound" in bench_with_bound(1.0)
    assert "OVER the bound" not in bench_with_bound(1e6)


def test_rss_after_load_is_resident_memory_not_the_loads_peak(tmp_path):
    """A load whose passing work peaks above what stays: rss_after_load_mb is what stays."""
    import numpy as np
    from gguf import GGMLQuantizationType as QT

    import edgellm
    from edgellm.bench import memory_fields
    from tests.synthetic import write_tiny_model

    path = write_tiny_model(tmp_path / "t.gguf", tensor_type=QT.F16, seed=3).path
    big = np.ones(64 * 2**20 // 8)          # 64 MiB raises the peak, then goes: a load's temporaries
    del big
    e = edgellm.load(path, n_ctx=64)
    e.wait_loaded()
    m = memory_fields(e)
    assert m["rss_load_peak_mb"] >= m["rss_after_load_mb"] + 50, m


def test_bench_keeps_one_opened_model_file(tiny, monkeypatch):
    """bench reads the model's header before the load (its trained context); that ModelFile (its
    tokenizer and metadata, ~3.3 MiB on SmolLM2) stayed alive beside the engine's own for the whole
    bench, in the RSS after load and every run's peak."""
    import gc

    import edgellm.bench as b
    from edgellm.model.loader import ModelFile

    seen = []
    orig = b.memory_fields

    def counting(engine):
        gc.collect()
        seen.append(sum(1 for o in gc.get_objects() if isinstance(o, ModelFile) and o.path == engine.model.path))
        return orig(engine)

    monkeypatch.setattr(b, "memory_fields", counting)
    r = runner.invoke(app, ["bench", "--model", tiny, "--prompt-tokens", "8", "--gen-tokens", "2", "--runs", "1",
                            "--no-floor"])
    assert r.exit_code == 0, r.output
    assert seen == [1]
