"""Engine.logits of a long prompt held its chunks' logits in a list, then their concatenation,
then a float32 copy of that: twice the result at its peak (1.8 GB for 4k SmolLM2 tokens, a
helper's long-context probe). Each chunk's rows now go straight into the result."""
from __future__ import annotations

import tracemalloc

import numpy as np
from gguf import GGMLQuantizationType as QT

import edgellm
from tests.synthetic import write_tiny_model


def test_logits_peak_memory_is_about_the_result(tmp_path):
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.Q8_0, vocab_size=1300, context_length=1024, seed=1)
    eng = edgellm.load(tm.path, n_ctx=1024, prefill_chunk=64)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 1300, 600)]
    eng.logits(ids[:10])                      # first-call allocations (scratch, tables) out of the way
    tracemalloc.start()
    try:
        out = eng.logits(ids)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out.shape == (600, 1300) and out.dtype == np.float32
    assert peak < 1.6 * out.nbytes, (peak, out.nbytes)      # 2.13x before
    # the first chunk's rows are those of its 64 ids alone (the rows do not depend on the chunking)
    eng.clear_cache()
    np.testing.assert_array_equal(out[:64], eng.logits(ids[:64]))
