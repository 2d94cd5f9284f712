"""Probe 23's findings: a damaged checksum sidecar of a requantized model, a sensitivity cache too
deeply nested to parse, a searched plan predicted slower than `quality`, non-finite source
weights given to `edgellm quantize`, and a device profile path naming a file that is no profile."""
from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader

import edgellm
from edgellm.calibration import load_calibration
from edgellm.device.profile import load_profile
from edgellm.dispatch import Dispatcher
from edgellm.errors import ConfigError
from edgellm.kv.store import KVConfig
from edgellm.model.loader import open_model
from edgellm.ops import weight_formats
from edgellm.precision import load_plan, parse_plan
from edgellm.precision_runtime import ComputeTable, plan_model, planned_formats
from edgellm.precision_search import SEARCH_OPS, op_times, search
from edgellm.requant import convert, requantize_gguf
from edgellm.sensitivity import _read_cache, analyze
from tests.synthetic import write_tiny_model


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# -- 1: the requantized model's checksum sidecar --------------------------------------------------


def test_a_sidecar_that_is_not_text_is_a_damaged_cache(home, tmp_path, caplog):
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.Q4_1, n_layers=5, seed=3)
    mf, plan = open_model(tm.path), load_plan("fast")
    first, note = plan_model(mf, plan)
    assert "written" in note
    with open(first.path + ".sample-sha256", "wb") as f:
        f.write(b"\xff\xfe")
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        again, note = plan_model(mf, plan)
    assert "unusable" in caplog.text and "written" in note
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        e = edgellm.load(tm.path, precision="fast", n_ctx=64, threads=1)   # rebuilt once: a hit now
    assert "unusable" not in caplog.text
    assert np.isfinite(np.asarray(e.logits(e.tokenize("hi")))).all()


# -- 2: the sensitivity cache ------------------------------------------------------------------------


def test_deeply_nested_sensitivity_cache_is_a_miss(tmp_path, caplog):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200000 + "]" * 200000)
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        assert _read_cache(path, {}) is None
    assert "sensitivity cache miss" in caplog.text


# -- 3: a searched plan is never predicted slower than quality ---------------------------------------


def _predicted(profile, mf, plan, objective, prompt_tokens):
    # as `edgellm precision plan` predicts each plan for its report
    cfg = mf.config
    d = Dispatcher(profile, cfg, planned_formats(mf, plan), probe=False, compute=ComputeTable(plan, cfg.n_layers),
                   kv_bytes=KVConfig(precision=plan.kv_precision).bytes_per_elem)
    p = d.plan(prompt_tokens=prompt_tokens, n_ctx=max(prompt_tokens + 1, 2048), memory_budget=1 << 30)
    return p.predicted_ttft_ms if objective == "ttft" else 1e3 / p.predicted_decode_tps


# (prompt lengths at which the greedy plan was predicted slower on rk3588: 0.056 vs 0.023 ms at ttft 4)
@pytest.mark.parametrize("objective,prompt_tokens", [("decode", 512), ("ttft", 4)])
def test_search_never_returns_a_plan_predicted_slower_than_quality(home, tmp_path, objective, prompt_tokens):
    tm = write_tiny_model(tmp_path / "tiny.gguf")
    ref = edgellm.load(tm.path, n_ctx=256, units=["reference"], threads=1)
    sens = analyze(ref, load_calibration("builtin"), formats=("q4_0",), ops=SEARCH_OPS, max_tokens=64)
    mf, cfg = ref.model, ref.config
    profile = load_profile("rk3588")
    files = weight_formats(mf)
    times = op_times(Dispatcher(profile, cfg, files, probe=False), objective, prompt_tokens, files, ("q4_0",))
    res = search(sens, times, 0.02, objective, cfg.n_layers, ("q4_0",))
    q_ms = _predicted(profile, mf, load_plan("quality"), objective, prompt_tokens)
    s_ms = _predicted(profile, mf, res.plan, objective, prompt_tokens)
    assert s_ms <= q_ms * (1 + 1e-9), (objective, s_ms, q_ms, res.note)
    assert math.isclose(res.predicted_kl, math.fsum(c.kl for c in res.changes))


def test_search_returns_quality_with_a_note_when_every_change_is_predicted_slower(tmp_path):
    from edgellm.sensitivity import Entry, Sensitivity

    entries = tuple(Entry(i, op, "weights", "q4_0", 1e-4, 20.0) for i in range(2) for op in ("qkv", "ffn_down"))
    sens = Sensitivity("0" * 64, "0" * 64, n_layers=2, n_tokens=8, formats=("q4_0",), ops=("qkv", "ffn_down"),
                       activations=(), entries=entries)
    times = {op: {("gguf", "fp32"): 1.0, ("q4_0", "fp32"): 0.5, ("gguf", "int8"): math.inf,
                  ("q4_0", "int8"): math.inf} for op in ("qkv", "ffn_down")}
    # the whole-model view: any change loses a fused step worth more than all per-op savings
    res = search(sens, times, 1.0, "decode", 2, ("q4_0",),
                 predict=lambda plan: 1.0 if not plan.layers else 5.0)
    assert res.changes == () and not res.plan.layers and res.predicted_kl == 0
    assert "quality" in res.note and res.predicted_ms == res.quality_ms == 1.0


# -- 4: non-finite source weights ------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_quantize_refuses_non_finite_source_weights(tmp_path, bad):
    src = tmp_path / "src.gguf"
    write_tiny_model(src)
    t = next(t for t in GGUFReader(src).tensors if t.name == "blk.1.ffn_up.weight")
    with open(src, "r+b") as f:
        f.seek(int(t.data_offset) + 4 * 5)
        f.write(np.float32(bad).tobytes())
    out = tmp_path / "out.gguf"
    with pytest.raises(ConfigError, match=r"blk\.1\.ffn_up\.weight.*NaN or infinite"):
        requantize_gguf(src, out, {"blk.1.ffn_up.weight": "q8_0"})
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["src.gguf"]
    w = np.ones((4, 32), np.float32)
    w[2, 7] = bad
    with pytest.raises(ConfigError, match=r"w7: 1 of 128 values"):
        convert(w, "int4-32", name="w7")


# -- 5: a profile path that names some other file ----------------------------------------------------


def test_profile_error_does_not_quote_a_whole_file(tmp_path):
    secret = "root:x:0:0:root:/root:/bin/bash\n" + "".join(f"user{i}:x:{i}:{i}::/home/u{i}:/bin/sh\n" for i in range(100))
    p = tmp_path / "passwd"
    p.write_text(secret)
    with pytest.raises(ConfigError) as ei:
        load_profile(str(p))
    msg = str(ei.value)
    assert "expected a mapping" in msg and "characters)" in msg
    assert len(msg) < 400 and "user99" not in msg
