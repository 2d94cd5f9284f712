"""Engine.close(): an app that keeps the Engine object (UI state, a registry) while it switches
models had no way to free its memory but to drop every reference and wait for a collection."""
import gc
import weakref

import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.errors import ConfigError
from edgellm.scheduler import Scheduler
from tests.synthetic import write_tiny_model


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("close") / "m.gguf", tensor_type=QT.Q4_0, seed=2).path


def test_close_frees_the_kv_and_weights_and_later_calls_are_typed_errors(path):
    eng = edgellm.load(path, n_ctx=64, threads=1)
    text = eng.generate("hello", max_tokens=3, temperature=0)
    pool, runner = weakref.ref(eng.kv.pool), weakref.ref(eng.runner)
    eng.close()
    gc.collect()
    assert pool() is None and runner() is None                  # the arena and the weights are gone
    for call in (lambda: eng.generate("hello", max_tokens=1), lambda: eng.chat([{"role": "user", "content": "x"}]),
                 lambda: eng.warm("hello"), lambda: eng.logits([1, 2]), lambda: eng.save_session("/tmp/x.edgesess")):
        with pytest.raises(ConfigError, match="the engine is closed"):
            call()
    with pytest.raises(ConfigError, match="the engine is closed"):
        Scheduler(eng).submit("hello").result(timeout=30)
    eng.close()                                                   # twice: nothing
    assert eng.tokenize("hello") and eng.last_stats.generated_tokens == 3    # what needs no model stays
    with edgellm.load(path, n_ctx=64, threads=1) as again:        # and as a context manager
        assert again.generate("hello", max_tokens=3, temperature=0) == text
    with pytest.raises(ConfigError, match="the engine is closed"):
        again.generate("hello", max_tokens=1)


def test_close_inside_a_step_waits_for_its_end_and_frees_a_schedulers_hold(path):
    """close() from a signal handler mid-step got in through the re-entrant lock and broke the
    step (AttributeError); load_session after close was an AttributeError; an idle Scheduler's
    last request kept the KV arena alive after close (from a helper's probe of the day's features)."""
    eng = edgellm.load(path, n_ctx=64, threads=1)
    with eng.turn():
        eng.close()                   # as a handler would, inside a step of this thread
        assert eng.runner is not None  # not yet: the step goes on
    assert eng.runner is None          # done when the turn ended
    with pytest.raises(ConfigError, match="the engine is closed"):
        eng.load_session("/nonexistent.edgesess")
    eng = edgellm.load(path, n_ctx=64, threads=1)
    with Scheduler(eng) as s:
        s.submit("hello", max_tokens=2).result(timeout=30)
        pool = eng.kv.pool
        eng.close()
        assert pool.k is None and pool.v is None   # the arena is dropped though the pool is held


def test_close_frees_a_rings_window_and_its_pool_view(path):
    """The ring's pool view holds reshapes of the window: dropping the window's own arrays alone
    kept them alive (the arena release reached the pool's and the ring's attributes only)."""
    eng = edgellm.load(path, kv="ring", window=32, sinks=4, threads=1)
    eng.generate("hello", max_tokens=2)
    ring = eng.kv.ring
    eng.close()
    assert ring.k is None and ring.pool.k is None and ring.pool.v is None


def test_close_hands_freed_heap_pages_back(path, monkeypatch):
    """glibc keeps freed heap memory mapped: an NPU engine's onnxruntime sessions stayed ~1.0-1.4
    GiB resident after close() (94 MiB once trimmed, a helper's probe, session 26)."""
    from edgellm import api
    calls = []
    monkeypatch.setattr(api, "release_free_pages", lambda: calls.append(1) or True)
    eng = edgellm.load(path, n_ctx=64, threads=1)
    calls.clear()                       # (load trims too)
    eng.close()
    assert calls, "close() did not hand freed pages back"
