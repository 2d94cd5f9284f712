"""What the npu unit hands an NPU runtime: static-shape subgraphs and their weights, independent of
the runtime (ONNX Runtime in npu_onnx.py, LiteRT/TFLite in npu_tflite.py).

Two subgraph kinds, each compiled once per token bucket (NPUs compile for fixed shapes):
    LinearGraph  y = x @ W^T (+ b)                      x (tokens, K) f32 -> (tokens, N) f32
    FfnGraph     y = down(silu(gate(x)) * up(x))        x (tokens, d) f32 -> (tokens, d) f32
                 gate_up holds gate rows then up rows, (2 * ff, d), as the engine's fused matmul
The caller pads a short chunk to its bucket and drops the padded rows of the output.

Weight formats (QLinear.fmt):
    "int8"  symmetric per output channel: W[n, :] ~ q[n, :] * scale[n], q int8 in [-127, 127];
            the runtime quantizes the activations to int8 per row (an int8 x int8 matmul)
    "int8s" "int8" per slice of 64 columns: W[n, 64j:64j+64] ~ q * scale[n, j], q int8 in
            [-127, 127]; the runtime quantizes each row's slice of the activations to int8 on its
            own and sums the slices' products in float (LiteRT: one hybrid FC per slice)
    "int8b" symmetric blocks of 32 along K: W[n, 32j:32j+32] ~ q * scale[n, j], q int8 in
            [-127, 127], activations stay float (W8A16-style: weight-only int8, as NPUs run
            LLM projections when int8 activations cost too much accuracy)
    "int4"  symmetric blocks of 32 along K: W[n, 32j:32j+32] ~ (q - 8) * scale[n, j], q in [0, 15]
            stored one value per uint8 (the runtime packs nibbles as its format wants)
    "fp16"  W as float16
    "fp32"  W as float32
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..hashing import sha256
from ..errors import EdgeLLMError

FORMATS = ("int8", "int8s", "int8b", "int4", "fp16", "fp32")
INT4_BLOCK = 32
# int8s slice width. One scale per output channel over all of K, and one int8 step per input row,
# cost LiteRT's hybrid FC 5-8 points of top-1 on SmolLM2-135M; giving each 64-column slice its own
# weight scales and its own activation step recovers them (numpy emulation against llama.cpp,
# F32 / Q4_1 goldens: unsliced 90.2% / 91.6%, 128 columns 91.6% / 93.8%, 64 columns 98.2% / 96.7%,
# 32 columns 98.55% / 97.1% for twice the ops): 64 is the widest of these above 95% on both.
INT8S_SLICE = 64


class NpuGraphError(EdgeLLMError):
    """A subgraph a runtime path rejects: a malformed spec, the checker, a provider or delegate
    that does not take its nodes. `graph` names it, `reason` says why; the unit falls back."""

    def __init__(self, graph: str, reason: str):
        self.graph, self.reason = graph, reason
        super().__init__(f"npu subgraph {graph!r}: {reason}")


class NpuInputError(EdgeLLMError, ValueError):
    """run() got an input (or output buffer) of the wrong shape or type for its static shape."""


_BLOCK = {"int8s": INT8S_SLICE, "int8b": INT4_BLOCK, "int4": INT4_BLOCK}   # K must divide by these


@dataclass(frozen=True, eq=False)
class QLinear:
    fmt: str                     # one of FORMATS
    n: int                       # output features
    k: int                       # input features
    q: np.ndarray                # int8, int8s, int8b: (N, K) int8; int4: (N, K) uint8 in 0..15; fp16/fp32: (N, K)
    scale: np.ndarray | None     # int8: (N,) f32; int8s: (N, K / 64) f32; int8b, int4: (N, K / 32) f32;
    #                              None for fp16/fp32
    bias: np.ndarray | None = None   # (N,) f32

    def dequantize(self) -> np.ndarray:
        """W as float32 (N, K): the exact weights the subgraph multiplies by."""
        if self.fmt == "int8":
            return self.q.astype(np.float32) * self.scale[:, None]
        if self.fmt in ("int8b", "int8s"):
            width = _BLOCK[self.fmt]
            blocks = self.q.astype(np.float32).reshape(self.n, self.k // width, width)
            return (blocks * self.scale[:, :, None]).reshape(self.n, self.k)
        if self.fmt == "int4":
            blocks = (self.q.astype(np.float32) - 8.0).reshape(self.n, self.k // INT4_BLOCK, INT4_BLOCK)
            return (blocks * self.scale[:, :, None]).reshape(self.n, self.k)
        return self.q.astype(np.float32)

    def digest(self) -> str:
        """Content hash: part of every cache key built from these weights."""
        h = sha256(f"{self.fmt}|{self.n}|{self.k}".encode())
        for a in (self.q, self.scale, self.bias):
            h.update(b"-" if a is None else np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:24]


# Rows requantized at a time: each format's steps make three or four f32 temporaries the size of
# their input, 324 MiB at once for SmolLM2-135M's head (49152 x 576), the load's peak RSS; every
# step is per row, so the chunks give the same bits
_QUANT_ROWS = 2048


def quantize(w, fmt: str, bias: np.ndarray | None = None) -> QLinear:
    """W (N, K) float32 -> QLinear in `fmt`. A row (or block) of zeros gets scale 0, q 0.
    W: an array, or anything with .shape whose [r0:r1] gives those rows as float32 (a GGUF
    matrix dequantized a slice at a time: the head's 108 MiB of f32 never exist at once)."""
    if fmt not in FORMATS:
        raise ValueError(f"weight format {fmt!r}: expected one of {FORMATS}")
    if isinstance(w, np.ndarray) or not hasattr(w, "shape"):
        w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    b = None if bias is None else np.asarray(bias, dtype=np.float32)
    if n > _QUANT_ROWS or not isinstance(w, np.ndarray):
        rows = (lambda r: np.asarray(w[r:r + _QUANT_ROWS], dtype=np.float32))
        first = _quantize(rows(0), fmt, None)
        q = np.empty((n, k), first.q.dtype)
        scale = None if first.scale is None else np.empty((n,) + first.scale.shape[1:], np.float32)
        for r in range(0, n, _QUANT_ROWS):
            part = first if r == 0 else _quantize(rows(r), fmt, None)
            q[r:r + _QUANT_ROWS] = part.q
            if scale is not None:
                scale[r:r + _QUANT_ROWS] = part.scale
        return QLinear(fmt, n, k, q, scale, b)
    return _quantize(w, fmt, b)


def _quantize(w: np.ndarray, fmt: str, b: np.ndarray | None) -> QLinear:
    n, k = w.shape
    if fmt == "int8":
        amax = np.abs(w).max(axis=1)
        scale = (amax / 127.0).astype(np.float32)
        q = np.divide(w, scale[:, None], out=np.zeros_like(w), where=scale[:, None] > 0)
        return QLinear(fmt, n, k, np.clip(np.rint(q), -127, 127).astype(np.int8), scale, b)
    if fmt in _BLOCK and k % _BLOCK[fmt]:
        raise ValueError(f"{fmt} weights need K a multiple of {_BLOCK[fmt]}, got (N, K) = ({n}, {k})")
    if fmt in ("int8b", "int8s"):
        blocks = w.reshape(n, k // _BLOCK[fmt], _BLOCK[fmt])
        scale = (np.abs(blocks).max(axis=2) / 127.0).astype(np.float32)
        q = np.divide(blocks, scale[:, :, None], out=np.zeros_like(blocks), where=scale[:, :, None] > 0)
        return QLinear(fmt, n, k, np.clip(np.rint(q), -127, 127).astype(np.int8).reshape(n, k), scale, b)
    if fmt == "int4":
        blocks = w.reshape(n, k // INT4_BLOCK, INT4_BLOCK)
        scale = (np.abs(blocks).max(axis=2) / 7.0).astype(np.float32)
        q = np.divide(blocks, scale[:, :, None], out=np.zeros_like(blocks), where=scale[:, :, None] > 0)
        q = np.clip(np.rint(q), -8, 7) + 8
        return QLinear(fmt, n, k, q.reshape(n, k).astype(np.uint8), scale, b)
    return QLinear(fmt, n, k, w.astype(np.float16 if fmt == "fp16" else np.float32), None, b)


@dataclass(frozen=True, eq=False)
class LinearGraph:
    name: str                    # "blk.3.qkv": unique per model, used in cache keys and messages
    w: QLinear
    tokens: int                  # the bucket: static row count of x

    def key(self) -> str:
        return f"{self.name}|linear|{self.tokens}|{self.w.digest()}"


@dataclass(frozen=True, eq=False)
class FfnGraph:
    name: str                    # "blk.3.ffn"
    gate_up: QLinear             # (2 * ff, d): gate rows, then up rows
    down: QLinear                # (d, ff)
    tokens: int

    def key(self) -> str:
        return f"{self.name}|ffn|{self.tokens}|{self.gate_up.digest()}|{self.down.digest()}"


def reference(graph, x: np.ndarray) -> np.ndarray:
    """What the subgraph computes, in numpy float32 from the dequantized weights (fp32
    activations: the runtime's own activation quantization, if any, is what the tests bound)."""
    if isinstance(graph, LinearGraph):
        y = x @ graph.w.dequantize().T
        return y + graph.w.bias if graph.w.bias is not None else y
    gu = x @ graph.gate_up.dequantize().T
    ff = gu.shape[1] // 2
    g, u = gu[:, :ff], gu[:, ff:]
    h = g / (1.0 + np.exp(-g)) * u
    return h @ graph.down.dequantize().T
