"""The numpy backend: ground truth for every other backend's ops, and the first runnable unit.

Ops work on float32 and accumulate in float32 (BLAS sgemm) or wider. Shapes use T = tokens in
the chunk, n = tokens in the KV cache so far (past + chunk), H / KVH = query / key-value heads,
hd = head_dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import quant
from ..errors import ModelFormatError
from ..model import layout
from ..model.config import ModelConfig

NAME = "reference"
KIND = "cpu"


def available() -> tuple[bool, str]:
    return True, "numpy runs everywhere"


def supports(op: str, precision: str = "fp32") -> tuple[bool, str]:
    if op not in _OP_FUNCS:
        return False, f"op {op!r} is not implemented by the reference backend"
    return True, "reference implements every op in fp32"


# ---- ops -------------------------------------------------------------------------------------

def embedding(table: "EmbeddingTable", ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """ids (T,) -> (T, d) float32; dequantizes only the looked-up rows (into `out` when given)."""
    return quant.dequantize_rows(table.raw, table.qtype, table.d_model, ids, out=out)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x (T, d) -> x / sqrt(mean(x^2) + eps) * w."""
    ms = np.einsum("td,td->t", x, x, dtype=np.float32) / np.float32(x.shape[1])
    return x * (1.0 / np.sqrt(ms + np.float32(eps)))[:, None] * w


def matmul(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """x (T, in) @ w (out, in)^T [+ b (out,)] -> (T, out). w keeps GGUF's row-major (out, in)."""
    y = x @ w.T
    if b is not None:
        y += b
    return y


def rope_tables(cfg: ModelConfig, n_ctx: int, freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables (n_ctx, rope_dim/2): angle(p, i) = p * theta^(-2i/rope_dim) [/ factor_i]."""
    return rope_rows(cfg, np.arange(n_ctx), freq_factors)


def rope_rows(cfg: ModelConfig, positions: np.ndarray, freq_factors: np.ndarray | None = None,
              rotation_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (len(positions), rope_dim/2) of any positions: the rows rope_tables would hold
    for them, bit for bit (a ring buffer's positions run past any table). rotation_only: without
    YaRN's magnitude factor (rotating keys already stored on by a number of positions)."""
    inv = cfg.rope_theta ** (-np.arange(0, cfg.rope_dim, 2, dtype=np.float64) / cfg.rope_dim)
    if freq_factors is not None:
        inv = inv / freq_factors.astype(np.float64)
    pos = np.asarray(positions, dtype=np.float64)
    yarn = getattr(cfg, "rope_yarn", None)
    m = 1.0 if rotation_only else getattr(cfg, "rope_attn_factor", 1.0)   # (rope.scaling.attn_factor)
    if yarn is None:
        ang = (pos * cfg.rope_freq_scale)[:, None] * inv[None, :]
    else:
        s = cfg.rope_freq_scale
        low, high = _yarn_corr_dims(cfg.rope_dim, yarn.n_ctx_orig, cfg.rope_theta, yarn.beta_fast, yarn.beta_slow)
        i = np.arange(cfg.rope_dim // 2, dtype=np.float64)
        ramp = (1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)) * yarn.ext_factor
        ang = pos[:, None] * (inv * (s * (1.0 - ramp) + ramp))[None, :]
        # ggml's 1 + 0.1 ln(1 / s), which llama_context cancels for a factor 1 / s below 1 (its
        # get_mscale is 1 there): the magnitude is 1 + 0.1 ln(factor) above 1, else 1
        if not rotation_only:
            m *= yarn.attn_factor * ((1.0 + 0.1 * np.log(1.0 / s)) if yarn.ext_factor and s < 1.0 else 1.0)
    # (times 1.0 for a plain rotation: exact, the tables' bits are unchanged)
    return (np.cos(ang) * m).astype(np.float32), (np.sin(ang) * m).astype(np.float32)


def _yarn_corr_dims(n_dims: int, n_ctx_orig: int, base: float, beta_fast: float, beta_slow: float
                    ) -> tuple[float, float]:
    """The pair indices where YaRN's ramp starts and ends: the dims whose wavelength turns
    beta_fast and beta_slow times over the original context (ggml_rope_yarn_corr_dims)."""
    def dim(n_rot: float) -> float:
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))
    return max(0.0, math.floor(dim(beta_fast))), min(n_dims - 1.0, math.ceil(dim(beta_slow)))


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """x (T, heads, hd), cos/sin (T, rope_dim/2) for the chunk's positions -> rotated copy.
    style "norm" rotates adjacent pairs (2i, 2i+1); "neox" rotates (i, i + rope_dim/2)."""
    half = cos.shape[1]
    out = x.copy()
    c, s = cos[:, None, :], sin[:, None, :]
    if style == "norm":
        x0, x1 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        out[..., 0 : 2 * half : 2] = x0 * c - x1 * s
        out[..., 1 : 2 * half : 2] = x0 * s + x1 * c
    else:
        x0, x1 = x[..., :half], x[..., half : 2 * half]
        out[..., :half] = x0 * c - x1 * s
        out[..., half : 2 * half] = x0 * s + x1 * c
    return out


# Query rows per block of causal attention: each block only scores the keys it can see, which
# skips most of the masked triangle in a long prefill while keeping GEMMs large enough for BLAS.
ATTN_Q_BLOCK = 128


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Causal GQA attention of a chunk against the cache.
    q (T, H, hd) at positions start..start+T-1; k, v (KVH, n, hd) hold positions 0..n-1 with
    n = start + T. Query head h reads kv head h // (H / KVH), as llama.cpp groups them.
    Returns (T, H * hd)."""
    T, H, hd = q.shape
    kvh = k.shape[0]
    g = H // kvh
    # scale folded into q: T*H*hd multiplies instead of one per score
    qh = (q * np.float32(1.0 / np.sqrt(hd))).transpose(1, 0, 2).reshape(kvh, g, T, hd)
    out = np.empty((kvh, g, T, hd), dtype=np.float32)
    for b0 in range(0, T, ATTN_Q_BLOCK):
        b1 = min(T, b0 + ATTN_Q_BLOCK)
        n = start + b1                                           # keys visible to the block's last row
        qb = qh[:, :, b0:b1].reshape(kvh, g * (b1 - b0), hd)
        s = qb @ k[:, :n].transpose(0, 2, 1)                     # (KVH, G*rows, n)
        s = s.reshape(kvh, g, b1 - b0, n)
        if b1 - b0 > 1:
            # key j is visible to query t iff j <= start + t: the last rows - 1 columns form a triangle
            s[..., start + b0 + 1 :] += _causal_bias(b1 - b0)
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        denom = s.sum(axis=-1, keepdims=True)                    # (KVH, G, rows, 1)
        if b1 - b0 > 1 and not np.isfinite(v[:, start + b0 + 1 : n]).all():
            # a key a row does not see has probability 0 there, but 0 * inf is NaN: with a
            # non-finite V row among the masked ones (an fp16 store that overflowed), each row
            # sums only the keys it sees
            sr, pv = s.reshape(kvh, g, b1 - b0, n), np.empty((kvh, g, b1 - b0, hd), np.float32)
            for r in range(b1 - b0):
                pv[:, :, r] = sr[:, :, r, : start + b0 + r + 1] @ v[:, : start + b0 + r + 1]
        else:
            pv = s.reshape(kvh, g * (b1 - b0), n) @ v[:, :n]      # (KVH, G*rows, hd)
        # normalise the (rows, hd) result rather than the (rows, n) probabilities
        out[:, :, b0:b1] = pv.reshape(kvh, g, b1 - b0, hd) / denom
    return out.reshape(H, T, hd).transpose(1, 0, 2).reshape(T, H * hd)


_BIAS_CACHE: dict[int, np.ndarray] = {}


def _causal_bias(rows: int) -> np.ndarray:
    """(rows, rows - 1) additive mask: row t may see the first t of the last rows - 1 key columns."""
    bias = _BIAS_CACHE.get(rows)
    if bias is None:
        bias = np.where(np.arange(rows - 1)[None, :] < np.arange(rows)[:, None], 0.0, -np.inf).astype(np.float32)
        _BIAS_CACHE[rows] = bias
    return bias


def swiglu(gate_up: np.ndarray) -> np.ndarray:
    """gate_up (T, 2*ff) = [gate | up] -> silu(gate) * up, (T, ff)."""
    ff = gate_up.shape[1] // 2
    g, u = gate_up[:, :ff], gate_up[:, ff:]
    out = np.negative(g)            # in place from here: one temporary instead of four
    np.exp(out, out=out)
    out += 1.0
    np.divide(g, out, out=out)
    out *= u
    return out


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a + b


def sample_chain(x: np.ndarray, top_k: int, top_p: float, min_p: float,
                 temperature: float) -> tuple[np.ndarray, np.ndarray, float]:
    """The sampler chain (sampling.py's numpy chain, neon/sample.c's el_sample) from its
    definition, in float64: (the final candidates in id order, their cumulative weights
    normalized to end at 1, margin). A uniform u draws ids[first i with cum[i] > u]. margin:
    how close (relative to the mass, or in logits for min-p) a top-p cut or the min-p threshold
    came to deciding differently; rounding may decide within it. Candidates rank by (logit
    descending, id ascending); top-k 0 (or >= the vocabulary) keeps all."""
    x64 = np.asarray(x, dtype=np.float64)
    m = float(x64.max())
    ids = np.lexsort((np.arange(x64.size), -x64))
    if 0 < top_k < x64.size:
        ids = ids[:top_k]
    margin = np.inf
    if top_p < 1.0:
        e = np.exp(x64[ids] - m)
        c = np.cumsum(e) / e.sum()
        margin = min(margin, float(np.min(np.abs(c - top_p))))
        ids = ids[: min(int(np.searchsorted(c, top_p, side="left")) + 1, ids.size)]
    if min_p > 0.0:
        thr = m + np.log(min_p)
        margin = min(margin, float(np.min(np.abs(x64[ids] - thr))))
        ids = ids[x64[ids] >= thr]
    ids = np.sort(ids)
    cum = np.cumsum(np.exp((x64[ids] - m) / temperature))
    return ids, cum / cum[-1], margin


def lm_head(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (T, d) final-normed -> logits (T, vocab)."""
    return x @ w.T


# ---- resident weights ------------------------------------------------------------------------

@dataclass(frozen=True)
class EmbeddingTable:
    raw: np.ndarray            # memory-mapped file bytes of token_embd, kept in its GGUF type
    qtype: object              # GGMLQuantizationType
    d_model: int


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: np.ndarray      # (d,)
    wqkv: np.ndarray           # (q_dim + 2*kv_dim, d): Q, K, V stacked so one GEMM projects all three
    bqkv: np.ndarray | None    # (q_dim + 2*kv_dim,) or None
    wo: np.ndarray             # (d, q_dim)
    ffn_norm: np.ndarray       # (d,)
    w_gate_up: np.ndarray      # (2*d_ff, d): gate then up, one GEMM
    w_down: np.ndarray         # (d, d_ff)


@dataclass(frozen=True)
class PreparedWeights:
    embedding: EmbeddingTable
    layers: tuple[LayerWeights, ...]
    output_norm: np.ndarray    # (d,)
    lm_head: np.ndarray        # (vocab, d) fp32
    rope_freqs: np.ndarray | None


def prepared_nbytes(cfg: ModelConfig, ops: set[str] | None = None) -> int:
    """Resident bytes prepare() allocates for `ops` (None: all): fp32 matrices and norms; the
    embedding stays mapped."""
    d = cfg.d_model
    per_op = {"qkv": d * (cfg.q_dim + 2 * cfg.kv_dim), "attn_out": d * cfg.q_dim, "ffn_gate_up": 2 * d * cfg.d_ff,
              "ffn_down": d * cfg.d_ff}
    n = cfg.n_layers * (2 * d + sum(v for k, v in per_op.items() if ops is None or k in ops)) + d
    if ops is None or "lm_head" in ops:
        n += cfg.vocab_size * d
    return 4 * n


def prepare_rope_freqs(model) -> np.ndarray | None:
    """Llama 3.x per-frequency divisors (rope_dim/2,), or None: shared by every unit's RoPE."""
    cfg = model.config
    if not cfg.has_rope_freqs:
        return None
    f = quant.dequantize(model.raw("rope_freqs.weight"), model.tensor_type("rope_freqs.weight"), (cfg.rope_dim // 2,))
    # each frequency is divided by its value: a zero, negative, NaN or inf divisor made every
    # RoPE angle, and so every logit, NaN (or silently wrong), with no word about the tensor
    bad = ~(np.isfinite(f) & (f > 0))
    if bad.any():
        i = int(np.argmax(bad))
        raise ModelFormatError(getattr(model, "path", "<model>"), "tensor 'rope_freqs.weight'",
                               f"expected finite per-frequency divisors > 0, found {float(f[i])!r} at index {i} "
                               f"({int(bad.sum())} of {f.size} values bad)")
    return f


def prepare(model, precision: str = "fp32", progress=None, ops: set[str] | None = None) -> PreparedWeights:
    """Dequantize every matrix to fp32 once, at load, and fuse QKV and gate/up.
    fp32 because numpy's only fast GEMM is sgemm; the cost is stated by prepared_nbytes().
    ops: the op names this unit runs (None: all); matrices of ops it does not run are left out
    (None), so a unit that only takes the norms costs no fp32 copy of the model."""
    cfg: ModelConfig = model.config
    need = (lambda op: True) if ops is None else (lambda op: op in ops)

    def f32(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return quant.dequantize(model.raw(name), model.tensor_type(name), shape)

    def fused(*parts: tuple[str, int], cols: int) -> np.ndarray:
        """Dequantize several (out_i, cols) matrices into one stacked (sum out_i, cols) buffer."""
        buf = np.empty((sum(r for _, r in parts), cols), dtype=np.float32)
        row = 0
        for name, rows in parts:
            quant.dequantize(model.raw(name), model.tensor_type(name), (rows, cols), out=buf[row : row + rows])
            row += rows
        return buf

    def mat(i: int, op: str) -> np.ndarray | None:
        parts, k = layout.projection(cfg, i, op)
        return fused(*parts, cols=k) if need(op) else None

    d = cfg.d_model
    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=f32(p + "attn_norm.weight", (d,)), wqkv=mat(i, "qkv"), bqkv=layout.qkv_bias(model, i),
            wo=mat(i, "attn_out"), ffn_norm=f32(p + "ffn_norm.weight", (d,)),
            w_gate_up=mat(i, "ffn_gate_up"), w_down=mat(i, "ffn_down")))
        if progress:
            progress(i + 1, cfg.n_layers + 1)
    lm = f32(layout.head_tensor(cfg), (cfg.vocab_size, d)) if need("lm_head") else None
    if progress:
        progress(cfg.n_layers + 1, cfg.n_layers + 1)
    return PreparedWeights(
        embedding=EmbeddingTable(model.raw("token_embd.weight"), model.tensor_type("token_embd.weight"), d),
        layers=tuple(layers), output_norm=f32("output_norm.weight", (d,)), lm_head=lm,
        rope_freqs=prepare_rope_freqs(model),
    )


_OP_FUNCS = {"embedding": embedding, "rmsnorm": rmsnorm, "matmul": matmul, "rope": rope,
             "attention": attention, "swiglu": swiglu, "add": add, "lm_head": lm_head}


def run(op: str, *inputs):
    """Execute one op by name (the backend interface's generic entry point)."""
    return _OP_FUNCS[op](*inputs)
