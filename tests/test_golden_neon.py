"""The real model with every op on the neon unit against llama.cpp's goldens.

The issue asks top-1 >= 98% and mean KL <= 0.02: checked on the F32 golden (llama.cpp computing
in fp32 on the dequantized weights), as for the reference unit. Measured (2026-11-21): 98.55%,
KL 0.0022. The neon matmuls round activations to int8 blocks (SDOT); the output head keeps fp32
activations against its Q8_0 blocks: with an int8 head, top-1 was 97.45% (the head's near-ties
pick the token). Against the Q4_1 golden (llama.cpp with its own 8-bit activations and f16 KV
cache) 97.1%, KL 0.0024: the reference unit's own level, checked at the foundation's bound.

Greedy continuations diverge from llama.cpp's (0 of 5 identical on either golden): the int8
activation rounding of 30 layers moves logits by up to a few tenths, and these continuations pass
through near-ties (measured gaps at the first divergence 0.006-0.28). The check is that every
divergence happens at such a tie: llama.cpp's own top-1/top-2 gap there is under 0.5."""
import pytest

from tests.test_golden_smollm2 import CASES, _greedy, agreement

pytestmark = pytest.mark.model
# golden -> (min top-1, max mean KL)
BOUNDS = {"f32": (0.98, 0.02), "q4_1": (0.96, 0.02)}
NEAR_TIE = 0.5


@pytest.fixture(scope="module")
def neon_engine(real_model_path):
    import edgellm

    eng = edgellm.load(real_model_path, n_ctx=1024, units=["neon"])
    used = {p.op: p.unit for p in eng.plan.prefill.placements}
    assert used["qkv"] == used["attention"] == used["ffn_down"] == used["lm_head"] == "neon", used
    return eng


@pytest.fixture(scope="module", params=list(BOUNDS))
def measured(neon_engine, request):
    return {**agreement(neon_engine, CASES[request.param][0]), "name": request.param}


def test_neon_top1_agreement_with_llama_cpp(measured):
    print(f"\n[neon vs {measured['name']}] top-1 agreement {measured['top1']:.4f} over {measured['n']} "
          f"positions, mean KL {measured['kl'].mean():.5f}")
    assert measured["n"] >= 200
    assert measured["top1"] >= BOUNDS[measured["name"]][0]


def test_neon_mean_kl(measured):
    assert measured["kl"].mean() <= BOUNDS[measured["name"]][1]


@pytest.mark.parametrize("golden", list(BOUNDS))
def test_neon_greedy_diverges_only_at_near_ties(neon_engine, golden):
    identical, gaps = 0, []
    for g in CASES[golden][0]["greedy"]:
        ours = _greedy(neon_engine, g["prompt_ids"], len(g["ids"]))
        if ours == g["ids"]:
            identical += 1
            continue
        first = next(i for i, (a, b) in enumerate(zip(ours, g["ids"])) if a != b)
        gaps.append(g["top1_top2_gap"][first])
    print(f"\n[neon vs {golden}] greedy identical {identical} of 5; top-2 gaps at divergences "
          f"{[round(x, 4) for x in gaps]}")
    assert all(x < NEAR_TIE for x in gaps), gaps
