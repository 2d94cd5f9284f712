"""A precision plan at run time: requantized weights (cached), compute precisions in placement and
in the kernels, the KV precision, and the quality guard."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.costmodel import Unit
from edgellm.dispatch import Dispatcher
from edgellm.device.profile import load_profile
from edgellm.errors import ConfigError
from edgellm.model.loader import open_model
from edgellm.ops import OpSpec, weight_formats
from edgellm.precision import load_plan, parse_plan
from edgellm.precision_runtime import ComputeTable, effective, plan_model, planned_formats
from edgellm.quality_guard import GuardState, QualityGuard, uncertainty
from tests.synthetic import write_tiny_model

MATMUL = OpSpec("ffn_down", "matmul", "layer", k=64, n=64)

# decode in int8, prefill in fp32, the file's weights
DECODE_INT8 = """
schema: 1
kv_cache: f16
defaults:
  qkv: {prefill: {compute: fp32}, decode: {compute: int8}}
  attn_out: {prefill: {compute: fp32}, decode: {compute: int8}}
  ffn_gate_up: {prefill: {compute: fp32}, decode: {compute: int8}}
  ffn_down: {prefill: {compute: fp32}, decode: {compute: int8}}
"""


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.Q4_1, n_layers=5, seed=3)


@pytest.mark.parametrize("asked,supported,expect", [
    ("int8", ("int8", "fp32"), "int8"), ("fp32", ("int8", "fp32"), "fp32"),
    ("int8", ("fp32",), "fp32"), ("fp16", ("fp32", "int8"), "fp32"), ("fp16", ("fp16",), "fp16"),
    ("fp32", ("int8",), None), ("fp32", ("fp16", "int8"), None), ("fp16", ("int8",), None),
])
def test_effective_never_below_the_ask(asked, supported, expect):
    assert effective(asked, supported) == expect


def test_units_answer_the_plans_ask():
    neon = Unit("neon", "cpu", {"fp32": 1e9, "int8": 2e9}, 1e9, 0.0, quant_precision="int8",
                quant_precisions=("int8", "fp32"), stores_quantized=True)
    ref = Unit("reference", "cpu", {"fp32": 1e9}, 1e9, 0.0, stores_quantized=False)
    npu = Unit("npu", "npu", {"int8": 1e10}, 1e9, 0.0, quant_precision="int8", stores_quantized=True)
    assert neon.precision_for(MATMUL, "q4_1") == ("int8", "q4_1")            # its own choice
    assert neon.precision_for(MATMUL, "q4_1", "fp32") == ("fp32", "q4_1")
    assert ref.precision_for(MATMUL, "q4_1", "int8") == ("fp32", "f32")      # runs above the ask
    assert npu.precision_for(MATMUL, "q4_1", "fp32")[0] is None              # cannot
    assert npu.precision_for(MATMUL, "q4_1", "int8") == ("int8", "int8")


def _disp(profile_name, tm, plan):
    mf = open_model(tm.path)
    p = load_plan(plan) if isinstance(plan, str) else plan
    compute = ComputeTable(p, mf.config.n_layers) if p is not None else None
    formats = planned_formats(mf, p) if p is not None else weight_formats(mf)
    return Dispatcher(load_profile(profile_name), mf.config, formats, probe=False, compute=compute)


def test_dispatcher_reads_the_plans_compute(tiny):
    by = lambda ph: {p.op: p for p in ph.placements}                            # noqa: E731
    quality = _disp("rk3588", tiny, "quality").plan(prompt_tokens=64, n_ctx=256, memory_budget=1 << 30)
    for ph in (quality.prefill, quality.decode):
        for op in ("qkv", "attn_out", "ffn_gate_up", "ffn_down", "lm_head"):
            p = by(ph)[op]
            assert p.precision == "fp32", (ph.phase, op, p)
            # the NPU computes quantized weights in int8 only: it cannot take an fp32 ask
            if op != "lm_head":
                assert "npu" in dict(p.alternatives) and "asks fp32" in dict(p.alternatives)["npu"]
        assert "fused decode step" not in by(ph)["qkv"].reason    # the fused step is int8 only
    balanced = _disp("rk3588", tiny, "balanced").plan(prompt_tokens=64, n_ctx=256, memory_budget=1 << 30)
    assert by(balanced.decode)["qkv"].precision == "int8"
    assert "fused decode step" in by(balanced.decode)["qkv"].reason
    # attention: the plan's fp16 ask runs in fp32, and the reason says so
    fast = _disp("rk3588", tiny, "fast").plan(prompt_tokens=64, n_ctx=256, memory_budget=1 << 30)
    att = by(fast.decode)["attention"]
    assert att.precision == "fp32" and "asks fp16" in att.reason


def test_plan_model_requantizes_once_and_rebuilds_a_damaged_cache(home, tiny, caplog):
    mf = open_model(tiny.path)
    plan = load_plan("fast")
    assert plan_model(mf, load_plan("quality"))[0] is mf                  # nothing to convert
    got, note = plan_model(mf, plan)
    assert got.path != mf.path and "requantized" in note
    n = mf.config.n_layers
    for i in range(n):
        want = QT.Q4_1 if i < 2 or i >= n - 2 else QT.Q4_0                  # depth policy keeps the ends
        assert got.tensor_type(f"blk.{i}.ffn_down.weight") == want
        assert got.tensor_type(f"blk.{i}.attn_q.weight") == QT.Q4_1
    mtime = os.stat(got.path).st_mtime_ns
    again, note = plan_model(mf, plan)
    assert again.path == got.path and "cached" in note and os.stat(got.path).st_mtime_ns == mtime
    with open(got.path, "r+b") as f:                                     # damage the header
        f.write(b"XXXX")
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        fixed, _ = plan_model(mf, plan)
    assert "unusable" in caplog.text
    assert open_model(fixed.path).tensor_type("blk.1.ffn_down.weight") == fixed.tensor_type("blk.1.ffn_down.weight")


def test_plan_model_rebuilds_a_cache_whose_tensor_data_was_damaged(home, tiny, caplog):
    """Zeros written over tensor data, the mtime kept: the header still parses and the types
    match, and the damaged weights were used without a word. The sampled checksum written beside
    the cache sees it, and the cache is written again; a cache without a checksum (older) too."""
    mf, plan = open_model(tiny.path), load_plan("fast")
    got, _ = plan_model(mf, plan)
    clean = open(got.path, "rb").read()
    st = os.stat(got.path)
    with open(got.path, "r+b") as f:
        f.seek(len(clean) // 2)
        f.write(bytes(len(clean) // 4))
    os.utime(got.path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        fixed, note = plan_model(mf, plan)
    assert "its bytes differ from those written" in caplog.text and "written" in note
    assert open(fixed.path, "rb").read() == clean
    os.remove(fixed.path + ".sample-sha256")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        plan_model(mf, plan)
    assert "no checksum was recorded for it" in caplog.text
    assert "cached" in plan_model(mf, plan)[1]


def _plan_with_q4_0_middle(n_layers: int):
    return parse_plan("schema: 1\nkv_cache: f16\nlayers:\n  1: {ffn_down: {weights: q4_0}}\n", name="mid")


def test_load_applies_the_plans_weights_and_kv(home, tiny):
    eng = edgellm.load(tiny.path, n_ctx=128, units=["reference"], precision=_plan_with_q4_0_middle(5))
    assert eng.model.tensor_type("blk.1.ffn_down.weight") == QT.Q4_0
    assert eng.model.tensor_type("blk.0.ffn_down.weight") == QT.Q4_1
    assert eng.precision_plan.name == "mid"
    fast = edgellm.load(tiny.path, n_ctx=128, units=["reference"], precision="fast")
    assert fast.kv.kv.layout.startswith("pool/int8")
    ring = edgellm.load(tiny.path, n_ctx=128, units=["reference"], precision="fast", kv="ring", window=64)
    assert ring.kv.kv.layout.startswith("ring/int8")   # the ring keeps int8 K/V too
    explicit = edgellm.load(tiny.path, n_ctx=128, units=["reference"], precision="fast", kv_precision="f32")
    assert explicit.kv.kv.layout.startswith("pool/f32")
    with pytest.raises(ConfigError, match="unknown precision plan|preset"):
        edgellm.load(tiny.path, n_ctx=128, precision="no-such-plan")


def test_neon_computes_what_the_plan_asks(home, tiny):
    """fp32 asks run neon's fp32-activation kernels: they agree with the fp32 reference far more
    closely than neon's int8-activation kernels do. Fails if the plan's precision is ignored."""
    ids = list(range(5, 40))
    ref = edgellm.load(tiny.path, n_ctx=128, units=["reference"]).logits(ids)
    q = edgellm.load(tiny.path, n_ctx=128, units=["neon"], precision="quality")
    b = edgellm.load(tiny.path, n_ctx=128, units=["neon"], precision="balanced")
    assert {p.precision for p in q.plan.prefill.placements if p.kind == "matmul"} == {"fp32"}
    assert {p.precision for p in b.plan.prefill.placements if p.kind == "matmul"} == {"int8"}
    err_q = float(np.abs(q.logits(ids) - ref).max())
    err_b = float(np.abs(b.logits(ids) - ref).max())
    assert err_q < 1e-3 and err_b > 10 * err_q, (err_q, err_b)


def test_uncertainty_matches_a_direct_softmax():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(np.float32) * 3
    p = np.exp(x.astype(np.float64) - x.max())
    p /= p.sum()
    ent, top = uncertainty(x)
    assert ent == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-9)
    assert top == pytest.approx(float(p.max()), rel=1e-12)
    assert uncertainty(np.zeros(55, np.float32))[0] == pytest.approx(np.log(55))


class _Runner:
    class cfg:
        n_layers = 2
    decode_override = None


def test_guard_switches_holds_and_returns():
    r = _Runner()
    g = GuardState(QualityGuard(max_entropy=1.0, min_top1=0.0, hold_steps=2), r)
    sure, unsure = np.array([10.0, 0, 0, 0]), np.zeros(8)
    g.observe(sure)
    assert g.override() is None
    g.observe(unsure)
    assert g.override() is not None and g.switches == 1
    g.observe(unsure)                                    # still unsure: held, not a new switch
    assert g.switches == 1
    g.observe(sure)
    assert g.override() is not None                      # one calm step of two
    g.observe(sure)
    assert g.override() is None
    assert r.decode_override is None                     # the runner is the generation's to set, per step
    with pytest.raises(ConfigError, match="hold_steps"):
        QualityGuard(hold_steps=0)


def test_one_requests_guard_switch_leaves_the_others_precision(home, tiny):
    """The guard wrote the runner's shared override: one request's switch ran another request's
    decode steps in fp32 (15 of 20 in a helper's run), and one request's end cleared the other's
    hold. Steps now run with their own generation's table."""
    from edgellm.api import generation_config
    from edgellm.engine import CancelToken
    from edgellm.generation import Generation

    always = QualityGuard(max_entropy=1e-9, min_top1=0.0, hold_steps=1000)
    never = QualityGuard(max_entropy=1e9, min_top1=0.0, hold_steps=1)
    eng = edgellm.load(tiny.path, n_ctx=128, units=["neon"], precision=parse_plan(DECODE_INT8, name="d8"),
                       quality_guard=always)
    cfg = generation_config(max_tokens=4, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    a = Generation(eng, eng.tokenize("hello world"), cfg, CancelToken(), t, t)
    eng.quality_guard = never
    b = Generation(eng, eng.tokenize("the cat"), cfg, CancelToken(), t, t)
    seen = []
    real = eng.runner.forward

    def spy(seq, ids, *args, **kwargs):
        seen.append((seq is a.seq, eng.runner.decode_override is not None))
        return real(seq, ids, *args, **kwargs)
    eng.runner.forward = spy
    for _ in range(4):
        a.step()
        b.step()
    assert a.guard.switches >= 1
    assert any(mine and fp32 for mine, fp32 in seen)                  # a's held steps in fp32
    assert not any(fp32 for mine, fp32 in seen if not mine)           # b's never
    assert eng.runner.decode_override is None


def test_guard_in_the_engine_runs_decode_at_the_quality_precision(home, tiny):
    """A guard that always triggers runs every decode step after the first token in fp32: the
    tokens and logits equal the quality plan's, while the plan alone (int8 decode) differs."""
    prompt = "hello world"
    cfg = dict(max_tokens=12, temperature=0, ignore_eos=True)
    quality = edgellm.load(tiny.path, n_ctx=128, units=["neon"], precision="quality")
    want = quality.generate(prompt, **cfg)
    always = QualityGuard(max_entropy=1e-9, min_top1=0.0, hold_steps=1)
    guarded = edgellm.load(tiny.path, n_ctx=128, units=["neon"], precision=parse_plan(DECODE_INT8, name="d8"),
                           quality_guard=always)
    assert guarded.generate(prompt, **cfg) == want
    assert guarded.last_stats.guard_switches == 1 and guarded.runner.decode_override is None
    # the check can fail: without the guard the int8 decode steps give different logits
    plain = edgellm.load(tiny.path, n_ctx=128, units=["neon"], precision=parse_plan(DECODE_INT8, name="d8"))
    ids = guarded.tokenize(prompt)
    lq = _decode_logits(quality, ids)
    assert np.abs(_decode_logits(plain, ids) - lq).max() > 1e-4
    guarded.runner.decode_override = ComputeTable(load_plan("quality"), guarded.config.n_layers)
    assert np.abs(_decode_logits(guarded, ids) - lq).max() < 1e-5


def test_guarded_generations_do_not_grow_the_runners_kwargs_cache(home, tiny):
    """Each generation's guard built its own quality table, and the runner caches per-layer
    kwargs by table: an entry (~23 KB) per guarded generation, for good (+25 MB per 1000)."""
    always = QualityGuard(max_entropy=1e-9, min_top1=0.0, hold_steps=1)
    eng = edgellm.load(tiny.path, n_ctx=128, units=["neon"], precision=parse_plan(DECODE_INT8, name="d8"),
                       quality_guard=always)
    sizes = []
    for i in range(6):
        eng.generate(f"hello {i}", max_tokens=4, temperature=0, ignore_eos=True)
        assert eng.last_stats.guard_switches == 1
        sizes.append(len(eng.runner._kw_cache))
    assert sizes[-1] == sizes[1], sizes


def _decode_logits(eng, ids):
    from edgellm.precision_search import teacher_forced_logits

    return teacher_forced_logits(eng, ids, "decode")


def test_requantizing_4_bit_weights_into_4_bits_is_warned(home, tiny, caplog):
    mf = open_model(tiny.path)                                           # Q4_1
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        plan_model(mf, load_plan("fast"))                                # FFN int4-32 -> Q4_0
    assert "already stores in 4 bits (Q4_1)" in caplog.text
    caplog.clear()
    q8 = write_tiny_model(tiny.path.replace("m.gguf", "q8.gguf"), tensor_type=QT.Q8_0, n_layers=5, seed=3)
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        plan_model(open_model(q8.path), load_plan("fast"))
    assert "4 bits" not in caplog.text


def test_layers_asking_different_precisions(tmp_path):
    """Layers 0-1 int8, the rest fp32: neon runs both, the estimate is their mean, and the fused
    decode step (int8 in every layer) is not chosen. (Wide enough not to be launch-bound.)"""
    tiny = write_tiny_model(tmp_path / "w.gguf", tensor_type=QT.Q4_1, n_layers=5, d_model=1024, d_ff=4096,
                            n_heads=8, n_kv_heads=4, seed=3)

    def placed(text):
        plan = parse_plan("schema: 1\nkv_cache: f16\n" + text, name="p")
        p = _disp("rk3588", tiny, plan).plan(prompt_tokens=64, n_ctx=256, memory_budget=1 << 30)
        return {x.op: x for x in p.prefill.placements}, {x.op: x for x in p.decode.placements}

    pre, dec = placed("layers:\n" + "".join(f"  {i}: {{ffn_down: {{compute: int8}}}}\n" for i in (0, 1)))
    assert dec["ffn_down"].precision == "int8+fp32" and "fused decode step" not in dec["ffn_down"].reason
    all8, _ = placed("defaults:\n  ffn_down: {compute: int8}\n")
    none, _ = placed("")
    neon_ms = lambda p: float(dict(p["ffn_down"].alternatives)["neon"].split()[0])     # noqa: E731
    assert neon_ms(all8) < neon_ms(pre) < neon_ms(none)


def test_int8_kv_keeps_the_fused_decode_step(tiny):
    """neon's fused step reads int8 pools too (the fast preset's KV): decode stays fused. A unit
    whose fused step cannot read the cache's element size runs op by op, and the plan says why."""
    fast = _disp("rk3588", tiny, "fast")
    fast.kv_bytes = 1.0
    p = fast.plan(prompt_tokens=64, n_ctx=256, memory_budget=1 << 30)
    assert any("fused decode step" in x.reason for x in p.decode.placements) and not p.warnings
    fast.units = tuple(replace(u, fused_kv_bytes=frozenset({2.0, 4.0})) for u in fast.units)
    p = fast.plan(prompt_tokens=64, n_ctx=256, memory_budget=1 << 30)
    assert all("fused decode step" not in x.reason for x in p.decode.placements)
    assert any("fused layer step cannot read a 1-byte KV cache" in w for w in p.warnings)


_INT8_MATMULS = """
schema: 1
kv_cache: f16
defaults:
  qkv: {compute: int8}
  attn_out: {compute: int8}
  ffn_gate_up: {compute: int8}
  ffn_down: {compute: int8}
"""
_RAISED_AT_8 = """
sequence:
  - min_tokens: 8
    with:
      qkv: {compute: fp32}
      attn_out: {compute: fp32}
      ffn_gate_up: {compute: fp32}
      ffn_down: {compute: fp32}
"""
_HEAD_INT8 = "schema: 1\nkv_cache: f16\ndefaults:\n  lm_head: {compute: int8}\n"
_HEAD_RAISED_AT_8 = "sequence:\n  - min_tokens: 8\n    with:\n      lm_head: {compute: fp32}\n"


@pytest.mark.parametrize("base, raised", [(_INT8_MATMULS, _RAISED_AT_8), (_HEAD_INT8, _HEAD_RAISED_AT_8)])
def test_a_sequence_policy_that_raises_compute_is_honoured(home, tiny, base, raised):
    """A plan whose matmuls (or head) are int8 until the sequence reaches 8 tokens, fp32 from
    there: past 8 tokens the logits are the fp32 plan's. The fused step (and its head) took the
    asks at 0 tokens and ran int8 throughout; the base plan alone still differs, so the check can
    fail."""
    ids = list(range(5, 21))                    # 16 tokens: one prefill step ending past 8
    fp32 = edgellm.load(tiny.path, n_ctx=64, units=["neon"], precision="quality").logits(ids)
    plain = edgellm.load(tiny.path, n_ctx=64, units=["neon"], precision=parse_plan(base, name="b")).logits(ids)
    eng = edgellm.load(tiny.path, n_ctx=64, units=["neon"], precision=parse_plan(base + raised, name="r"))
    assert np.abs(plain - fp32).max() > 1e-4
    assert np.abs(eng.logits(ids) - fp32).max() < 1e-5


def test_a_repulled_model_replaces_its_stale_cache_copy_and_dead_writers_go(home, tiny, tmp_path):
    """The cache key holds the model's mtime and path: a model re-pulled (or touched) got a new
    copy beside the old one, each a whole model's size, kept for good. And a requantization
    killed while another process finished the same file left its part forever."""
    import subprocess
    import sys
    from edgellm.precision_runtime import cache_dir
    mf = open_model(tiny.path)
    first, _ = plan_model(mf, load_plan("fast"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    part = cache_dir() / f".{Path(first.path).name}.pid{dead}.x1y2z3.tmp"
    part.write_bytes(b"x" * 4096)
    os.utime(tiny.path, ns=(os.stat(tiny.path).st_atime_ns, os.stat(tiny.path).st_mtime_ns + 10**9))
    second, note = plan_model(open_model(tiny.path), load_plan("fast"))
    assert second.path != first.path and "written" in note
    left = sorted(p.name for p in cache_dir().iterdir())
    assert left == sorted([Path(second.path).name, Path(second.path).name + ".sample-sha256"]), left



def test_another_model_put_in_place_with_the_mtime_kept_is_requantized(home, tmp_path):
    """The key held the source's path, size and mtime: another model of the same size copied over
    it with its mtime kept (cp -p) got the first model's requantized copy, silently."""
    a = write_tiny_model(tmp_path / "a.gguf", tensor_type=QT.Q4_1, n_layers=5, seed=3).path
    b = write_tiny_model(tmp_path / "b.gguf", tensor_type=QT.Q4_1, n_layers=5, seed=4).path
    assert os.path.getsize(a) == os.path.getsize(b)
    name = "blk.2.ffn_down.weight"     # (requantized by the plan: Q4_1 -> Q4_0)
    first, _ = plan_model(open_model(a), load_plan("fast"))
    stale = bytes(first.raw(name))
    st = os.stat(a)
    time.sleep(0.1)    # (past a tick of the kernel's coarse file clock: a rewrite within it keeps ctime)
    with open(a, "r+b") as f:
        f.write(Path(b).read_bytes())
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))
    second, note = plan_model(open_model(a), load_plan("fast"))
    assert "written" in note
    assert not os.path.exists(first.path)           # the stale copy went
    want, _ = plan_model(open_model(b), load_plan("fast"))
    assert stale != bytes(want.raw(name))           # (the two models' copies differ there)
    assert bytes(second.raw(name)) == bytes(want.raw(name))


def test_dead_writers_are_recognised_by_their_tag(tmp_path):
    import subprocess
    import sys
    from edgellm.fileio import remove_dead_writers, write_atomic, writer_alive
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (tmp_path / f".pull-pid{dead}-abc").mkdir()
    (tmp_path / f".pull-pid{dead}-abc" / "m.whl").write_bytes(b"w")
    (tmp_path / f".m.gguf.pid{dead}.q1.part").write_bytes(b"p")
    (tmp_path / f".m.gguf.pid{os.getpid()}.q2.part").write_bytes(b"mine")
    (tmp_path / ".hidden.part").write_bytes(b"not a writer's")
    assert writer_alive(".hidden.part") is None and writer_alive(f".x.pid{dead}.y.tmp") is False
    assert remove_dead_writers(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f".m.gguf.pid{os.getpid()}.q2.part", ".hidden.part"])
    write_atomic(tmp_path / "f.txt", b"ok")      # its temporary name is tagged too (nothing left)
    assert (tmp_path / "f.txt").read_bytes() == b"ok"


def test_a_guard_that_can_change_nothing_says_so(home, tiny, caplog):
    """With decode's matmuls on units that have no choice of compute precision (reference, npu,
    opencl), or a plan at fp32 already, the guard logged switches 'to fp32' that changed nothing
    (from a helper's probe of feature combinations)."""
    with caplog.at_level(logging.INFO, logger="edgellm"):
        ref = edgellm.load(tiny.path, n_ctx=128, units=["reference"], quality_guard=True)
        q = edgellm.load(tiny.path, n_ctx=128, units=["neon"], precision="quality", quality_guard=True)
        # and it is off: no switch is logged, however uncertain the steps (it logged switches
        # "to fp32" that changed nothing: a helper's probe of the precision workflow)
        assert ref.quality_guard is None and q.quality_guard is None
        q.generate("hello", max_tokens=8, temperature=1.5, seed=1, ignore_eos=True)
    said = [r.getMessage() for r in caplog.records if "switches change nothing" in r.getMessage()]
    assert len(said) == 2 and "(reference)" in said[0] and "(neon)" in said[1] and "the guard is off" in said[0]
    assert not [r for r in caplog.records if "quality guard: step" in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        edgellm.load(tiny.path, n_ctx=128, units=["neon"], precision=parse_plan(DECODE_INT8, name="d8"),
                     quality_guard=True)
    assert not [r for r in caplog.records if "switches change nothing" in r.getMessage()]


def test_cached_copies_of_other_sources_or_formats_stay(home, tmp_path):
    """The cache deleted every copy of a model file name under a plan name whose key differed:
    two models named alike in two folders, or two plans of one name with other formats,
    requantized the whole model on every load (from a helper's probe of the written GGUFs)."""
    import shutil
    a, b = tmp_path / "d1", tmp_path / "d2"
    a.mkdir()
    b.mkdir()
    write_tiny_model(a / "m.gguf", tensor_type=QT.Q8_0, seed=3, n_layers=5)
    shutil.copy(a / "m.gguf", b / "m.gguf")
    plan = load_plan("fast")                         # FFNs of layers 2.. to int4-32
    notes = [plan_model(open_model(str(d / "m.gguf")), plan)[1] for d in (a, b, a, b)]
    assert ["written" in n for n in notes] == [True, True, False, False], notes
    other = parse_plan("schema: 1\nkv_cache: f16\ndefaults:\n  qkv: {weights: q4_0}\n", name="fast")
    notes = [plan_model(open_model(str(a / "m.gguf")), p)[1] for p in (other, plan, other)]
    assert ["written" in n for n in notes] == [True, False, False], notes


def test_a_copy_under_the_name_before_identities_is_kept(home, tiny):
    """The new cache names carry an identity: a valid copy under the old name was deleted and the
    whole model requantized again (from a review of the day's change)."""
    import edgellm.precision_runtime as pr
    mf, plan = open_model(tiny.path), load_plan("fast")
    first, note = plan_model(mf, plan)
    assert "written" in note
    new = Path(first.path)
    key = new.name.rsplit("-", 1)[1].removesuffix(".gguf")
    old = new.with_name(f"m-fast-{key}.gguf")
    new.rename(old)
    pr._fingerprint_file(new).rename(pr._fingerprint_file(old))
    again, note = plan_model(open_model(tiny.path), plan)
    assert "cached" in note and Path(again.path) == new and not old.exists()


def test_damage_between_the_samples_is_seen_by_the_whole_file_checksum(home, tiny, caplog, monkeypatch):
    """109 KB overwritten between two samples of an 11 MB copy loaded without a word (a probing
    helper, session 25). A file written to since its check (ctime moved) is hashed whole. Here
    2 samples of 4 KiB leave the middle of the tiny model's copy unsampled."""
    import edgellm.precision_runtime as pr
    monkeypatch.setattr(pr, "_SAMPLES", 2)
    monkeypatch.setattr(pr, "_SAMPLE_BYTES", 4096)
    mf, plan = open_model(tiny.path), load_plan("fast")
    got, _ = plan_model(mf, plan)
    clean = open(got.path, "rb").read()
    assert "cached" in plan_model(mf, plan)[1]          # unchanged: the samples alone
    with open(got.path, "r+b") as f:
        f.seek(len(clean) // 2)
        f.write(b"\x33" * 64)
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        fixed, note = plan_model(mf, plan)
    assert "whole-file checksum" in caplog.text and "written" in note
    assert open(fixed.path, "rb").read() == clean


@pytest.mark.parametrize("what, how", [("sidecar", "fifo"), ("sidecar", "devzero"), ("sidecar", "dir"),
                                       ("copy", "fifo"), ("copy", "dir"), ("copy", "devzero"),
                                       ("sidecar", "other entry")])
def test_a_cache_entry_replaced_by_something_else_is_rewritten(home, tiny, caplog, what, how):
    """A FIFO as the sidecar hung every load, /dev/zero was read whole (MemoryError), and a FIFO
    or a folder in place of the copy failed every load; another entry's sidecar vouched for it."""
    import shutil
    import edgellm.precision_runtime as pr
    mf, plan = open_model(tiny.path), load_plan("fast")
    got, _ = plan_model(mf, plan)
    clean = open(got.path, "rb").read()
    target = pr._fingerprint_file(Path(got.path)) if what == "sidecar" else Path(got.path)
    if how == "other entry":
        text = target.read_text().replace(f"entry {Path(got.path).name}", "entry other.gguf")
        target.write_text(text)
        os.utime(got.path)        # (and the copy touched: its stat no longer matches)
    else:
        target.unlink()
        if how == "fifo":
            os.mkfifo(target)
        elif how == "dir":
            target.mkdir()
        else:
            target.symlink_to("/dev/zero")
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        fixed, note = plan_model(mf, plan)
    assert "unusable" in caplog.text and "written" in note
    assert open(fixed.path, "rb").read() == clean and Path(fixed.path).is_file()
    assert "cached" in plan_model(mf, plan)[1]
    if target.is_dir():
        shutil.rmtree(target)


def test_a_folder_named_like_a_stale_copy_does_not_stop_the_load(home, tiny):
    """IsADirectoryError from the clean-up of stale copies reached edgellm.load."""
    mf, plan = open_model(tiny.path), load_plan("fast")
    got, _ = plan_model(mf, plan)
    p = Path(got.path)
    stale = p.with_name(p.name.rsplit("-", 1)[0] + "-0000000000000000.gguf")
    stale.mkdir()
    p.unlink()
    assert "written" in plan_model(mf, plan)[1]


def test_requantized_copies_stay_under_the_cache_cap_oldest_first(home, tiny, monkeypatch, caplog):
    """Each plan (an edited one too) was a whole model's copy kept for good: 11 plans of SmolLM2
    took 994 MiB (a helper's probe, session 26)."""
    import logging
    from edgellm.precision_runtime import CACHE_CAP_ENV, cache_dir

    def plan(fmt):
        return parse_plan(f"schema: 1\nkv_cache: f16\ndefaults:\n  ffn_down: {{weights: {fmt}, compute: fp32}}\n",
                          name=fmt)
    a, _ = plan_model(open_model(tiny.path), plan("q8_0"))
    size = Path(a.path).stat().st_size
    monkeypatch.setenv(CACHE_CAP_ENV, str(2.5 * size / 2**20))        # room for two copies
    b, _ = plan_model(open_model(tiny.path), plan("f16"))
    os.utime(a.path, (1e9, 1e9))
    os.utime(b.path, (1.5e9, 1.5e9))
    with caplog.at_level(logging.INFO, logger="edgellm"):
        c, _ = plan_model(open_model(tiny.path), plan("int4-32"))
    left = sorted(p.name for p in cache_dir().iterdir())
    names = [Path(p).name for p in (b.path, c.path)]
    assert left == sorted(names + [n + ".sample-sha256" for n in names]), left   # a and its sidecar went
    assert any("requantized model cache" in r.getMessage() and "evicted 1 file" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("value", ("abc", "0", "nan"))
def test_a_bad_requantized_cache_cap_is_refused_before_any_work(home, tiny, value, monkeypatch):
    """A bad EDGELLM_PRECISION_CACHE_MB was read only after a requantization had written its copy
    (the run failed once, and every later run was a cache hit that never read it), and its message
    said the default held for each model where it holds for all (a helper's probe of the docs)."""
    from edgellm.precision_runtime import CACHE_CAP_ENV, cache_dir

    plan = parse_plan("schema: 1\nkv_cache: f16\ndefaults:\n  ffn_down: {weights: q8_0, compute: fp32}\n", name="c")
    monkeypatch.setenv(CACHE_CAP_ENV, value)
    for _ in range(2):    # a miss, then (had it been written) a hit: refused both times
        with pytest.raises(ConfigError, match=rf"{CACHE_CAP_ENV}='{value}' is invalid: expected a number of MiB > 0 "
                                              r"\(unset, the requantized models take up to 1024 MiB in all\)"):
            plan_model(open_model(tiny.path), plan)
        assert not cache_dir().exists() or not any(cache_dir().glob("*.gguf"))   # nothing written
