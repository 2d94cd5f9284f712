"""load()'s arguments and concurrent loads (from helpers' probes of the README and of several
engines in one process)."""
import threading

import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.errors import ConfigError
from tests.synthetic import write_tiny_model


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("la") / "m.gguf", tensor_type=QT.Q4_0, seed=2).path


def test_arguments_of_the_wrong_type_are_config_errors(path):
    """window=64.0 ended in a TypeError inside the planner, window="64" in the KV check, and
    prefault="no" turned paging on."""
    for kw, what in ((dict(kv="ring", window=64.0), "ring window must be an int"),
                     (dict(kv="ring", window="64"), "ring window must be an int"),
                     (dict(kv="ring", sinks=2.5), "ring sinks must be an int"),
                     (dict(prefault="no"), "prefault must be True, False or None")):
        with pytest.raises(ConfigError, match=what):
            edgellm.load(path, **kw)


def test_the_ring_cap_is_not_called_the_callers(path):
    """The ring's capped chunk was derived as '(set by the caller)' though the caller set none."""
    d = edgellm.load(path, kv="ring", window=64, sinks=4, threads=1).plan.chunk.derivation
    assert not any("set by the caller" in line for line in d) and "the ring's cap" in d[0]


def test_two_loads_at_once_keep_their_own_thread_counts(path):
    """Two threads loading at once swapped the neon unit's pool: the threads=2 engine's fused
    step held a 1-thread pool (3 of 4 runs)."""
    for _ in range(3):
        engines, errors = {}, []

        def load(n):
            try:
                engines[n] = edgellm.load(path, n_ctx=64, threads=n, prefault=False)
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(e)
        ts = [threading.Thread(target=load, args=(n,)) for n in (1, 2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors
        for n, e in engines.items():
            step = next((v for v in vars(e.runner).values() if hasattr(v, "_npool")), None)
            assert step is not None and step._npool.threads == n == e.threads


def test_a_load_from_inside_a_load_is_refused(path):
    """The load lock let a progress callback load another engine in the same thread, which swapped
    the outer engine's neon pool (from a review of the day's change)."""
    def progress(stage, done, total):
        edgellm.load(path, n_ctx=64, threads=1, prefault=False)
    with pytest.raises(ConfigError, match="called from inside another load"):
        edgellm.load(path, n_ctx=64, threads=2, prefault=False, progress=progress)
    assert edgellm.load(path, n_ctx=64, threads=1, prefault=False).threads == 1     # and loads go on
