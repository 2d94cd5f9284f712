"""Cost model honesty: predicted vs measured time of every matmul op of the real model.

Runs the engine's real forward pass (a prefill chunk of --tokens, then decode steps at that
context), times each matmul call as the engine makes it (weights streaming from memory as they
do in a real run, not a cache-hot microbenchmark), and compares the median per op with the
dispatcher's prediction under the device profile (default: the measured host profile).

    python tools/cost_model_check.py [--model PATH] [--device host] [--tokens 512] [--runs 3]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import numpy as np

import edgellm
from edgellm.backends import reference
from edgellm.dispatch import Dispatcher
from edgellm.ops import MATMUL_KINDS, weight_formats

TOLERANCE = 0.35


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--device", default=None, help="profile to predict with (default: host)")
    ap.add_argument("--tokens", type=int, default=512, help="prefill chunk measured")
    ap.add_argument("--runs", type=int, default=3, help="prefill runs (decode: 16 steps per run)")
    args = ap.parse_args()

    eng = edgellm.load(args.model, args.device, n_ctx=args.tokens + 64, prefill_chunk=args.tokens,
                       units=["reference"])
    cfg = eng.config
    names = {(cfg.q_dim + 2 * cfg.kv_dim, cfg.d_model): "qkv", (cfg.d_model, cfg.q_dim): "attn_out",
             (2 * cfg.d_ff, cfg.d_model): "ffn_gate_up", (cfg.d_model, cfg.d_ff): "ffn_down",
             (cfg.vocab_size, cfg.d_model): "lm_head"}
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    phase = ["prefill"]
    orig_mm, orig_head = reference.matmul, reference.lm_head

    def timed(fn):
        def run(x, w, *rest):
            t0 = time.perf_counter()
            y = fn(x, w, *rest)
            times[(names[w.shape], phase[0])].append(time.perf_counter() - t0)
            return y
        return run

    rng = np.random.default_rng(0)
    reference.matmul, reference.lm_head = timed(orig_mm), timed(orig_head)
    try:
        for _ in range(args.runs):
            seq = eng.kv.new_sequence()
            ids = rng.integers(100, cfg.vocab_size, args.tokens)
            phase[0] = "prefill"
            eng.runner.forward(seq, ids)
            phase[0] = "decode"
            for _ in range(16):
                eng.runner.forward(seq, rng.integers(100, cfg.vocab_size, 1))
            seq.free()
    finally:
        reference.matmul, reference.lm_head = orig_mm, orig_head

    disp = Dispatcher(eng.profile, cfg, weight_formats(eng.model), probe=True, units=eng.plan.units,
                      override=["reference"])
    plans = {"prefill": disp.place("prefill", args.tokens, 0), "decode": disp.place("decode", 1, args.tokens)}
    print(f"profile {eng.profile.name} ({eng.profile.soc}); measured: median over {args.runs} runs x "
          f"{cfg.n_layers} layers; prefill chunk {args.tokens}, decode at context {args.tokens}")
    print(f"{'op':<12} {'phase':<8} {'rows':>5} {'predicted ms':>13} {'measured ms':>12} {'ratio':>6}  within ±35%")
    ok = total = 0
    for ph in ("prefill", "decode"):
        for p in plans[ph].placements:
            if p.kind not in MATMUL_KINDS:
                continue
            measured = statistics.median(times[(p.op, ph)]) * 1e3
            ratio = p.predicted_ms / measured
            good = abs(ratio - 1) <= TOLERANCE
            ok, total = ok + good, total + 1
            rows = 1 if (ph == "decode" or p.op == "lm_head") else args.tokens
            print(f"{p.op:<12} {ph:<8} {rows:>5} {p.predicted_ms:>13.4f} {measured:>12.4f} {ratio:>6.2f}  "
                  f"{'yes' if good else 'NO'}")
    print(f"{ok} of {total} ops ({ok / total:.0%}) predicted within ±{TOLERANCE:.0%}")


if __name__ == "__main__":
    main()
