"""Block types no edgellm unit computes with, rewritten into ones every unit does, without a second
rounding where the two layouts allow it (BF16 too: F16 holds its values, F32 its vectors).

- Q4_K (super-blocks of 256: fp16 d and dmin, eight 6-bit scale / min pairs, 4-bit values) is,
  per 32 values, x = (d sc) q - (dmin m) with q in 0..15: a Q4_1 block (x = d' q + m') whose d'
  and m' are those two products rounded to fp16 and whose values are the same nibbles. The only
  change is that rounding, at most 2^-11 of d' and m' (their exact products need 17 bits):
  ~1/100 of a 4-bit step, against ~1/30 rms for a Q8_0 copy of the same block; and Q4_1 takes
  5 bits a weight where Q8_0 takes 8.5.
- Q5_0 (x = d (q - 16), q in 0..31) is Q8_0 (x = d q8) with q8 = q - 16: exact.
- The rest (Q2_K, Q3_K, Q5_K, Q6_K, Q5_1) become Q8_0 from their dequantized values: their
  sub-blocks of 16 have their own scales, or their values an offset, which no 32-value block
  here holds.

Layouts as ggml defines them (ggml-common.h); tests check them against the gguf package's
dequantizers.
"""
from __future__ import annotations

import numpy as np

from edgellm.model.ggml_types import GGMLQuantizationType as T

QK_K = 256
_Q4_K = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qs", "u1", (128,))])
_Q5_0 = np.dtype([("d", "<f2"), ("qh", "<u4"), ("qs", "u1", (16,))])
_Q4_1 = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))])
_Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])


def runs_as(t: T) -> T:
    """The type a matrix of type t runs as (t itself where a unit computes with it)."""
    if t == T.Q4_K:
        return T.Q4_1
    if t == T.BF16:
        return T.F16        # exact for every BF16 value in fp16's normal range (8 of its 11 bits)
    from edgellm.quant import CONVERTIBLE_TYPES

    return T.Q8_0 if t in CONVERTIBLE_TYPES else t


def copy_types(tensors) -> dict[str, T]:
    """{tensor name: the type load()'s copy holds it in} for the tensors of a model (name ->
    gguf_file tensor info) that load() converts: matrices in CONVERTIBLE_TYPES as runs_as says,
    and BF16 vectors (norms) as F32, which holds them exactly (vectors run as F32 / F16)."""
    from edgellm.model.layout import SEGMENTS
    from edgellm.quant import CONVERTIBLE_TYPES

    out = {}
    for name, info in tensors.items():
        if info.ggml_type in CONVERTIBLE_TYPES and len(info.shape) == 2:
            out[name] = runs_as(info.ggml_type)
        elif info.ggml_type == T.BF16 and len(info.shape) == 1:
            out[name] = T.F32
    # a fused projection (q, k, v; gate, up) runs on neon / opencl only in one format: a Q4_K_M
    # layer's Q4_K attn_q / attn_k beside its Q6_K attn_v ran as Q4_1 beside Q8_0, and its qkv went
    # to reference (numpy, fp32 copies, no fused decode step) in every layer: 4.4x slower decode
    # than the all-Q8_0 copy. Such a layer's Q4_K parts take Q8_0, as the rest of the group does.
    for name in out:
        if out[name] != T.Q4_1 or not name.startswith("blk.") or name.count(".") != 3:
            continue
        layer, seg = name.split(".")[1:3]
        group = next((g for g in SEGMENTS.values() if seg in g and len(g) > 1), None)
        members = [f"blk.{layer}.{s}.weight" for s in group or ()]
        kinds = {out.get(m, tensors[m].ggml_type) for m in members if m in tensors}
        if len(kinds) > 1:
            for m in members:
                if m in out and tensors[m].ggml_type == T.Q4_K:
                    out[m] = T.Q8_0
    return out


def copy_growth(mf) -> tuple[int, dict]:
    """(bytes load()'s copy of mf adds to the file, {name: the type it takes} of the tensors it
    converts): what is mapped in the file's place is that much larger (`plan` sized a Q4_K_M
    model's memory by its file)."""
    from edgellm.model.ggml_types import GGML_QUANT_SIZES

    conv = copy_types(mf.gguf.tensors)
    grows = 0
    for name, t in conv.items():
        info = mf.gguf.tensors[name]
        block, size = GGML_QUANT_SIZES[t]
        grows += info.n_elements // block * size - info.nbytes
    return grows, conv


def conversions(tensors, conv: dict[str, T]) -> str:
    """conv ({name: type}, copy_types) as a note: "BF16 as F16/F32, Q4_K as Q4_1"."""
    pairs: dict[str, set] = {}
    for name, t in conv.items():
        pairs.setdefault(tensors[name].ggml_type.name, set()).add(t.name)
    return ", ".join(f"{src} as {'/'.join(sorted(dst))}" for src, dst in sorted(pairs.items()))


def _q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sc, m), each (n, 8) of 6-bit integers, from Q4_K's 12 packed bytes (n, 12): pairs 0-3 are
    the low 6 bits of bytes 0-3 and 4-7; pairs 4-7 take their low 4 bits from bytes 8-11 and
    their top 2 from the top bits of bytes 0-3 (sc) and 4-7 (m)."""
    s = scales.astype(np.uint8)
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], axis=1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, m


def q4_k_to_q4_1(rows: np.ndarray) -> np.ndarray | None:
    """Q4_K rows (uint8, (n, row bytes)) as Q4_1 rows; None when a block's d sc or dmin m is past
    fp16's range (the caller requantizes those rows from their values instead)."""
    n = rows.shape[0]
    b = np.ascontiguousarray(rows).view(_Q4_K).reshape(-1)           # super-blocks, row-major
    sc, m = _q4_k_scales(b["scales"])
    d = b["d"].astype(np.float32)[:, None] * sc                    # exact in fp32 (<= 17 bits)
    mins = -(b["dmin"].astype(np.float32)[:, None] * m)
    with np.errstate(over="ignore"):
        d16, m16 = d.astype(np.float16), mins.astype(np.float16)
    if not (np.isfinite(d16).all() and np.isfinite(m16).all()):
        return None
    qs = b["qs"].reshape(-1, 4, 32)                                # 4 chunks of 64 values each
    # chunk j: low nibbles are sub-block 2j's 32 values, high nibbles sub-block 2j+1's
    q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 8, 32)
    out = np.empty(q.shape[:2], _Q4_1)
    out["d"], out["m"] = d16, m16
    out["qs"] = q[:, :, :16] | (q[:, :, 16:] << 4)                   # Q4_1: value i low, i + 16 high
    return out.reshape(n, -1).view(np.uint8).reshape(n, -1)


def q5_0_to_q8_0(rows: np.ndarray) -> np.ndarray:
    """Q5_0 rows (uint8, (n, row bytes)) as Q8_0 rows, the same values exactly."""
    n = rows.shape[0]
    b = np.ascontiguousarray(rows).view(_Q5_0).reshape(-1)
    bit = np.arange(32, dtype=np.uint32)
    high = ((b["qh"][:, None] >> bit) & 1).astype(np.uint8) << 4    # value i's fifth bit is qh bit i
    low = np.concatenate([b["qs"] & 0xF, b["qs"] >> 4], axis=1)
    out = np.empty(len(b), _Q8_0)
    out["d"] = b["d"]
    out["qs"] = (low | high).astype(np.int16) - 16
    return out.reshape(n, -1).view(np.uint8).reshape(n, -1)


# (source type, target type) -> a rewrite of whole rows without a second rounding
REPACKS = {(T.Q4_K, T.Q4_1): q4_k_to_q4_1, (T.Q5_0, T.Q8_0): q5_0_to_q8_0}
