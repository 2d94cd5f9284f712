"""TTFT / prefill / decode of edgellm and llama.cpp (llama-cpp-python) on the same model, same
prompts, same thread count, measured alternately in one process so both see the same machine.

    python tools/compare_llama_cpp.py [--model PATH] [--prompt-tokens 128,512,1024] [--runs 5]

Needs llama-cpp-python (not a dependency of edgellm). TTFT for both runs from the call with the
prompt text to the first sampled token, tokenization included. Prints a table and, with --json,
writes the medians and the edgellm / llama.cpp ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def _last_logits(llm) -> np.ndarray:
    # with logits_all=False llama.cpp keeps one output row: the last evaluated position
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def llama_cpp_once(llm, text: str, gen: int) -> tuple[float, float, int]:
    """(ttft_ms, decode tok/s, prompt tokens) with greedy decoding and EOS ignored."""
    t0 = time.perf_counter()
    ids = llm.tokenize(text.encode(), add_bos=True, special=True)
    llm.reset()
    llm.eval(ids)
    tok = int(np.argmax(_last_logits(llm)))
    ttft = (time.perf_counter() - t0) * 1e3
    t1 = time.perf_counter()
    for _ in range(gen - 1):
        llm.eval([tok])
        tok = int(np.argmax(_last_logits(llm)))
    dt = time.perf_counter() - t1
    return ttft, (gen - 1) / dt if dt > 0 else 0.0, len(ids)


def main() -> None:
    import llama_cpp

    import edgellm
    from edgellm.api import GenerationConfig
    from edgellm.bench import prompt_of_length

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: the registry's default model)")
    ap.add_argument("--prompt-tokens", default="128,512,1024")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--units", default=None, help="edgellm --units (default: the dispatcher's plan)")
    args = ap.parse_args()
    lengths = [int(x) for x in args.prompt_tokens.split(",")]
    n_ctx = max(lengths) + args.gen_tokens + 16

    t = time.perf_counter()
    eng = edgellm.load(args.model, n_ctx=max(n_ctx, 2048), threads=args.threads, units=args.units)
    print(f"edgellm plan: prefill on {sorted({p.unit for p in eng.plan.prefill.placements})}, decode on "
          f"{sorted({p.unit for p in eng.plan.decode.placements})}, chunk {eng.plan.chunk.tokens}")
    edge_load = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    # logits_all=False: llama.cpp computes the lm_head for the last position only, as edgellm does
    llm = llama_cpp.Llama(eng.model.path, n_ctx=max(n_ctx, 2048), n_batch=max(lengths), n_ubatch=512,
                          n_threads=args.threads, n_threads_batch=args.threads, logits_all=False, verbose=False)
    llama_load = (time.perf_counter() - t) * 1e3
    gen = GenerationConfig(max_tokens=args.gen_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for n in lengths:
        text, actual = prompt_of_length(eng, n)
        eng.clear_cache()   # (or the previous length's prompt and answer serve part of the warm-up)
        eng.generate(text, config=gen)
        llama_cpp_once(llm, text, args.gen_tokens)  # warm-ups
        e_ttft, e_dec, l_ttft, l_dec = [], [], [], []
        for _ in range(args.runs):
            eng.clear_cache()  # measure the prompt computed, not served from the prefix cache
            eng.generate(text, config=gen)
            e_ttft.append(eng.last_stats.ttft_ms)
            e_dec.append(eng.last_stats.decode_tps)
            a, b, _ = llama_cpp_once(llm, text, args.gen_tokens)
            l_ttft.append(a)
            l_dec.append(b)
        row = {"prompt_tokens": actual,
               "edgellm_ttft_ms_p50": statistics.median(e_ttft), "llama_cpp_ttft_ms_p50": statistics.median(l_ttft),
               "edgellm_decode_tps": statistics.median(e_dec), "llama_cpp_decode_tps": statistics.median(l_dec)}
        row["ttft_ratio"] = row["edgellm_ttft_ms_p50"] / row["llama_cpp_ttft_ms_p50"]
        row["decode_ratio"] = row["edgellm_decode_tps"] / row["llama_cpp_decode_tps"]
        rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
        r = rows[-1]
        print(f"{actual:>5} tok  TTFT edgellm {r['edgellm_ttft_ms_p50']:7.0f} ms  llama.cpp {r['llama_cpp_ttft_ms_p50']:7.0f} ms"
              f"  ratio {r['ttft_ratio']:.2f}   decode edgellm {r['edgellm_decode_tps']:5.1f}  llama.cpp "
              f"{r['llama_cpp_decode_tps']:5.1f} tok/s  ratio {r['decode_ratio']:.2f}", flush=True)
    print(f"load: edgellm {edge_load:.0f} ms, llama.cpp {llama_load:.0f} ms; threads {args.threads}, runs {args.runs}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"llama_cpp_python": llama_cpp.__version__, "threads": args.threads, "runs": args.runs,
                       "load_ms": {"edgellm": edge_load, "llama_cpp": llama_load}, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
