"""Issue 8's table: each precision plan against llama.cpp's golden distributions (mean KL, top-1)
on both execution paths, then `edgellm bench` per plan (TTFT, decode tok/s, peak RSS), one
process per plan so that peak RSS is that plan's.

    python tools/precision_table.py [--plans quality,balanced,fast,PATH.yaml] [--runs 3] [--json OUT]

The golden is tests/data/golden_smollm2.json (llama.cpp on the Q4_1 file) and _f32.json (on the
same weights dequantized to F32). Quality is measured twice, through the two paths a plan's
compute precision can differ on: `prefill` (the whole text in one forward with all logits, the
prefill placement) and `decode` (teacher-forced, one decode step per token, the decode
placement). KL is the bucketed lower bound of tests/test_golden_smollm2.py.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def agreement(engine, golden: dict, phase: str) -> tuple[float, float, int]:
    """(mean bucketed KL, top-1 agreement, positions) of engine's `phase` path with a golden."""
    from edgellm.precision_search import teacher_forced_logits
    from tests.test_golden_smollm2 import bucketed_kl, log_softmax

    kls, agree, n = [], 0, 0
    for text in golden["logprobs"]:
        lp = log_softmax(teacher_forced_logits(engine, text["ids"], phase))
        for i, pos in enumerate(text["positions"]):
            kls.append(bucketed_kl(pos["top"], lp[i]))
            agree += int(np.argmax(lp[i])) == pos["top"][0][0]
            n += 1
    return float(np.mean(kls)), agree / n, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", default="quality,balanced,fast")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import edgellm

    goldens = {name: json.loads((ROOT / "tests" / "data" / f"golden_smollm2{suffix}.json").read_text())
               for name, suffix in (("q4_1", ""), ("f32", "_f32"))}
    rows = []
    for plan in args.plans.split(","):
        eng = edgellm.load(precision=plan, n_ctx=512)
        row = {"plan": plan, "units": ",".join(eng.plan.units_used())}
        for phase in ("prefill", "decode"):
            for g, golden in goldens.items():
                kl, top1, n = agreement(eng, golden, phase)
                row[f"{g}_{phase}_kl"], row[f"{g}_{phase}_top1"] = kl, top1
                print(f"{plan}: {phase} path vs {g} golden: KL {kl:.4f}, top-1 {top1:.4f} ({n} positions)",
                      flush=True)
        del eng
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, "-m", "edgellm.cli", "bench", "--precision", plan, "--prompt-tokens",
                   str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens), "--runs", str(args.runs),
                   "--json", f.name]
            subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
            rec = json.loads(Path(f.name).read_text())[0]
        row.update(ttft_ms=rec["ttft_ms_p50"], decode_tps=rec["decode_tps"], peak_rss_mb=rec["peak_rss_mb"])
        print(f"{plan}: TTFT({args.prompt_tokens}) {rec['ttft_ms_p50']:.0f} ms, decode {rec['decode_tps']:.1f} tok/s, "
              f"peak RSS {rec['peak_rss_mb']:.0f} MB", flush=True)
        rows.append(row)
    print("\n| plan | KL / top-1 vs Q4_1 golden, prefill path | decode path | vs F32 golden, prefill | decode "
          "| TTFT(512) ms | decode tok/s | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cell = lambda g, ph: f"{r[f'{g}_{ph}_kl']:.4f} / {100 * r[f'{g}_{ph}_top1']:.2f}%"  # noqa: E731
        print(f"| {r['plan']} | {cell('q4_1', 'prefill')} | {cell('q4_1', 'decode')} | {cell('f32', 'prefill')} | "
              f"{cell('f32', 'decode')} | {r['ttft_ms']:.0f} | {r['decode_tps']:.1f} | {r['peak_rss_mb']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
