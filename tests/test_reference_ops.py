"""The reference ops against naive, loop-by-loop restatements of their definitions.

The reference backend is the ground truth for every other backend, so its vectorised tricks
(GQA head grouping, the causal mask with a cache offset, strided RoPE pairs) are checked here
against the plainest formulation; the whole model is then checked against llama.cpp.
"""
import math

import numpy as np
import pytest

from edgellm.backends import reference as ref


def nmse(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / max((b**2).sum(), 1e-30))


rng = np.random.default_rng(0)


def test_rmsnorm_naive():
    x = rng.standard_normal((5, 48)).astype(np.float32)
    w = rng.standard_normal(48).astype(np.float32)
    want = np.stack([row / math.sqrt(float((row.astype(np.float64) ** 2).mean()) + 1e-5) * w for row in x])
    assert nmse(ref.rmsnorm(x, w, 1e-5), want) < 1e-12


def test_matmul_with_bias():
    x = rng.standard_normal((3, 16)).astype(np.float32)
    w = rng.standard_normal((8, 16)).astype(np.float32)
    b = rng.standard_normal(8).astype(np.float32)
    want = [[sum(float(x[t, i]) * float(w[o, i]) for i in range(16)) + float(b[o]) for o in range(8)] for t in range(3)]
    assert nmse(ref.matmul(x, w, b), want) < 1e-12


def _naive_rope(x, pos, theta, rope_dim, style):
    out = x.astype(np.float64).copy()
    T, H, hd = x.shape
    for t in range(T):
        for h in range(H):
            for i in range(rope_dim // 2):
                a = pos[t] * theta ** (-2.0 * i / rope_dim)
                if style == "norm":
                    j0, j1 = 2 * i, 2 * i + 1
                else:
                    j0, j1 = i, i + rope_dim // 2
                x0, x1 = float(x[t, h, j0]), float(x[t, h, j1])
                out[t, h, j0] = x0 * math.cos(a) - x1 * math.sin(a)
                out[t, h, j1] = x0 * math.sin(a) + x1 * math.cos(a)
    return out


class _Cfg:  # the fields rope_tables reads
    def __init__(self, theta, rope_dim, freq_scale=1.0):
        self.rope_theta, self.rope_dim, self.rope_freq_scale = theta, rope_dim, freq_scale


@pytest.mark.parametrize("style", ["norm", "neox"])
@pytest.mark.parametrize("rope_dim", [16, 8])  # 8 < head_dim: partial rotation leaves the tail alone
def test_rope_naive(style, rope_dim):
    x = rng.standard_normal((4, 3, 16)).astype(np.float32)
    cos, sin = ref.rope_tables(_Cfg(10000.0, rope_dim), 40)
    pos = [7, 8, 9, 33]
    got = ref.rope(x, cos[pos], sin[pos], style)
    assert nmse(got, _naive_rope(x, pos, 10000.0, rope_dim, style)) < 1e-12


def _naive_attention(q, k, v, start):
    T, H, hd = q.shape
    kvh, n, _ = k.shape
    out = np.zeros((T, H, hd))
    for t in range(T):
        for h in range(H):
            kv = h // (H // kvh)
            s = np.array([float(q[t, h] @ k[kv, j]) / math.sqrt(hd) for j in range(start + t + 1)])
            p = np.exp(s - s.max())
            p /= p.sum()
            out[t, h] = p @ v[kv, : start + t + 1]
    return out.reshape(T, H * hd)


@pytest.mark.parametrize("T,start,H,kvh", [(1, 0, 4, 2), (5, 0, 4, 2), (3, 6, 6, 2), (1, 9, 3, 3), (4, 2, 2, 1)])
def test_attention_naive(T, start, H, kvh):
    hd = 8
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    k = rng.standard_normal((kvh, start + T, hd)).astype(np.float32)
    v = rng.standard_normal((kvh, start + T, hd)).astype(np.float32)
    assert nmse(ref.attention(q, k, v, start), _naive_attention(q, k, v, start)) < 1e-10


def test_swiglu_and_add():
    gu = rng.standard_normal((2, 12)).astype(np.float32)
    g, u = gu[:, :6].astype(np.float64), gu[:, 6:].astype(np.float64)
    assert nmse(ref.swiglu(gu), g / (1 + np.exp(-g)) * u) < 1e-12
    a, b = gu[:, :6], gu[:, 6:]
    np.testing.assert_array_equal(ref.add(a, b), a + b)


def test_supports_names_its_reason():
    ok, why = ref.supports("matmul")
    assert ok and why
    ok, why = ref.supports("conv2d")
    assert not ok and "conv2d" in why


def test_run_dispatches_by_name():
    x = rng.standard_normal((2, 8)).astype(np.float32)
    w = np.ones(8, np.float32)
    np.testing.assert_array_equal(ref.run("rmsnorm", x, w, 1e-6), ref.rmsnorm(x, w, 1e-6))


@pytest.mark.parametrize("T,start,block", [(7, 0, 2), (9, 4, 3), (5, 0, 1), (6, 3, 16)])
def test_attention_query_blocks(monkeypatch, T, start, block):
    """Several query blocks, each scoring only the keys it can see, equal the naive definition."""
    monkeypatch.setattr(ref, "ATTN_Q_BLOCK", block)
    H, kvh, hd = 4, 2, 8
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    k = rng.standard_normal((kvh, start + T, hd)).astype(np.float32)
    v = rng.standard_normal((kvh, start + T, hd)).astype(np.float32)
    assert nmse(ref.attention(q, k, v, start), _naive_attention(q, k, v, start)) < 1e-10
