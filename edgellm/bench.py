"""`edgellm bench`: load once, then per prompt length warm TTFT (median, p95), prefill and
decode throughput, peak RSS. TTFT runs from the call to the first sampled token, tokenization
included. A warm-up run per length is not counted. "Warm" means the model is loaded and paged
in; the prefix cache is cleared before every measured run, so the prompt itself is computed
(--shared-prefix measures the cached case)."""
from __future__ import annotations

import statistics
import time
from typing import Callable

from .api import Engine, GenerationConfig
from .bench_floor import decode_kv_bytes, decode_weight_bytes, floor_fields
from .procmem import file_rss_mb, reset_peak_rss

# Plain prose, repeated to reach the requested length; varied enough that the tokenizer sees
# ordinary English rather than one repeated token.
_BASE_TEXT = (
    "The lighthouse keeper climbed the spiral stairs each evening, counting the one hundred and "
    "twelve steps out of habit rather than need. Below, the harbour settled into its nightly "
    "rhythm: fishing boats returning with gulls in their wake, nets hung to dry on the sea wall, "
    "children called home for supper. He trimmed the wick, polished the great lens until it "
    "shone, and wrote the weather in his log — wind from the south-west, sea moderate, "
    "visibility good. "
)


def percentile(xs: list[float], q: float) -> float:
    """numpy.percentile's default (linear between the closest ranks), in plain Python: numpy's
    first call pages in ~1.3 MB of its code, which the 512-token runs after it counted in
    their peak RSS as if the runtime used it."""
    s = sorted(xs)
    h = (len(s) - 1) * q / 100
    lo = int(h)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (h - lo)


def prompt_of_length(engine: Engine, n_tokens: int) -> tuple[str, int]:
    """A text that tokenizes to n_tokens (or the closest count found); returns (text, count)."""
    base = engine.tokenize(_BASE_TEXT)
    ids = engine.tokenize(_BASE_TEXT * (n_tokens // max(1, len(base)) + 2))
    m = n_tokens
    best = None
    for _ in range(8):  # re-tokenizing decoded text can merge across the cut; nudge the cut
        # (skip_special: a BOS the tokenizer added is not text; written out, a model that adds
        # BOS got it twice in the count while the engine strips one)
        text = engine.detokenize(ids[:m], skip_special=True)
        got = len(engine.tokenize(text))
        if best is None or abs(got - n_tokens) < abs(best[1] - n_tokens):
            best = (text, got)
        if got == n_tokens:
            break
        m += n_tokens - got
    return best


def memory_fields(engine: Engine) -> dict:
    """RSS right after load (engine.rss_after_load_mb: with the mapped weights paged in when load
    pages them, once the caller has waited for that), the load's peak (engine.load_rss_mb: an NPU
    load's requantization passed ~90 MiB above what stayed) and the bound RSS is held to: 1.5x the model
    file plus the KV cache, which leaves room for the runtime only if the weights stay quantized
    and mapped (a dequantized or repacked copy would not fit). MB = 2^20 bytes, as peak_rss_mb."""
    file_mb = engine.model.file_size / 2**20
    kv_mb = engine.kv.nbytes / 2**20
    out = {"rss_after_load_mb": round(engine.rss_after_load_mb, 1), "rss_load_peak_mb": round(engine.load_rss_mb, 1),
           "model_file_mb": round(file_mb, 1),
           "kv_cache_mb": round(kv_mb, 1), "rss_bound_mb": round(1.5 * file_mb + kv_mb, 1)}
    # where it goes: the model file's pages mapped in (the weights), the KV cache (committed at
    # load), and the rest (interpreter, libraries, tokenizer, the units' buffers): the bound
    # leaves the rest 0.5x the file
    mapped = file_rss_mb(engine.model.path)
    if mapped is not None:
        out["rss_model_mapped_mb"] = round(mapped, 1)
        out["rss_runtime_mb"] = round(engine.rss_after_load_mb - mapped - kv_mb, 1)
    return out


def predicted(engine: Engine, prompt_tokens: int, context: int = 0) -> dict:
    """What the engine's plan predicts for a prompt of `prompt_tokens` after `context` cached
    tokens (the dispatcher's cost model under the engine's profile and chunk): set beside the
    measured figures, it shows how far the model is off on this machine."""
    d = engine.dispatcher
    if d is None:
        return {}
    ttft, tps = d.predict(prompt_tokens, engine.plan.chunk.tokens, context, plan=engine.plan)
    return {"predicted_ttft_ms": round(ttft, 2), "predicted_decode_tps": round(tps, 2)}


def run(engine: Engine, prompt_tokens: list[int], gen_tokens: int, runs: int,
        on_run: Callable[[int, int, dict], None] | None = None,
        bandwidth: Callable[[], float | None] | None = None) -> list[dict]:
    """bandwidth: a read-bandwidth probe (GB/s, or None when it fails), run before and after
    each length's measured runs; the records then carry the decode memory floor
    (bench_floor.floor_fields)."""
    gen = GenerationConfig(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    records = []
    first = None    # (TTFT ms, prompt tokens) of the engine's first request: the cold start's second half
    for n in prompt_tokens:
        text, actual = prompt_of_length(engine, n)
        # warm-up: page in weights, BLAS thread start; with the prefix cache cleared, or the
        # previous length's prompt and answer served most of it (a helper: 527 of 1024 tokens)
        engine.clear_cache()
        engine.generate(text, config=gen)
        if first is None:
            first = (engine.last_stats.ttft_ms, engine.last_stats.prompt_tokens)
        bw = [bandwidth()] if bandwidth else []
        # this length's own peak: VmHWM is the process's, which the load (or an earlier length)
        # set; every row showed the same figure (clear_refs 5 resets the mark, Linux 4.0+)
        reset_peak_rss()
        ttft, prefill_tps, decode_tps, rss = [], [], [], []
        for r in range(runs):
            engine.clear_cache()  # the same prompt again would come from the prefix cache
            engine.generate(text, config=gen)
            s = engine.last_stats
            ttft.append(s.ttft_ms)
            prefill_tps.append(s.prompt_tokens / (s.prefill_ms / 1e3))
            decode_tps.append(s.decode_tps)
            rss.append(s.peak_rss_mb)
            if on_run:
                on_run(n, r, {"ttft_ms": s.ttft_ms, "decode_tps": s.decode_tps})
        if bandwidth:
            bw.append(bandwidth())
        records.append({
            "prompt_tokens": actual,
            "ttft_ms_p50": round(statistics.median(ttft), 2),
            "ttft_ms_p95": round(percentile(ttft, 95), 2),
            "prefill_tps": round(statistics.median(prefill_tps), 2),
            "decode_tps": round(statistics.median(decode_tps), 2),
            "peak_rss_mb": round(max(rss), 1),
            "load_ms": round(engine.load_ms, 1),
            "first_request_ttft_ms": round(first[0], 2),
            "first_request_tokens": first[1],
            **memory_fields(engine),
            "gen_tokens": gen_tokens,
            "runs": runs,
            "threads": engine.threads,
            **predicted(engine, actual),
        })
        if bandwidth:
            records[-1].update(floor_fields(decode_weight_bytes(engine.model), statistics.median(decode_tps), bw,
                                            decode_kv_bytes(engine, actual, gen_tokens)))
    return records


def run_concurrent(engine: Engine, long_tokens: int, short_tokens: int, delay_ms: float, gen_tokens: int,
                   runs: int, chunk: int = 128, on_run: Callable[[str, int, dict], None] | None = None) -> dict:
    """A long prefill, then a short request `delay_ms` later: the short one's TTFT when the
    scheduler interleaves, against its TTFT when queued behind the long one (FIFO), in one run.
    The long request takes its first token only: queued behind its whole answer, the baseline
    also counted its decode (~18% of it at 64 tokens), flattering the ratio."""
    from .scheduler import Scheduler

    long_text, long_n = prompt_of_length(engine, long_tokens)
    short_text, short_n = prompt_of_length(engine, short_tokens)
    kw = dict(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    with Scheduler(engine, chunk=chunk) as s:
        s.submit(short_text, **kw).result()  # warm-up
    # the policies alternate run by run (all of one, then all of the other, put a drifting host's
    # speed into the ratio); one Scheduler at a time, as the module asks
    times: dict[str, tuple[list[float], list[float]]] = {"interleave": ([], []), "fifo": ([], [])}
    for r in range(runs):
        for policy in (("interleave", "fifo") if r % 2 == 0 else ("fifo", "interleave")):
            with Scheduler(engine, chunk=chunk, policy=policy) as s:
                # the worker is idle between runs; a cached long prompt would shorten the baseline
                engine.clear_cache()
                long = s.submit(long_text, **{**kw, "max_tokens": 1})
                time.sleep(delay_ms / 1e3)
                short = s.submit(short_text, **kw)
                short.result()
                long.result()
            times[policy][0].append(short.stats.ttft_ms)
            times[policy][1].append(long.stats.ttft_ms)
            if on_run:
                on_run(policy, r, {"short_ttft_ms": short.stats.ttft_ms, "long_ttft_ms": long.stats.ttft_ms})
    out = {p: [statistics.median(a), statistics.median(b)] for p, (a, b) in times.items()}
    return {
        "scenario": "concurrent", "long_prompt_tokens": long_n, "short_prompt_tokens": short_n,
        "delay_ms": delay_ms, "chunk": chunk, "runs": runs, "threads": engine.threads,
        "short_ttft_ms_p50_interleaved": round(out["interleave"][0], 1),
        "short_ttft_ms_p50_queued": round(out["fifo"][0], 1),
        "short_ttft_ratio": round(out["interleave"][0] / out["fifo"][0], 3),
        "long_ttft_ms_p50_interleaved": round(out["interleave"][1], 1),
        "long_ttft_ms_p50_queued": round(out["fifo"][1], 1),
    }


def run_shared_prefix(engine: Engine, prefix_tokens: int, suffix_tokens: list[int], gen_tokens: int, runs: int,
                      on_run: Callable[[int, int, dict], None] | None = None) -> list[dict]:
    """A `prefix_tokens` system prompt shared by requests that differ in a `suffix_tokens` user
    message: cold TTFT (prefix cache cleared) and TTFT with the prefix warmed, in one run. Each
    run uses a different user message, so only the prefix can come from the cache."""
    prefix, _ = prompt_of_length(engine, prefix_tokens)
    prefix = prefix.rstrip() + "\n"  # a newline ends a pre-token: the prefix tokenizes the same alone
    gen = GenerationConfig(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True)
    records = []
    for n in suffix_tokens:
        base, _ = prompt_of_length(engine, n + 8)
        cold, cached, cached_tokens, prefill_tps, decode_tps, rss = [], [], [], [], [], []
        nxt, nxt_tokens = [], []
        for r in range(runs + 1):  # run 0 warms up and is not counted
            text = prefix + engine.detokenize(engine.tokenize(f"Message {r}: " + base)[:n], skip_special=True)
            engine.clear_cache()
            engine.generate(text, config=gen)
            s = engine.last_stats
            cold_ttft, total = s.ttft_ms, s.prompt_tokens
            prefill_tps.append(s.prompt_tokens / (s.prefill_ms / 1e3))
            engine.clear_cache()
            engine.warm(prefix)
            engine.generate(text, config=gen)
            s = engine.last_stats
            # the next user on the same system prompt: the prefix from the prefix cache's full
            # blocks, after another request (the warm-then-ask case above continues the warmed
            # sequence in place, its last partial block included, with its KV still in cache)
            other = prefix + engine.detokenize(engine.tokenize(f"Reply {r}: " + base)[:n], skip_special=True)
            engine.generate(other, config=gen)
            s2 = engine.last_stats
            if r == 0:
                continue
            nxt.append(s2.ttft_ms)
            nxt_tokens.append(s2.cached_tokens)
            cold.append(cold_ttft)
            cached.append(s.ttft_ms)
            cached_tokens.append(s.cached_tokens)
            decode_tps.append(s.decode_tps)
            rss.append(s.peak_rss_mb)
            if on_run:
                on_run(n, r - 1, {"ttft_ms": cold_ttft, "ttft_ms_cached": s.ttft_ms, "cached": s.cached_tokens})
        records.append({
            "prompt_tokens": total,
            "ttft_ms_p50": round(statistics.median(cold), 2),
            "ttft_ms_p95": round(percentile(cold, 95), 2),
            "ttft_ms_p50_cached": round(statistics.median(cached), 2),
            "cached_prefix_tokens": int(statistics.median(cached_tokens)),
            "cached_ttft_ratio": round(statistics.median(cached) / statistics.median(cold), 4),
            "ttft_ms_p50_cached_next": round(statistics.median(nxt), 2),
            "cached_prefix_tokens_next": int(statistics.median(nxt_tokens)),
            "cached_ttft_ratio_next": round(statistics.median(nxt) / statistics.median(cold), 4),
            "prefill_tps": round(statistics.median(prefill_tps[1:]), 2),
            "decode_tps": round(statistics.median(decode_tps), 2),
            "peak_rss_mb": round(max(rss), 1),
            "load_ms": round(engine.load_ms, 1),
            **memory_fields(engine),
            # the prefix as run: the newline that ends it can add a token to the length asked for
            "shared_prefix_tokens": len(engine.tokenize(prefix)), "gen_tokens": gen_tokens, "runs": runs,
            "threads": engine.threads,
            **predicted(engine, total),
            **{f"{k}_cached": v for k, v in predicted(engine, total - int(statistics.median(cached_tokens)),
                                                        int(statistics.median(cached_tokens))).items()},
        })
    return records
