"""Mends from a helper's probe of the API: a stream that outlives its engine, one piece after a
cancel, repeat penalties that overflow float32, an infinite scheduler timeout, NUL and empty
session paths, numpy integers as options, a non-callable progress and an empty model path, the
ring's warm() count, window cap and memory message, a truncated session's conversation, and
non-finite rows from Engine.logits()."""
import gc
import logging
import math
import sys
import warnings

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm import api
from edgellm.engine import CancelToken
from edgellm.errors import ConfigError, EdgeLLMError
from edgellm.kv.session_file import SessionFileError, read_header
from edgellm.sampling import SamplingConfig
from edgellm.scheduler import Scheduler
from tests.synthetic import write_tiny_model

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("probe22") / "m.gguf", tensor_type=QT.Q4_0, seed=2).path


@pytest.fixture(scope="module")
def eng(path):
    e = edgellm.load(path, n_ctx=128, threads=1)
    yield e
    e.close()


# -- a stream that outlives its engine ------------------------------------------------------------

def test_closing_a_stream_after_its_engine_closed_does_not_raise(path, monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    e = edgellm.load(path, n_ctx=64, threads=1)
    it = e.stream("Hi", max_tokens=30, **GREEDY)
    next(it)
    dropped = e.stream("Hi", max_tokens=30, **GREEDY)
    next(dropped)
    e.close()
    it.close()                       # raised ConfigError('the engine is closed')
    del dropped                      # printed "Exception ignored in ... Engine._stream"
    gc.collect()
    assert unraisable == []


def test_closing_the_engine_inside_a_stream_loop_raises_once(path):
    e = edgellm.load(path, n_ctx=64, threads=1)
    with pytest.raises(ConfigError, match="the engine is closed") as ei:
        for _ in e.stream("Hi", max_tokens=30, **GREEDY):
            e.close()
    # one error, not a second one from the generator's close chained onto the first
    assert ei.value.__context__ is None


# -- cancel between pieces ------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["token", "engine"])
def test_a_cancel_between_pieces_yields_no_further_piece(eng, how):
    token = CancelToken() if how == "token" else None
    it = eng.stream("hello there", max_tokens=30, cancel=token, **GREEDY)
    next(it)
    produced = eng.last_stats.generated_tokens
    (token or eng).cancel()
    assert list(it) == []
    assert eng.last_stats.stop_reason == "cancelled"
    assert eng.last_stats.generated_tokens == produced   # no decode step ran after the cancel


# -- repeat_penalty bounds ------------------------------------------------------------------------

@pytest.mark.parametrize("rp", [1e-300, 1e-45, 1e-40, 1e-31, 1e31, 1e300])
def test_a_repeat_penalty_that_overflows_float32_is_refused_up_front(eng, rp):
    with pytest.raises(ConfigError, match=r"repeat_penalty.*1e-30, 1e\+30"):
        eng.generate("hello", max_tokens=4, repeat_penalty=rp)
    with pytest.raises(ConfigError, match="repeat_penalty"):
        SamplingConfig(repeat_penalty=rp)


@pytest.mark.parametrize("rp", [1e-30, 1e30])
def test_the_bounds_of_repeat_penalty_run_without_numpy_warnings(eng, rp):
    with pytest.raises(ConfigError, match="repeat_penalty"):   # and a step past them is refused
        SamplingConfig(repeat_penalty=rp * 10 if rp > 1 else rp / 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for temperature in (0, 0.8):
            eng.generate("hello hello hello", max_tokens=6, repeat_penalty=rp, temperature=temperature,
                         seed=1, ignore_eos=True)


# -- scheduler timeout ----------------------------------------------------------------------------

@pytest.mark.parametrize("timeout", [math.inf, 1e300])
def test_an_infinite_result_timeout_waits_without_end(eng, timeout):
    with Scheduler(eng) as s:
        assert s.submit("hello", max_tokens=3, **GREEDY).result(timeout=timeout)


# -- session paths --------------------------------------------------------------------------------

def test_a_nul_byte_or_an_empty_session_path_is_a_config_error(eng, tmp_path):
    eng.generate("hello", max_tokens=2, **GREEDY)
    bad = str(tmp_path / "a\x00.s")
    with pytest.raises(ConfigError, match="NUL byte"):
        eng.save_session(bad)
    with pytest.raises(ConfigError, match="NUL byte"):
        eng.load_session(bad)
    with pytest.raises(ConfigError, match="session path is empty"):
        eng.save_session("")
    with pytest.raises(ConfigError, match="session path is empty"):
        eng.load_session("")


# -- numpy integers -------------------------------------------------------------------------------

def test_numpy_integers_are_taken_wherever_an_int_is(path):
    e = edgellm.load(path, n_ctx=np.int64(64), threads=np.int64(1), prefill_chunk=np.int64(8))
    try:
        assert e.threads == 1 and type(e.threads) is int
        assert e.runner.prefill_chunk == 8
        out = e.generate("hello", max_tokens=np.int64(4), top_k=np.int32(5), seed=np.uint8(1), temperature=0.5,
                         ignore_eos=True)
        assert e.last_stats.generated_tokens == 4 and isinstance(out, str)
        with Scheduler(e, chunk=np.int64(8)) as s:
            assert s.submit("hello", max_tokens=np.int64(2), **GREEDY).result(timeout=60)
        for bad in (True, np.float64(4.0)):
            with pytest.raises(ConfigError, match="max_tokens"):
                e.generate("hello", max_tokens=bad)
    finally:
        e.close()
    with pytest.raises(ConfigError, match="threads"):
        edgellm.load(path, threads=True)


# -- load's progress and model --------------------------------------------------------------------

def test_a_non_callable_progress_and_an_empty_model_path_are_refused_up_front(path):
    with pytest.raises(ConfigError, match="progress must be a callable"):
        edgellm.load(path, n_ctx=64, threads=1, progress=5)
    with pytest.raises(ConfigError, match="model path is empty"):
        edgellm.load("", n_ctx=64, threads=1)


# -- ring engines ---------------------------------------------------------------------------------

def test_warm_on_a_ring_returns_the_text_tokens_as_on_a_pool(path):
    text = " ".join(f"word{i}" for i in range(60))
    with edgellm.load(path, kv="ring", window=32, sinks=4, threads=1) as ring:
        n = len(ring.tokenize(text))
        assert n > 32
        assert ring.warm(text) == n          # was 32: the window, not the tokens computed
    with edgellm.load(path, n_ctx=256, threads=1) as pool:
        assert pool.warm(text) == len(pool.tokenize(text))


def test_a_ring_window_past_the_trained_context_is_capped_with_a_warning(path, caplog):
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        with edgellm.load(path, kv="ring", window=100000, sinks=4, threads=1) as e:
            assert e.kv.kv.window == 256 == e.config.context_length
            assert e.kv.ring.window == 256
    assert any("window 100000 is above" in r.getMessage() for r in caplog.records)


def test_a_rings_memory_refusal_names_its_window(path, monkeypatch):
    monkeypatch.setattr(api, "available_bytes", lambda: 1 << 10)
    with pytest.raises(ConfigError, match=r"at window=32 \(kv='ring'\).*lower window") as ei:
        edgellm.load(path, kv="ring", window=32, sinks=4, threads=1)
    assert "n_ctx" not in str(ei.value)
    with pytest.raises(ConfigError, match=r"at n_ctx=64 .*lower n_ctx"):
        edgellm.load(path, n_ctx=64, threads=1)


# -- a truncated session's conversation -----------------------------------------------------------

def test_a_truncated_session_file_keeps_its_conversation(eng, tmp_path, caplog):
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]
    eng.chat(messages[:1], max_tokens=4, **GREEDY)
    p = tmp_path / "s.edgesess"
    assert eng.save_session(p, meta={"messages": messages}) > 0
    data = p.read_bytes()
    header_end = 16 + int.from_bytes(data[12:16], "little")
    cut = tmp_path / "s3.edgesess"
    cut.write_bytes(data[:header_end + 100])
    with caplog.at_level(logging.WARNING):
        assert eng.load_session(cut) is False           # its KV is a cache miss, with the reason
    assert "size mismatch" in caplog.text
    h = read_header(cut, whole=False)                 # but the conversation it holds continues
    assert h.meta["messages"] == messages and h.n_tokens > 0
    # as a checksum mismatch's does (the header is read alike)
    flipped = tmp_path / "s4.edgesess"
    flipped.write_bytes(data[:-40] + bytes([data[-40] ^ 1]) + data[-39:])
    assert eng.load_session(flipped) is False
    assert read_header(flipped, whole=False).meta["messages"] == messages
    with pytest.raises(SessionFileError, match="size mismatch"):   # a listing still calls it unusable
        read_header(cut)
    with pytest.raises(SessionFileError, match="truncated"):       # a header cut short has no meta
        read_header(_cut_to(tmp_path, data, header_end - 5), whole=False)


def _cut_to(tmp_path, data: bytes, n: int):
    p = tmp_path / "short.edgesess"
    p.write_bytes(data[:n])
    return p


# -- non-finite logits ----------------------------------------------------------------------------

def test_logits_refuses_non_finite_rows_as_generate_does(tmp_path):
    p = write_tiny_model(tmp_path / "nan.gguf", tensor_type=QT.F32, seed=3).path
    r = gguf.GGUFReader(p, "r+")
    next(t for t in r.tensors if t.name == "output_norm.weight").data[:] = np.nan
    del r
    with edgellm.load(p, n_ctx=64, threads=1) as e:
        with pytest.raises(EdgeLLMError, match="non-finite") as from_generate:
            e.generate("hi", max_tokens=2)
        with pytest.raises(EdgeLLMError, match="non-finite") as from_logits:
            e.logits([1, 2, 3])
        assert type(from_logits.value) is type(from_generate.value)
