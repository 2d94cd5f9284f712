"""The NEON self-test cases: inputs and the numpy reference's outputs for every kernel, in the
binary file neon/selftest.c reads (format documented there). Used by `edgellm build` bundles and
by the host and qemu self-tests."""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np


(OP_MATMUL, OP_RMSNORM, OP_ROPE, OP_SWIGLU, OP_SOFTMAX, OP_ADD, OP_ATTN_DENSE, OP_ATTN_POOL, OP_EMBED,
 OP_KV_QUANT, OP_SAMPLE, OP_STEP) = range(1, 13)
STEP_CHUNK, STEP_DECODE, STEP_GREEDY = 0, 1, 2   # OP_STEP modes (neon/selftest.c)
CASES_MAGIC, CASES_VERSION = b"ELSTCASE", 1
KIND_F32, KIND_RAW = 1, 2
BOUND_ELEMENTWISE = 1e-7     # NMSE bounds of DESIGN.md's correctness discipline
BOUND_MATMUL = 5e-4
# el_matmul_f32act: x stays fp32 and W is compared with its own dequantization, so only the
# summation order differs (~K eps^2 ~ 1e-11 at K = 1536); one wrong output in 33 is ~3e-2.
BOUND_F32ACT = 1e-9
BOUND_ATTENTION = 5e-4
# the embedding lookup computes what quant.dequantize does (its products are exact in fp32):
# bit-identical, so any difference fails (the file needs a positive bound; a one-ulp error in one
# value of a row is ~1e-15)
BOUND_EXACT = 1e-30
EL_F32, EL_F16, EL_Q4_0, EL_Q4_1, EL_Q8_0 = 0, 1, 2, 3, 8
EL_KV_I8 = 16                # an int8 KV pool's kv_type (arena + per-row scales)


@dataclass(frozen=True)
class Case:
    op: int                         # OP_*
    name: str                       # printable, no spaces; unique in a file
    bound: float                    # NMSE bound
    ints: tuple[int, ...]           # shape parameters, per op (neon/selftest.c's header)
    floats: tuple[float, ...]       # eps for rmsnorm, else empty
    arrays: tuple[np.ndarray, ...]  # float32 arrays are stored as f32, anything else as raw bytes; last = expected


def encode_case(c: Case) -> bytes:
    name = c.name.encode("ascii")
    parts = [struct.pack("<II", c.op, len(name)), name, struct.pack("<f", c.bound),
             struct.pack(f"<I{len(c.ints)}i", len(c.ints), *c.ints),
             struct.pack(f"<I{len(c.floats)}f", len(c.floats), *c.floats), struct.pack("<I", len(c.arrays))]
    for a in c.arrays:
        a = np.ascontiguousarray(a)
        if a.dtype == np.float32:
            parts += [struct.pack("<IIQ", KIND_F32, 0, a.size), a.astype("<f4").tobytes()]
        else:
            raw = a.view(np.uint8).reshape(-1)
            parts += [struct.pack("<IIQ", KIND_RAW, 0, raw.size), raw.tobytes()]
    return b"".join(parts)


def encode_cases(cases: Sequence[Case]) -> bytes:
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError("duplicate case names")
    return b"".join([CASES_MAGIC, struct.pack("<II", CASES_VERSION, len(cases)), *map(encode_case, cases)])


def _f32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _matmul_cases(rng: np.random.Generator) -> list[Case]:
    from edgellm.model.ggml_types import GGMLQuantizationType as G

    from . import quant
    from .backends import reference

    types = {"q4_0": (EL_Q4_0, G.Q4_0), "q4_1": (EL_Q4_1, G.Q4_1), "q8_0": (EL_Q8_0, G.Q8_0),
             "f32": (EL_F32, G.F32), "f16": (EL_F16, G.F16)}
    cases = []

    def one(tname: str, M: int, K: int, segs: Sequence[int], bias: bool, scratch: bool, zero_row: bool = False,
            suffix: str = "") -> Case:
        el, g = types[tname]
        N = sum(segs)
        # rows of different magnitude (per-block scales differ) and one all-zero block (d = 0)
        w = rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K)
        w *= np.exp(rng.normal(0.0, 0.5, N)).astype(np.float32)[:, None]
        w[0, : min(K, 32)] = 0.0
        x = rng.standard_normal((M, K)).astype(np.float32)
        if K > 32:
            # an outlier channel, as LLM activations have; it coarsens its block's int8 scale, so
            # not where the block is the whole row (the bound would then test the int8 step size)
            x[:, rng.integers(K)] *= 8.0
        if zero_row:
            x[1] = 0.0                                # a padded row: its int8 scale is 0
        raws, deqs = [], []
        for s0, s1 in zip(np.cumsum([0, *segs[:-1]]), np.cumsum(segs)):
            raw = quant.quantize(w[s0:s1], g)
            raws.append(np.ascontiguousarray(raw))
            deqs.append(quant.dequantize(raw.reshape(-1), g, (s1 - s0, K)))
        b = _f32(rng.standard_normal(N)) if bias else None
        want = reference.matmul(x, np.concatenate(deqs), b)
        name = f"matmul/{tname}/m{M}_k{K}_n{N}{suffix}" + ("_bias" if bias else "") + ("_scratch" if scratch else "") \
            + ("_zrow" if zero_row else "")
        return Case(OP_MATMUL, name, BOUND_MATMUL, (el, M, K, len(segs), int(bias), int(scratch), *segs), (),
                    (x, *raws, *([b] if bias else []), _f32(want)))

    def f32act(tname: str, M: int, K: int, segs: Sequence[int], bias: bool, zero_row: bool = False) -> Case:
        """An el_matmul_f32act case (the matmul op's trailing f32act int = 1). x is exactly
        representable as int8 blocks with fp16 scales (d * q, |q| <= 127, one |q| = 127 per
        block): an int8-activation kernel then rounds nothing either, which keeps the file's
        int8 fairness check (tests/test_neon_selftest.py) true for the tight bound; what tells the
        fp32 path from the int8 one is tests/test_neon_matmul.py, on Gaussian x."""
        el, g = types[tname]
        N = sum(segs)
        w = rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K)
        w *= np.exp(rng.normal(0.0, 0.5, N)).astype(np.float32)[:, None]
        w[0, : min(K, 32)] = 0.0
        nb = K // 32
        q = np.clip(np.rint(rng.standard_normal((M, nb, 32)) * 50.0), -127, 127)
        q[:, :, 0] = np.where(rng.random((M, nb)) < 0.5, -127.0, 127.0)   # the block's max |q|
        d = np.exp(rng.normal(0.0, 1.0, (M, nb, 1))).astype(np.float16).astype(np.float32)
        x = _f32((q * d).reshape(M, K))                                    # exact: 11 x 7 bits
        if zero_row:
            x[1] = 0.0
        raws, deqs = [], []
        for s0, s1 in zip(np.cumsum([0, *segs[:-1]]), np.cumsum(segs)):
            raw = quant.quantize(w[s0:s1], g)
            raws.append(np.ascontiguousarray(raw))
            deqs.append(quant.dequantize(raw.reshape(-1), g, (s1 - s0, K)))
        b = _f32(rng.standard_normal(N)) if bias else None
        want = reference.matmul(x, np.concatenate(deqs), b)
        name = f"matmul_f32act/{tname}/m{M}_k{K}_n{N}" + (f"_segs{len(segs)}" if len(segs) > 1 else "") \
            + ("_bias" if bias else "") + ("_zrow" if zero_row else "")
        return Case(OP_MATMUL, name, BOUND_F32ACT, (el, M, K, len(segs), int(bias), 0, *segs, 1), (),
                    (x, *raws, *([b] if bias else []), _f32(want)))

    for tname in types:
        i = 0
        # every (M, K, N) tail combination except the large K = 576, N = 960 cell, which the fused
        # QKV cases below cover (keeps the file small enough to push to a phone)
        for M in (1, 3, 17):
            for K, N in ((32, 7), (32, 33), (32, 960), (576, 7), (576, 33)):
                cases.append(one(tname, M, K, [N], bias=i % 2 == 1, scratch=i % 3 == 0, zero_row=M > 1 and N == 33))
                i += 1
        # fused projections: Q, K, V kept as separate tensors (SmolLM2-135M's 576/192/192; a third
        # of that for the plain float types, whose weights are 2-8x larger)
        qkv = [576, 192, 192] if tname not in ("f32", "f16") else [192, 64, 64]
        cases.append(one(tname, 1, 576, qkv, True, False, suffix="_qkv"))
        cases.append(one(tname, 3, 576, qkv, True, True, suffix="_qkv"))
        cases.append(one(tname, 17, 576, qkv, False, True, suffix="_qkv"))
        cases.append(one(tname, 3, 96, [7, 1, 25], True, False, suffix="_segs3"))
        if tname in ("f32", "f16"):          # no block structure: K need not be a multiple of 32
            cases.append(one(tname, 3, 45, [7], True, False))
            cases.append(one(tname, 1, 5, [33], False, True))
        # el_matmul_f32act: block and tile tails, a zero x row, segments, a GEMV of the lm_head's
        # width (576) over 260 rows (several tasks on a 2-thread pool; the real head's 49152 rows
        # would make the file too large to push to a phone), K = 1536
        cases.append(f32act(tname, 1, 32, [7], True))
        cases.append(f32act(tname, 3, 576, [33], False, zero_row=True))
        if tname not in ("f32", "f16"):      # el_matmul's own kernels: covered above
            cases.append(f32act(tname, 17, 96, [7, 1, 25], True))
            cases.append(f32act(tname, 1, 576, [260], False))
            cases.append(f32act(tname, 2, 1536, [33], True))
    return cases


def _elementwise_cases(rng: np.random.Generator) -> list[Case]:
    from .backends import reference

    cases = []
    for T, d, eps in ((1, 576, 1e-5), (3, 7, 1e-6), (17, 960, 1e-5), (2, 33, 1e-6), (4, 1, 1e-5)):
        x = _f32(rng.standard_normal((T, d)))
        x[0] *= 1e3
        if T > 2:
            x[2] = 0.0                               # only eps keeps 1/rms finite
        w = _f32(rng.standard_normal(d))
        cases.append(Case(OP_RMSNORM, f"rmsnorm/t{T}_d{d}", BOUND_ELEMENTWISE, (T, d), (eps,),
                          (x, w, _f32(reference.rmsnorm(x, w, eps)))))
    for neox in (0, 1):
        style = "neox" if neox else "norm"
        for T, heads, hd, rd, inplace in ((1, 9, 64, 64, 0), (5, 3, 64, 32, 0), (17, 2, 128, 128, 1),
                                          (3, 1, 6, 4, 0), (2, 4, 80, 64, 1)):
            x = _f32(rng.standard_normal((T, heads, hd)))
            pos = rng.integers(0, 4096) + np.arange(T)
            ang = pos[:, None].astype(np.float64) * 10000.0 ** (-np.arange(0, rd, 2) / rd)[None, :]
            cos, sin = _f32(np.cos(ang)), _f32(np.sin(ang))
            cases.append(Case(OP_ROPE, f"rope/{style}/t{T}_h{heads}_hd{hd}_rd{rd}" + ("_inplace" if inplace else ""),
                              BOUND_ELEMENTWISE, (T, heads, hd, rd, neox, inplace), (),
                              (x, cos, sin, _f32(reference.rope(x, cos, sin, style)))))
    for T, ff, scale in ((1, 1536, 1.0), (3, 7, 1.0), (17, 33, 3.0), (2, 64, 90.0)):
        gu = _f32(rng.standard_normal((T, 2 * ff)) * scale)   # scale 90: exp(-g) overflows fp32
        with np.errstate(over="ignore"):
            want = reference.swiglu(gu.copy())
        cases.append(Case(OP_SWIGLU, f"swiglu/t{T}_ff{ff}" + ("_large" if scale > 10 else ""), BOUND_ELEMENTWISE,
                          (T, ff), (), (gu, _f32(want))))
    for rows, n, scale, masked in ((1, 49152, 5.0, False), (3, 7, 1.0, False), (17, 33, 50.0, False),
                                   (2, 1, 1.0, False), (4, 100, 10.0, True)):
        x = _f32(rng.standard_normal((rows, n)) * scale)
        if masked:
            x[:, ::3] = -np.inf                     # masked logits (banned tokens): probability 0
        # reference.py has no softmax (the model never needs one outside attention): float64 here
        x64 = x.astype(np.float64)
        e = np.exp(x64 - x64.max(axis=1, keepdims=True))
        cases.append(Case(OP_SOFTMAX, f"softmax/r{rows}_n{n}" + ("_masked" if masked else ""), BOUND_ELEMENTWISE,
                          (rows, n), (), (x, _f32(e / e.sum(axis=1, keepdims=True)))))
    for n in (1, 7, 33, 16323):
        a, b = _f32(rng.standard_normal(n)), _f32(rng.standard_normal(n))
        cases.append(Case(OP_ADD, f"add/n{n}", BOUND_ELEMENTWISE, (n,), (), (a, b, _f32(reference.add(a, b)))))
    return cases


def _attention_cases(rng: np.random.Generator) -> list[Case]:
    from .backends import reference

    cases = []
    # (T, H, KVH, hd, start): decode, prefill from 0, a chunk after a cached prefix, one head
    for T, H, KVH, hd, start in ((1, 9, 3, 64, 40), (7, 9, 3, 64, 0), (5, 4, 4, 32, 11), (1, 1, 1, 64, 0),
                                 (17, 2, 1, 128, 30), (3, 6, 2, 80, 5), (33, 4, 2, 64, 100)):
        n = start + T
        q = _f32(rng.standard_normal((T, H, hd)) * 2.0)
        k = _f32(rng.standard_normal((KVH, n, hd)))
        v = _f32(rng.standard_normal((KVH, n, hd)))
        cases.append(Case(OP_ATTN_DENSE, f"attn_dense/t{T}_h{H}_kvh{KVH}_hd{hd}_s{start}", BOUND_ATTENTION,
                          (T, H, KVH, hd, start), (), (q, k, v, _f32(reference.attention(q, k, v, start)))))
    # (T, H, KVH, hd, start, block_tokens, n_layers, layer)
    for kv_type, dt in ((EL_F16, np.float16), (EL_F32, np.float32)):
        kvname = "f16" if kv_type == EL_F16 else "f32"
        for T, H, KVH, hd, start, bt, L, layer in ((1, 9, 3, 64, 45, 16, 3, 2), (7, 9, 3, 64, 20, 16, 3, 0),
                                                   (1, 1, 1, 64, 0, 16, 2, 1), (17, 4, 2, 128, 31, 8, 2, 1),
                                                   (3, 2, 2, 32, 4, 1, 1, 0)):
            n = start + T
            need = -(-n // bt)
            n_blocks = need + 3
            table = rng.permutation(n_blocks)[: need + (1 if T > 1 else 0)].astype(np.int32)
            # (blocks, layers, block_tokens, KVH, hd); NaN wherever the kernel must not read: other
            # layers, other blocks, positions >= n (the real pool leaves them uninitialised)
            shape = (n_blocks, L, bt, KVH, hd)
            karena, varena = np.full(shape, np.nan, dtype=dt), np.full(shape, np.nan, dtype=dt)
            k = rng.standard_normal((n, KVH, hd)).astype(dt)
            v = rng.standard_normal((n, KVH, hd)).astype(dt)
            for p in range(n):
                karena[table[p // bt], layer, p % bt] = k[p]
                varena[table[p // bt], layer, p % bt] = v[p]
            q = _f32(rng.standard_normal((T, H, hd)) * 2.0)
            want = reference.attention(q, _f32(k.transpose(1, 0, 2)), _f32(v.transpose(1, 0, 2)), start)
            name = f"attn_pool/{kvname}/t{T}_h{H}_kvh{KVH}_hd{hd}_s{start}_bt{bt}_l{layer}of{L}"
            ints = (T, H, KVH, hd, start, kv_type, bt, L, layer, n_blocks)
            cases.append(Case(OP_ATTN_POOL, name, BOUND_ATTENTION, ints, (),
                              (q, karena.view(np.uint8), varena.view(np.uint8), table, _f32(want))))
    cases += _attention_i8_cases(rng)
    return cases


def _attention_i8_cases(rng: np.random.Generator) -> list[Case]:
    """An int8 pool (EL_KV_I8): rows quantized as kv/pool.py writes them; the scales of every row
    the kernel must not read are NaN (garbage int8 values beside them), so reading one fails."""
    from .backends import reference
    from .kv.pool import quantize_int8

    cases = []
    # decode (the tile path with its key splits), a chunk after a prefix, one head, hd 80
    for T, H, KVH, hd, start, bt, L, layer in ((1, 9, 3, 64, 45, 16, 3, 2), (7, 9, 3, 64, 20, 16, 3, 0),
                                               (1, 1, 1, 64, 0, 16, 2, 1), (5, 6, 2, 80, 70, 8, 2, 1)):
        n = start + T
        need = -(-n // bt)
        n_blocks = need + 3
        table = rng.permutation(n_blocks)[:need].astype(np.int32)
        shape = (n_blocks, L, bt, KVH, hd)
        karena = rng.integers(-127, 128, shape).astype(np.int8)
        varena = rng.integers(-127, 128, shape).astype(np.int8)
        kscale, vscale = np.full(shape[:-1], np.nan, np.float32), np.full(shape[:-1], np.nan, np.float32)
        k = _f32(rng.standard_normal((n, KVH, hd)) * rng.choice([0.1, 1.0, 20.0], (n, KVH, 1)))
        v = _f32(rng.standard_normal((n, KVH, hd)))
        (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
        for p in range(n):
            b, r = table[p // bt], p % bt
            karena[b, layer, r], kscale[b, layer, r] = kq[p], ks[p]
            varena[b, layer, r], vscale[b, layer, r] = vq[p], vs[p]
        kd, vd = (_f32(a.astype(np.float32) * s_[..., None]) for a, s_ in ((kq, ks), (vq, vs)))
        q = _f32(rng.standard_normal((T, H, hd)) * 2.0)
        want = reference.attention(q, _f32(kd.transpose(1, 0, 2)), _f32(vd.transpose(1, 0, 2)), start)
        name = f"attn_pool/i8/t{T}_h{H}_kvh{KVH}_hd{hd}_s{start}_bt{bt}_l{layer}of{L}"
        ints = (T, H, KVH, hd, start, EL_KV_I8, bt, L, layer, n_blocks)
        cases.append(Case(OP_ATTN_POOL, name, BOUND_ATTENTION, ints, (),
                          (q, karena.view(np.uint8), varena.view(np.uint8), table, kscale, vscale, _f32(want))))
    return cases


def _kv_quant_cases(rng: np.random.Generator) -> list[Case]:
    """The int8 KV store (el_kv_quantize_i8) against the pool writer, bit for bit: random rows at
    several magnitudes, rounding ties, a zero row, a subnormal maximum, hd not a multiple of 8."""
    from .kv.pool import quantize_int8

    cases = []
    for rows, hd in ((6, 64), (5, 13), (3, 128)):
        x = _f32(rng.standard_normal((rows, hd)) * rng.choice([1e-3, 1.0, 1e3], (rows, 1)))
        x[0] = 0.0
        x[1] = (np.arange(hd) % 127 + 0.5) * 3.0
        x[1, 0] = 381.0                      # scale 3.0 exactly: the others are ties
        x[2] = 1e-40
        q, s = quantize_int8(x)
        cases.append(Case(OP_KV_QUANT, f"kv_quant/rows{rows}_hd{hd}", BOUND_EXACT, (rows, hd), (),
                          (x, _f32(np.concatenate([q.reshape(-1).astype(np.float32), s])))))
    return cases


def _sample_cases(rng: np.random.Generator) -> list[Case]:
    """The sampler chain (el_sample): each u is the middle of one candidate's slice of the
    cumulative weights, computed in float64 from the chain's definition (reference.sample_chain),
    so any correct draw picks that candidate whatever its exp rounds to; sampling.draw_numpy must
    agree. Ties at the top-k boundary (keep the lower ids), -inf logits, a real-size vocabulary,
    two chains without top-k."""
    from .backends import reference
    from .sampling import SamplingConfig, draw_numpy

    cases = []
    # (n, logits, top_k, top_p, min_p, temperature): parameters exact in float32 (the file's)
    for n, kind, k, top_p, min_p, temp in ((5000, "normal", 40, 0.9375, 0.0625, 0.75), (1000, "ties", 7, 1.0, 0.0, 1.5),
                                           (49152, "normal", 40, 0.9375, 0.046875, 0.8125),
                                           (33, "neg_inf", 32, 0.9375, 0.0, 2.0), (2, "normal", 1, 1.0, 0.0, 1.0),
                                           # no top-k: every logit weighed (vectorized exp), the
                                           # nucleus cut by buckets, the draw walked by blocks
                                           (3000, "normal", 0, 0.875, 0.0, 1.0),
                                           (3000, "neg_inf", 0, 1.0, 0.03125, 0.6875)):
        x = rng.integers(-8, 9, n) / 4.0 if kind == "ties" else rng.standard_normal(n) * 3.0
        x = _f32(x)
        if kind == "neg_inf":
            x[::3] = -np.inf
        ids, c, margin = reference.sample_chain(x, k, top_p, min_p, temp)
        assert margin > 1e-4, "a top-p cut or min-p threshold too close to call"
        lo = np.concatenate([[0.0], c[:-1]])
        wide = (c - lo) > 1e-3                          # a float32 u lands well inside the slice
        u = _f32((lo + c)[wide] / 2)
        want = ids[wide]
        cfg = SamplingConfig(temperature=temp, top_k=k, top_p=top_p, min_p=min_p)
        assert [draw_numpy(cfg, x, x.max(), float(v)) for v in u] == want.tolist()
        cases.append(Case(OP_SAMPLE, f"sample/{kind}_n{n}_k{k}_p{top_p}", BOUND_EXACT, (n, k, u.size), (top_p, min_p, temp),
                          (x, u, _f32(want))))
    return cases


def _embed_cases(rng: np.random.Generator) -> list[Case]:
    from . import quant

    cases = []
    for tname, qt in (("f32", quant.T.F32), ("f16", quant.T.F16), ("q8_0", quant.T.Q8_0), ("q4_0", quant.T.Q4_0),
                      ("q4_1", quant.T.Q4_1)):
        # (T, row_len, n_rows): a decode token, a chunk with a repeated id, one block a row; rows
        # scaled far apart (tiny and large d)
        for T, d, n_rows in ((1, 64, 9), (7, 576, 40), (5, 32, 3)):
            w = rng.standard_normal((n_rows, d)) * rng.choice([1e-3, 1.0, 50.0], size=(n_rows, 1))
            raw = quant.quantize(_f32(w), qt).reshape(-1)
            ids = rng.integers(0, n_rows, T).astype(np.int32)
            if T > 2:
                ids[-1] = ids[0]
            want = quant.dequantize_rows(raw, qt, d, ids)
            cases.append(Case(OP_EMBED, f"embed/{tname}/t{T}_d{d}_rows{n_rows}", BOUND_EXACT,
                              (int(qt), T, d, n_rows), (), (raw, ids, _f32(want))))
    return cases


# The fused step against a numpy forward in fp32: its 5 matmuls a layer take int8 activations
# (each ~1e-5 NMSE against fp32 here, BOUND_MATMUL's regime), K/V go through fp16 as the pool
# stores them (the reference rounds them too). Two layers and the head compound that to ~1e-4;
# a wrong kernel anywhere in the step gives ~1 (a wrong argmax, a swapped row, a stale K).
BOUND_STEP = 2e-3


def _step_forward(layers, out_norm, head, x, cos, sin, H, KVH, hd, eps) -> np.ndarray:
    """The chunk's last-row logits by the reference ops: per layer rmsnorm, QKV, RoPE ('norm'
    pairs), K/V rounded to fp16, causal GQA attention, output projection + residual, rmsnorm,
    gate|up, SwiGLU, down + residual; then rmsnorm and the head."""
    from .backends import reference

    T = x.shape[0]
    for attn_norm, wqkv, wo, ffn_norm, wgu, wdown in layers:
        qkv = reference.matmul(reference.rmsnorm(x, attn_norm, eps), wqkv)
        q = reference.rope(qkv[:, : H * hd].reshape(T, H, hd), cos, sin, "norm")
        k = reference.rope(qkv[:, H * hd : (H + KVH) * hd].reshape(T, KVH, hd), cos, sin, "norm")
        v = qkv[:, (H + KVH) * hd :].reshape(T, KVH, hd)
        k16, v16 = (_f32(a.astype(np.float16)).transpose(1, 0, 2).copy() for a in (k, v))
        x = x + reference.matmul(reference.attention(q, k16, v16, 0), wo)
        x = x + reference.matmul(reference.swiglu(reference.matmul(reference.rmsnorm(x, ffn_norm, eps), wgu)), wdown)
    return reference.matmul(reference.rmsnorm(x[-1:], out_norm, eps), head)[0]


def _step_cases(rng: np.random.Generator) -> list[Case]:
    """The fused layer step (decode_step.c), which every prefill chunk and decode token of the
    neon unit runs: a 2-layer model with random weights, GQA 4:2, through el_chunk_logits (one
    chunk), el_chunk_step + a one-token el_chunk_logits (the decode path: GEMVs, the decode
    attention), and el_chunk_step + el_decode_greedy (the embedding lookup from an id and the
    argmax, against the reference's argmax, chosen with a wide margin)."""
    from . import quant

    L, d, H, KVH, hd, ff, n_vocab, eps = 2, 64, 4, 2, 16, 128, 96, 1e-5
    cases = []
    for mode, tname, qt, T, bt in ((STEP_CHUNK, "q4_0", quant.T.Q4_0, 40, 16), (STEP_DECODE, "q4_1", quant.T.Q4_1, 40, 16),
                                   (STEP_GREEDY, "q8_0", quant.T.Q8_0, 9, 4), (STEP_CHUNK, "q8_0", quant.T.Q8_0, 1, 4)):
        def matrix(rows: int, cols: int):
            w = _f32(rng.standard_normal((rows, cols)) / np.sqrt(cols))
            raw = quant.quantize(w, qt).reshape(-1)
            return raw, quant.dequantize(raw, qt, (rows, cols))

        arrays, layers = [], []
        for _ in range(L):
            an, fn = _f32(1.0 + 0.1 * rng.standard_normal(d)), _f32(1.0 + 0.1 * rng.standard_normal(d))
            (rq, dq), (ro, do), (rg, dg), (rd, dd) = (matrix((H + 2 * KVH) * hd, d), matrix(d, H * hd),
                                                      matrix(2 * ff, d), matrix(d, ff))
            arrays += [an, rq, ro, fn, rg, rd]
            layers.append((an, dq, do, fn, dg, dd))
        out_norm = _f32(1.0 + 0.1 * rng.standard_normal(d))
        head_raw = quant.quantize(_f32(rng.standard_normal((n_vocab, d))), quant.T.Q8_0).reshape(-1)
        head = quant.dequantize(head_raw, quant.T.Q8_0, (n_vocab, d))   # tied: also the embedding table
        inv = 10000.0 ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
        ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
        cos, sin = _f32(np.cos(ang)), _f32(np.sin(ang))
        for _ in range(100):
            ids = rng.integers(0, n_vocab, T).astype(np.int32)
            x = _f32(head[ids])
            logits = _step_forward(layers, out_norm, head, x, cos, sin, H, KVH, hd, eps)
            top2 = np.sort(logits)[-2:]
            if mode != STEP_GREEDY or top2[1] - top2[0] > 0.25 * logits.std():
                break
        want = _f32([np.argmax(logits)]) if mode == STEP_GREEDY else _f32(logits)
        name = f"step/{['chunk', 'decode', 'greedy'][mode]}/{tname}_t{T}_bt{bt}"
        cases.append(Case(OP_STEP, name, BOUND_EXACT if mode == STEP_GREEDY else BOUND_STEP,
                          (L, d, H, KVH, hd, ff, hd, 0, EL_Q4_0 if tname == "q4_0" else EL_Q4_1 if tname == "q4_1"
                           else EL_Q8_0, EL_Q8_0, n_vocab, T, bt, mode), (eps,),
                          (*arrays, out_norm, head_raw, x, cos, sin, ids, want)))
    return cases


def make_cases(seed: int = 20240531) -> list[Case]:
    """Every kernel, awkward shapes included (tails of 1, 7, 33; M = 1, 3, 17; GQA 9:3; fused
    segments; shuffled KV blocks), with expected outputs from the numpy reference."""
    rng = np.random.default_rng(seed)
    return [*_matmul_cases(rng), *_elementwise_cases(rng), *_attention_cases(rng), *_embed_cases(rng),
            *_kv_quant_cases(rng), *_sample_cases(rng), *_step_cases(rng)]


def write_cases(path: str | os.PathLike, seed: int = 20240531) -> int:
    """Write the self-test cases file; returns the number of cases."""
    cases = make_cases(seed)
    data = encode_cases(cases)
    tmp = Path(f"{path}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return len(cases)
