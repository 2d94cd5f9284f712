"""GGML block formats: F32, F16, Q8_0, Q4_0, Q4_1 — (de)quantization in numpy.

A block holds 32 consecutive values of one row (GGUF ne[0] is the row length, always a multiple
of the block size; the loader has checked that). Layouts, as ggml defines them:
  Q8_0: d:f16, qs:int8[32]                     x = d * q
  Q4_0: d:f16, qs:u8[16] (low nibbles = 0..15,  x = d * (q - 8)
        high nibbles = 16..31)
  Q4_1: d:f16, m:f16, qs:u8[16] (same nibbles)  x = d * q + m
Quantization follows ggml's reference (round-to-nearest) so files we write round-trip with
llama.cpp and the gguf package.
"""
from __future__ import annotations

import numpy as np

from edgellm.model.ggml_types import GGMLQuantizationType as T

QK = 32  # values per block for every block format here

_BLOCK_DTYPES = {
    T.Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", (QK,))]),
    T.Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))]),
    T.Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (QK // 2,))]),
}

SUPPORTED_TYPES = (T.F32, T.F16, T.Q8_0, T.Q4_0, T.Q4_1)
# Block types llama.cpp writes that no edgellm unit computes with (a Q4_K_M file keeps most matrices
# in Q4_K, output.weight and some attn_v / ffn_down in Q6_K): such a matrix loads from a copy made
# once, Q4_K as Q4_1 and the rest as Q8_0 (kquant_repack, api.load). dequantize() reads them
# through the gguf package's numpy dequantizers, the reference for their layouts.
CONVERTIBLE_TYPES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0, T.Q5_1, T.BF16)


def bytes_per_row(qtype: T, row_len: int) -> int:
    if qtype == T.F32:
        return 4 * row_len
    if qtype == T.F16:
        return 2 * row_len
    return (row_len // QK) * _BLOCK_DTYPES[qtype].itemsize


def dequantize(raw: np.ndarray, qtype: T, shape: tuple[int, ...], out: np.ndarray | None = None) -> np.ndarray:
    """Raw tensor bytes (uint8, or the f32/f16 view) -> float32 array of numpy `shape`
    (GGUF ne reversed: (rows, row_len) for a matrix). With `out` (float32, C-contiguous, that
    shape), the values are written there: fused weights are filled without a concatenate copy."""
    n = int(np.prod(shape))
    if out is None:
        out = np.empty(shape, dtype=np.float32)
    if qtype in (T.F32, T.F16):
        src = np.asarray(raw).view(np.float32 if qtype == T.F32 else np.float16).reshape(-1)[:n]
        out.reshape(-1)[...] = src
        return out
    if qtype in CONVERTIBLE_TYPES:
        import gguf.quants

        flat = np.asarray(raw).view(np.uint8).reshape(-1)
        out.reshape(-1)[...] = gguf.quants.dequantize(flat, qtype).reshape(-1)[:n]
        return out
    if qtype not in _BLOCK_DTYPES:
        raise ValueError(f"no dequantizer for tensor type {qtype.name}")
    blocks = np.asarray(raw).view(np.uint8).reshape(-1).view(_BLOCK_DTYPES[qtype])
    o = out.reshape(-1, QK)                                   # (blocks, 32)
    d = blocks["d"].astype(np.float32)[:, None]
    qs = blocks["qs"]
    if qtype == T.Q8_0:
        np.multiply(qs, d, out=o)
        return out
    # 4-bit: low nibbles are values 0..15 of the block, high nibbles 16..31 (ggml's order)
    lo, hi = o[:, : QK // 2], o[:, QK // 2 :]
    np.bitwise_and(qs, 0x0F, out=lo, casting="unsafe")
    np.right_shift(qs, 4, out=hi, casting="unsafe")
    if qtype == T.Q4_0:
        o -= 8.0
        o *= d
    else:  # Q4_1
        o *= d
        o += blocks["m"].astype(np.float32)[:, None]
    return out


def dequantize_rows(raw: np.ndarray, qtype: T, row_len: int, rows: np.ndarray,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Dequantize only the given rows of a (n_rows, row_len) tensor: embedding lookup without
    materialising the whole table in fp32. With `out` (float32, C-contiguous, (len(rows),
    row_len)), the rows are written there: a fused step's input buffer, no second copy."""
    if qtype in (T.F32, T.F16):
        table = np.asarray(raw).view(np.float32 if qtype == T.F32 else np.float16).reshape(-1, row_len)
        if out is None:
            return table[rows].astype(np.float32)
        out[...] = table[rows]
        return out
    table = np.asarray(raw).view(np.uint8).reshape(-1, bytes_per_row(qtype, row_len))
    picked = np.ascontiguousarray(table[rows])
    return dequantize(picked.reshape(-1), qtype, (len(rows), row_len), out=out)


def _round_half_away(x: np.ndarray) -> np.ndarray:
    # ggml rounds with roundf (half away from zero), not numpy's half-to-even.
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def quantize(values: np.ndarray, qtype: T) -> np.ndarray:
    """float array (..., row_len) -> raw uint8 bytes (..., bytes_per_row) in ggml's layout."""
    x = np.asarray(values, dtype=np.float32)
    if qtype == T.F32:
        return x.view(np.uint8).reshape(*x.shape[:-1], -1)
    if qtype == T.F16:
        return x.astype(np.float16).view(np.uint8).reshape(*x.shape[:-1], -1)
    if x.shape[-1] % QK:
        raise ValueError(f"row length {x.shape[-1]} is not a multiple of {QK}")
    lead = x.shape[:-1]
    b = x.reshape(-1, QK)
    out = np.zeros(b.shape[0], dtype=_BLOCK_DTYPES[qtype])
    with np.errstate(divide="ignore", invalid="ignore"):
        if qtype == T.Q8_0:
            d = np.abs(b).max(axis=1) / 127.0
            inv = np.where(d != 0, 1.0 / d, 0.0)
            out["qs"] = _round_half_away(b * inv[:, None]).astype(np.int8)
        elif qtype == T.Q4_0:
            # Signed extreme: the value with the largest magnitude maps to -8.
            idx = np.abs(b).argmax(axis=1)
            mx = b[np.arange(len(b)), idx]
            d = mx / -8.0
            inv = np.where(d != 0, 1.0 / d, 0.0)
            q = np.minimum(15, np.trunc(b * inv[:, None] + 8.5)).astype(np.uint8)
            out["qs"] = q[:, : QK // 2] | (q[:, QK // 2 :] << 4)
        elif qtype == T.Q4_1:
            mn, mx = b.min(axis=1), b.max(axis=1)
            d = (mx - mn) / 15.0
            inv = np.where(d != 0, 1.0 / d, 0.0)
            q = np.minimum(15, np.trunc((b - mn[:, None]) * inv[:, None] + 0.5)).astype(np.uint8)
            out["qs"] = q[:, : QK // 2] | (q[:, QK // 2 :] << 4)
            out["m"] = mn.astype(np.float16)
        else:
            raise ValueError(f"no quantizer for tensor type {qtype.name}")
    out["d"] = d.astype(np.float16)
    return out.view(np.uint8).reshape(*lead, -1)
