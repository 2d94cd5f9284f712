"""KV pool faults a probe found under memory pressure: a prompt one token past a cached block was
refused on an idle engine whose pool holds one context (copy-on-write asked for every block at
once, one more than the pool has), and the conversation the engine keeps for its next turn cut a
running answer short (stop_reason context_full)."""
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.errors import ContextFull
from tests.synthetic import write_tiny_model

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("kv28") / "tiny.gguf", tensor_type=QT.F32, seed=6).path


def text_of(eng, n):
    """A text that tokenizes to exactly n tokens."""
    for words in range(n, 4 * n):
        t = " ".join(f"w{i}" for i in range(words))
        ids = eng.tokenize(t)
        if len(ids) >= n:
            t = eng.detokenize(ids[:n], skip_special=True)
            if len(eng.tokenize(t)) == n:
                return t
    raise AssertionError(f"no text of {n} tokens")


@pytest.mark.parametrize("kv_precision", ["f16", "int8"])
def test_a_prompt_one_token_past_a_cached_block_fits_a_pool_of_one_context(model_path, kv_precision):
    fresh = edgellm.load(model_path, n_ctx=80, threads=1, kv_precision=kv_precision)
    block = fresh.kv.pool.block_tokens
    assert fresh.kv.pool.n_blocks * block == 80
    p = text_of(fresh, 4 * block + 1)                  # fills the pool's blocks but the last one
    want = fresh.generate(p, max_tokens=4, **GREEDY)
    eng = edgellm.load(model_path, n_ctx=80, threads=1, kv_precision=kv_precision)
    eng.warm(p)
    eng.warm(p)                                        # ContextFull before
    assert eng.generate(p, max_tokens=4, **GREEDY) == want
    eng.clear_cache()
    eng.warm(text_of(eng, 4 * block))
    assert eng.generate(p, max_tokens=4, **GREEDY) == want
    eng.kv.pool.check()


def test_the_kept_conversation_does_not_cut_a_running_answer_short(model_path):
    eng = edgellm.load(model_path, n_ctx=64, threads=1)
    alone = edgellm.load(model_path, n_ctx=64, threads=1)
    want = alone.generate("a list of fruits:", max_tokens=52, **GREEDY)
    stream = eng.stream("a list of fruits:", max_tokens=52, **GREEDY)
    first = next(stream)
    eng.warm(text_of(eng, 2 * eng.kv.pool.block_tokens + 3))   # kept as the engine's last conversation
    got = first + "".join(stream)
    assert eng.last_stats.stop_reason == "max_tokens" and eng.last_stats.generated_tokens == 52
    assert got == want
    eng.kv.pool.check()


def test_a_cancelled_answer_leaves_its_blocks_for_the_next_turn(model_path):
    """A chat's next turn after a Ctrl-C holds the answer so far: it found nothing cached and
    recomputed the whole conversation (148 tokens, 0 cached, in the probe)."""
    from edgellm.engine import CancelToken

    eng = edgellm.load(model_path, n_ctx=256, threads=1)
    prompt = text_of(eng, 3 * eng.kv.pool.block_tokens + 5)
    cancel = CancelToken()
    pieces = []
    for piece in eng.stream(prompt, max_tokens=100, cancel=cancel, **GREEDY):
        pieces.append(piece)
        if len(pieces) == 5:
            cancel.cancel()
    assert eng.last_stats.stop_reason == "cancelled"
    eng.generate(prompt + "".join(pieces) + " and then", max_tokens=2, **GREEDY)
    assert eng.last_stats.cached_tokens >= 3 * eng.kv.pool.block_tokens
    eng.kv.pool.check()
