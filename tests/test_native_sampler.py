"""The sampler chain in C (neon/sample.c, el_sample) against its numpy twin (sampling.draw_numpy)
and against the chain written from its definitions in float64; the uniform stream a native
decode run draws from (Sampler.uniforms / unuse)."""
from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from edgellm.backends import neon, neon_lib, reference
from edgellm.errors import EdgeLLMError
from edgellm.sampling import Sampler, SamplingConfig, draw_numpy
from edgellm.sampling_native import NativeChain

EINVAL, ENONFINITE = -1, neon_lib.EL_ENONFINITE


def _chain64(x: np.ndarray, cfg: SamplingConfig, u: float) -> tuple[int, float]:
    """The id u draws by the chain's float64 definition (reference.sample_chain), and how close
    (relative) a top-p cut, the min-p threshold or u came to a boundary rounding could decide."""
    ids, cum, margin = reference.sample_chain(x, cfg.top_k, cfg.top_p, cfg.min_p, cfg.temperature)
    j = min(int(np.searchsorted(cum, u, side="right")), ids.size - 1)
    return int(ids[j]), min(margin, float(np.min(np.abs(cum - u))))


def _native(cfg: SamplingConfig) -> NativeChain:
    ok, why = neon.available()
    assert ok, f"the NEON library must load here: {why}"
    return NativeChain(neon._lib(), cfg)


def _el_sample(x: np.ndarray, params, u: float, scratch_bytes: int | None = None) -> int:
    lib = neon._lib()
    s = np.empty(lib.el_sample_scratch(max(x.size, 1)), np.uint8)
    nb = s.nbytes if scratch_bytes is None else scratch_bytes
    return lib.el_sample(x.ctypes.data, x.size, ctypes.addressof(params), u, s.ctypes.data, nb)


@settings(max_examples=400, deadline=None)
@given(seed=st.integers(0, 2**32), n=st.integers(2, 3000), ties=st.booleans(), top_k=st.one_of(st.integers(2, 120), st.just(0), st.integers(3000, 3100)),
       top_p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 0.9), temperature=st.floats(0.05, 4.0),
       u=st.floats(0.0, 1.0, exclude_max=True), neg_inf=st.integers(0, 3))
def test_property_c_and_numpy_chains_pick_the_definitions_id(seed, n, ties, top_k, top_p, min_p, temperature, u,
                                                             neg_inf):
    """Both twins draw the id the float64 chain does, ties at the top-k and top-p boundaries
    included (logits in steps of 1/4), with top-k or without (0, or as wide as the vocabulary:
    every logit weighed), wherever no rounding boundary lies within 1e-5 (the twins round exp
    and sums in float32 / float64 as numpy does, the definition in float64)."""
    rng = np.random.default_rng(seed)
    x = (rng.integers(-40, 41, n) / 4.0 if ties else rng.standard_normal(n) * rng.uniform(0.5, 10)).astype(np.float32)
    x[:neg_inf] = -np.inf
    assume(np.isfinite(x.max()))
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    want, margin = _chain64(x, cfg, u)
    assume(margin > 1e-5)
    assert _native(cfg).draw(x, u) == want
    assert draw_numpy(cfg, x, x.max(), u) == want


def test_ties_at_the_top_k_boundary_keep_the_lower_ids():
    x = np.zeros(5000, np.float32)
    x[4000] = 1.0                          # the best; then 4999 ties
    cfg = SamplingConfig(temperature=100.0, top_k=4)
    chain = _native(cfg)
    us = np.linspace(0, 1, 200, endpoint=False)
    assert {chain.draw(x, u) for u in us} == {4000, 0, 1, 2}
    assert {draw_numpy(cfg, x, x.max(), u) for u in us} == {4000, 0, 1, 2}


def test_the_c_chain_draws_its_distribution():
    """Over uniforms spread evenly on [0, 1), each candidate is picked in proportion to its
    weight: the draw walks the cumulative weights (id order)."""
    x = np.full(1000, -20.0, np.float32)
    x[[7, 300, 512, 999]] = np.log(np.array([0.1, 0.2, 0.3, 0.4], np.float32))
    cfg = SamplingConfig(temperature=1.0, top_k=4)
    chain = _native(cfg)
    n = 10000
    picks = np.array([chain.draw(x, (i + 0.5) / n) for i in range(n)])
    for i, p in zip((7, 300, 512, 999), (0.1, 0.2, 0.3, 0.4)):
        assert abs((picks == i).mean() - p) < 2e-3


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_logits_are_refused(bad):
    cfg = SamplingConfig(temperature=0.8, top_k=40)
    x = np.random.default_rng(0).standard_normal(500).astype(np.float32)
    x[123] = bad
    assert _el_sample(x, _native(cfg).params, 0.5) == ENONFINITE
    x = np.full(500, -np.inf, np.float32)
    assert _el_sample(x, _native(cfg).params, 0.5) == ENONFINITE
    # the Sampler reports them with its typed error, as numpy's chain does
    x[0] = bad
    with pytest.raises(EdgeLLMError, match="expected finite values"):
        Sampler(cfg).sample(x)
    # naming the likely cause: a file whose block scales hold NaN ran cleanly through load, and
    # the error blamed "a backend" (from a helper's probe of hostile GGUF files)
    with pytest.raises(EdgeLLMError, match="block scales hold NaN or inf gives this; `--units reference`"):
        Sampler(cfg).sample(x)


def test_bad_arguments_are_refused():
    x = np.random.default_rng(1).standard_normal(300).astype(np.float32)
    def E(k, p, mp, t, pen=1.0, last_n=64):
        return neon_lib.ElSampling(k, p, mp, t, pen, last_n)

    ok = E(40, 0.95, 0.05, 0.8)
    assert _el_sample(x, ok, 0.5) >= 0
    for u in (-0.1, 1.0, float("nan")):
        assert _el_sample(x, ok, u) == EINVAL, u
    for params in (E(40, 0.95, 0.05, 0.0), E(40, 0.95, 0.05, float("inf")), E(40, -1e-9, 0.05, 0.8),
                   E(40, 1.5, 0.05, 0.8), E(40, 0.95, -0.1, 0.8), E(40, 0.95, 1.1, 0.8), E(-1, 0.95, 0.05, 0.8),
                   E(40, 0.95, 0.05, 0.8, pen=0.0), E(40, 0.95, 0.05, 0.8, pen=float("nan")),
                   E(40, 0.95, 0.05, 0.8, pen=float("inf")), E(40, 0.95, 0.05, 0.8, last_n=-2)):
        assert _el_sample(x, params, 0.5) == EINVAL
    assert _el_sample(x, ok, 0.5, scratch_bytes=8) == EINVAL
    for k in (0, 300, 400):          # no top-k, or one as wide as the vocabulary: every logit
        assert 0 <= _el_sample(x, E(k, 0.95, 0.05, 0.8), 0.5) < 300
    lib = neon._lib()
    assert lib.el_sample(None, 300, ctypes.addressof(ok), 0.5, None, 0) == EINVAL


def test_sampler_draws_natively_unless_greedy():
    assert Sampler(SamplingConfig(temperature=0.8, top_k=40)).native is not None
    assert Sampler(SamplingConfig(temperature=0.8, top_k=0)).native is not None
    assert Sampler(SamplingConfig(temperature=0.0, top_k=40)).native is None      # greedy: argmax
    s = Sampler(SamplingConfig(temperature=0.8, top_k=40))
    assert s.run_chain() == (s.native, None)
    assert Sampler(SamplingConfig(temperature=0.0)).run_chain() == (None, None)      # the bare argmax


@settings(max_examples=200, deadline=None)
@given(groups=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 8)), min_size=1, max_size=12),
       seed=st.integers(0, 2**32))
def test_property_uniform_stream_ignores_how_draws_are_grouped(groups, seed):
    """Runs take n uniforms and give back those no draw used: the uniforms the draws do use are
    the seeded stream's, in order, whatever the grouping."""
    plain = Sampler(SamplingConfig(temperature=0.8, top_k=40, seed=seed))
    grouped = Sampler(SamplingConfig(temperature=0.8, top_k=40, seed=seed))
    used = []
    for n, k in groups:
        us = grouped.uniforms(n)
        k = min(k, n)
        used += us[:k]
        grouped.unuse(us[k:])
    assert used == [plain._uniform() for _ in used]
    assert grouped._uniform() == plain._uniform()


def test_seeded_sampling_reproduces_through_the_native_chain():
    x = (np.random.default_rng(3).standard_normal(49152) * 3).astype(np.float32)
    cfg = SamplingConfig(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=11)
    a = [Sampler(cfg).sample(x) for _ in range(3)]
    s, t = Sampler(cfg), Sampler(cfg)
    assert [s.sample(x) for _ in range(50)] == [t.sample(x) for _ in range(50)]
    assert len(set(a)) == 1


def test_the_generic_twin_draws_the_same_ids():
    """el_use_generic(1): the scalar maximum, top-k scan and exp, the same picks."""
    rng = np.random.default_rng(9)
    cases = []
    for i in range(60):
        n = int(rng.integers(3, 6000))
        x = (rng.integers(-20, 21, n) / 4.0 if i % 2 else rng.standard_normal(n) * 4).astype(np.float32)
        cfg = SamplingConfig(temperature=float(rng.uniform(0.1, 3)), top_k=0 if i % 3 == 0 else int(rng.integers(2, min(n - 1, 90) + 1)),
                             top_p=float(rng.uniform(0.3, 1.0)), min_p=float(rng.uniform(0, 0.3)))
        cases.append((x, _native(cfg), rng.random(5)))
    fast = [[chain.draw(x, u) for u in us] for x, chain, us in cases]
    lib = neon._lib()
    lib.el_use_generic(1)
    try:
        generic = [[chain.draw(x, u) for u in us] for x, chain, us in cases]
    finally:
        lib.el_use_generic(0)
    assert generic == fast


def test_a_refused_draw_names_its_code():
    chain = _native(SamplingConfig(temperature=0.8, top_k=40))
    with pytest.raises(EdgeLLMError, match="EL_EINVAL"):
        chain.draw(np.zeros(100, np.float32), 1.5)
    with pytest.raises(EdgeLLMError, match="EL_ENONFINITE"):
        chain.draw(np.full(100, np.nan, np.float32), 0.5)


@pytest.mark.parametrize("top_p, min_p, temperature", [(1.0, 0.0, 0.8), (0.9, 0.0, 1.0), (1.0, 0.05, 1.3),
                                                       (0.95, 0.02, 0.7)])
def test_whole_vocabulary_chains_draw_the_definitions_id(top_p, min_p, temperature):
    """Without top-k at a real vocabulary's size: every weight through the vectorized exp, the
    draw walked by blocks, a nucleus of thousands of ids (the growing ranked slice)."""
    x = (np.random.default_rng(12).standard_normal(49152) * 2).astype(np.float32)
    cfg = SamplingConfig(temperature=temperature, top_k=0, top_p=top_p, min_p=min_p)
    chain, checked = _native(cfg), 0
    for u in np.random.default_rng(13).random(60):
        want, margin = _chain64(x, cfg, float(u))
        if margin > 1e-6:
            checked += 1
            assert chain.draw(x, float(u)) == want == draw_numpy(cfg, x, x.max(), float(u))
    assert checked >= 50


@pytest.mark.parametrize("top_p", [1 - 1e-12, 1 - 1e-9, np.nextafter(1.0, 0.0)])
def test_a_nucleus_a_hair_under_one_draws_ids_both_twins_agree_on(top_p):
    """top_p just under 1 over the whole vocabulary, where the cut lands at the ranking's end and
    float64 rounding decides it: every draw is an id of the vocabulary, and both twins agree."""
    x = (np.random.default_rng(14).standard_normal(5000) * 2).astype(np.float32)
    x[::7] = -60.0                             # a tail whose weights are tiny, not zero
    cfg = SamplingConfig(temperature=1.0, top_k=0, top_p=float(top_p))
    chain = _native(cfg)
    for u in np.linspace(0.0, 0.999, 40):
        got = chain.draw(x, float(u))
        assert 0 <= got < x.size
        assert got == draw_numpy(cfg, x, x.max(), float(u))


def test_a_nucleus_whose_bucketed_mass_falls_short_keeps_every_id():
    """el_nucleus_flat adds the weights' mass bucket by bucket (by logit). One weight of 1 and 64
    tails of ~2^-54 each, one per bucket: each is lost when added to the 1, so the buckets' running
    mass never reaches top_p * total (1 + ~2^-49, summed in another order) and the walk ends in the
    last, empty bucket. The definition keeps every id there (its cumulative sum stays under
    top_p), and so must both twins: a u inside a tail id's slice draws that id, not the maximum."""
    x = np.concatenate([-37.5 - 0.03 * np.arange(64), [0.0]]).astype(np.float32)
    cfg = SamplingConfig(temperature=1.0, top_k=0, top_p=float(np.nextafter(1.0, 0.0)))
    ids, cum, _ = reference.sample_chain(x, cfg.top_k, cfg.top_p, cfg.min_p, cfg.temperature)
    assert ids.size == x.size                        # the definition's nucleus: every id
    chain, lib = _native(cfg), neon._lib()
    us = [float((cum[k - 1] if k else 0.0) + cum[k]) / 2 for k in (0, 10, 63)] + [0.5]   # mid-slice
    want = [0, 10, 63, 64]
    assert [draw_numpy(cfg, x, x.max(), u) for u in us] == want
    assert [chain.draw(x, u) for u in us] == want
    lib.el_use_generic(1)                            # the scalar exp's weights, the same walk
    try:
        assert [chain.draw(x, u) for u in us] == want
    finally:
        lib.el_use_generic(0)


@pytest.mark.parametrize("temperature", [1e-39, 2.9e-39, 1e-300, 5e-324])
def test_a_temperature_too_small_for_float_draws_the_argmax(temperature):
    """1/t past FLT_MAX made the maximum's weight (m - m) * inf = NaN and every draw EL_EINVAL
    (a refused request after its prefill); both twins pick the argmax there."""
    x = np.random.default_rng(1).standard_normal(500).astype(np.float32)
    cfg = SamplingConfig(temperature=temperature)
    for u in (0.0, 0.5, 0.999):
        assert _native(cfg).draw(x, u) == int(np.argmax(x))
        assert draw_numpy(cfg, x, x.max(), u) == int(np.argmax(x))


@pytest.mark.parametrize("field,value", [("top_k", 2**32 + 1), ("top_k", 2**31), ("repeat_last_n", 2**32 + 1)])
def test_c_int_fields_past_int_max_mean_the_same_as_int_max(field, value):
    """top_k and repeat_last_n are C ints in el_sampling: ctypes wrapped 2**32 + 1 to 1, so a
    top_k that wide sampled greedily without a word (2**31: EL_EINVAL)."""
    x = np.random.default_rng(2).standard_normal(300).astype(np.float32)
    wide = SamplingConfig(temperature=1.0, **{field: value})
    off = SamplingConfig(temperature=1.0, **{field: 0 if field == "top_k" else -1})
    for u in np.linspace(0.0, 0.99, 25):
        assert _native(wide).draw(x, float(u)) == _native(off).draw(x, float(u)) == draw_numpy(wide, x, x.max(), float(u))


def test_a_numpy_integer_seed_seeds_as_its_int():
    """validate() accepts numpy integers as seeds; random.Random refused them at the first draw
    (an untyped TypeError from inside a stream)."""
    x = np.random.default_rng(3).standard_normal(300).astype(np.float32)
    a = Sampler(SamplingConfig(temperature=1.0, seed=np.int64(5)))
    b = Sampler(SamplingConfig(temperature=1.0, seed=5))
    assert [a.sample(x, []) for _ in range(20)] == [b.sample(x, []) for _ in range(20)]


@pytest.mark.parametrize("top_k", [0, 7, 3000])
def test_top_p_zero_keeps_the_most_probable_token_alone(top_k):
    """top_p = 0 keeps one token, as llama.cpp's top-p (min_keep 1): the highest logit, the lowest
    id among equal ones. The C chain and its numpy twin, called directly (the Sampler takes the
    argmax path for it), draw that id for every u; the Sampler draws it at any temperature."""
    rng = np.random.default_rng(21)
    x = (rng.integers(-20, 21, 3000) / 4.0).astype(np.float32)
    top = np.flatnonzero(x == x.max())
    assert top.size > 1                               # ties at the top: the first id wins
    cfg = SamplingConfig(temperature=1.7, top_k=top_k, top_p=0.0, min_p=0.0)
    ids, _, _ = reference.sample_chain(x, cfg.top_k, cfg.top_p, cfg.min_p, cfg.temperature)
    assert ids.tolist() == [top[0]]
    params = neon_lib.ElSampling(top_k, 0.0, 0.0, 1.7, 1.0, 64)
    for u in np.linspace(0.0, 0.999, 25):
        assert _el_sample(x, params, float(u)) == top[0] == draw_numpy(cfg, x, x.max(), float(u))
    assert cfg.greedy
    assert Sampler(SamplingConfig(temperature=1.7, top_p=0.0, seed=3)).sample(x, []) == top[0]
