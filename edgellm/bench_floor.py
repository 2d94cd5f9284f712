"""The decode memory floor for `edgellm bench`: weight bytes one decode step reads, divided by
the read bandwidth `edgellm profile` measures, taken in the same run as the decode figures.

A decode token streams every layer's weights and the output projection once, so no kernel can
beat bytes / bandwidth; how far above it a token's time sits is what the kernels leave on the
table. The bandwidth probe is the profile's own (the neon library's threads streaming a buffer
far larger than the caches; numpy's sgemv without the library), run in a child process: its
256+ MiB buffer would otherwise become this process's peak RSS, which the bench also reports.
The sgemv it replaced read slower than the decode kernels stream (decode at 128 tokens read
0.94x and 0.96x of its floor on Zen 4); the bench still says so when a ratio falls under 1.
"""
from __future__ import annotations

import logging
import statistics
import subprocess
import sys

from .model.loader import ModelFile

log = logging.getLogger("edgellm.bench")

# the child sizes its matrix as `edgellm profile --quick` does (from the caches), unless told
_PROBE = ("import sys; from dataclasses import replace; "
          "from edgellm.device.probes import QUICK, estimate_host_profile, measure_read_bandwidth, resolve_sizes; "
          "n = int(sys.argv[1]); "
          "s = replace(QUICK, bandwidth_bytes=n) if n else resolve_sizes(QUICK, estimate_host_profile().clusters); "
          "print(measure_read_bandwidth(s))")


def decode_weight_bytes(model: ModelFile) -> int:
    """Bytes of weights one decode token reads: every tensor except the token embedding, of
    which a step reads one row; with no separate output.weight the head is tied to the
    embedding and reads all of it."""
    tensors = model.gguf.tensors
    tied = "output.weight" not in tensors
    return sum(t.nbytes for name, t in tensors.items() if name != "token_embd.weight" or tied)


def read_bandwidth_gbs(nbytes: int = 0, timeout_s: float = 120.0) -> float | None:
    """GB/s from the profile's read-bandwidth probe (QUICK sizes; nbytes > 0 sets its matrix
    size) in a child process; None, with a warning naming why, when the probe fails."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE, str(int(nbytes))], capture_output=True, text=True,
                             timeout=timeout_s, check=True)
        gbs = float(out.stdout.strip().splitlines()[-1]) / 1e9
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or "").strip().splitlines()
        log.warning("bandwidth probe failed (exit %d): %s", e.returncode, tail[-1] if tail else "no output")
        return None
    except (subprocess.TimeoutExpired, OSError, ValueError, IndexError) as e:
        log.warning("bandwidth probe failed: %s", e)
        return None
    if not gbs > 0:
        log.warning("bandwidth probe returned %r GB/s", gbs)
        return None
    return gbs


def decode_kv_bytes(engine, prompt_tokens: int, gen_tokens: int) -> int:
    """Bytes of KV cache a decode token reads, at the decode's middle position: every layer's K
    and V of every position before it (the floor counted only the weights: up to ~25% low at
    1,024 tokens, a probe)."""
    from .kv.pool import KVPool

    c, kv = engine.config, engine.kv.kv
    held = prompt_tokens + gen_tokens / 2
    if kv.kind == "ring":
        held = min(held, kv.window)
    # one position's K and V in every layer, int8's row scales included (the ring's rows are the
    # pool's): the pool's own count, not a second copy of its layout
    return int(KVPool.nbytes_for(c.n_layers, c.n_kv_heads, c.head_dim, 1, 1, kv.precision) * held)


def floor_fields(weight_bytes: int, decode_tps: float, bandwidths: list[float | None], kv_bytes: int = 0) -> dict:
    """The record's floor fields: (weights + KV) bytes at the median bandwidth measured around
    the runs (of the two probes a length takes, their mean: a spike is halved, not rejected).
    The fastest one set it before: one spike of the probe, 31 to 53 GB/s back to back on a
    shared host, made the ratio 1.4 at one length and 2.5 at the next. None measured, or no
    decode rate: the fields say so with None."""
    measured = [b for b in bandwidths if b]
    rec = {"decode_weight_mb": round(weight_bytes / 1e6, 2), "decode_kv_mb": round(kv_bytes / 1e6, 2),
           "read_bandwidth_gbs": [round(b, 2) if b else None for b in bandwidths],
           "decode_floor_ms": None, "decode_ms_per_token": None, "decode_vs_floor": None}
    if decode_tps > 0:
        rec["decode_ms_per_token"] = round(1e3 / decode_tps, 6)
    if measured:
        floor_ms = (weight_bytes + kv_bytes) / (statistics.median(measured) * 1e9) * 1e3
        rec["decode_floor_ms"] = round(floor_ms, 6)
        if decode_tps > 0:
            rec["decode_vs_floor"] = round(1e3 / decode_tps / floor_ms, 3)
    return rec
