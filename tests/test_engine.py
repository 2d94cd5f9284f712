"""The forward pass on tiny synthetic models: an independent from-scratch numpy transformer,
chunked prefill == one pass, decode == teacher forcing, cancel and context limits."""
import threading

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from edgellm.engine import CancelToken, ModelRunner
from edgellm.errors import Cancelled, ConfigError, ContextFull
from edgellm.kv.pool import KVPool
from edgellm.model.loader import open_model
from tests.synthetic import write_tiny_model


def new_seq(runner, capacity=64, precision="f32"):
    """A sequence in a pool of exactly `capacity` tokens (blocks of 4), fp32 so results are exact."""
    c = runner.cfg
    return KVPool(c.n_layers, c.n_kv_heads, c.head_dim, -(-capacity // 4), 4, precision).new_sequence()


def fwd(path, ids, capacity=64, chunk=512, **kw):
    r = ModelRunner(open_model(path), capacity, prefill_chunk=chunk)
    return r.forward(new_seq(r, capacity), ids, **kw)


def naive_forward(tm, ids, theta=10000.0, eps=1e-5, neox=False):
    """Plain transformer from the writer's own float32 weights, no cache, one position at a time
    for attention. Returns (T, vocab) logits."""
    W = {k: v.astype(np.float64) for k, v in tm.weights.items()}
    H, KVH, hd = tm.n_heads, tm.n_kv_heads, tm.head_dim
    T = len(ids)

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x):  # x (T, heads, hd)
        out = x.copy()
        for t in range(T):
            for i in range(hd // 2):
                a = t * theta ** (-2 * i / hd)
                j0, j1 = (i, i + hd // 2) if neox else (2 * i, 2 * i + 1)
                x0, x1 = x[t, :, j0], x[t, :, j1]
                out[t, :, j0] = x0 * np.cos(a) - x1 * np.sin(a)
                out[t, :, j1] = x0 * np.sin(a) + x1 * np.cos(a)
        return out

    x = W["token_embd.weight"][ids]
    for layer in range(tm.n_layers):
        p = f"blk.{layer}."
        h = norm(x, W[p + "attn_norm.weight"])
        q, k, v = (h @ W[p + f"attn_{n}.weight"].T + W.get(p + f"attn_{n}.bias", 0) for n in "qkv")
        q, k, v = rope(q.reshape(T, H, hd)), rope(k.reshape(T, KVH, hd)), v.reshape(T, KVH, hd)
        att = np.zeros((T, H, hd))
        for t in range(T):
            for hh in range(H):
                kv = hh // (H // KVH)
                s = k[: t + 1, kv] @ q[t, hh] / np.sqrt(hd)
                pr = np.exp(s - s.max())
                att[t, hh] = (pr / pr.sum()) @ v[: t + 1, kv]
        x = x + att.reshape(T, H * hd) @ W[p + "attn_output.weight"].T
        h = norm(x, W[p + "ffn_norm.weight"])
        g, u = h @ W[p + "ffn_gate.weight"].T, h @ W[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "ffn_down.weight"].T
    head = W.get("output.weight", W["token_embd.weight"])
    return norm(x, W["output_norm.weight"]) @ head.T


def nmse(a, b):
    return float(((a - b) ** 2).sum() / (b**2).sum())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return write_tiny_model(d / "llama.gguf", tensor_type=QT.F32, n_layers=2, seed=1)


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", True)])
def test_forward_matches_from_scratch_transformer(tmp_path, arch, tied):
    tm = write_tiny_model(tmp_path / "m.gguf", arch=arch, tensor_type=QT.F32, tied_embeddings=tied, seed=3)
    ids = [5, 77, 130, 9, 200, 41, 3]
    got = fwd(tm.path, ids, all_logits=True)
    want = naive_forward(tm, ids, neox=(arch == "qwen2"))
    assert nmse(got, want) < 1e-9


@pytest.mark.parametrize("qtype,bound", [(QT.F16, 1e-5), (QT.Q8_0, 1e-3), (QT.Q4_1, 2e-2), (QT.Q4_0, 3e-2)])
def test_quantized_model_close_to_float_weights(tmp_path, qtype, bound):
    """Quantized files dequantize to the writer's weights up to the format's rounding error."""
    tm = write_tiny_model(tmp_path / "q.gguf", tensor_type=qtype, seed=4)
    ids = [1, 50, 99, 150, 250]
    got = fwd(tm.path, ids, all_logits=True)
    assert nmse(got, naive_forward(tm, ids)) < bound


def test_chunked_prefill_equals_single_pass(tiny):
    ids = list(range(3, 40))
    one = fwd(tiny.path, ids, all_logits=True)
    chunked = fwd(tiny.path, ids, chunk=5, all_logits=True)
    assert nmse(chunked, one) < 1e-10
    last = fwd(tiny.path, ids, chunk=5)
    assert nmse(last, one[-1]) < 1e-10


def test_decode_steps_equal_teacher_forcing(tiny):
    ids = [7, 8, 9, 100, 101, 5, 6, 250]
    full = fwd(tiny.path, ids, all_logits=True)
    r = ModelRunner(open_model(tiny.path), 64)
    seq = new_seq(r)
    steps = [r.forward(seq, ids[:3])] + [r.forward(seq, [t]) for t in ids[3:]]
    assert seq.n_tokens == len(ids)
    assert nmse(np.stack(steps), full[2:]) < 1e-10


def test_cancel_mid_prefill_rolls_back_and_engine_stays_usable(tiny):
    r = ModelRunner(open_model(tiny.path), 64, prefill_chunk=4)
    seq = new_seq(r)
    r.forward(seq, [1, 2, 3])
    tok = CancelToken()
    tok.cancel()
    with pytest.raises(Cancelled):
        r.forward(seq, list(range(10, 30)), cancel=tok)
    assert seq.n_tokens == 3
    after = r.forward(seq, [4, 5])
    fresh = fwd(tiny.path, [1, 2, 3, 4, 5])
    assert nmse(after, fresh) < 1e-10


def test_context_full_refuses_without_writing(tiny):
    r = ModelRunner(open_model(tiny.path), 8)
    seq = new_seq(r, 8)
    r.forward(seq, [1, 2, 3, 4, 5, 6])
    k_before = seq.pool.k.copy()
    with pytest.raises(ContextFull):
        r.forward(seq, [7, 8, 9])
    assert seq.n_tokens == 6
    np.testing.assert_array_equal(seq.pool.k, k_before)


@pytest.mark.parametrize("ids", [[], [-1], [10**6]])
def test_bad_token_ids_are_typed_errors(tiny, ids):
    with pytest.raises(ConfigError):
        fwd(tiny.path, ids, capacity=16)


def test_cancel_token_from_another_thread(tiny):
    tok = CancelToken()
    t = threading.Timer(0.0, tok.cancel)
    t.start()
    t.join()
    assert tok.cancelled
    tok.reset()
    assert not tok.cancelled
