"""A prompt row's logits and K/V do not depend on how the prompt was cut into chunks, on the
fused neon path: the whole prompt in one chunk, the same prompt continued from a cached head
(a short last chunk, one of a single token), and a chunk size that leaves one row over all give
the same bits.

Two things broke that before: a prompt chunk of few rows at 128+ keys split its keys over the
threads and merged the parts (another rounding than one tile's online softmax), and a lone
prompt token ran the decode kernels (GEMVs, the decode attention). Either changed the logits in
the last bits, and greedy text could then differ between a cold request and the same request
with its head from the prefix cache.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.backends import neon
from edgellm.kv.pool import KVPool
from tests.synthetic import write_tiny_model

BT = 16
L = 300          # prompt tokens: past 128 keys, where a short chunk used to split its keys


# an FFN as wide as K = 576 (18 blocks a row), which the GEMV sums in another order than the
# GEMM tile: a row on the other kernel shows
@pytest.fixture(scope="module", params=[dict(n_heads=6, n_kv_heads=2, d_model=96, d_ff=576),   # GQA 3:1
                                        dict(n_heads=4, n_kv_heads=1, d_model=64, d_ff=128),   # MQA
                                        dict(n_heads=6, n_kv_heads=2, d_model=96, d_ff=576,
                                             tensor_type=QT.F16)],   # the float tiles
                ids=["q4_1-gqa", "q4_1-mqa", "f16-gqa"])
def eng(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("chunking") / "m.gguf"
    write_tiny_model(path, **{"arch": "llama", "tensor_type": QT.Q4_1, "n_layers": 2, "seed": 7,
                              "context_length": 512, **request.param})
    e = edgellm.load(str(path), n_ctx=512, units=["neon"], threads=2)
    assert e.runner._fused_phases, e.runner.placement
    # x86 builds: the 512-bit GEMVs, whose sums differ from the GEMM tile's where the AVX2 ones
    # (picked on some CPUs) may not; -1: not an x86 AVX-512 build
    lib = neon._lib()
    before = lib.el_x86_gemv(-1)
    if before >= 0:
        lib.el_x86_gemv(3)
    yield e
    if before >= 0:
        lib.el_x86_gemv(before)
    e.close()


def _seq(e):
    cfg = e.config
    return KVPool(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, -(-L // BT) + 2, BT, "f16").new_sequence()


def _kv(seq) -> list[np.ndarray]:
    pool, n = seq.pool, seq.n_tokens
    p = np.arange(n)
    blk = np.asarray(seq.block_table)[p // BT]
    return [a[blk, :, p % BT].view(np.uint16).copy() for a in (pool.k, pool.v)]


def _run(e, ids, cuts, chunk=None):
    """forward the prompt in calls ending at `cuts`, a call of one token after the sequence's
    last one taken back (as Generation does); the last call's logits and the K/V rows"""
    seq, start, out = _seq(e), 0, None
    for c in list(cuts) + [len(ids)]:
        part = list(ids[start:c])
        if len(part) == 1:
            part = [e.runner.take_back_last(seq)] + part
        out = e.runner.forward(seq, part, chunk=chunk)
        start = c
    return out, _kv(seq)


@pytest.mark.parametrize("n, cuts, chunk", [
    (150, (140,), None),     # a 10-row last chunk at 150 keys (it split its keys before)
    (150, (149,), None),     # a cached head and one prompt token
    (150, (133, 149), None),  # ... after a 16-row chunk
    (150, (), 149),          # a chunk size that leaves one row over
    (150, (), 37),           # 37, 37, 37, 37, 2
    (300, (), 257),          # a chunk of 257 rows: native slices of 256 rows, x chunks of 128
    (300, (43,), None),      # 43, then 257
    (300, (), 129),          # a GEMM of 129 rows: x chunks of 128
])
def test_prompt_rows_do_not_depend_on_the_chunking(eng, n, cuts, chunk):
    ids = np.random.default_rng(1).integers(3, eng.config.vocab_size, n)
    ref, ref_kv = _run(eng, ids, ())
    got, got_kv = _run(eng, ids, cuts, chunk)
    np.testing.assert_array_equal(got, ref)
    for a, b in zip(got_kv, ref_kv, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_decode_token_still_takes_the_decode_step(eng, monkeypatch):
    """a one-token forward (a sampled token) keeps the one-call decode step and drops nothing
    from the sequence"""
    used = []
    orig = type(eng.runner)._decode_fused
    monkeypatch.setattr(type(eng.runner), "_decode_fused", lambda self, *a: used.append(1) or orig(self, *a))
    seq = _seq(eng)
    eng.runner.forward(seq, [5, 6, 7])
    eng.runner.forward(seq, [8])
    assert used == [1] and seq.n_tokens == 4 and seq.tokens == [5, 6, 7, 8]


def test_take_back_last_refuses_what_it_cannot_undo_exactly(eng):
    seq = _seq(eng)
    assert eng.runner.take_back_last(seq) is None          # empty
    eng.runner.forward(seq, [5, 6, 7])
    assert eng.runner.take_back_last(seq) == 7 and seq.tokens == [5, 6] and seq.n_tokens == 2


def test_a_repeated_request_gives_the_same_text(eng):
    """The same greedy request twice: the second one's head comes from the prefix cache, its last
    prompt token alone is left to compute; the texts are equal."""
    eng.clear_cache()
    text = "".join(chr(97 + (i * 7) % 26) for i in range(200))
    ids = eng.tokenize(text)
    text = eng.detokenize(ids[: 2 * BT + 1])      # two full blocks and one token
    first = eng.generate(text, max_tokens=12, temperature=0, ignore_eos=True)
    again = eng.generate(text, max_tokens=12, temperature=0, ignore_eos=True)
    assert eng.last_stats.cached_tokens == 2 * BT - 1   # the last cached token recomputed with the new one
    assert again == first


@pytest.mark.parametrize("type_name, K, M, f32act", [
    ("Q4_1", 16384, 33, False),   # x86 quantized: x chunks of 32 rows at K = 16384 (512 KiB of int8 x)
    ("Q4_1", 576, 129, False),    # ... of 128
    ("F32", 1024, 33, False),     # fp32 x: chunks of 32 rows at K = 1024 (128 KiB)
    ("F16", 1024, 33, False),
    # block weights against fp32 x (the quality preset's prefill): every call of 2 rows or more
    # takes matmul_bqpanel.c's GEMM form, whose sums differ from the 4 x 4 tile's
    ("Q4_1", 576, 6, True),
    ("Q4_0", 1536, 45, True),
    ("Q8_0", 576, 129, True),
])
def test_a_matmul_row_does_not_depend_on_the_rows_beside_it(type_name, K, M, f32act):
    """el_matmul cuts x into chunks; a lone row left over used to run on its own (the GEMV, or a
    float tile with its own summation order): its result differed from the same row's in a
    smaller call. Every row equals the row of a 2-row call."""
    from edgellm import quant

    lib = neon._lib()
    before = lib.el_x86_gemv(-1)
    if before >= 0:
        lib.el_x86_gemv(3)     # the 512-bit GEMVs: their sums differ from the GEMM tile's
    try:
        rng = np.random.default_rng(K + M)
        w = rng.standard_normal((64, K)).astype(np.float32)
        data = {"F32": w, "F16": w.astype(np.float16).view(np.uint8)}.get(type_name)
        if data is None:
            data = quant.quantize(w, getattr(quant.T, type_name))
        m = neon.QMatrix.from_arrays(type_name, [data], [64], K)
        x = rng.standard_normal((M, K)).astype(np.float32)
        prec = "int8" if type_name.startswith("Q") and not f32act else "fp32"
        y = neon.matmul(x, m, precision=prec)
        for r in range(2, 6):    # every call of 2 to 5 rows: none of them may sum otherwise
            np.testing.assert_array_equal(y[M - r:], neon.matmul(x[M - r:], m, precision=prec), err_msg=str(r))
    finally:
        if before >= 0:
            lib.el_x86_gemv(before)


def test_quality_preset_rows_do_not_depend_on_the_chunking(tmp_path):
    """The same on the quality preset (fp32 activations against the file's block weights): a
    cached head and one prompt token (a 2-row call) or a 3-row tail gave other bits than the
    whole prompt in one chunk when the GEMM form took calls of 6 rows or more only (a review)."""
    path = tmp_path / "m.gguf"
    write_tiny_model(path, arch="llama", tensor_type=QT.Q4_1, n_layers=2, seed=7, context_length=512,
                     n_heads=6, n_kv_heads=2, d_model=96, d_ff=576)
    e = edgellm.load(str(path), n_ctx=512, units=["neon"], threads=2, precision="quality")
    try:
        assert e.runner.placement["prefill"]["ffn_down"] == "neon", e.runner.placement
        ids = np.random.default_rng(1).integers(3, e.config.vocab_size, 150)
        ref, ref_kv = _run(e, ids, ())
        for cuts in ((149,), (147,), (133, 149)):
            got, got_kv = _run(e, ids, cuts)
            np.testing.assert_array_equal(got, ref, err_msg=str(cuts))
            for a, b in zip(got_kv, ref_kv, strict=True):
                np.testing.assert_array_equal(a, b, err_msg=str(cuts))
    finally:
        e.close()
