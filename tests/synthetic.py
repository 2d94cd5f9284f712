"""Synthetic tiny GGUF models for tests, and helpers that corrupt a valid file's bytes.

write_tiny_model() writes a small but complete Llama-family GGUF (llama.cpp key and tensor names,
a GPT-2 byte-level BPE vocabulary with consistent merges, random small weights). gguf_layout()
walks a *valid* file's header (trusting it; it is independent of edgellm's parser on purpose) and
returns where each field lies, so tests can patch exactly the byte they mean to break.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from edgellm.model.tokenizer import bytes_to_unicode

# ---------------------------------------------------------------------------------------------
# tokenizer


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 as in SmolLM2
TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL = 1, 3
BOS_ID, EOS_ID, UNK_ID, PAD_ID = 1, 2, 0, 2

# Merges in rank order; each uses only tokens that exist before it.
_BASE_MERGES = [
    ("Ġ", "t"), ("Ġ", "a"), ("h", "e"), ("i", "n"), ("r", "e"), ("o", "n"), ("Ġt", "he"),
    ("e", "r"), ("Ġ", "s"), ("a", "t"), ("Ġ", "w"), ("Ġ", "o"), ("e", "n"), ("Ġ", "c"),
    ("i", "t"), ("i", "s"), ("a", "n"), ("o", "r"), ("e", "s"), ("Ġ", "b"), ("e", "d"),
    ("Ġ", "f"), ("in", "g"), ("Ġ", "p"), ("o", "u"), ("Ġa", "n"), ("a", "l"), ("a", "r"),
    ("Ġt", "o"), ("Ġ", "m"), ("Ġo", "f"), ("Ġ", "in"), ("Ġ", "d"), ("Ġ", "h"), ("Ġan", "d"),
    ("l", "l"), ("Ġ", "l"), ("Ġ", "n"), ("Ġ", "is"), ("Ġ", "H"), ("Ġ", "T"), ("Ġ", "I"),
    ("Ġh", "e"), ("l", "o"), ("Ġw", "or"), ("Ġwor", "l"), ("Ġworl", "d"), ("Ġhe", "ll"),
    ("Ġhell", "o"), ("Ġ", "y"), ("Ġy", "ou"),
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_vocab(vocab_size: int | None = None) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges) for a GPT-2 style byte-level BPE. Layout: the special tokens,
    then the 256 byte tokens in byte order, then one token per merge (rank order). vocab_size None
    means all base merges; a larger size adds letter-pair merges, a smaller one drops merges."""
    specials = list(SPECIAL_TOKENS)
    b2u = bytes_to_unicode()
    byte_tokens = [b2u[b] for b in range(256)]
    n_fixed = len(specials) + len(byte_tokens)
    if vocab_size is not None and vocab_size < n_fixed:
        raise ValueError(f"vocab_size must be at least {n_fixed} (specials + 256 bytes), got {vocab_size}")
    tokens = specials + byte_tokens
    have = set(tokens)
    merges: list[str] = []

    def candidates() -> Iterable[tuple[str, str]]:
        yield from _BASE_MERGES
        if vocab_size is None:
            return
        letters = "etaoinshrdlucmfwypvbgkjqxz"
        for a in ["Ġ" + c for c in letters] + list(letters):
            for b in letters:
                yield a, b

    for a, b in candidates():
        if vocab_size is not None and len(tokens) >= vocab_size:
            break
        if a in have and b in have and a + b not in have:
            tokens.append(a + b)
            have.add(a + b)
            merges.append(f"{a} {b}")
    if vocab_size is not None and len(tokens) != vocab_size:
        raise ValueError(f"cannot build a vocabulary of {vocab_size} tokens (ran out at {len(tokens)})")
    types = [TOKEN_TYPE_CONTROL] * len(specials) + [TOKEN_TYPE_NORMAL] * (len(tokens) - len(specials))
    return tokens, types, merges


# ---------------------------------------------------------------------------------------------
# model writer

QUANT_TYPES = (QT.Q8_0, QT.Q4_0, QT.Q4_1)
# Types the gguf package dequantizes but cannot write: random blocks with small fp16 scales at
# these byte offsets (the rest of a block, quants and sub-scales, any bytes are valid); the
# model's weights are then the gguf package's dequantization of them
RANDOM_BLOCK_TYPES = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,), QT.Q2_K: (80, 82), QT.Q3_K: (108,),
                      QT.Q5_0: (0,), QT.Q5_1: (0, 2)}


def write_kquant_model(path: str | os.PathLike[str], tensor_types: dict[str, QT]) -> "TinyModel":
    """A tiny untied llama whose matrices named by `tensor_types` (suffix -> type, as
    write_tiny_model takes them) are in RANDOM_BLOCK_TYPES, the rest Q8_0; widths are multiples
    of the K-quants' 256-value blocks."""
    return write_tiny_model(path, tensor_type=QT.Q8_0, d_model=256, d_ff=512, n_heads=4, n_kv_heads=2,
                            tied_embeddings=False, tensor_types=tensor_types, seed=3)


def random_blocks(rows: int, cols: int, qtype: QT, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(raw (rows, bytes per row) uint8, its dequantization (rows, cols) float32) of a matrix in
    one of RANDOM_BLOCK_TYPES, its values within ~0.1"""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for off in RANDOM_BLOCK_TYPES[qtype]:
        raw[:, off:off + 2] = np.full(len(raw), 1e-4 if qtype.name.endswith("K") else 5e-3,
                                      np.float16).view(np.uint8).reshape(-1, 2)
    raw = raw.reshape(rows, -1)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)
_FILE_TYPES = {QT.F32: gguf.LlamaFileType.ALL_F32, QT.F16: gguf.LlamaFileType.MOSTLY_F16,
               QT.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, QT.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
               QT.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}


@dataclass(frozen=True)
class TinyModel:
    path: str                           # the written GGUF
    arch: str                           # general.architecture
    tensor_type: QT                     # storage type of the matrices (norms/biases stay F32)
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int                       # d_model // n_heads
    d_ff: int
    vocab_size: int
    tokens: list[str]
    merges: list[str]
    # float32 weights before quantization, numpy order (reversed GGUF ne), for reference tests
    weights: dict[str, np.ndarray] = field(repr=False)


def _infer_type(value: Any) -> VT:
    if isinstance(value, bool):
        return VT.BOOL
    if isinstance(value, int):
        return VT.UINT32 if 0 <= value < 1 << 32 else VT.INT64
    if isinstance(value, float):
        return VT.FLOAT32
    if isinstance(value, (str, bytes)):
        return VT.STRING
    if isinstance(value, (list, tuple)):
        return VT.ARRAY
    raise TypeError(f"cannot infer a GGUF type for {value!r}")


def write_tiny_model(path: str | os.PathLike[str], *, arch: str = "llama",
                     tensor_type: QT = QT.F32, n_layers: int = 2, d_model: int = 64,
                     n_heads: int = 4, n_kv_heads: int = 2, d_ff: int = 128,
                     vocab_size: int | None = None, seed: int = 0, tied_embeddings: bool = True,
                     qkv_bias: bool | None = None, context_length: int = 256,
                     rope_freq_base: float = 10000.0, rms_eps: float = 1e-5,
                     extra_metadata: dict[str, Any] | None = None,
                     omit: Iterable[str] = (), tensor_types: dict[str, QT] | None = None,
                     head_dim: int | None = None) -> TinyModel:
    """Writes a valid small Llama-family GGUF and returns its description.

    vocab_size None: 3 specials + 256 bytes + the base merges (310 tokens). qkv_bias None means
    arch == "qwen2". extra_metadata: key -> value (type inferred: bool, int -> UINT32 (INT64 when
    out of range), float -> FLOAT32, str, list -> ARRAY), or key -> (value, GGUFValueType) or
    (value, ARRAY, element type); it overrides generated keys. "general.alignment" given as a
    plain int also sets the writer's data alignment. omit: tensor names or metadata keys to leave
    out (general.architecture included). tensor_types: name suffix (e.g. "attn_v.weight") -> the
    type of the matrices it ends, in place of tensor_type (a llama.cpp-style per-tensor mix).
    head_dim: other than d_model / n_heads, written as attention.key_length / value_length."""
    if qkv_bias is None:
        qkv_bias = arch == "qwen2"
    tensor_type = QT(tensor_type)
    own_head_dim = head_dim is not None and head_dim * n_heads != d_model
    head_dim = head_dim or d_model // n_heads
    if (head_dim * n_heads != d_model and not own_head_dim) or n_heads % n_kv_heads:
        raise ValueError("d_model must be divisible by n_heads, n_heads by n_kv_heads")
    if tensor_type in QUANT_TYPES:
        block = gguf.GGML_QUANT_SIZES[tensor_type][0]
        if d_model % block or d_ff % block:
            raise ValueError(f"{tensor_type.name} needs d_model and d_ff multiples of {block}")
    omit = set(omit)
    tokens, token_types, merges = build_vocab(vocab_size)
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    meta: dict[str, tuple[Any, VT, VT | None]] = {}

    def put(key: str, value: Any, vtype: VT, sub: VT | None = None) -> None:
        meta[key] = (value, vtype, sub)

    put("general.name", f"tiny-{arch}-{tensor_type.name}", VT.STRING)
    if tensor_type in _FILE_TYPES:
        put("general.file_type", int(_FILE_TYPES[tensor_type]), VT.UINT32)
    put("general.quantization_version", gguf.GGML_QUANT_VERSION, VT.UINT32)
    put(f"{arch}.vocab_size", n_vocab, VT.UINT32)
    put(f"{arch}.block_count", n_layers, VT.UINT32)
    put(f"{arch}.context_length", context_length, VT.UINT32)
    put(f"{arch}.embedding_length", d_model, VT.UINT32)
    put(f"{arch}.feed_forward_length", d_ff, VT.UINT32)
    put(f"{arch}.attention.head_count", n_heads, VT.UINT32)
    put(f"{arch}.attention.head_count_kv", n_kv_heads, VT.UINT32)
    put(f"{arch}.rope.freq_base", float(rope_freq_base), VT.FLOAT32)
    put(f"{arch}.attention.layer_norm_rms_epsilon", float(rms_eps), VT.FLOAT32)
    put(f"{arch}.rope.dimension_count", head_dim, VT.UINT32)
    if own_head_dim:
        put(f"{arch}.attention.key_length", head_dim, VT.UINT32)
        put(f"{arch}.attention.value_length", head_dim, VT.UINT32)
    put("tokenizer.ggml.model", "gpt2", VT.STRING)
    put("tokenizer.ggml.pre", "smollm", VT.STRING)
    put("tokenizer.ggml.tokens", tokens, VT.ARRAY, VT.STRING)
    put("tokenizer.ggml.token_type", token_types, VT.ARRAY, VT.INT32)
    put("tokenizer.ggml.merges", merges, VT.ARRAY, VT.STRING)
    put("tokenizer.ggml.bos_token_id", BOS_ID, VT.UINT32)
    put("tokenizer.ggml.eos_token_id", EOS_ID, VT.UINT32)
    put("tokenizer.ggml.unknown_token_id", UNK_ID, VT.UINT32)
    put("tokenizer.ggml.padding_token_id", PAD_ID, VT.UINT32)
    put("tokenizer.ggml.add_bos_token", False, VT.BOOL)
    put("tokenizer.chat_template", CHAT_TEMPLATE, VT.STRING)

    alignment = None
    for key, spec in (extra_metadata or {}).items():
        if isinstance(spec, tuple) and len(spec) in (2, 3) and isinstance(spec[1], VT):
            put(key, spec[0], spec[1], spec[2] if len(spec) == 3 else None)
        else:
            if key == "general.alignment":
                alignment = int(spec)
            put(key, spec, _infer_type(spec))

    # ---- weights, numpy order (reversed GGUF ne)
    weights: dict[str, np.ndarray] = {}

    def mat(name: str, rows: int, cols: int) -> None:  # GGUF ne = [cols, rows]
        weights[name] = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)

    def vec(name: str, n: int, center: float) -> None:
        weights[name] = (center + rng.standard_normal(n) * 0.02).astype(np.float32)

    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    mat("token_embd.weight", n_vocab, d_model)
    for i in range(n_layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", d_model, 1.0)
        mat(p + "attn_q.weight", q_dim, d_model)
        mat(p + "attn_k.weight", kv_dim, d_model)
        mat(p + "attn_v.weight", kv_dim, d_model)
        if qkv_bias:
            vec(p + "attn_q.bias", q_dim, 0.0)
            vec(p + "attn_k.bias", kv_dim, 0.0)
            vec(p + "attn_v.bias", kv_dim, 0.0)
        mat(p + "attn_output.weight", d_model, q_dim)
        vec(p + "ffn_norm.weight", d_model, 1.0)
        mat(p + "ffn_gate.weight", d_ff, d_model)
        mat(p + "ffn_up.weight", d_ff, d_model)
        mat(p + "ffn_down.weight", d_model, d_ff)
    vec("output_norm.weight", d_model, 1.0)
    if not tied_embeddings:
        mat("output.weight", n_vocab, d_model)

    writer = gguf.GGUFWriter(os.fspath(path), arch)
    if alignment is not None:
        writer.data_alignment = alignment  # the key itself is written below with the others
    if "general.architecture" in omit:
        del writer.kv_data[0]["general.architecture"]
    for key, (value, vtype, sub) in meta.items():
        if key not in omit:
            writer.add_key_value(key, value, vtype, sub)
    for name, w in weights.items():
        if name in omit:
            continue
        named = next((QT(v) for suf, v in (tensor_types or {}).items() if name.endswith(suf)), None)
        t = named if named is not None else tensor_type   # (QT.F32 is 0)
        # a BF16 file keeps its vectors in F32 (llama.cpp's converter; its CPU backend cannot
        # multiply by a BF16 norm): BF16 ones only where tensor_types names them
        if t == QT.BF16 and (w.ndim == 2 or named == QT.BF16):
            raw = gguf.quants.quantize(w, t)
            weights[name] = gguf.quants.dequantize(raw, t).reshape(w.shape).astype(np.float32)
            writer.add_tensor(name, raw, raw_dtype=t)
        elif w.ndim == 1 or t == QT.F32:
            writer.add_tensor(name, w)
        elif t == QT.F16:
            writer.add_tensor(name, w.astype(np.float16))
        elif t in RANDOM_BLOCK_TYPES:
            raw, weights[name] = random_blocks(w.shape[0], w.shape[1], t, rng)
            writer.add_tensor(name, raw, raw_dtype=t)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, t), raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyModel(path=os.fspath(path), arch=arch, tensor_type=tensor_type, n_layers=n_layers,
                     d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                     d_ff=d_ff, vocab_size=n_vocab, tokens=tokens, merges=merges,
                     weights={k: v for k, v in weights.items() if k not in omit})


# ---------------------------------------------------------------------------------------------
# layout of a valid file, and byte patching

_SCALAR_SIZES = {VT.UINT8: 1, VT.INT8: 1, VT.UINT16: 2, VT.INT16: 2, VT.UINT32: 4, VT.INT32: 4,
                 VT.FLOAT32: 4, VT.BOOL: 1, VT.UINT64: 8, VT.INT64: 8, VT.FLOAT64: 8}


@dataclass
class KVLayout:
    index: int
    key: str
    start: int                  # offset of the key's u64 length (the entry's first byte)
    key_at: int                 # first byte of the key text
    type_at: int                # u32 value type
    value_at: int               # first byte of the value (for arrays: the u32 element type)
    end: int                    # one past the entry's last byte
    array_len_at: int | None = None     # u64 array length (arrays only)
    elem_type: VT | None = None


@dataclass
class TensorLayout:
    index: int
    name: str
    start: int                  # offset of the name's u64 length
    name_at: int
    n_dims_at: int              # u32
    dims_at: list[int]          # u64 each, ne order
    type_at: int                # u32
    offset_at: int              # u64, relative to the data section
    end: int
    shape: list[int]
    ggml_type: QT
    rel_offset: int


@dataclass
class Layout:
    kvs: dict[str, KVLayout]
    tensors: dict[str, TensorLayout]
    kv_end: int                 # end of the key/value section = first tensor info
    header_end: int             # end of the tensor infos
    alignment: int
    data_start: int             # header_end rounded up to alignment
    version_at: int = 4
    tensor_count_at: int = 8
    kv_count_at: int = 16

    def int_fields(self) -> list[tuple[int, int]]:
        """(offset, width) of every integer field in the header: counts, lengths, types, dims."""
        out = [(4, 4), (8, 8), (16, 8)]
        for kv in self.kvs.values():
            out += [(kv.start, 8), (kv.type_at, 4)]
            if kv.array_len_at is not None:
                out += [(kv.value_at, 4), (kv.array_len_at, 8)]
                if kv.elem_type == VT.STRING:
                    out.append((kv.array_len_at + 8, 8))  # the first element's length
            elif kv.elem_type is None:
                out.append((kv.value_at, 8))  # a string value's length, or a scalar's bytes
        for t in self.tensors.values():
            out += [(t.start, 8), (t.n_dims_at, 4), (t.type_at, 4), (t.offset_at, 8)]
            out += [(d, 8) for d in t.dims_at]
        return out


def gguf_layout(data: bytes) -> Layout:
    """Field offsets of a *valid* little-endian GGUF v2/v3 (no validation: test helper only)."""
    u32 = lambda at: struct.unpack_from("<I", data, at)[0]  # noqa: E731
    u64 = lambda at: struct.unpack_from("<Q", data, at)[0]  # noqa: E731
    n_tensors, n_kv = u64(8), u64(16)
    pos = 24

    def skip_value(vt: VT, at: int) -> int:
        if vt == VT.STRING:
            return at + 8 + u64(at)
        if vt == VT.ARRAY:
            et, n = VT(u32(at)), u64(at + 4)
            at += 12
            if et in _SCALAR_SIZES:
                return at + n * _SCALAR_SIZES[et]
            for _ in range(n):
                at = skip_value(et, at)
            return at
        return at + _SCALAR_SIZES[vt]

    kvs: dict[str, KVLayout] = {}
    alignment = 32
    for i in range(n_kv):
        start = pos
        klen = u64(pos)
        key = data[pos + 8:pos + 8 + klen].decode()
        type_at = pos + 8 + klen
        vt = VT(u32(type_at))
        value_at = type_at + 4
        end = skip_value(vt, value_at)
        kv = KVLayout(i, key, start, pos + 8, type_at, value_at, end)
        if vt == VT.ARRAY:
            kv.array_len_at = value_at + 4
            kv.elem_type = VT(u32(value_at))
        if key == "general.alignment":
            alignment = u32(value_at)
        kvs[key] = kv
        pos = end
    kv_end = pos
    tensors: dict[str, TensorLayout] = {}
    for i in range(n_tensors):
        start = pos
        nlen = u64(pos)
        name = data[pos + 8:pos + 8 + nlen].decode()
        n_dims_at = pos + 8 + nlen
        n_dims = u32(n_dims_at)
        dims_at = [n_dims_at + 4 + 8 * d for d in range(n_dims)]
        type_at = n_dims_at + 4 + 8 * n_dims
        offset_at = type_at + 4
        pos = offset_at + 8
        tensors[name] = TensorLayout(i, name, start, start + 8, n_dims_at, dims_at, type_at, offset_at,
                                     pos, [u64(d) for d in dims_at], QT(u32(type_at)), u64(offset_at))
    data_start = -(-pos // alignment) * alignment
    return Layout(kvs, tensors, kv_end, pos, alignment, data_start)


def patch_u32(data: bytes, at: int, value: int) -> bytes:
    """data with the u32 at `at` replaced (negative values as two's complement)."""
    return data[:at] + struct.pack("<I", value & 0xFFFFFFFF) + data[at + 4:]


def patch_u64(data: bytes, at: int, value: int) -> bytes:
    """data with the u64 at `at` replaced (negative values as two's complement)."""
    return data[:at] + struct.pack("<Q", value & 0xFFFFFFFFFFFFFFFF) + data[at + 8:]


def patch_bytes(data: bytes, at: int, new: bytes) -> bytes:
    """data with len(new) bytes at `at` overwritten."""
    return data[:at] + new + data[at + len(new):]


def encode_string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def encode_kv(key: str | bytes, vtype: VT | int, payload: bytes) -> bytes:
    """One raw key/value entry: key string, u32 type, then `payload` (the encoded value)."""
    return encode_string(key) + struct.pack("<I", int(vtype)) + payload


def encode_array(elem_type: VT | int, count: int, payload: bytes) -> bytes:
    """An array value body: u32 element type, u64 count, then the encoded elements."""
    return struct.pack("<IQ", int(elem_type), count) + payload


def splice_header(data: bytes, start: int, end: int, new: bytes, *, kv_delta: int = 0,
                  tensor_delta: int = 0) -> bytes:
    """Replaces header bytes [start, end) with `new`, adjusts kv_count/tensor_count by the deltas,
    and re-pads so the tensor data section starts aligned again (tensor offsets stay valid)."""
    lay = gguf_layout(data)
    assert end <= lay.header_end, "splice_header edits the header only"
    header = data[:start] + new + data[end:lay.header_end]
    header = patch_u64(header, 16, len(lay.kvs) + kv_delta)
    header = patch_u64(header, 8, len(lay.tensors) + tensor_delta)
    pad = -len(header) % lay.alignment
    return header + b"\0" * pad + data[lay.data_start:]
