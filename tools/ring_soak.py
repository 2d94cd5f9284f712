"""Generate one long conversation on the ring-buffer KV and report memory as it goes.

    python tools/ring_soak.py [--tokens 8192] [--window 1024] [--sinks 4] [--model PATH]

Prints peak and current RSS at 1k-token steps and text samples from the start, the middle and
the end, so a reader can judge coherence; --json writes the figures.
"""
from __future__ import annotations

import argparse
import json
import resource
import time

import psutil

import edgellm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    eng = edgellm.load(args.model, kv="ring", window=args.window, sinks=args.sinks, threads=args.threads)
    prompt = eng.render_chat([{"role": "user", "content":
                               "Tell me a long, detailed story about a lighthouse keeper and the town "
                               "around the lighthouse, chapter by chapter."}])
    proc = psutil.Process()
    marks, pieces, text = [], [], []
    t0 = time.perf_counter()
    for piece in eng.stream(prompt, max_tokens=args.tokens, temperature=0.7, top_k=40, top_p=0.95,
                            repeat_penalty=1.1, seed=1, ignore_eos=True):
        text.append(piece)
        n = eng.last_stats.generated_tokens
        if n % 1024 == 0 and (not marks or marks[-1]["tokens"] != n):
            marks.append({"tokens": n, "rss_mb": round(proc.memory_info().rss / 2**20, 1),
                          "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                          "ring_tokens": eng.kv.ring.n_tokens, "elapsed_s": round(time.perf_counter() - t0, 1)})
            print(marks[-1], flush=True)
            pieces.append("".join(text[-40:]))
    full = "".join(text)
    third = len(full) // 3
    for name, at in (("start", 0), ("middle", third), ("end", len(full) - 600)):
        print(f"--- {name} ---\n{full[at:at + 600]}\n")
    print(f"generated {eng.last_stats.generated_tokens} tokens at {eng.last_stats.decode_tps:.1f} tok/s, "
          f"KV {eng.kv.nbytes / 2**20:.1f} MiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"window": args.window, "sinks": args.sinks, "marks": marks,
                       "kv_mib": eng.kv.nbytes / 2**20, "decode_tps": eng.last_stats.decode_tps,
                       "text": full}, f, indent=1)


if __name__ == "__main__":
    main()
