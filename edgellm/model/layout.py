"""Where a llama-family layer's weights live in a GGUF file: the one table every backend's
prepare() and the requantizer read, instead of each spelling out the tensor names.

A projection op is a stack of row segments along its output (QKV: Q, K, V; gate/up: gate, up),
each a separate GGUF tensor of shape (rows, k)."""
from __future__ import annotations

import numpy as np

from .. import quant
from .config import ModelConfig

# projection op -> the GGUF tensor stems of its row segments, in output order
SEGMENTS = {"qkv": ("attn_q", "attn_k", "attn_v"), "attn_out": ("attn_output",),
            "ffn_gate_up": ("ffn_gate", "ffn_up"), "ffn_down": ("ffn_down",)}


def projection(cfg: ModelConfig, layer: int, op: str) -> tuple[tuple[tuple[str, int], ...], int]:
    """((tensor name, rows) per segment, k) of a layer's projection op."""
    d, ff = cfg.d_model, cfg.d_ff
    rows = {"attn_q": cfg.q_dim, "attn_k": cfg.kv_dim, "attn_v": cfg.kv_dim, "attn_output": d,
            "ffn_gate": ff, "ffn_up": ff, "ffn_down": d}
    k = {"qkv": d, "attn_out": cfg.q_dim, "ffn_gate_up": d, "ffn_down": ff}[op]
    return tuple((f"blk.{layer}.{s}.weight", rows[s]) for s in SEGMENTS[op]), k


def head_tensor(cfg: ModelConfig) -> str:
    """The output head's matrix: the token embedding when the model ties them."""
    return "token_embd.weight" if cfg.tied_embeddings else "output.weight"


def qkv_bias(model, layer: int) -> np.ndarray | None:
    """The layer's Q|K|V bias as one fp32 vector (q_dim + 2 kv_dim,), or None (no bias)."""
    cfg = model.config
    if not cfg.qkv_bias:
        return None
    p = f"blk.{layer}."
    return np.concatenate([quant.dequantize(model.raw(p + s + ".bias"), model.tensor_type(p + s + ".bias"), (n,))
                           for s, n in (("attn_q", cfg.q_dim), ("attn_k", cfg.kv_dim), ("attn_v", cfg.kv_dim))])
