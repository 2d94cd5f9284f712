"""Arguments a probing session (session 25) passed to the Python API, each of which let an
untyped exception reach the caller: a huge int temperature (OverflowError), stop=None inside a
GenerationConfig (TypeError), a 0-d numpy array of ids (TypeError), a session path holding a lone
surrogate (UnicodeEncodeError), a meta nested 10^5 deep (RecursionError), wait_loaded("1")
(TypeError), load(5) / load(b"...") (TypeError) and load("x" * 5000) (ENAMETOOLONG), a value whose
__repr__ raises (its own error in place of ConfigError), a Mapping whose get() and [] disagree
(KeyError), end_generation(None) (AttributeError); and logits() of 20M ids took 8 s to refuse."""
import time

import numpy as np
import pytest
from collections.abc import Mapping
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.errors import ConfigError, ContextFull, EdgeLLMError, ModelNotFoundError
from tests.synthetic import write_tiny_model


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("api25") / "m.gguf", tensor_type=QT.Q8_0, seed=3).path
    return edgellm.load(path, n_ctx=256, threads=1, prefault=False)


class NoRepr:
    def __repr__(self):
        raise RuntimeError("an app's broken __repr__")


class Disagreeing(Mapping):
    def __getitem__(self, k):
        raise KeyError(k)

    def get(self, k, default=None):
        return "x"

    def __iter__(self):
        return iter(("role", "content"))

    def __len__(self):
        return 2


def _deep():
    d = c = {}
    for _ in range(100_000):
        c["a"] = {}
        c = c["a"]
    return d


CASES = {
    "huge int temperature": (lambda e, t: e.generate("hi", temperature=10**400), ConfigError, "sampling.temperature"),
    "stop=5 in a config": (lambda e, t: e.generate("hi", config=edgellm.GenerationConfig(stop=5)), ConfigError,
                           "stop: expected a string or a list of strings, found int"),
    "0-d ids to logits": (lambda e, t: e.logits(np.array(5)), ConfigError, "ndarray of 0 dimensions"),
    "0-d ids to detokenize": (lambda e, t: e.detokenize(np.array(5)), ConfigError, "ndarray of 0 dimensions"),
    "surrogate session path": (lambda e, t: e.load_session(str(t) + "/\ud800.bin"), ConfigError, "not encodable"),
    "deep meta": (lambda e, t: (e.generate("hi", max_tokens=2), e.save_session(t / "s.bin", meta=_deep())),
                  ConfigError, "cannot save the session: RecursionError"),
    "wait_loaded('1')": (lambda e, t: e.wait_loaded("1"), ConfigError, "wait_loaded: timeout"),
    "wait_loaded(10**400)": (lambda e, t: e.wait_loaded(10**400), ConfigError, "wait_loaded: timeout"),
    "load(5)": (lambda e, t: edgellm.load(5), ModelNotFoundError, "found int"),
    "load(bytes)": (lambda e, t: edgellm.load(b"/m.gguf"), ModelNotFoundError, "found bytes"),
    "load(long name)": (lambda e, t: edgellm.load("x" * 5000), ModelNotFoundError, "not a usable model path"),
    "repr raises": (lambda e, t: e.generate("hi", top_k=NoRepr()), ConfigError, "found <NoRepr object>"),
    "get and [] disagree": (lambda e, t: e.chat([Disagreeing()]), ConfigError, "messages: could not be read"),
    "end_generation(None)": (lambda e, t: e.end_generation(None), ConfigError, "found NoneType"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_arguments_are_typed_errors(eng, tmp_path, case):
    call, kind, says = CASES[case]
    with pytest.raises(kind, match=None) as e:
        call(eng, tmp_path)
    assert isinstance(e.value, EdgeLLMError) and says in str(e.value), str(e.value)
    # and the engine goes on as before
    assert eng.generate("hello", max_tokens=4, temperature=0) == eng.generate("hello", max_tokens=4, temperature=0)


def test_stop_none_in_a_config_means_no_stop_strings(eng):
    want = eng.generate("hello", max_tokens=4, temperature=0)
    assert eng.generate("hello", config=edgellm.GenerationConfig(stop=None, max_tokens=4, temperature=0)) == want


def test_too_many_ids_are_refused_before_they_are_checked_one_by_one(eng):
    t = time.perf_counter()
    with pytest.raises(ContextFull, match="20000000 token ids but the context holds 256"):
        eng.logits([5] * 20_000_000)
    assert time.perf_counter() - t < 2.0
    with pytest.raises(edgellm.errors.TokenIdError, match="token id 1000000000 outside the vocabulary"):
        eng.logits(np.full(8, 10**9))
    ids = [1, 2, 3]
    assert np.array_equal(eng.logits(np.array(ids)), eng.logits(ids))
