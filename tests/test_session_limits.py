"""A conversation saved at the end of its context loads again (from a helper's long-run probe:
save_session wrote 64 tokens at n_ctx=64, and load_session refused them as "more than the
capacity of 63")."""
from gguf import GGMLQuantizationType as QT

import edgellm
from tests.synthetic import write_tiny_model


def test_a_session_that_filled_the_context_loads_again(tmp_path):
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.Q8_0, seed=3)
    eng = edgellm.load(tm.path, n_ctx=64, threads=1)
    eng.generate("hello there", max_tokens=200, temperature=0, ignore_eos=True)
    assert eng.last_stats.stop_reason == "context_full"
    f = tmp_path / "full.edgesess"
    assert eng.save_session(f) == 64
    fresh = edgellm.load(tm.path, n_ctx=64, threads=1)
    assert fresh.load_session(f)
