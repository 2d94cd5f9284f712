"""Decode runs: several decode tokens in one native call, greedy (el_decode_greedy) or sampled
through the native chain (el_decode_sample), via DecodeStep.run_tokens, ModelRunner.decode_run
and Generation's runs. Each must give what token-by-token decoding gives: the same tokens, the
same K/V, the same stop reasons, and a sequence that holds exactly the tokens a token-by-token
run would have fed."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.backends import neon
from edgellm.errors import ConfigError
from edgellm.generation import Generation
from edgellm.kv.pool import KVPool
from edgellm.sampling import SamplingConfig
from edgellm.sampling_native import NativeChain
from tests.cancel_after import CancelAfter
from tests.synthetic import write_tiny_model

EINVAL = -1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("greedy") / "tiny.gguf", tensor_type=QT.Q4_1, seed=5,
                            n_layers=3, d_model=64, d_ff=128, context_length=512).path
    eng = edgellm.load(path, n_ctx=256, units=["neon"], threads=2)
    assert eng.runner.can_decode_run(_seq(eng))
    return eng


@pytest.fixture(scope="module")
def real(real_model_path):
    eng = edgellm.load(real_model_path, n_ctx=512)
    assert eng.runner.can_decode_run(_seq(eng))
    return eng


def _seq(eng, blocks=16):
    c = eng.config
    return KVPool(c.n_layers, c.n_kv_heads, c.head_dim, blocks, 16, "f16").new_sequence()


def test_a_run_equals_token_by_token_decoding(tiny):
    """decode_run's tokens are the argmax chain forward gives token by token, its last logits
    forward's bit for bit, and both sequences hold the same tokens and K/V bytes."""
    r, cfg = tiny.runner, tiny.config
    prompt = np.random.default_rng(1).integers(3, cfg.vocab_size, 20)
    a, b = _seq(tiny), _seq(tiny)
    tok = int(np.argmax(r.forward(a, prompt)))
    assert tok == int(np.argmax(r.forward(b, prompt)))
    ids, logits = r.decode_run(a, tok, 7)
    want, t = [], tok
    for _ in range(7):
        lg = r.forward(b, [t])
        t = int(np.argmax(lg))
        want.append(t)
    assert ids == want
    np.testing.assert_array_equal(logits, lg)
    # a fed every token but its last produced one, which the next step feeds; b fed that one too
    assert a.n_tokens == 27 and a.tokens == list(prompt) + [tok] + want[:-1]
    assert b.tokens[:27] == a.tokens
    for arr in ("k", "v"):
        x, y = getattr(a.pool, arr), getattr(b.pool, arr)
        for p in range(27):
            np.testing.assert_array_equal(x[a.block_table[p // 16], :, p % 16].view(np.uint16),
                                          y[b.block_table[p // 16], :, p % 16].view(np.uint16))


def test_a_sampled_run_equals_token_by_token_draws(tiny):
    """A run drawing with the native chain gives the tokens forward + the chain's draw give
    with the same uniforms, forward's last logits bit for bit, and the same K/V bytes."""
    r, cfg = tiny.runner, tiny.config
    chain = NativeChain(neon._lib(), SamplingConfig(temperature=1.5, top_k=20, top_p=0.9, min_p=0.02))
    prompt = np.random.default_rng(3).integers(3, cfg.vocab_size, 20)
    a, b = _seq(tiny), _seq(tiny)
    tok = int(np.argmax(r.forward(a, prompt)))
    r.forward(b, prompt)
    u = np.random.default_rng(4).random(9)
    ids, logits = r.decode_run(a, tok, 9, chain=chain, uniforms=u)
    want, t = [], tok
    for i in range(9):
        lg = r.forward(b, [t])
        t = chain.draw(lg, u[i])
        want.append(t)
    assert ids == want and len(set(want)) > 2          # draws, not an argmax chain
    np.testing.assert_array_equal(logits, lg)
    assert a.tokens == b.tokens[:a.n_tokens] and a.n_tokens == 20 + 9
    for arr in ("k", "v"):
        x, y = getattr(a.pool, arr), getattr(b.pool, arr)
        for p in range(a.n_tokens):
            np.testing.assert_array_equal(x[a.block_table[p // 16], :, p % 16].view(np.uint16),
                                          y[b.block_table[p // 16], :, p % 16].view(np.uint16))


@pytest.mark.parametrize("sampling", [dict(temperature=0.0, repeat_penalty=1.8, repeat_last_n=6),
                                      dict(temperature=1.2, top_k=30, repeat_penalty=0.7, repeat_last_n=-1),
                                      dict(temperature=0.9, top_k=25, top_p=0.9, repeat_penalty=2.5, repeat_last_n=3)])
def test_a_run_with_a_repetition_penalty_picks_as_the_sampler(tiny, sampling):
    """With a penalty the run picks what Sampler.sample picks token by token from the same
    logits, history and uniforms (numpy's penalty, then the draw), its window sliding over the
    run's own tokens; the logits it returns are the step's own, unpenalized."""
    from edgellm.sampling import Sampler
    r, cfg = tiny.runner, tiny.config
    sc = SamplingConfig(seed=21, **sampling)
    plain, native = Sampler(sc), Sampler(sc)
    chain, why = native.run_chain()
    assert why is None and chain is not None
    prompt = list(np.random.default_rng(5).integers(3, 12, 14))     # few distinct ids: the penalty bites
    a, b = _seq(tiny), _seq(tiny)
    tok = int(np.argmax(r.forward(a, prompt)))
    r.forward(b, prompt)
    history = prompt + [tok]
    n = 10
    u = None if chain.greedy else native.uniforms(n)
    window = history if sc.repeat_last_n < 0 else history[-sc.repeat_last_n:]
    ids, logits = r.decode_run(a, tok, n, chain=chain, uniforms=u, history=window)
    want, t = [], tok
    for _ in range(n):
        lg = r.forward(b, [t])
        t = plain.sample(lg, history)
        history.append(t)
        want.append(t)
    assert ids == want
    np.testing.assert_array_equal(logits, lg)
    free, _ = r.decode_run(_run_copy(tiny, prompt), tok, n)              # no penalty: another text
    assert free != ids


def test_a_sampled_run_refuses_bad_uniforms_and_chains(tiny):
    r, cfg = tiny.runner, tiny.config
    chain = NativeChain(neon._lib(), SamplingConfig(temperature=0.8, top_k=20))
    seq = _run_copy(tiny, [5, 6, 7])
    k0 = seq.pool.k.copy()
    with pytest.raises(ValueError, match="3 uniforms"):
        r._fused.run_tokens(5, 3, r.cos, r.sin, seq.pool, seq.block_table, 3, chain=chain, uniforms=[0.5])
    for u in ([0.5, 1.0, 0.2], [0.5, -0.5, 0.2], [np.nan, 0.1, 0.2]):
        with pytest.raises(Exception, match="EL_EINVAL"):
            r._fused.run_tokens(5, 3, r.cos, r.sin, seq.pool, seq.block_table, 3, chain=chain, uniforms=u)
    assert np.array_equal(seq.pool.k.view(np.uint16), k0.view(np.uint16))    # nothing written


def test_a_run_ends_after_a_stop_id_and_before_nan_logits(tiny):
    r, cfg = tiny.runner, tiny.config
    prompt = np.random.default_rng(2).integers(3, cfg.vocab_size, 12)
    a = _seq(tiny)
    tok = int(np.argmax(r.forward(a, prompt)))
    free, _ = r.decode_run(_run_copy(tiny, prompt), tok, 6)
    stop = free[2]
    b = _run_copy(tiny, prompt)
    ids, _ = r.decode_run(b, tok, 6, stop_ids=(stop, cfg.vocab_size + 5))
    assert ids == free[: free.index(stop) + 1] and b.n_tokens == 12 + len(ids)
    # logits holding a NaN (an output norm of NaN): nothing is produced, nothing committed
    step = r._fused
    saved = step._onorm.copy()
    step._onorm[...] = np.nan
    try:
        c = _run_copy(tiny, prompt)
        ids, _ = r.decode_run(c, tok, 4)
    finally:
        step._onorm[...] = saved
    assert ids == [] and c.n_tokens == 12


def _run_copy(eng, prompt):
    s = _seq(eng)
    eng.runner.forward(s, prompt)
    return s


def test_library_refuses_bad_arguments(tiny):
    lib, step = neon._lib(), tiny.runner._fused
    seq = _run_copy(tiny, [5, 6, 7])
    seq.reserve(2)
    step._take(seq.pool, seq.block_table)
    step._fit_chunk(1)
    r = tiny.runner
    out, logits, stop = np.zeros(4, np.int32), np.zeros(step._n_vocab, np.float32), np.array([1], np.int32)

    def call(n_max=2, out_p=out.ctypes.data, n_stop=0, stop_p=None, dims=step._dims_p, cos=r.cos.ctypes.data):
        return lib.el_decode_greedy(None, step._layers_p, tiny.config.n_layers, dims, step._emb_p, 5,
                                    step._chunk_ptrs[0], 3, n_max, cos, r.sin.ctypes.data, step._k_p, step._v_p,
                                    step._kv_type, step._tbl_p, len(seq.block_table), step._bt, step._nb,
                                    step._chunk_scratch_p, step._chunk_scratch.nbytes, step._onorm.ctypes.data,
                                    step._head_p, step._n_vocab, 1, logits.ctypes.data, stop_p, n_stop, out_p)
    k0 = seq.pool.k.copy()
    for bad in (dict(n_max=0), dict(n_max=-1), dict(out_p=None), dict(n_stop=-1), dict(n_stop=1),
                dict(dims=None), dict(cos=None)):
        assert call(**bad) == EINVAL, bad
    assert np.array_equal(seq.pool.k.view(np.uint16), k0.view(np.uint16)) and not logits.any()
    assert call(n_stop=1, stop_p=stop.ctypes.data) in (1, 2)
    with pytest.raises(ValueError, match="n_max >= 1"):
        step.run_tokens(5, 3, r.cos, r.sin, seq.pool, seq.block_table, 0)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        r.decode_run(seq, tiny.config.vocab_size, 2)


def _mid_stop(eng, prompt, kw):
    """A stop string whose first occurrence in the generated text lies in its second half."""
    free = eng.generate(prompt, **{**kw, "ignore_eos": True, "max_tokens": 40, "stop": ()})
    for n in (3, 4, 5, 6):
        for i in range(len(free) // 2, len(free) - n):
            if free.find(free[i : i + n]) == i:
                return free[i : i + n]
    raise AssertionError(f"no stop string found in {free!r}")


# greedy, and the API's default chain (top-k 40, top-p 0.95, min-p 0.05, temperature 0.8) seeded,
# each also with a repetition penalty
_PICKS = {"greedy": dict(temperature=0), "sampled": dict(temperature=0.8, seed=5),
          "greedy_penalty": dict(temperature=0, repeat_penalty=1.3),
          "sampled_penalty": dict(temperature=0.8, seed=5, repeat_penalty=1.3)}


@pytest.mark.parametrize("pick", sorted(_PICKS))
@pytest.mark.parametrize("kw", [dict(ignore_eos=True, max_tokens=40), dict(ignore_eos=False, max_tokens=40),
                                dict(ignore_eos=True, max_tokens=40, stop="mid"),
                                dict(ignore_eos=True, max_tokens=5)])
def test_generation_with_runs_equals_token_by_token(real, kw, pick, monkeypatch):
    """Generation's runs (a step's time sets their length; here forced long) give the token-by-
    token text and stop reason; after a stop inside a run the conversation's next turn (which
    continues the kept sequence) matches too. A sampled run draws the seeded stream's uniforms
    and gives back those it did not use, so runs of 8 and single tokens draw the same text.
    (The real model: a tiny random one repeats one token.)"""
    tiny = real
    prompt = "The lighthouse keeper climbed the stairs and"
    kw = {**kw, **_PICKS[pick]}
    if kw.get("stop") == "mid":
        kw = {**kw, "stop": [_mid_stop(tiny, prompt, kw)]}

    def run(max_run):
        monkeypatch.setattr(Generation, "RUN_MAX", max_run)
        monkeypatch.setattr(Generation, "RUN_S", 10.0)        # every run as long as allowed
        tiny.clear_cache()
        first = tiny.generate(prompt, **kw)
        st, kept = tiny.last_stats, list(tiny.kv.last.tokens)     # what the kept sequence was fed
        second = tiny.generate(prompt + first + " zeta", **kw)
        return first, st.stop_reason, st.generated_tokens, kept, second, tiny.last_stats.cached_tokens

    calls = []
    orig = type(tiny.runner).decode_run
    monkeypatch.setattr(type(tiny.runner), "decode_run",
                        lambda self, *a, **k: calls.append((a[2], k.get("uniforms") is not None)) or orig(self, *a, **k))
    runs = run(8)
    assert calls and all(sampled == pick.startswith("sampled") for _, sampled in calls)
    assert runs == run(1)
    if "stop" in kw:
        assert runs[1] == "stop"


def test_runs_answer_cancellation_within_the_run(real, monkeypatch):
    """A cancel seen inside a run ends generation at that token, as token by token."""
    monkeypatch.setattr(Generation, "RUN_S", 10.0)
    out = []
    for max_run in (8, 1):
        monkeypatch.setattr(Generation, "RUN_MAX", max_run)
        real.clear_cache()
        out.append((real.generate("one two three", temperature=0, ignore_eos=True, max_tokens=30, cancel=CancelAfter(9)),
                    real.last_stats.stop_reason, real.last_stats.generated_tokens))
    assert out[0] == out[1] and out[0][1] == "cancelled"


@pytest.mark.parametrize("kw, want", [(dict(temperature=0), "native runs, greedy"),
                                      (dict(temperature=0.8, seed=1), "native runs, sampled"),
                                      (dict(temperature=0, repeat_penalty=1.2), "native runs, greedy"),
                                      (dict(temperature=0.8, top_k=0, seed=1), "native runs, sampled")])
def test_stats_say_how_decode_ran(real, kw, want):
    real.generate("Name three colors.", max_tokens=6, ignore_eos=True, **kw)
    assert real.last_stats.decode_runs == want
    assert f"({want})" in real.last_stats.summary()


def test_stats_say_why_a_ring_decodes_token_by_token(real_model_path):
    eng = edgellm.load(real_model_path, n_ctx=512, kv="ring", window=128, sinks=4)
    eng.generate("Name three colors.", max_tokens=6, ignore_eos=True, temperature=0)
    assert eng.last_stats.decode_runs == "token by token: the ring buffer moves its window between tokens"


def test_stats_say_why_a_guarded_decode_goes_token_by_token(real_model_path):
    eng = edgellm.load(real_model_path, n_ctx=512, quality_guard=True)
    eng.generate("Name three colors.", max_tokens=6, ignore_eos=True, temperature=0)
    assert eng.last_stats.decode_runs == "token by token: the quality guard looks at every token's logits"
