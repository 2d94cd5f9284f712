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


def test_loading_a_session_keeps_the_warmed_prompts(tmp_path):
    """load_session emptied the whole prefix cache: an app that warm()ed its system prompts
    lost them on every session load and paid their full prefill again, without a word."""
    tm = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.Q8_0, seed=3)
    eng = edgellm.load(tm.path, n_ctx=256, threads=1)
    eng.generate("an unrelated conversation", max_tokens=8, temperature=0)
    f = tmp_path / "other.edgesess"
    eng.save_session(f)
    system = "You are a helpful assistant who answers briefly. " * 3
    eng.warm(system)
    assert eng.load_session(f)
    eng.generate(system + "Hi!", max_tokens=1, temperature=0)
    bt = eng.kv.pool.block_tokens
    assert eng.last_stats.cached_tokens >= len(eng.tokenize(system)) // bt * bt > 0
