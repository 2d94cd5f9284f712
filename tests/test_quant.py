"""quant.py against the gguf package's own (de)quantization, which mirrors ggml's reference C."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
import gguf.quants

from edgellm import quant

BLOCK_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1]


def _data(seed, rows=7, cols=96):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0 must not produce NaN
    x[1, :32] = 3.0  # a constant block
    x[2] *= 1e-3     # tiny magnitudes
    return x


@pytest.mark.parametrize("qtype", BLOCK_TYPES + [T.F16, T.F32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantize_matches_gguf_bit_for_bit(qtype, seed):
    x = _data(seed)
    ours = quant.quantize(x, qtype)
    theirs = gguf.quants.quantize(x, qtype)
    theirs = np.ascontiguousarray(theirs).view(np.uint8).reshape(x.shape[0], -1)  # F16/F32 come back as floats
    assert ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("qtype", BLOCK_TYPES + [T.F16, T.F32])
def test_dequantize_matches_gguf(qtype):
    x = _data(5)
    raw = gguf.quants.quantize(x, qtype)
    ours = quant.dequantize(np.ascontiguousarray(raw).view(np.uint8).reshape(-1), qtype, x.shape)
    theirs = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    np.testing.assert_array_equal(ours, theirs)
    assert ours.dtype == np.float32 and np.isfinite(ours).all()


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_dequantize_rows_equals_full_table_rows(qtype):
    x = _data(9, rows=11)
    raw = quant.quantize(x, qtype)
    full = quant.dequantize(raw.reshape(-1), qtype, x.shape)
    rows = np.array([10, 0, 3, 3])
    np.testing.assert_array_equal(quant.dequantize_rows(raw.reshape(-1), qtype, x.shape[1], rows), full[rows])


@pytest.mark.parametrize("qtype", BLOCK_TYPES + [T.F32, T.F16])
def test_dequantize_rows_into_out_writes_there(qtype):
    """With out, the rows land in the caller's buffer (a fused step's input: no second copy),
    equal to the rows returned without it."""
    x = _data(9, rows=11)
    raw = quant.quantize(x, qtype).reshape(-1)
    rows = np.array([10, 0, 3, 3])
    out = np.full((len(rows), x.shape[1]), np.nan, np.float32)
    got = quant.dequantize_rows(raw, qtype, x.shape[1], rows, out=out)
    assert got is out
    np.testing.assert_array_equal(out, quant.dequantize_rows(raw, qtype, x.shape[1], rows))


@pytest.mark.parametrize("qtype,bound", [(T.Q8_0, 1e-4), (T.Q4_1, 1e-2), (T.Q4_0, 2e-2)])
def test_round_trip_error_is_small(qtype, bound):
    x = np.random.default_rng(3).standard_normal((16, 256)).astype(np.float32)
    y = quant.dequantize(quant.quantize(x, qtype).reshape(-1), qtype, x.shape)
    nmse = float(((x - y) ** 2).sum() / (x**2).sum())
    assert nmse < bound


def test_bytes_per_row():
    assert quant.bytes_per_row(T.Q4_1, 576) == 18 * 20
    assert quant.bytes_per_row(T.Q8_0, 64) == 2 * 34
    assert quant.bytes_per_row(T.Q4_0, 32) == 18
    assert quant.bytes_per_row(T.F16, 10) == 20
