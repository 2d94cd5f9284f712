"""Sampler chain (llama.cpp order and definitions) and StopChecker."""
from __future__ import annotations

import math
from collections import Counter, deque

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgellm import sampling as S
from edgellm.errors import ConfigError, EdgeLLMError
from edgellm.sampling import Sampler, SamplingConfig, StopChecker

VOCAB = 49152


def _logits(seed: int, n: int = VOCAB, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def _draws(cfg: SamplingConfig, logits: np.ndarray, n: int, history=()) -> Counter:
    s = Sampler(cfg)
    return Counter(s.sample(logits, history) for _ in range(n))


# -- reference chain, written from the definitions (float64, full sort) ------------------------


def _probs(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v.max())
    return e / e.sum()


def _allowed(logits: np.ndarray, cfg: SamplingConfig, eps: float = 1e-5) -> set[int]:
    """Ids the chain may pick (distinct logits assumed), widened by eps at the p / min_p edges."""
    x = logits.astype(np.float64)
    ids = np.arange(x.size)
    if 0 < cfg.top_k < x.size:
        ids = np.argsort(-x, kind="stable")[: cfg.top_k]
    if cfg.top_p < 1.0:
        p = _probs(x[ids])
        # llama.cpp keeps the sorted prefix up to and including the first token where the
        # cumulative probability reaches top_p: a token is kept iff the mass of the strictly
        # more likely tokens is still below top_p
        mass_above = np.array([p[p > pi].sum() for pi in p])
        ids = ids[mass_above < cfg.top_p + eps]
    if cfg.min_p > 0.0:
        ids = ids[x[ids] >= x[ids].max() + math.log(cfg.min_p) - eps]
    return set(ids.tolist())


# -- greedy ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_greedy_is_argmax(seed):
    x = _logits(seed)
    # truncation settings cannot change the argmax, and temperature 0 ignores them
    for cfg in (SamplingConfig(), SamplingConfig(top_k=40, top_p=0.5, min_p=0.2)):
        assert Sampler(cfg).sample(x, []) == int(np.argmax(x))


def test_greedy_accepts_float64_and_lists():
    assert Sampler().sample(np.array([0.0, 3.0, 1.0]), []) == 1
    assert Sampler().sample([0.0, 3.0, 1.0], []) == 1


@settings(max_examples=200, deadline=None)
@given(
    x=hnp.arrays(np.float32, st.integers(1, 64),
                 elements=st.floats(-1e4, 1e4, width=32)),
    temperature=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**32),
    history=st.lists(st.integers(0, 63), max_size=10),
)
def test_top_k_1_is_greedy_at_any_temperature(x, temperature, seed, history):
    history = [h for h in history if h < x.size]
    cfg = SamplingConfig(temperature=temperature, top_k=1, seed=seed, repeat_penalty=1.3)
    greedy = Sampler(SamplingConfig(repeat_penalty=1.3)).sample(x, history)
    assert Sampler(cfg).sample(x, history) == greedy


# -- seeding -----------------------------------------------------------------------------------


def test_seeded_runs_reproduce_and_seeds_differ():
    x = _logits(1, scale=1.0)
    cfg = SamplingConfig(temperature=1.0, top_k=40, top_p=0.95, seed=1234)
    s1, s2 = Sampler(cfg), Sampler(cfg)
    a = [s1.sample(x, []) for _ in range(200)]
    assert a == [s2.sample(x, []) for _ in range(200)]
    s1.reset()
    assert a == [s1.sample(x, []) for _ in range(200)]
    s3 = Sampler(SamplingConfig(temperature=1.0, top_k=40, top_p=0.95, seed=1235))
    assert a != [s3.sample(x, []) for _ in range(200)]
    assert len(set(a)) > 10  # actually random, not stuck on one token


# -- truncation: statistical checks on a small vocabulary --------------------------------------

SMALL = np.log(np.array([0.40, 0.25, 0.15, 0.08, 0.05, 0.04, 0.02, 0.01])).astype(np.float32)


def test_top_p_keeps_the_llama_cpp_prefix():
    # cumulative: .40 .65 .80 .88 ... -> top_p=0.7 keeps {0,1,2} (0.80 is the first >= 0.7)
    cfg = SamplingConfig(temperature=1.0, top_p=0.7, seed=0)
    assert _allowed(SMALL, cfg) == {0, 1, 2}
    c = _draws(cfg, SMALL, 6000)
    assert set(c) == {0, 1, 2}
    # renormalised: .40/.80 = .5, .25/.80 = .3125, .15/.80 = .1875 (+- ~4 sigma)
    for tok, p in ((0, 0.5), (1, 0.3125), (2, 0.1875)):
        assert abs(c[tok] / 6000 - p) < 0.03


def test_top_p_keeps_the_token_that_crosses():
    # cumulative .40 < .6, then .65 >= .6 at token 1: llama.cpp keeps token 1 and stops there
    x = np.log(np.array([0.40, 0.25, 0.35 / 2, 0.35 / 2]))  # float64 logits
    c = _draws(SamplingConfig(temperature=1.0, top_p=0.6, seed=3), x, 3000)
    assert set(c) == {0, 1}


def test_min_p_drops_tokens_below_fraction_of_max():
    # p_max = .40; min_p = 0.3 -> threshold .12 keeps {0,1,2}; min_p = 0.1 -> .04 keeps 0..5
    for min_p, want in ((0.3, {0, 1, 2}), (0.1, {0, 1, 2, 3, 4, 5})):
        cfg = SamplingConfig(temperature=1.0, min_p=min_p, seed=1)
        assert _allowed(SMALL, cfg) == want
        assert set(_draws(cfg, SMALL, 6000)) == want


def test_chain_order_top_k_then_top_p_then_min_p():
    # top_k=4 renormalises over {.40,.25,.15,.08} (sum .88): cumulative .4545 .7386 .909 ...
    # top_p=0.85 then keeps {0,1,2}; min_p=0.5 (threshold .20) keeps {0,1}
    cfg = SamplingConfig(temperature=0.7, top_k=4, top_p=0.85, min_p=0.5, seed=5)
    assert _allowed(SMALL, cfg) == {0, 1}
    assert set(_draws(cfg, SMALL, 3000)) == {0, 1}
    cfg = SamplingConfig(temperature=0.7, top_k=4, top_p=0.85, seed=5)
    assert set(_draws(cfg, SMALL, 3000)) == {0, 1, 2}


def test_temperature_sharpens_after_truncation():
    cfg_hot = SamplingConfig(temperature=2.0, top_k=2, seed=9)
    cfg_cold = SamplingConfig(temperature=0.25, top_k=2, seed=9)
    # top-2 ratio .40/.25 = 1.6; at T: 1.6 ** (1/T)
    for cfg in (cfg_hot, cfg_cold):
        c = _draws(cfg, SMALL, 8000)
        want = 1 / (1 + 1.6 ** (-1 / cfg.temperature))
        assert set(c) <= {0, 1}
        assert abs(c[0] / 8000 - want) < 0.03


def test_large_vocab_draw_matches_distribution():
    # exercises the two-level (block) draw: put known mass on a few ids spread over blocks
    x = np.full(VOCAB, -1e9, dtype=np.float32)  # exp underflows to exactly 0
    ids = [3, 700, 20000, VOCAB - 1]
    x[ids] = np.log([0.1, 0.2, 0.3, 0.4])
    c = _draws(SamplingConfig(temperature=1.0, seed=2), x, 4000)
    assert set(c) == set(ids)
    for i, p in zip(ids, (0.1, 0.2, 0.3, 0.4)):
        assert abs(c[i] / 4000 - p) < 0.04  # ~5 sigma


# distinct logits at least 0.01 apart, so sets defined by ranking have no ties
_distinct = hnp.arrays(np.int32, st.integers(2, 48), elements=st.integers(-2000, 2000),
                       unique=True).map(lambda a: (a * 0.01).astype(np.float32))


@settings(max_examples=200, deadline=None)
@given(
    x=_distinct,
    top_k=st.integers(0, 50),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    temperature=st.floats(0.05, 5.0),
    seed=st.integers(0, 2**32),
)
def test_property_pick_is_inside_the_reference_set(x, top_k, top_p, min_p, temperature, seed):
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                         seed=seed)
    allowed = _allowed(x, cfg)
    s = Sampler(cfg)
    for _ in range(20):
        assert s.sample(x, []) in allowed


@settings(max_examples=200, deadline=None)
@given(x=hnp.arrays(np.float32, st.integers(2, 5000),
                    elements=st.floats(-50, 50, width=32)),
       k=st.integers(1, 200))
def test_property_top_k_prefilter_is_exact(x, k):
    # the k best by (value descending, id ascending), in that order: ties keep the lower ids
    assume(k < x.size)
    got = S._ranked(x, k)
    want = np.lexsort((np.arange(x.size), -x))[:k]
    assert got.tolist() == want.tolist()


@settings(max_examples=200, deadline=None)
@given(x=_distinct, p=st.floats(0.01, 0.999))
def test_property_nucleus_equals_definition(x, p):
    q = _probs(x.astype(np.float64))
    cum = np.cumsum(np.sort(q)[::-1])
    assume(np.min(np.abs(cum - p)) > 1e-4)  # away from float rounding at the boundary
    got = S._nucleus(x, x.max(), p)
    assert set(got.tolist()) == _allowed(x, SamplingConfig(temperature=1.0, top_p=p), eps=0)
    assert list(x[got]) == sorted(x[got], reverse=True)


def test_nucleus_on_large_flat_vocab_grows_past_first_slice():
    x = _logits(4, scale=1.0)  # nucleus of thousands of ids: the partial sort must grow
    got = S._nucleus(x, x.max(), 0.9)
    q = _probs(x.astype(np.float64))
    order = np.argsort(-q)
    n = int(np.searchsorted(np.cumsum(q[order]), 0.9)) + 1
    assert n > 512 and abs(got.size - n) <= 1
    assert set(got[: n - 1].tolist()) <= set(order[:n].tolist())


def test_zero_weight_entries_are_never_picked():
    w = np.zeros(5000, dtype=np.float32)
    w[[0, 4999]] = 1.0
    for u in (0.0, 0.25, 0.5, 0.75, np.nextafter(1.0, 0.0)):
        assert S._pick(w, u) in (0, 4999)
        assert S._pick(w[:300], u) == 0


# -- repetition penalty ------------------------------------------------------------------------


def test_repeat_penalty_follows_llama_cpp_definition():
    x = np.array([2.0, 1.8, -1.0, 0.0, 0.5], dtype=np.float32)
    s = Sampler(SamplingConfig(repeat_penalty=1.25))
    # positive logits divided, non-positive multiplied, each distinct id once
    y = s._penalize(x, [0, 0, 0, 2, 3])
    np.testing.assert_allclose(y, [2.0 / 1.25, 1.8, -1.0 * 1.25, 0.0, 0.5], rtol=1e-6)
    assert np.array_equal(x, np.float32([2.0, 1.8, -1.0, 0.0, 0.5]))  # input untouched
    # 2.0 / 1.25 = 1.6 < 1.8, so the repeated token loses the argmax
    assert Sampler(SamplingConfig()).sample(x, [0]) == 0
    assert s.sample(x, [0]) == 1


def test_repeat_penalty_window_and_modes():
    x = np.array([2.0, 1.0, -2.0, 4.0], dtype=np.float32)
    last2 = Sampler(SamplingConfig(repeat_penalty=2.0, repeat_last_n=2))
    np.testing.assert_allclose(last2._penalize(x, [0, 1, 2, 3]), [2.0, 1.0, -4.0, 2.0])
    whole = Sampler(SamplingConfig(repeat_penalty=2.0, repeat_last_n=-1))
    np.testing.assert_allclose(whole._penalize(x, [0, 1, 2, 3]), [1.0, 0.5, -4.0, 2.0])
    off = Sampler(SamplingConfig(repeat_penalty=2.0, repeat_last_n=0))
    assert off._penalize(x, [0, 1]) is x
    boost = Sampler(SamplingConfig(repeat_penalty=0.5))  # < 1 favours repeats
    np.testing.assert_allclose(boost._penalize(x, [1, 2]), [2.0, 2.0, -1.0, 4.0])


@pytest.mark.parametrize("history", [
    [5, 7], (5, 7), np.array([5, 7]), deque([5, 7]), range(5, 8, 2)])
def test_history_sequence_types(history):
    x = np.zeros(10, dtype=np.float32)
    x[[5, 7]] = 1.0
    y = Sampler(SamplingConfig(repeat_penalty=2.0))._penalize(x, history)
    assert y[5] == y[7] == 0.5 and y.sum() == 1.0


def test_history_id_out_of_vocab_is_a_config_error():
    with pytest.raises(ConfigError, match="history"):
        Sampler(SamplingConfig(repeat_penalty=1.1)).sample(np.zeros(4, np.float32), [4])
    with pytest.raises(ConfigError, match="history"):
        Sampler(SamplingConfig(repeat_penalty=1.1)).sample(np.zeros(4, np.float32), [-1])


def test_nonfinite_logits_raise_typed_error():
    x = np.zeros(8, dtype=np.float32)
    x[3] = np.nan
    for cfg in (SamplingConfig(), SamplingConfig(temperature=1.0, top_k=4, seed=0)):
        with pytest.raises(EdgeLLMError, match="NaN"):
            Sampler(cfg).sample(x, [])
    with pytest.raises(EdgeLLMError, match="finite"):
        Sampler().sample(np.full(8, -np.inf, dtype=np.float32), [])


def test_bad_logits_shape():
    with pytest.raises(ConfigError, match="logits"):
        Sampler().sample(np.zeros((2, 3), np.float32), [])
    with pytest.raises(ConfigError, match="logits"):
        Sampler().sample(np.zeros(0, np.float32), [])


# -- config validation -------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", -1e-9), ("top_p", -0.5), ("top_p", 1.01), ("top_p", float("nan")),
    ("min_p", -0.01), ("min_p", 1.5),
    ("top_k", -1), ("top_k", 2.5),
    ("repeat_penalty", 0.0), ("repeat_penalty", -1.0), ("repeat_penalty", float("inf")),
    ("repeat_last_n", -2),
    ("seed", -1), ("seed", "42"),
])
def test_invalid_params_raise_config_error_naming_param(field, value):
    with pytest.raises(ConfigError, match=rf"sampling\.{field}: expected .*found"):
        SamplingConfig(**{field: value})


def test_valid_edges_accepted_and_config_frozen():
    cfg = SamplingConfig(temperature=0, top_k=0, top_p=1.0, min_p=1.0, repeat_penalty=0.01,
                         repeat_last_n=-1, seed=0)
    assert cfg.greedy
    with pytest.raises(AttributeError):
        cfg.temperature = 1.0  # type: ignore[misc]


# -- stop strings ------------------------------------------------------------------------------


def _stream(checker: StopChecker, pieces):
    out, stopped = [], False
    for p in pieces:
        step = checker.feed(p)
        out.append(step.text)
        if step.stopped:
            stopped = True
            break
    if not stopped:
        out.append(checker.flush())
    return "".join(out), stopped


def test_stop_split_across_pieces_is_never_emitted():
    c = StopChecker(["<|im_end|>"])
    steps = [c.feed(p) for p in ["Hello", " world<|", "im_", "end|>", "ignored"]]
    assert [s.text for s in steps] == ["Hello", " world", "", "", ""]
    assert [s.stopped for s in steps] == [False, False, False, True, True]
    assert c.flush() == ""


def test_stop_inside_one_piece_emits_text_before_it():
    assert _stream(StopChecker(["\nUser:"]), ["ok.\nUser: hi"]) == ("ok.", True)


def test_false_start_is_released():
    c = StopChecker(["<|im_end|>"])
    assert c.feed("a<|im").text == "a"
    assert c.held == "<|im"
    assert c.feed("ag").text == "<|imag"  # diverged: held text is safe again
    assert _stream(StopChecker(["<|im_end|>"]), ["x <", "|i", "m"]) == ("x <|im", False)


def test_overlapping_prefixes():
    # "aab": after "aa" arrives, "aa" must be held whole (both "a" and "aa" are prefixes)
    c = StopChecker(["aab"])
    assert c.feed("xaa").text == "x"
    assert c.feed("a").text == "a"  # "aaa": only the last "aa" can still start "aab"
    assert c.feed("b") == (True, "")
    # several stops: the earliest occurrence wins, whichever string it is
    assert _stream(StopChecker(["END", "ND!"]), ["fooEN", "D!"]) == ("foo", True)
    assert _stream(StopChecker(["abcd", "bc"]), ["xab", "cd"]) == ("x", True)
    assert _stream(StopChecker(["abcd", "bc"]), ["xab", "ce"]) == ("xa", True)
    # a stop that is a prefix of another stops at the shorter one
    assert _stream(StopChecker(["###", "##"]), ["a#", "#", "#"]) == ("a", True)


def test_no_stop_passes_everything_through():
    pieces = ["The", " cat", " sat", " <", "|", " on", " mat."]
    assert _stream(StopChecker([]), pieces) == ("".join(pieces), False)
    assert _stream(StopChecker(["<|im_end|>"]), pieces) == ("".join(pieces), False)
    c = StopChecker([])
    assert all(c.feed(p).text == p for p in pieces)


def test_stop_checker_rejects_empty_stop():
    with pytest.raises(ConfigError, match="stop"):
        StopChecker(["ok", ""])


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab<|>", max_size=40),
       stops=st.lists(st.text(alphabet="ab<|>", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=10))
def test_property_stream_equals_whole_text_rule(text, stops, cuts):
    # Generation ends after the first piece that completes a stop string; the output is the text
    # before the earliest-starting stop complete by then (or all of it). A longer stop that would
    # have started earlier can no longer complete once generation has ended: with stops "<" and
    # "><<", the pieces "><", "<" end at "<" and print ">" (found by this property).
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    want = (text, False)
    for b in bounds[1:]:
        hits = [i for i in (text[:b].find(s) for s in stops) if i >= 0]
        if hits:
            want = (text[: min(hits)], True)
            break
    assert _stream(StopChecker(stops), pieces) == want
