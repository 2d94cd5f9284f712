"""kquant_repack: Q4_K rewritten as Q4_1 and Q5_0 as Q8_0 without a second rounding, checked
against the gguf package's dequantizers (the reference for ggml's layouts)."""
import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from edgellm import quant, requant
from edgellm.errors import UnsupportedModelError
from edgellm.kquant_repack import q4_k_to_q4_1, q5_0_to_q8_0, runs_as

ROWS, COLS = 48, 1024


def _q4_k(rng, d: float, dmin: float) -> np.ndarray:
    """Random Q4_K rows (random scales, mins and values) whose super-block scales are d, dmin."""
    raw = rng.integers(0, 256, (ROWS * COLS // 256, 144), dtype=np.uint8)
    raw[:, 0:2] = np.full(len(raw), d, np.float16).view(np.uint8).reshape(-1, 2)
    raw[:, 2:4] = np.full(len(raw), dmin, np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(ROWS, -1)


def _reference(raw: np.ndarray, t: QT) -> np.ndarray:
    return gguf.quants.dequantize(raw, t).reshape(ROWS, COLS).astype(np.float64)


@pytest.mark.parametrize("d", [1e-6, 1e-4, 3e-3, 0.05, 30.0])
def test_q4_k_as_q4_1_rounds_only_the_block_scales(d):
    raw = _q4_k(np.random.default_rng(1), d, 0.7 * d)
    want = _reference(raw, QT.Q4_K)
    rows = q4_k_to_q4_1(raw)
    assert rows.shape == (ROWS, COLS // 32 * 20)
    have = quant.dequantize(rows, QT.Q4_1, (ROWS, COLS)).astype(np.float64)
    blocks = rows.reshape(-1, 20)
    d1 = np.abs(blocks[:, 0:2].copy().view(np.float16).astype(np.float64))
    m1 = np.abs(blocks[:, 2:4].copy().view(np.float16).astype(np.float64))
    # 2^-11 of d' (times the largest value, 15) and of m'; 2^-25 each below fp16's normal range
    bound = (15 * d1 + m1) * 2.0 ** -11 + 16 * 2.0 ** -25
    assert np.all(np.abs(have - want).reshape(-1, 32) <= bound)
    # against what a Q8_0 copy of the same values (the conversion before) loses
    q8 = quant.dequantize(quant.quantize(want.astype(np.float32), QT.Q8_0), QT.Q8_0, (ROWS, COLS))
    err_q41, err_q8 = np.mean((have - want) ** 2), np.mean((q8 - want) ** 2)
    assert err_q41 <= err_q8 / 50, (err_q41, err_q8)


def test_q4_k_past_fp16_range_is_left_to_the_caller():
    raw = _q4_k(np.random.default_rng(2), 60000.0, 1.0)     # d sc up to 63 x 60000
    raw.reshape(-1, 144)[:, 4:8] |= 63                       # the first four scales at their largest
    assert q4_k_to_q4_1(raw) is None


def test_q5_0_as_q8_0_is_exact():
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (ROWS * COLS // 32, 22), dtype=np.uint8)
    raw[:, 0:2] = np.full(len(raw), 5e-3, np.float16).view(np.uint8).reshape(-1, 2)
    raw = raw.reshape(ROWS, -1)
    have = quant.dequantize(q5_0_to_q8_0(raw), QT.Q8_0, (ROWS, COLS))
    np.testing.assert_array_equal(have, _reference(raw, QT.Q5_0).astype(np.float32))


def test_what_each_type_runs_as():
    assert runs_as(QT.Q4_K) == QT.Q4_1
    for t in (QT.Q2_K, QT.Q3_K, QT.Q5_K, QT.Q6_K, QT.Q5_0, QT.Q5_1):
        assert runs_as(t) == QT.Q8_0, t
    for t in (QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.F16, QT.F32):
        assert runs_as(t) == t


def test_values_past_what_fp16_scales_hold_are_refused_by_name():
    """Such a block came back as inf (a RuntimeWarning, then a model of nan): Q4_1 and Q8_0 keep
    fp16 scales, and values past ~15 x 65504 need a larger one."""
    raw = _q4_k(np.random.default_rng(4), 60000.0, 1.0)
    raw.reshape(-1, 144)[:, 4:8] |= 63
    for dst in (QT.Q4_1, QT.Q8_0):
        job = requant._Job("blk.0.w", QT.Q4_K, dst, (ROWS, COLS), dst.name.lower(), raw.nbytes, 0, "")
        with pytest.raises(UnsupportedModelError, match="blk.0.w.*past what"):
            requant._convert_rows(raw, job, "m.gguf")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_q5_0_block_with_a_nan_or_inf_scale_is_refused_as_the_other_types_are(bad):
    """The exact repack took the scale as it was: the copy held NaN values (Q4_K, Q6_K: refused)."""
    from edgellm.errors import ConfigError

    rng = np.random.default_rng(6)
    raw = rng.integers(0, 256, (32, 22), dtype=np.uint8)
    raw[:, 0:2] = np.full(32, 5e-3, np.float16).view(np.uint8).reshape(-1, 2)
    raw[3, 0:2] = np.array([bad], np.float16).view(np.uint8)
    job = requant._Job("blk.0.attn_v.weight", QT.Q5_0, QT.Q8_0, (2, 512), "q8_0", raw.nbytes, 0, "")
    with np.errstate(all="ignore"), pytest.raises(ConfigError, match="blk.0.attn_v.weight.*NaN or infinite"):
        requant._convert_rows(raw.reshape(2, -1), job, "m.gguf")
