"""The neon embedding lookup (neon/embedding.c through backends/neon.py) against
backends/reference.py: every GGUF type a model may use, rows bit-identical to the reference's
(any arithmetic slip fails: a swapped nibble order, a scale of the wrong block), and bad input
refused with a named error and nothing written. The qemu self-test runs the same kernel on aarch64
(selftest_cases._embed_cases)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from edgellm import quant
from edgellm.backends import neon, neon_lib, reference
from edgellm.backends.reference import EmbeddingTable

T = quant.T
TYPES = [T.F32, T.F16, T.Q8_0, T.Q4_0, T.Q4_1]
EINVAL, EUNSUPPORTED = -1, -3


def table(qt, rows: int, d: int, seed: int = 0, special: bool = False) -> EmbeddingTable:
    """A token table of `rows` rows in type qt, rows scaled from 1e-6 to 1e4 (subnormal fp16
    scales among them), plus inf, nan and subnormal values in float tables when `special`."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, d)) * np.geomspace(1e-6, 1e4, rows)[:, None]
    w = w.astype(np.float32)
    if special and qt in (T.F32, T.F16):
        w[0, :4] = [np.inf, -np.inf, np.nan, 3e-6]
    raw = quant.quantize(w, qt).reshape(-1)
    if qt == T.F32:
        raw = raw.view(np.float32)
    elif qt == T.F16:
        raw = raw.view(np.float16)
    return EmbeddingTable(raw, qt, d)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.float32 and a.shape == b.shape and np.array_equal(a.view(np.uint32),
                                                                                      b.view(np.uint32))


@pytest.mark.parametrize("qt", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("d,n_ids", [(32, 1), (64, 9), (576, 33)])
def test_rows_bit_identical_to_reference(qt, d, n_ids):
    t = table(qt, 24, d, seed=d, special=True)
    ids = np.random.default_rng(n_ids).integers(0, 24, n_ids)
    ids[0] = 0                                   # the special values' row
    want = reference.embedding(t, ids)
    assert same_bits(neon.embedding(t, ids), want)
    out = np.full((n_ids, d), 5.0, np.float32)
    assert neon.embedding(t, ids, out=out) is out and same_bits(out, want)


def test_bad_input_is_refused_by_name():
    t = table(T.Q4_1, 10, 64)
    for bad in ([0, 10], [-1], [2 ** 40]):
        with pytest.raises(ValueError, match=f"embedding id {bad[-1]} is outside the table's 10 rows"):
            neon.embedding(t, np.array(bad))
    with pytest.raises(ValueError, match="non-empty 1-D"):
        neon.embedding(t, np.zeros((2, 2), np.int64))
    with pytest.raises(ValueError, match="non-empty 1-D"):
        neon.embedding(t, np.zeros(0, np.int64))
    for out in (np.zeros((2, 64), np.float32), np.zeros((1, 64), np.float64), np.zeros((1, 128), np.float32)[:, ::2]):
        with pytest.raises(ValueError, match=r"C-contiguous float32 \(1, 64\)"):
            neon.embedding(t, np.array([3]), out=out)


def test_library_refuses_bad_arguments_and_writes_nothing():
    lib = neon._lib()
    t = table(T.Q4_1, 10, 64)
    desc = neon.embedding_desc(t)
    ids = np.array([1, 9, 3], np.int32)
    out = np.full((3, 64), 5.0, np.float32)

    def call(emb=None, ids_p=ids.ctypes.data, n=3, out_p=out.ctypes.data, **change):
        e = neon.ElEmbedding.from_buffer_copy(desc)
        for k, v in change.items():
            setattr(e, k, v)
        return lib.el_embed_rows(ctypes.addressof(e) if emb is None else emb, ids_p, n, out_p)

    cases = {
        "embedding NULL": (dict(emb=0), EINVAL),
        "ids NULL": (dict(ids_p=None), EINVAL),
        "out NULL": (dict(out_p=None), EINVAL),
        "no ids": (dict(n=0), EINVAL),
        "table NULL": (dict(table=None), EINVAL),
        "no rows": (dict(n_rows=0), EINVAL),
        "rows of 0": (dict(row_len=0), EINVAL),
        "rows not whole blocks": (dict(row_len=48), EINVAL),
        "id past the table": (dict(n_rows=9), EINVAL),
        "type 7": (dict(wtype=7), EUNSUPPORTED),
    }
    for what, (change, code) in cases.items():
        assert call(**change) == code, what
    assert (out == 5.0).all()
    ids[1] = -1
    assert call() == EINVAL and (out == 5.0).all()
    ids[1] = 9
    assert call() == 0 and same_bits(out, reference.embedding(t, ids))


def test_desc_counts_the_table_rows():
    for qt in TYPES:
        t = table(qt, 7, 96)
        desc = neon.embedding_desc(t)
        assert (desc.n_rows, desc.row_len, desc.wtype) == (7, 96, neon._GGML_TO_EL[qt.name])
        assert desc.table == np.asarray(t.raw).ctypes.data
    assert neon_lib.EL_Q4_1 == 3
