"""ModelConfig: the hyperparameters of a Llama-family GGUF, validated against its tensors.

Covers RELIABILITY.md items 13-14: metadata of the wrong type, lengths inconsistent with the
vocabulary or the layer count, hyperparameters inconsistent with tensor shapes, missing tensors.
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import ModelFormatError, UnsupportedModelError
from .ggml_types import GGMLQuantizationType as T
from .gguf_file import describe_value
from .gguf_strings import GGUFStrings
from ..quant import CONVERTIBLE_TYPES, SUPPORTED_TYPES

log = logging.getLogger("edgellm")

# Llama-family architectures and how they differ from plain llama.
#   rope_style "norm": rotate adjacent pairs (x0,x1),(x2,x3)... (llama.cpp's LLAMA_ROPE_TYPE_NORM;
#   the GGUF converter permuted Q/K so this matches HF's rotate_half); "neox": rotate (x_i, x_i+d/2).
ARCHITECTURES = {
    "llama": dict(rope_style="norm", qkv_bias=False),
    "qwen2": dict(rope_style="neox", qkv_bias=True),
}

MAX_LAYERS = 1024
MAX_DIM = 1 << 20


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling as llama.cpp's ggml computes it (ggml_rope_yarn_corr_dims, rope_yarn):
    pair i's angle is p theta_i (s (1 - r_i) + r_i), s = rope_freq_scale, r_i a ramp that is 1
    (extrapolate: the trained frequency) below the correction dims and 0 (interpolate) above;
    cos and sin are multiplied by attn_factor (1 + 0.1 ln(1 / s)) when ext_factor is not 0 and
    1 / s > 1 (llama_context cancels the log term of a factor below 1). llama.cpp reads no
    rope.scaling.yarn_* key for llama or qwen2 (only for a few other architectures): these
    fields keep its defaults (see _yarn)."""
    n_ctx_orig: int           # rope.scaling.original_context_length (default: the trained context)
    ext_factor: float = 1.0   # rope.scaling.yarn_ext_factor: the ramp's weight
    attn_factor: float = 1.0  # rope.scaling.yarn_attn_factor
    beta_fast: float = 32.0   # rope.scaling.yarn_beta_fast: rotations where the ramp starts
    beta_slow: float = 1.0    # rope.scaling.yarn_beta_slow: and where it ends


@dataclass(frozen=True)
class ModelConfig:
    arch: str                 # GGUF general.architecture
    name: str                 # general.name, for display
    n_layers: int             # transformer blocks
    d_model: int              # residual stream width
    n_heads: int              # query heads
    n_kv_heads: int           # key/value heads (GQA when < n_heads)
    head_dim: int             # per-head width of Q and K/V
    d_ff: int                 # FFN hidden width (gate/up output)
    vocab_size: int           # rows of the embedding table
    context_length: int       # trained context, in tokens
    rope_theta: float         # RoPE frequency base
    rope_dim: int             # leading dims of each head that RoPE rotates
    rope_style: str           # "norm" | "neox", see ARCHITECTURES
    norm_eps: float           # RMSNorm epsilon
    tied_embeddings: bool     # lm_head reuses token_embd (no output.weight)
    qkv_bias: bool            # Q/K/V projections carry a bias
    has_rope_freqs: bool      # a rope_freqs.weight tensor divides the frequencies (Llama 3.x)
    rope_freq_scale: float = 1.0  # linear RoPE scaling: positions times this (1 / the GGUF's factor)
    rope_yarn: Yarn | None = None   # YaRN scaling (rope.scaling.type yarn): its parameters
    rope_attn_factor: float = 1.0   # rope.scaling.attn_factor: cos and sin times this, any scaling type

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def _get(meta: Mapping[str, Any], path: str, key: str, kind: type, *, default: Any = None, required: bool = True):
    if key not in meta:
        if required:
            raise ModelFormatError(path, key, "required key is missing")
        return default
    v = meta[key]
    ok = (isinstance(v, kind) and not isinstance(v, bool)) if kind in (int, float) else isinstance(v, kind)
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        ok, v = True, float(v)
    if not ok:
        raise ModelFormatError(path, key, f"expected a {kind.__name__}, found {type(v).__name__} {str(v)[:40]!r}")
    return v


def _positive(path: str, key: str, v: int, cap: int) -> int:
    if not 0 < v <= cap:
        raise ModelFormatError(path, key, f"expected 1..{cap}, found {v}")
    return v


def _is_string_array(value: Any) -> bool:
    """An array of strings as the parser gives it (GGUFStrings), or a list of str (tests)."""
    if isinstance(value, GGUFStrings):
        return True
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


def expected_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> GGUF shape (ne order: row length first) that the forward pass needs."""
    d, v = cfg.d_model, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (d, v), "output_norm.weight": (d,)}
    if not cfg.tied_embeddings:
        shapes["output.weight"] = (d, v)
    if cfg.has_rope_freqs:
        shapes["rope_freqs.weight"] = (cfg.rope_dim // 2,)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": (d,),
            p + "attn_q.weight": (d, cfg.q_dim),
            p + "attn_k.weight": (d, cfg.kv_dim),
            p + "attn_v.weight": (d, cfg.kv_dim),
            p + "attn_output.weight": (cfg.q_dim, d),
            p + "ffn_norm.weight": (d,),
            p + "ffn_gate.weight": (d, cfg.d_ff),
            p + "ffn_up.weight": (d, cfg.d_ff),
            p + "ffn_down.weight": (cfg.d_ff, d),
        })
        if cfg.qkv_bias:
            shapes.update({p + "attn_q.bias": (cfg.q_dim,), p + "attn_k.bias": (cfg.kv_dim,), p + "attn_v.bias": (cfg.kv_dim,)})
    return shapes


# Tensors a Llama-family GGUF may carry that the forward pass does not read.
_IGNORED = re.compile(r"^blk\.\d+\.attn_rot_embd")


def _rope_freq_scale(path: str, meta: Mapping[str, Any], a: str, ctx: int) -> tuple[float, Yarn | None]:
    """(positions times this, YaRN's parameters or None): RoPE scaling as llama.cpp reads it, the
    factor from rope.scaling.factor or the older rope.scale_linear, the type linear when absent. A
    file with a factor was run unscaled, without a word (a helper measured top-1 15.6% against
    llama.cpp at factor 4); other types (longrope) are refused."""
    key = next((k for k in (a + "rope.scaling.factor", a + "rope.scale_linear") if k in meta), None)
    factor = 0.0 if key is None else meta[key]
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor >= 0):
        raise ModelFormatError(path, key, f"expected a non-negative scaling factor, found {factor!r}")
    if factor and not math.isfinite(1.0 / factor):
        # a subnormal factor (5e-324 as f64) passes the check above, but positions times an
        # infinite 1 / factor make every RoPE angle, and so every logit, NaN
        raise ModelFormatError(path, key, f"expected a scaling factor whose inverse is finite, found {factor!r}")
    scaling = meta.get(a + "rope.scaling.type")
    if scaling is not None and not isinstance(scaling, str):
        raise ModelFormatError(path, a + "rope.scaling.type", f"expected a string, found {describe_value(scaling)}")
    if scaling in (None, "linear"):
        return (1.0 / factor if factor else 1.0), None       # (llama.cpp: a factor of 0 means none)
    if scaling == "none":
        if factor not in (0, 1):
            raise UnsupportedModelError(path, a + "rope.scaling.type", f"type 'none' beside a scaling factor {factor}")
        return 1.0, None
    if scaling == "yarn":
        return (1.0 / factor if factor else 1.0), _yarn(path, meta, a, ctx)
    raise UnsupportedModelError(path, a + "rope.scaling.type", f"RoPE scaling {scaling!r} is not supported yet")


def _yarn(path: str, meta: Mapping[str, Any], a: str, ctx: int) -> Yarn:
    """llama.cpp reads the rope.scaling.yarn_{ext,attn}_factor / yarn_beta_{fast,slow} keys only for
    a few architectures (grok, laguna, ...), not llama or qwen2: for these it runs its defaults
    whatever the file says (convert_hf_to_gguf writes the keys from any HF rope config that has
    them). So does edgellm, with a warning where a value differs (reading them made logits
    differ from llama.cpp's: centred NMSE up to 0.4 on tiny models); their checks stay."""
    k = a + "rope.scaling."
    if k + "yarn_log_multiplier" in meta:    # (DeepSeek's attention temperature: not a llama's)
        raise UnsupportedModelError(path, k + "yarn_log_multiplier", "YaRN's log multiplier is not supported")
    orig = _positive(path, k + "original_context_length",
                     _get(meta, path, k + "original_context_length", int, default=ctx, required=False), 1 << 24)
    ignored = []
    for name, default in (("ext_factor", 1.0), ("attn_factor", 1.0), ("beta_fast", 32.0), ("beta_slow", 1.0)):
        v = _get(meta, path, k + "yarn_" + name, float, default=default, required=False)
        if not (math.isfinite(v) and v >= 0):
            raise ModelFormatError(path, k + "yarn_" + name, f"expected a finite value >= 0, found {v}")
        if v != default:
            ignored.append(f"yarn_{name} {v:g} (runs as {default:g})")
    if ignored:
        log.warning("%s: %s: %s ignored, as llama.cpp ignores them for %s", path, k.rstrip("."),
                    ", ".join(ignored), a.rstrip("."))
    return Yarn(orig)


# a mixture-of-experts FFN's tensors (Mixtral-style llama files): router and stacked experts
# (ffn_gate.E.weight: llama.cpp's older per-expert names)
_EXPERT_TENSOR = re.compile(r"^blk\.\d+\.ffn_(gate_inp|(gate|up|down)_exps|(gate|up|down)\.\d+)\.")


def _refuse_experts(path: str, meta: Mapping[str, Any], tensors: Mapping[str, Any], a: str) -> None:
    """A mixture-of-experts file (llama.expert_count > 0, or expert tensors) is a well-formed
    model edgellm cannot run: refused here, before the tensor checks, which reported its missing
    dense FFN tensors as a malformed file."""
    n = _get(meta, path, a + "expert_count", int, default=0, required=False)
    if n < 0:
        raise ModelFormatError(path, a + "expert_count", f"expected a count >= 0, found {n}")
    if n > 0:
        used = meta.get(a + "expert_used_count")
        raise UnsupportedModelError(path, a + "expert_count",
                                    f"mixture of experts ({n} experts"
                                    + (f", {used} used per token" if isinstance(used, int) else "")
                                    + ") is not supported; edgellm runs dense FFNs only")
    name = next((t for t in tensors if _EXPERT_TENSOR.match(t)), None)
    if name is not None:
        raise UnsupportedModelError(path, f"tensor {name!r}",
                                    "a mixture-of-experts tensor; mixture of experts is not supported")


def config_from_gguf(path: str, meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> ModelConfig:
    """Build and validate the config; `tensors` maps name -> object with .shape (ne order) and .ggml_type."""
    arch = _get(meta, path, "general.architecture", str)
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(path, "general.architecture",
                                    f"{arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    a = f"{arch}."
    _refuse_experts(path, meta, tensors, a)
    n_layers = _positive(path, a + "block_count", _get(meta, path, a + "block_count", int), MAX_LAYERS)
    d_model = _positive(path, a + "embedding_length", _get(meta, path, a + "embedding_length", int), MAX_DIM)
    d_ff = _positive(path, a + "feed_forward_length", _get(meta, path, a + "feed_forward_length", int), MAX_DIM)
    n_heads = _positive(path, a + "attention.head_count", _get(meta, path, a + "attention.head_count", int), 4096)
    n_kv = _get(meta, path, a + "attention.head_count_kv", int, default=n_heads, required=False)
    _positive(path, a + "attention.head_count_kv", n_kv, n_heads)
    if n_heads % n_kv:
        raise ModelFormatError(path, a + "attention.head_count_kv",
                               f"head_count {n_heads} is not a multiple of head_count_kv {n_kv}")
    head_dim = _get(meta, path, a + "attention.key_length", int, default=None, required=False)
    if head_dim is None:
        if d_model % n_heads:
            raise ModelFormatError(path, a + "attention.head_count",
                                   f"embedding_length {d_model} is not divisible by head_count {n_heads}")
        head_dim = d_model // n_heads
    _positive(path, a + "attention.key_length", head_dim, 4096)
    v_len = _get(meta, path, a + "attention.value_length", int, default=head_dim, required=False)
    if v_len != head_dim:
        raise UnsupportedModelError(path, a + "attention.value_length",
                                    f"value_length {v_len} != key_length {head_dim} is not supported")
    ctx = _positive(path, a + "context_length", _get(meta, path, a + "context_length", int), 1 << 24)
    theta = _get(meta, path, a + "rope.freq_base", float, default=10000.0, required=False)
    if not 0 < theta < 1e12:
        raise ModelFormatError(path, a + "rope.freq_base", f"expected a positive frequency base, found {theta}")
    rope_dim = _get(meta, path, a + "rope.dimension_count", int, default=head_dim, required=False)
    eps = _get(meta, path, a + "attention.layer_norm_rms_epsilon", float)
    if not 0 < eps < 1:
        raise ModelFormatError(path, a + "attention.layer_norm_rms_epsilon", f"expected 0 < eps < 1, found {eps}")
    freq_scale, yarn = _rope_freq_scale(path, meta, a, ctx)
    # (llama.cpp reads it for every architecture and multiplies cos and sin by it, whatever the
    # scaling type; it was not read: logits differed, centred NMSE 7e-5 at 1.5 on a tiny model)
    attn_factor = _get(meta, path, a + "rope.scaling.attn_factor", float, default=1.0, required=False)
    if not (math.isfinite(attn_factor) and attn_factor > 0):
        raise ModelFormatError(path, a + "rope.scaling.attn_factor", f"expected a finite value > 0, found {attn_factor}")
    # (an embedding model's: it was run causal, silently; a u8 0 or a string "false" as well,
    # so the key must be a bool, as llama.cpp's typed read requires)
    if not _get(meta, path, a + "attention.causal", bool, default=True, required=False):
        raise UnsupportedModelError(path, a + "attention.causal", "bidirectional (non-causal) attention is not supported")
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        if name in tensors:   # (dropped silently before: LongRoPE's per-frequency factors change every position)
            raise UnsupportedModelError(path, f"tensor {name!r}", "LongRoPE frequency factors are not supported")

    if "token_embd.weight" not in tensors:
        raise ModelFormatError(path, "tensor 'token_embd.weight'", "required tensor is missing")
    emb_shape = tuple(tensors["token_embd.weight"].shape)
    if len(emb_shape) != 2 or emb_shape[0] != d_model:
        raise ModelFormatError(path, "tensor 'token_embd.weight'",
                               f"expected shape ({d_model}, vocab), found {emb_shape}")
    vocab = emb_shape[1]
    meta_vocab = _get(meta, path, a + "vocab_size", int, default=vocab, required=False)
    if meta_vocab != vocab:
        raise ModelFormatError(path, a + "vocab_size", f"{meta_vocab} disagrees with token_embd's {vocab} rows")
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and not _is_string_array(tokens):
        # (a u32 scalar had no len(): a TypeError; a string "abc" counted as 3 tokens)
        raise ModelFormatError(path, "tokenizer.ggml.tokens",
                               f"expected an array of strings, found {describe_value(tokens)}")
    if tokens is not None and len(tokens) != vocab:
        raise ModelFormatError(path, "tokenizer.ggml.tokens",
                               f"{len(tokens)} tokens disagree with the embedding's {vocab} rows")

    cfg = ModelConfig(
        arch=arch, name=str(meta.get("general.name", arch)), n_layers=n_layers, d_model=d_model,
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, d_ff=d_ff, vocab_size=vocab,
        context_length=ctx, rope_theta=theta, rope_dim=rope_dim, rope_style=ARCHITECTURES[arch]["rope_style"],
        norm_eps=eps, tied_embeddings="output.weight" not in tensors,
        qkv_bias=ARCHITECTURES[arch]["qkv_bias"] and "blk.0.attn_q.bias" in tensors,
        has_rope_freqs="rope_freqs.weight" in tensors, rope_freq_scale=freq_scale, rope_yarn=yarn,
        rope_attn_factor=attn_factor,
    )
    check_tensors(path, cfg, tensors)
    # (after the tensors: a wrong embedding_length or head_count gives a head size the count
    # cannot match; the tensor it disagrees with names the cause)
    if rope_dim % 2 or head_dim % 2:
        # (RoPE rotates pairs of dims: an odd head size, the count's default, passed the check
        # below and failed at load in a backend: numpy's broadcast, the fused step's dims check)
        raise ModelFormatError(path, a + "rope.dimension_count",
                               f"expected an even count (RoPE rotates pairs of dims) equal to the head size "
                               f"{head_dim}, found {rope_dim}")
    if rope_dim != head_dim:
        # both architectures rotate every dim of a head: llama.cpp refuses a llama file whose count
        # differs ("invalid n_rot") and asserts on a qwen2 one; run, the dims past it went
        # unrotated with nothing to check them against
        raise ModelFormatError(path, a + "rope.dimension_count",
                               f"expected the head size {head_dim} ({arch} rotates whole heads), found {rope_dim}")
    return cfg


def check_tensors(path: str, cfg: ModelConfig, tensors: Mapping[str, Any]) -> None:
    want = expected_tensor_shapes(cfg)
    for name, shape in want.items():
        if name not in tensors:
            raise ModelFormatError(path, f"tensor {name!r}", "required tensor is missing")
        info = tensors[name]
        if tuple(info.shape) != shape:
            raise ModelFormatError(path, f"tensor {name!r}",
                                   f"expected shape {shape} from the hyperparameters, found {tuple(info.shape)}")
        # (first: a norm in Q4_K was "Q4_K is not supported; supported: ..., Q4_K, ...")
        if len(shape) == 1 and info.ggml_type not in (T.F32, T.F16, T.BF16):   # (BF16: load() makes it F32)
            raise ModelFormatError(path, f"tensor {name!r}", f"a 1-D tensor must be F32/F16/BF16, found "
                                                             f"{info.ggml_type.name}")
        # (a matrix in a CONVERTIBLE type is run from a Q8_0 copy that load() makes once)
        if info.ggml_type not in SUPPORTED_TYPES and info.ggml_type not in CONVERTIBLE_TYPES:
            raise UnsupportedModelError(path, f"tensor {name!r}",
                                        f"type {info.ggml_type.name} is not supported; supported: "
                                        + ", ".join(t.name for t in SUPPORTED_TYPES + CONVERTIBLE_TYPES))
    for name in tensors:
        if name in want or _IGNORED.match(name):
            continue
        m = re.match(r"^blk\.(\d+)\.", name)
        if m and int(m.group(1)) >= cfg.n_layers:
            raise ModelFormatError(path, f"tensor {name!r}",
                                   f"belongs to layer {m.group(1)} but block_count is {cfg.n_layers}")
        raise UnsupportedModelError(path, f"tensor {name!r}",
                                    f"not part of the {cfg.arch} forward pass edgellm implements")
