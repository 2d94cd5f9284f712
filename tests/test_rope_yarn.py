"""YaRN RoPE scaling (rope.scaling.type yarn): parsed as llama.cpp reads it, and its magnitude
factor applied once. Its logits against llama.cpp's are in test_golden_tiny.py (llama and qwen2)."""
import numpy as np
import pytest
from typer.testing import CliRunner

from edgellm.backends import reference
from edgellm.cli import app
from edgellm.errors import ModelFormatError
from edgellm.model.loader import open_model
from tests.synthetic import write_tiny_model

A = "llama."
YARN = {A + "rope.scaling.type": "yarn", A + "rope.scaling.factor": 4.0}


def _cfg(tmp_path, **meta):
    return open_model(write_tiny_model(tmp_path / "m.gguf", extra_metadata={**YARN, **meta}).path).config


def test_defaults_are_llama_cpps(tmp_path):
    c = _cfg(tmp_path)
    assert c.rope_freq_scale == 0.25
    y = c.rope_yarn
    assert (y.n_ctx_orig, y.ext_factor, y.attn_factor, y.beta_fast, y.beta_slow) == (c.context_length, 1.0, 1.0, 32.0, 1.0)


def test_the_yarn_keys_llama_cpp_ignores(tmp_path, caplog):
    """llama.cpp reads no rope.scaling.yarn_* key for llama or qwen2: it runs its defaults (a
    differential run against it: NMSE up to 0.4 where they were read), with a warning here."""
    c = _cfg(tmp_path, **{A + "rope.scaling.original_context_length": 48, A + "rope.scaling.yarn_beta_fast": 16.0,
                          A + "rope.scaling.yarn_ext_factor": 0.5, A + "rope.scaling.yarn_attn_factor": 1.0})
    y = c.rope_yarn
    assert (y.n_ctx_orig, y.ext_factor, y.attn_factor, y.beta_fast, y.beta_slow) == (48, 1.0, 1.0, 32.0, 1.0)
    assert "yarn_ext_factor 0.5 (runs as 1), yarn_beta_fast 16 (runs as 32) ignored" in caplog.text
    assert "yarn_attn_factor" not in caplog.text      # (its default: nothing to say)


def test_rope_attn_factor_scales_every_type(tmp_path):
    """rope.scaling.attn_factor (read by llama.cpp for every architecture) multiplies cos and sin,
    with or without scaling; a key rotated on by a shift is not scaled again."""
    p = np.arange(40)
    for meta in ({}, {A + "rope.scaling.factor": 4.0}, YARN):
        c = open_model(write_tiny_model(tmp_path / "m.gguf", extra_metadata={**meta, A + "rope.scaling.attn_factor": 1.5}).path).config
        c1 = open_model(write_tiny_model(tmp_path / "n.gguf", extra_metadata=meta).path).config
        assert c.rope_attn_factor == 1.5 and c1.rope_attn_factor == 1.0
        (cos, sin), (cos1, sin1) = reference.rope_rows(c, p), reference.rope_rows(c1, p)
        np.testing.assert_allclose(cos, 1.5 * cos1, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(sin, 1.5 * sin1, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(reference.rope_rows(c, p, rotation_only=True)[0],
                                      reference.rope_rows(c1, p, rotation_only=True)[0])


def test_a_factor_below_one_keeps_the_magnitude(tmp_path):
    """llama_context cancels ggml's 1 + 0.1 ln(1 / s) where the factor is below 1 (its get_mscale
    is 1 there): cos^2 + sin^2 stays 1 (it was (1 + 0.1 ln 0.5)^2, NMSE 1.1e-6 against llama.cpp)."""
    c = _cfg(tmp_path, **{A + "rope.scaling.factor": 0.5})
    cos, sin = reference.rope_rows(c, np.arange(50))
    np.testing.assert_allclose(cos ** 2 + sin ** 2, 1.0, rtol=1e-6)


@pytest.mark.parametrize("key, value", [("yarn_beta_slow", -1.0), ("yarn_attn_factor", float("nan")),
                                        ("original_context_length", 0), ("attn_factor", 0.0),
                                        ("attn_factor", float("inf"))])
def test_a_bad_value_is_named(tmp_path, key, value):
    with pytest.raises(ModelFormatError, match=key):
        _cfg(tmp_path, **{A + "rope.scaling." + key: value})


def test_a_key_rotated_on_is_scaled_once(tmp_path):
    """A ring's sinks are rotated on by a shift (engine._shift_sinks): keys rotated at p then on by
    d must be the keys rotated at p + d, YaRN's magnitude (1 + 0.1 ln 4 here) applied once."""
    c = _cfg(tmp_path, **{A + "rope.scaling.original_context_length": 16})
    x = np.random.default_rng(0).standard_normal((6, c.n_kv_heads, c.head_dim)).astype(np.float32)
    p, d = np.arange(3, 9), 37
    c0, s0 = reference.rope_rows(c, p)
    c1, s1 = reference.rope_rows(c, np.full(len(p), d), rotation_only=True)
    c2, s2 = reference.rope_rows(c, p + d)
    twice = reference.rope(reference.rope(x, c0, s0, c.rope_style), c1, s1, c.rope_style)
    np.testing.assert_allclose(twice, reference.rope(x, c2, s2, c.rope_style), rtol=1e-4, atol=1e-5)
    assert np.allclose(c2 ** 2 + s2 ** 2, (1 + 0.1 * np.log(4.0)) ** 2, rtol=1e-5)


def test_info_says_yarn(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", extra_metadata={**YARN, A + "rope.scaling.original_context_length": 32}).path
    r = CliRunner().invoke(app, ["info", path])
    assert r.exit_code == 0 and "YaRN scaling x4 from a 32-token context" in r.output, r.output


@pytest.mark.parametrize("unit", ["neon", "opencl"])
def test_every_unit_runs_it_as_the_reference(tmp_path, home, unit):
    """The units take the engine's cos / sin tables, YaRN's included (the ring's too)."""
    from dataclasses import replace

    import edgellm
    from edgellm.backends import opencl
    from edgellm.device.host import estimate_host_profile
    from edgellm.device.profile import Gpu
    from edgellm.device.profile_yaml import write_profile

    # a host profile listing an OpenCL GPU (PoCL's CPU device runs it here), as test_opencl_faults
    gpu = Gpu("test gpu", "opencl", 2, {"fp32": 50e9}, False, True, 20e-6, 50e-6, 8, 32)
    write_profile(replace(estimate_host_profile(), name="host", gpu=gpu), home / "profiles" / "host.yaml")
    opencl.reset()
    path = write_tiny_model(tmp_path / "m.gguf", extra_metadata={**YARN, A + "rope.scaling.original_context_length": 16},
                            seed=4).path
    ids = list(range(5, 60))
    ref = edgellm.load(path, units=["reference"], n_ctx=128)
    e = edgellm.load(path, units=[unit], n_ctx=128)
    try:
        assert unit in e.plan.units_used()
        want, got = ref.logits(ids), e.logits(ids)
        assert float(((got - want) ** 2).mean() / (want ** 2).mean()) < 1e-4
    finally:
        ref.close()
        e.close()
        opencl.reset()
