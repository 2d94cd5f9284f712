"""KV behaviour on the real model: chunked prefill equals one pass, int8 KV stays close to fp16
against llama.cpp's golden distributions, and a saved session continues in a new process exactly
as the process that never stopped."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import edgellm

pytestmark = pytest.mark.model
GOLDEN = json.loads((Path(__file__).parent / "data" / "golden_smollm2.json").read_text())


@pytest.mark.parametrize("precision,bound", [("f32", 1e-4), ("f16", 2e-2)])
def test_chunked_prefill_equals_unchunked(real_model_path, precision, bound):
    """Max |logit diff| on the last position, chunks of 64 / 7 / 1 against one pass. fp32 KV
    meets the issue's 1e-4 (measured <= 4.4e-5). With f16 KV the bound is looser: BLAS rounds a
    7-row GEMM differently from a 300-row one in the last fp32 bit, which flips some K/V values
    to the neighbouring f16 (measured up to 9e-3)."""
    # one unit: with the default plan a 1-token call is a decode step, which may run on another unit
    e = edgellm.load(real_model_path, n_ctx=1024, kv_precision=precision, units=["reference"])
    text = " ".join(t["text"] for t in GOLDEN["logprobs"])
    ids = e.tokenize(text)[:300]

    def last_logits(ids, chunk):
        seq = e._new_sequence()
        try:
            return e.runner.forward(seq, ids, chunk=chunk)
        finally:
            seq.free()

    one, one_100 = last_logits(ids, 512), last_logits(ids[:100], 512)
    diffs = {c: float(np.abs(last_logits(ids, c) - one).max()) for c in (64, 7)}
    diffs[1] = float(np.abs(last_logits(ids[:100], 1) - one_100).max())  # 100 single-token calls
    print(f"\n{precision} KV: max |logit diff| vs one pass by chunk size: {diffs}")
    assert max(diffs.values()) <= bound


def _mean_kl(engine):
    kls = []
    for text in GOLDEN["logprobs"]:
        lg = engine.logits(text["ids"]).astype(np.float64)
        lp = lg - lg.max(-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
        for i, pos in enumerate(text["positions"]):
            ids = [t[0] for t in pos["top"]]
            ref = np.array([t[1] for t in pos["top"]])
            p = np.exp(ref)
            kl = float((p * (ref - lp[i][ids])).sum())
            rest, q_rest = max(1 - p.sum(), 0.0), max(1 - np.exp(lp[i][ids]).sum(), 1e-12)
            kls.append(kl + (rest * np.log(rest / q_rest) if rest > 1e-9 else 0.0))
    return float(np.mean(kls))


def test_int8_kv_adds_little_kl(real_engine, real_model_path):
    f16 = _mean_kl(real_engine)
    int8 = _mean_kl(edgellm.load(real_model_path, n_ctx=1024, kv_precision="int8"))
    print(f"\nmean KL vs llama.cpp: f16 KV {f16:.5f}, int8 KV {int8:.5f}, added {int8 - f16:.5f} nats")
    assert int8 - f16 <= 0.01


CONTINUE = """
import sys, edgellm
e = edgellm.load(sys.argv[1], n_ctx=1024)
assert e.load_session(sys.argv[2]), "session did not load"
print(e.generate(sys.argv[3], max_tokens=24, temperature=0, ignore_eos=True), end="")
"""


def test_session_continues_in_a_new_process(real_engine, real_model_path, tmp_path):
    e = real_engine
    first = e.render_chat([{"role": "user", "content": "Name three colours of the rainbow."}])
    answer = e.generate(first, max_tokens=20, temperature=0, ignore_eos=True)
    path = tmp_path / "chat.edgesess"
    e.save_session(path)
    follow = first + answer + "\nAnd three more?"
    never_stopped = e.generate(follow, max_tokens=24, temperature=0, ignore_eos=True)
    out = subprocess.run([sys.executable, "-c", CONTINUE, real_model_path, str(path), follow],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == never_stopped


def test_chunked_prefill_on_neon_matches_one_pass(real_model_path):
    """The default (neon) unit, f16 KV: chunkings whose last chunk has 24 rows or more give the
    one pass's logits (measured: identical). Not asserted, because it is not so: with a last chunk
    of a few rows (16 and under measured) the two threads split each row's keys in the attention
    and merge partial softmaxes, another fp32 summation order, and that rounding flips int8
    activations downstream: 0.3-0.8 in the logits, same top token (one thread: identical; a
    1-token chunk, which runs the decode kernels: 0.02)."""
    e = edgellm.load(real_model_path, n_ctx=1024)
    text = " ".join(t["text"] for t in GOLDEN["logprobs"]) * 3
    ids = e.tokenize(text)[:600]
    assert len(ids) == 600

    def last_logits(chunk):
        seq = e._new_sequence()
        try:
            return e.runner.forward(seq, ids, chunk=chunk)
        finally:
            seq.free()

    one = last_logits(600)
    diffs = {c: float(np.abs(last_logits(c) - one).max()) for c in (512, 100, 75)}   # last chunks 88, 100, 75
    print(f"\nneon, f16 KV: max |logit diff| vs one pass by chunk size: {diffs}")
    assert max(diffs.values()) <= 1e-3
