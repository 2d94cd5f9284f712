"""The KV caches inside the engine, on tiny models: prefix reuse, multi-turn continuation,
cancellation at many points, sessions (round trip, mutations are misses), the ring buffer."""
import os
import random

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.errors import ConfigError, ContextFull
from tests.cancel_after import CancelAfter
from tests.synthetic import write_tiny_model

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("kv") / "tiny.gguf", tensor_type=QT.F16, seed=8,
                            context_length=4096).path


def load(path, **kw):
    return edgellm.load(path, n_ctx=kw.pop("n_ctx", 512), threads=1, **kw)


def text_of(engine, n, seed=0):
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "theta", "kappa", "mu"]
    ids = engine.tokenize(" ".join(rng.choice(words) for _ in range(n)))
    return engine.detokenize(ids[:n])


def test_warm_prefix_is_reused_and_output_unchanged(tiny_path):
    e = load(tiny_path)
    system = text_of(e, 100, seed=1) + "\n"
    prompt = system + text_of(e, 20, seed=2)
    cold = e.generate(prompt, max_tokens=8, **GREEDY)
    assert e.last_stats.cached_tokens == 0  # a fresh engine has nothing cached
    e.clear_cache()
    assert e.warm(system) == len(e.tokenize(system))
    warm = e.generate(prompt, max_tokens=8, **GREEDY)
    assert e.last_stats.cached_tokens >= len(e.tokenize(system)) - 16
    assert warm == cold


def test_a_warm_that_does_not_fit_keeps_nothing_and_the_engine_usable(tiny_path):
    """A text longer than the context is refused up front; one that runs out of pool room beside
    a live request (mid-prefill) frees what it took (it used to stay a live sequence: every
    later request failed with ContextFull)."""
    e = load(tiny_path, n_ctx=256)
    pool = e.kv.pool
    want = e.generate(text_of(e, 30, seed=4), max_tokens=6, **GREEDY)
    e.clear_cache()
    free0 = pool.free_blocks
    with pytest.raises(ContextFull, match=r"warm: the text has 3.. tokens but must be shorter than the context \(256 tokens\)"):
        e.warm(text_of(e, 300, seed=5))
    it = e.stream(text_of(e, 150, seed=6), max_tokens=50, **GREEDY)
    next(it)                                          # a live request holding ~10 of 16 blocks
    with pytest.raises(ContextFull, match="KV pool full"):
        e.warm(text_of(e, 150, seed=7))
    it.close()
    assert not pool._live - {e.kv.last}
    e.clear_cache()
    assert pool.free_blocks == free0
    assert e.generate(text_of(e, 30, seed=4), max_tokens=6, **GREEDY) == want


def test_multi_turn_continues_in_place(tiny_path):
    e = load(tiny_path)
    first = text_of(e, 60, seed=3)
    answer = e.generate(first, max_tokens=10, **GREEDY)
    follow = first + answer + text_of(e, 10, seed=4)
    e.generate(follow, max_tokens=4, **GREEDY)
    # everything but the re-tokenization boundary of the answer comes from the cache
    assert e.last_stats.cached_tokens >= len(e.tokenize(first))


def test_pool_full_is_context_full_and_engine_recovers(tiny_path):
    e = load(tiny_path, n_ctx=64)
    with pytest.raises(ContextFull):
        e.generate(text_of(e, 80), max_tokens=2, **GREEDY)
    out = e.generate(text_of(e, 20), max_tokens=60, **GREEDY)
    assert e.last_stats.stop_reason == "context_full" and out


def test_cancel_at_100_points_leaves_engine_equal_to_fresh(tiny_path):
    e = load(tiny_path, prefill_chunk=16)
    fresh = load(tiny_path, prefill_chunk=16)
    rng = random.Random(0)
    prompts = [text_of(e, rng.randint(20, 120), seed=s) for s in range(5)]
    want = {p: fresh.generate(p, max_tokens=6, **GREEDY) for p in prompts}
    for point in range(100):
        p = prompts[point % len(prompts)]
        e.clear_cache() if point % 3 == 0 else None  # with and without cached prefixes around
        e.generate(p, max_tokens=6, cancel=CancelAfter(rng.randint(0, 40)), **GREEDY)
        assert e.generate(p, max_tokens=6, **GREEDY) == want[p], f"after cancel point {point}"
        e.kv.pool.check()


def test_session_round_trip_continues_identically(tiny_path, tmp_path):
    a = load(tiny_path)
    first = text_of(a, 50, seed=5)
    ans = a.generate(first, max_tokens=12, **GREEDY)
    path = tmp_path / "s.edgesess"
    n = a.save_session(path, meta={"text": first + ans})
    follow = first + ans + text_of(a, 8, seed=6)
    never_stopped = a.generate(follow, max_tokens=12, **GREEDY)
    b = load(tiny_path)
    assert b.load_session(path) and b.session_meta["text"] == first + ans and b.session_meta["n_tokens"] == n
    assert b.generate(follow, max_tokens=12, **GREEDY) == never_stopped
    assert b.last_stats.cached_tokens >= n - 16


def test_session_mismatch_and_mutations_are_misses(tiny_path, tmp_path, caplog):
    a = load(tiny_path)
    a.generate(text_of(a, 40), max_tokens=4, **GREEDY)
    path = tmp_path / "s.edgesess"
    a.save_session(path)
    other = load(tiny_path, kv_precision="f32")  # another KV layout: a miss, not an error
    assert other.load_session(path) is False
    data = path.read_bytes()
    rng = random.Random(1)
    bad = tmp_path / "bad.edgesess"
    n = int(os.environ.get("EDGELLM_FUZZ_EXAMPLES", "1000"))
    for i in range(n):
        b = bytearray(data)
        kind = i % 3
        if kind == 0:
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif kind == 1:
            del b[rng.randrange(len(b)):]
        else:
            b[rng.randrange(len(b))] = rng.randrange(256)
        bad.write_bytes(bytes(b))
        assert b == bytearray(data) or a.load_session(bad) is False
    assert a.load_session(path) is True  # and the engine is still fine
    assert a.generate("alpha beta", max_tokens=3, **GREEDY)


def test_a_session_that_does_not_fit_beside_a_live_request_is_a_miss(tiny_path, tmp_path, caplog):
    """Loading a session while a request holds most of the pool: a miss with a warning, as for
    a stale file (ContextFull escaped load_session, and left a live sequence behind); after the
    request the same file loads."""
    e = load(tiny_path, n_ctx=256)
    e.generate(text_of(e, 150, seed=8), max_tokens=4, **GREEDY)
    path = tmp_path / "big.edgesess"
    e.save_session(path)
    it = e.stream(text_of(e, 150, seed=9), max_tokens=50, **GREEDY)
    next(it)
    with caplog.at_level("WARNING"):
        assert e.load_session(path) is False
    assert "session cache miss" in caplog.text and "KV pool full" in caplog.text
    assert len(e.kv.pool._live) == 1                                    # only the live request's
    it.close()
    assert e.load_session(path) is True


def test_ring_runs_past_its_window_in_constant_memory(tiny_path):
    e = load(tiny_path, kv="ring", window=64, sinks=4, prefill_chunk=16)
    nbytes = e.kv.nbytes
    out = e.generate(text_of(e, 30), max_tokens=300, **GREEDY)
    assert e.last_stats.generated_tokens == 300 and e.last_stats.stop_reason == "max_tokens" and out
    assert e.kv.ring.n_tokens <= 64 and e.kv.nbytes == nbytes
    # a long prompt slides through the window in chunks
    e.generate(text_of(e, 200, seed=9), max_tokens=5, **GREEDY)
    assert e.last_stats.stop_reason == "max_tokens"


def test_ring_below_window_equals_pool(tiny_path):
    pool = load(tiny_path, kv_precision="f32")
    ring = load(tiny_path, kv="ring", kv_precision="f32", window=256, sinks=4)
    p = text_of(pool, 40, seed=11)
    assert ring.generate(p, max_tokens=20, **GREEDY) == pool.generate(p, max_tokens=20, **GREEDY)


def test_ring_keeps_the_prefix_a_new_prompt_shares_with_its_history(tiny_path):
    """A warmed system prompt the message does not extend token for token (its last pre-token
    is merged with the message's first word, an edited last turn) reused nothing on the ring
    (the pool reused all but a block). The ring keeps the shared prefix while nothing has been
    evicted, and the text stays what a fresh ring gives."""
    kw = dict(kv="ring", kv_precision="f32", window=256, sinks=4)
    system = text_of(load(tiny_path), 60, seed=4)
    first, prompt = system + "\nzeta zeta zeta", system + "\nkappa mu " + text_of(load(tiny_path), 10, seed=5)
    fresh = load(tiny_path, **kw).generate(prompt, max_tokens=12, **GREEDY)
    e = load(tiny_path, **kw)
    e.warm(first)
    shared = next(i for i, (a, b) in enumerate(zip(e.tokenize(first), e.tokenize(prompt))) if a != b)
    assert 0 < shared < len(e.tokenize(first))                 # the prompt does not extend the warmed ids
    assert e.generate(prompt, max_tokens=12, **GREEDY) == fresh
    assert e.last_stats.cached_tokens == shared
    # a new prompt that shares nothing still starts over
    other = text_of(e, 20, seed=6)
    assert e.generate(other, max_tokens=5, **GREEDY) == load(tiny_path, **kw).generate(other, max_tokens=5, **GREEDY)


@pytest.mark.parametrize("precision, tol", [("f32", 2e-4), ("int8", 2e-2)])
def test_ring_past_its_window_fused_equals_per_op(tiny_path, precision, tol, tmp_path, monkeypatch):
    """Past the window, with sinks rotated on: the fused native step (one call a chunk, RoPE rows
    of sequence positions past the engine's tables) gives the per-op path's logits, chunk by
    chunk and token by token, and both store the same keys (int8: within a quantization step)."""
    import numpy as np

    # the estimated host profile, as CI has: a measured one may price this tiny model's 8-row
    # chunks on the reference unit, and the fused step is what this test is about
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))

    e = load(tiny_path, kv="ring", kv_precision=precision, window=48, sinks=4, prefill_chunk=8)
    r = e.runner
    assert {"prefill", "decode"} <= r._fused_phases and len(r.cos) == 48
    ids = np.random.default_rng(4).integers(3, e.config.vocab_size, 130)
    rings, outs = [e.kv.new_sequence() for _ in range(2)], [[], []]
    for i, ring in enumerate(rings):
        saved = r._fused_phases
        r._fused_phases = saved if i == 0 else set()
        try:
            for lo, hi in ((0, 40), (40, 70), (70, 110)):
                outs[i].append(r.forward(ring, ids[lo:hi], chunk=8))
            outs[i] += [r.forward(ring, [t]) for t in ids[110:]]
        finally:
            r._fused_phases = saved
    assert rings[0].total_tokens == 130 and rings[0].n_tokens == 48 and rings[0].sink_shift == 130 - 48
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(np.abs(b).max()))
    keys = [r.read(layer, r.n_tokens)[0] for r in rings for layer in range(e.config.n_layers)]
    n = len(keys) // 2
    step = 1 / 127 if precision == "int8" else 1e-5        # of a row's largest value: one quantization step
    for a, b in zip(keys[:n], keys[n:]):
        np.testing.assert_allclose(a, b, rtol=0, atol=step * float(np.abs(b).max()))
    # the sinks (slots 0..3) hold the first 4 tokens' keys as a block pool stores them (rotated
    # at positions 0..3), rotated on by the 130 - 48 tokens evicted: attention sees them at cache
    # positions 0..3 while the window's tokens sit at 4..47
    from edgellm.backends import reference

    pool = load(tiny_path, kv_precision=precision)
    seq, _ = pool._open_sequence([])
    pool.runner.forward(seq, ids[:4], logits=False)
    cfg, tbl = e.config, seq.block_table
    pk = np.stack([seq.read(layer, 4)[0].transpose(1, 0, 2) for layer in range(cfg.n_layers)], axis=1)
    rows = pk.reshape(-1, cfg.n_kv_heads, cfg.head_dim)
    cos, sin = reference.rope_rows(cfg, np.full(len(rows), 130 - 48))
    want = reference.rope(rows, cos, sin, cfg.rope_style).reshape(pk.shape)
    got = np.stack([rings[0].read(layer, 4)[0].transpose(1, 0, 2) for layer in range(cfg.n_layers)], axis=1)
    np.testing.assert_allclose(got, want, rtol=0, atol=step * float(np.abs(want).max()))


@pytest.mark.parametrize("kw", [dict(kv="disk"), dict(kv_precision="int4"), dict(kv="ring", kv_precision="int4"),
                                dict(kv="ring", window=4, sinks=4)])
def test_bad_kv_options(tiny_path, kw):
    with pytest.raises(ConfigError):
        load(tiny_path, **kw)


def test_ring_has_no_sessions_yet(tiny_path, tmp_path):
    e = load(tiny_path, kv="ring", window=64)
    e.generate("alpha", max_tokens=2, **GREEDY)
    with pytest.raises(ConfigError):
        e.save_session(tmp_path / "x.edgesess")


@pytest.mark.parametrize("held", [20, 120])
def test_cancelled_ring_prefill_leaves_a_usable_engine(tiny_path, held):
    """Cancel before the third chunk of a forward, with the ring below and past its window (the
    ring takes the fused step, which looks between chunks: the third look cancels)."""
    e = load(tiny_path, kv="ring", window=64, sinks=4, prefill_chunk=8)
    fresh = load(tiny_path, kv="ring", window=64, sinks=4, prefill_chunk=8)
    assert "prefill" in e.runner._fused_phases
    first = text_of(e, held, seed=12)
    e.generate(first, max_tokens=1, **GREEDY)
    e.generate(first + text_of(e, 24, seed=13), max_tokens=4, cancel=CancelAfter(2), **GREEDY)
    assert e.last_stats.stop_reason == "cancelled"
    p = text_of(e, 30, seed=14)
    assert e.generate(p, max_tokens=6, **GREEDY) == fresh.generate(p, max_tokens=6, **GREEDY)


def test_clear_cache_while_a_ring_request_streams_lets_it_finish_then_forgets(tiny_path):
    """A "new chat" while an answer streams on a ring engine: the answer is what it is alone (the
    ring was freed under it), and the next request starts from an empty ring."""
    kw = dict(kv="ring", window=48, sinks=4)
    e, fresh = load(tiny_path, **kw), load(tiny_path, **kw)
    prompt = text_of(e, 20, seed=11)
    alone = fresh.generate(prompt, max_tokens=40, **GREEDY)
    it = e.stream(prompt, max_tokens=40, **GREEDY)
    got = next(it) + next(it)
    e.clear_cache()
    got += "".join(it)
    assert got == alone
    assert len(e.kv.history) == 0 and e.kv.ring.total_tokens == 0
    assert e.generate(prompt, max_tokens=8, **GREEDY) == fresh.generate(prompt, max_tokens=8, **GREEDY)
    assert e.last_stats.cached_tokens == 0


def test_a_ring_keeps_its_history_in_4_bytes_a_token(tiny_path):
    """The ring's history (every id it took, compared with each next prompt) was a list of Python
    ints, ~35 bytes a token, growing for as long as a chat runs while the ring stays flat."""
    e = load(tiny_path, kv="ring", window=48, sinks=4)
    prompt = text_of(e, 30, seed=5)
    e.generate(prompt, max_tokens=10, **GREEDY)
    first = e.kv.history.copy()
    assert first.dtype == np.int32 and first.nbytes == 4 * len(first) and len(first) >= 30
    assert list(first[:len(e.tokenize(prompt))]) == e.tokenize(prompt)
    e.generate(prompt + e.detokenize(list(first[len(e.tokenize(prompt)):])) + " more", max_tokens=4, **GREEDY)
    assert e.last_stats.cached_tokens > 0                   # the next prompt continued the history
