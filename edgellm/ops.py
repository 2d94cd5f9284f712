"""The op IR: the ops of one transformer layer (and the model's head), and what each costs.

For a phase step of T tokens with `context` tokens already in the KV cache, every op has FLOPs
and bytes moved: weights at the format they are stored in on the unit, fp32 activations in and
out, and the KV cache it reads or writes. Arithmetic intensity = FLOPs / bytes. The dispatcher's
roofline model turns these into predicted times per unit; nothing here knows about units.
"""
from __future__ import annotations

from dataclasses import dataclass

from .model.config import ModelConfig

# Bytes per weight element of each storage format. GGUF block formats count their scales:
# Q8_0 = 32 int8 + one fp16 scale per 32; Q4_0 = 16 bytes + fp16 scale; Q4_1 = 16 + fp16 scale
# and min. int8 / int4 (per-channel / per-group-of-32 fp16 scales) are the repacked formats.
WEIGHT_BYTES = {
    "f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
    "int8": 1.0, "int4": 18 / 32,
}
ACT_BYTES = 4        # activations travel between ops as fp32

# Op kinds are what a backend implements; op names are places in the layer.
MATMUL_KINDS = ("matmul", "lm_head")


@dataclass(frozen=True)
class OpSpec:
    name: str          # "qkv", "attn_out", "ffn_gate_up", ...: unique within its scope
    kind: str          # backend function: matmul, rmsnorm, rope, attention, swiglu, add, embedding, lm_head
    scope: str         # "layer" (repeated n_layers times) or "model" (once per step)
    k: int = 0         # matmul input width
    n: int = 0         # matmul output width; for elementwise ops, the row width
    last_row_only: bool = False   # in prefill only the last position needs it (final norm, head)


@dataclass(frozen=True)
class OpCost:
    flops: float
    weight_bytes: float
    act_bytes: float   # activations read + written (fp32)
    kv_bytes: float    # KV cache read + written
    in_bytes: float    # activation bytes the op reads from its producer (what a transfer moves)

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.act_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")


def layer_ops(cfg: ModelConfig) -> tuple[OpSpec, ...]:
    """One decoder layer, in execution order (the engine runs exactly these)."""
    d, q, kv, ff = cfg.d_model, cfg.q_dim, cfg.kv_dim, cfg.d_ff
    return (
        OpSpec("attn_norm", "rmsnorm", "layer", n=d),
        OpSpec("qkv", "matmul", "layer", k=d, n=q + 2 * kv),
        OpSpec("rope", "rope", "layer", n=q + kv),
        OpSpec("attention", "attention", "layer", n=q),
        OpSpec("attn_out", "matmul", "layer", k=q, n=d),
        OpSpec("attn_add", "add", "layer", n=d),
        OpSpec("ffn_norm", "rmsnorm", "layer", n=d),
        OpSpec("ffn_gate_up", "matmul", "layer", k=d, n=2 * ff),
        OpSpec("swiglu", "swiglu", "layer", n=ff),
        OpSpec("ffn_down", "matmul", "layer", k=ff, n=d),
        OpSpec("ffn_add", "add", "layer", n=d),
    )


def model_ops(cfg: ModelConfig) -> tuple[OpSpec, ...]:
    """The ops outside the layers: embedding before, final norm and head after."""
    d = cfg.d_model
    return (
        OpSpec("embedding", "embedding", "model", n=d),
        OpSpec("output_norm", "rmsnorm", "model", n=d, last_row_only=True),
        OpSpec("lm_head", "lm_head", "model", k=d, n=cfg.vocab_size, last_row_only=True),
    )


class MixedFormat(str):
    """The weight format of a fused projection whose tensors differ in format (Q4_0 q with F16
    k and v, say). It reads as its first part's format wherever one name is needed (a profile's
    shapes, a precision search); `parts` gives each segment's format and rows, for its bytes and
    for the units that run a projection in one format per call (they cannot take it)."""

    parts: tuple[tuple[str, int], ...]   # (format, output rows) per segment, in output order

    def __new__(cls, parts: tuple[tuple[str, int], ...]) -> "MixedFormat":
        obj = super().__new__(cls, parts[0][0])
        obj.parts = tuple(parts)
        return obj

    def __getnewargs__(self):   # pickle and copy rebuild it from its parts, not its name
        return (self.parts,)

    def formats(self) -> tuple[str, ...]:
        return tuple(sorted({f for f, _ in self.parts}))


def mixed_formats(weight_format: str) -> tuple[str, ...]:
    """The distinct formats of a mixed projection's parts; () for a single format."""
    return weight_format.formats() if isinstance(weight_format, MixedFormat) else ()


def weight_formats(model) -> dict[str, str]:
    """op name -> the model file's storage format of its weights ("q4_1", "f32", ...); ops
    without a weight matrix read fp32 norms or nothing: "f32". A fused projection reads every
    one of its tensors (q, k, v; gate, up): parts in different formats give a MixedFormat. A
    layer op whose layers differ (a mixed-precision file, `edgellm quantize`'s output) gets a
    costmodel.LayerFormats, which reads as the format most layers have (placement is per op, for
    all layers) and is costed layer by layer (as one name, the plan of such a file predicted the
    time of its majority format for every layer); where a layer itself mixes formats, the most
    common layer's."""
    from .costmodel import LayerFormats
    from .model import layout

    from .kquant_repack import copy_types, runs_as as runs_as_type

    gguf = getattr(model, "gguf", None)
    copy = copy_types(gguf.tensors) if gguf is not None else {}

    def runs_as(name: str) -> str:
        # a K-quant / Q5_x matrix runs from load()'s copy (api._runnable): costed as what it runs
        # as, Q4_1 or Q8_0 (`edgellm plan` on a Q4_K_M file stopped at a KeyError: 'q4_k'), by the
        # copy's own choice (a Q4_K beside a Q6_K in one projection takes Q8_0)
        return copy.get(name, runs_as_type(model.tensor_type(name))).name.lower()

    cfg = model.config
    fmt = {op.name: "f32" for op in (*layer_ops(cfg), *model_ops(cfg))}
    for op in layout.SEGMENTS:
        per_layer = []
        for i in range(cfg.n_layers):
            segs, _ = layout.projection(cfg, i, op)
            per_layer.append(tuple((runs_as(name), rows) for name, rows in segs))
        parts = max(dict.fromkeys(per_layer), key=per_layer.count)
        if len(set(per_layer)) > 1 and all(len({f for f, _ in p}) == 1 for p in per_layer):
            fmt[op] = LayerFormats(tuple(p[0][0] for p in per_layer))
        else:
            fmt[op] = parts[0][0] if len({f for f, _ in parts}) == 1 else MixedFormat(parts)
    fmt["embedding"] = runs_as("token_embd.weight")
    head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    fmt["lm_head"] = runs_as(head)
    return fmt


def weight_bytes(op: OpSpec, weight_format: str) -> float:
    """Bytes of op's weight matrix held in `weight_format` (each part at its own for a mix)."""
    if isinstance(weight_format, MixedFormat):
        return sum(op.k * rows * WEIGHT_BYTES[f] for f, rows in weight_format.parts)
    return op.k * op.n * WEIGHT_BYTES[weight_format]


# FLOPs booked per element of an elementwise op's output width
ELEMENTWISE_FLOPS = {"rmsnorm": 4.0,   # square, sum, scale, weight
                     "rope": 3.0,      # a rotation per pair: 4 mul + 2 add per 2 elements
                     "add": 1.0,
                     "swiglu": 5.0}    # silu(g) * u: exp, add, divide, multiply
# every op kind a unit may take (a profile's npu.supported_ops names some of them)
OP_KINDS = frozenset({*MATMUL_KINDS, "attention", "embedding", *ELEMENTWISE_FLOPS})


def elementwise_flops(kind: str, T: int, width: int) -> float:
    """FLOPs the cost model books for an elementwise op over T rows of `width` (also the unit of
    the rates `edgellm profile` measures)."""
    return ELEMENTWISE_FLOPS[kind] * T * width


def op_cost(op: OpSpec, cfg: ModelConfig, tokens: int, context: int, weight_format: str = "f32",
            kv_bytes_per_elem: float = 2.0, prefill: bool = True) -> OpCost:
    """Cost of `op` for a step of `tokens` new tokens after `context` cached ones.

    weight_format: how the unit stores this op's weights (a WEIGHT_BYTES key).
    kv_bytes_per_elem: 2 for the default f16 KV pool, 4 for f32, 1 for int8.
    prefill: in a prefill step, last_row_only ops run on one row."""
    if tokens < 1 or context < 0:
        raise ValueError(f"tokens must be >= 1 and context >= 0, got {tokens}, {context}")
    T = 1 if (op.last_row_only and prefill) else tokens
    a = ACT_BYTES
    if op.kind in MATMUL_KINDS:
        wb = weight_bytes(op, weight_format)
        return OpCost(2.0 * T * op.k * op.n, wb, a * T * (op.k + op.n), 0.0, a * T * op.k)
    if op.kind in ELEMENTWISE_FLOPS:
        f = elementwise_flops(op.kind, T, op.n)
        if op.kind == "rmsnorm":
            return OpCost(f, a * op.n, 2 * a * T * op.n, 0.0, a * T * op.n)
        if op.kind == "rope":     # reads cos/sin too
            return OpCost(f, 0.0, 2 * a * T * op.n + a * T * cfg.rope_dim, 0.0, a * T * op.n)
        return OpCost(f, 0.0, 3 * a * T * op.n, 0.0, 2 * a * T * op.n)
    if op.kind == "embedding":    # a row gather: the rows are read at the table's format
        return OpCost(0.0, T * op.n * WEIGHT_BYTES[weight_format], a * T * op.n, 0.0, 0.0)
    if op.kind == "attention":
        return _attention_cost(cfg, T, context, kv_bytes_per_elem)
    raise ValueError(f"no cost formula for op kind {op.kind!r}")


def attention_flops(T: int, context: int, n_heads: int, head_dim: int) -> float:
    """FLOPs the cost model books for causal attention of T queries after `context` keys (also
    the unit of the attention rates `edgellm profile` measures, so they predict their own probes)."""
    visible = T * context + T * (T + 1) // 2
    return visible * n_heads * (4.0 * head_dim + 5.0)


def _attention_cost(cfg: ModelConfig, T: int, context: int, kvb: float) -> OpCost:
    """Causal attention of T queries at positions context.. over their visible keys: query t sees
    context + t + 1 keys. Per visible key and head: q.k (2 hd FLOPs), softmax (~5), p.v (2 hd)."""
    flops = attention_flops(T, context, cfg.n_heads, cfg.head_dim)
    n = context + T
    kv = kvb * cfg.kv_dim * (2 * n + 2 * T)     # read K and V of n keys once; write the chunk's K, V
    act = ACT_BYTES * T * (cfg.q_dim + 2 * cfg.kv_dim) + ACT_BYTES * T * cfg.q_dim   # q, new k/v in; out
    return OpCost(flops, 0.0, act, kv, ACT_BYTES * T * (cfg.q_dim + 2 * cfg.kv_dim))
