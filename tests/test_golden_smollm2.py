"""The real model (SmolLM2-135M-Instruct Q4_1) against llama.cpp's golden outputs, written by
tools/make_golden.py with llama-cpp-python. Two goldens, same texts:

- golden_smollm2_f32.json: llama.cpp on the same weights dequantized to F32 (--dequantize).
  edgellm dequantizes bit-identically (tests/test_quant.py) and computes in fp32, so this is the
  strict check of the forward pass: the issue's targets (top-1 >= 98%, mean KL <= 0.02, greedy
  identical for >= 4 of 5 prompts) with a tighter KL bound on top.
- golden_smollm2.json: llama.cpp on the Q4_1 file itself. There llama.cpp rounds every matmul
  input to 8-bit blocks (Q8_1/Q8_0) and its KV cache to f16, edgellm does not; measured, that
  rounding makes llama.cpp disagree with itself: with only its KV cache switched from f16 to
  f32, its top-1 agreement over these 275 positions is 97.8% and its mean KL 0.0033 (measured
  with llama-cpp-python 0.3.36), the same size as its distance to edgellm (97.1%, 0.0025). The bounds below are the measured
  level with margin, so a real regression still fails; the issue's 98% / 4-of-5 are checked on
  the F32 golden.

The golden file keeps llama.cpp's top-20 logprobs per position plus the remaining mass, so KL is
computed over those 20 tokens and one "rest" bucket: by the log-sum inequality this never
exceeds the full-vocabulary KL, so it is a lower bound, reported as such.
"""
import json
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).parent / "data"
GOLDEN = json.loads((DATA / "golden_smollm2.json").read_text())
# name -> (golden, min top-1, max mean KL, min identical greedy continuations of 5)
CASES = {
    "f32": (json.loads((DATA / "golden_smollm2_f32.json").read_text()), 0.98, 0.001, 4),
    "q4_1": (GOLDEN, 0.96, 0.02, 2),
}
pytestmark = pytest.mark.model


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def bucketed_kl(top, edgellm_logprobs):
    """KL(p || q) over llama.cpp's top ids plus one bucket for everything else."""
    ids = np.array([t[0] for t in top])
    lp = np.array([t[1] for t in top])
    p, q = np.exp(lp), np.exp(edgellm_logprobs[ids])
    kl = float((p * (lp - edgellm_logprobs[ids])).sum())
    p_rest, q_rest = max(1.0 - p.sum(), 0.0), max(1.0 - q.sum(), 1e-12)
    if p_rest > 1e-9:
        kl += p_rest * np.log(p_rest / q_rest)
    return kl


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return request.param, *CASES[request.param]


def agreement(engine, golden) -> dict:
    """Per-position bucketed KL and top-1 agreement of `engine` with a golden file's logprobs."""
    kls, agree, n = [], 0, 0
    for text in golden["logprobs"]:
        lp = log_softmax(engine.logits(text["ids"]))
        for i, pos in enumerate(text["positions"]):
            kls.append(bucketed_kl(pos["top"], lp[i]))
            agree += int(np.argmax(lp[i])) == pos["top"][0][0]
            n += 1
    return {"kl": np.array(kls), "top1": agree / n, "n": n}


@pytest.fixture(scope="module")
def measured(real_engine, case):
    return {**agreement(real_engine, case[1]), "name": case[0], "min_top1": case[2], "max_kl": case[3]}


def test_enough_positions(measured):
    assert measured["n"] >= 200


def test_top1_agreement(measured):
    print(f"\n[{measured['name']}] top-1 agreement {measured['top1']:.4f} over {measured['n']} positions")
    assert measured["top1"] >= measured["min_top1"]


def test_mean_kl(measured):
    kl = measured["kl"]
    print(f"\n[{measured['name']}] KL(llama.cpp || edgellm) mean {kl.mean():.2e}, max {kl.max():.2e} nats")
    assert kl.mean() <= measured["max_kl"]


def _greedy(engine, prompt_ids, n):
    r, seq = engine.runner, engine._new_sequence()
    logits = r.forward(seq, prompt_ids)
    out = []
    for _ in range(n):
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = r.forward(seq, [tok])
    seq.free()
    return out


def test_greedy_continuations(real_engine, case):
    name, golden, _, _, min_identical = case
    identical, explained = 0, 0
    for g in golden["greedy"]:
        ours = _greedy(real_engine, g["prompt_ids"], len(g["ids"]))
        if ours == g["ids"]:
            identical += 1
            continue
        first = next(i for i, (a, b) in enumerate(zip(ours, g["ids"])) if a != b)
        gap = g["top1_top2_gap"][first]
        print(f"\n{g['text'][:40]!r}: diverges at step {first}, llama.cpp top-2 gap {gap:.4f}")
        explained += gap < 0.05
    print(f"\n[{name}] greedy identical {identical}/5, near-tie (< 0.05) divergences {explained}")
    assert identical >= min_identical
    if min_identical >= 4:
        assert identical + explained == len(golden["greedy"])


def test_tokenizer_ids_match(real_engine):
    for case in GOLDEN["tokenize"]:
        assert real_engine.tokenize(case["text"], add_bos=case["add_bos"]) == case["ids"], case["text"]
