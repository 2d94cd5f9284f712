"""The op wrappers of edgellm/backends/neon.py with arguments that do not fit: the C kernels take
bare pointers and sizes on trust, so a helper's mismatched shapes read past an array's end
(segfaults), and a float64 bias, an int64 block table or a longer k than the chunk needs were
read as the wrong numbers. Each is now refused with an OpArgumentError or computed right
(against backends/reference.py)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from edgellm import quant
from edgellm.backends import neon, reference
from edgellm.errors import EdgeLLMError, KernelError, OpArgumentError
from edgellm.kv.pool import KVPool

pytestmark = pytest.mark.skipif(not neon.available()[0], reason="the neon library is not built")

rng = np.random.default_rng(7)


def nmse(y, ref):
    return float(np.mean((y - ref) ** 2) / np.mean(ref ** 2))


@pytest.fixture(scope="module")
def q4():
    w = rng.standard_normal((48, 64)).astype(np.float32)
    raw = np.ascontiguousarray(quant.quantize(w, T.Q4_0))
    return neon.QMatrix.from_arrays("Q4_0", [raw.reshape(-1)], [48], 64), quant.dequantize(raw.reshape(-1), T.Q4_0,
                                                                                           (48, 64))


def test_mismatched_shapes_are_refused_before_the_kernel_reads(q4):
    w, _ = q4
    x = rng.standard_normal((4, 64)).astype(np.float32)
    cases = [
        (lambda: neon.matmul(np.ones((4, 96), np.float32), w), "x has 96 columns, the weights take 64"),
        (lambda: neon.matmul(x, w, b=np.ones(47, np.float32)), r"bias must have shape \(48,\)"),
        (lambda: neon.matmul(np.ones(64, np.float32), w), "x must be 2-D"),
        (lambda: neon.rmsnorm(x, np.ones(63, np.float32), 1e-5), r"w must have shape \(64,\)"),
        (lambda: neon.rmsnorm(np.ones((2, 3, 64), np.float32), np.ones(64, np.float32), 1e-5), "x must be 2-D"),
        (lambda: neon.rope(np.ones((3, 2, 8), np.float32), np.ones((2, 4), np.float32), np.ones((2, 4), np.float32),
                           "neox"), "cos and sin"),
        (lambda: neon.rope(np.ones((3, 2, 8), np.float32), np.ones((3, 4), np.float32), np.ones((3, 3), np.float32),
                           "neox"), "cos and sin"),
        (lambda: neon.rope(np.ones((3, 2, 8), np.float32), np.ones((3, 4), np.float32), np.ones((3, 4), np.float32),
                           "gptj"), "style must be one of norm, neox"),
        (lambda: neon.swiglu(np.ones((3, 65), np.float32)), "width must be even"),
        (lambda: neon.add(np.ones((4, 64), np.float32), np.ones(63, np.float32)), "does not broadcast"),
        (lambda: neon.attention(np.ones((2, 4, 8), np.float32), np.ones((2, 3, 8), np.float32),
                                np.ones((2, 3, 8), np.float32), start=2), "hold 3 positions, the chunk needs"),
        (lambda: neon.attention(np.ones((2, 4, 8), np.float32), np.ones((2, 4, 16), np.float32),
                                np.ones((2, 4, 16), np.float32), start=2), "head_dim must match"),
        (lambda: neon.attention(np.ones((2, 4, 8), np.float32), np.ones((3, 4, 8), np.float32),
                                np.ones((3, 4, 8), np.float32), start=2), "multiple of KVH"),
    ]
    for call, what in cases:
        with pytest.raises(OpArgumentError, match=what):
            call()
    assert issubclass(OpArgumentError, (EdgeLLMError, ValueError))


def test_the_pool_reader_checks_the_block_table():
    pool = KVPool(n_layers=2, n_kv_heads=2, head_dim=16, n_blocks=4, block_tokens=4, precision="f16")
    q = rng.standard_normal((3, 4, 16)).astype(np.float32)
    for table, what in ((np.array([0, 4], np.int32), r"block ids must be in 0..3"),
                        (np.array([0, -1], np.int32), r"block ids must be in 0..3"),
                        (np.array([1], np.int32), "the block table has 1 blocks"),
                        (np.array([0.0, 1.0]), "1-D integer array")):
        with pytest.raises(OpArgumentError, match=what):
            neon.attention_pool(q, pool, table, 0, start=2)
    with pytest.raises(OpArgumentError, match="layer 2 of a 2-layer pool"):
        neon.attention_pool(q, pool, np.array([0, 1], np.int32), 2, start=2)
    with pytest.raises(OpArgumentError, match="kv heads of 16"):
        neon.attention_pool(q[:, :, :8], pool, np.array([0, 1], np.int32), 0, start=2)
    # an int64 table (np.asarray of a list) was read as int32 pairs: the same numbers as int32 now
    pool.k[:] = rng.standard_normal(pool.k.shape).astype(np.float16)
    pool.v[:] = rng.standard_normal(pool.v.shape).astype(np.float16)
    as32 = neon.attention_pool(q, pool, np.array([3, 1], np.int32), 1, start=2)
    np.testing.assert_array_equal(neon.attention_pool(q, pool, np.array([3, 1, 0], np.int64), 1, start=2), as32)


def test_inputs_once_read_as_other_numbers_now_match_the_reference(q4):
    w, deq = q4
    x = rng.standard_normal((5, 64)).astype(np.float32)
    b64 = rng.standard_normal(48)             # float64: read as raw float32 on the int8 path
    want = reference.matmul(x, deq, b64.astype(np.float32))
    assert nmse(neon.matmul(x, w, b=b64), want) < 5e-4
    strided = np.repeat(b64, 2)[::2]          # a strided view of the same values
    assert nmse(neon.matmul(x, w, b=strided), want) < 5e-4
    # k, v holding more positions than the chunk reads (the kernel assumed exactly start + T)
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 9, 8)).astype(np.float32) for _ in range(2))
    got = neon.attention(q, k, v, start=3)
    assert nmse(got, reference.attention(q, k[:, :5], v[:, :5], 3).reshape(got.shape)) < 5e-4
    # add broadcasts b as numpy (the reference) does; it read a.size floats of b
    a, row = rng.standard_normal((4, 64)).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    np.testing.assert_allclose(neon.add(a, row), reference.add(a, row), rtol=1e-7)


def test_zero_rows_give_empty_results_and_kernel_refusals_are_typed(q4):
    w, _ = q4
    assert neon.matmul(np.ones((0, 64), np.float32), w).shape == (0, 48)
    assert neon.rmsnorm(np.ones((0, 64), np.float32), np.ones(64, np.float32), 1e-5).shape == (0, 64)
    assert neon.swiglu(np.ones((0, 8), np.float32)).shape == (0, 4)
    with pytest.raises(KernelError, match="EL_EINVAL"):    # a NaN eps: the kernel's own refusal
        neon.rmsnorm(np.ones((2, 64), np.float32), np.ones(64, np.float32), float("nan"))


def test_embedding_refuses_float_ids_and_a_read_only_out():
    d = 32
    raw = quant.quantize(rng.standard_normal((10, d)).astype(np.float32), T.Q8_0)
    table = reference.EmbeddingTable(np.ascontiguousarray(raw).reshape(-1), T.Q8_0, d)
    with pytest.raises(OpArgumentError, match="ids must be integers"):
        neon.embedding(table, np.array([1.7, 2.0]))
    out = np.zeros((2, d), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        neon.embedding(table, np.array([1, 2]), out=out)
    assert not out.any()
