"""Scheduler faults a probe found: close() missed the batch being tokenized (it ran to the end:
173 s for 100 queued requests), a ring engine opened a window per queued request (846 MiB for
40), a bad engine or a non-EdgeLLM exception in tokenization killed the worker (every later
result() hung), numpy priorities and non-number timeouts."""
import threading
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.engine import CancelToken
from edgellm.errors import ConfigError, EdgeLLMError
from edgellm.scheduler import Scheduler
from tests.synthetic import write_tiny_model

GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("schedfix") / "tiny.gguf", tensor_type=QT.F32, seed=6,
                            context_length=1024).path


@pytest.fixture(scope="module")
def engine(model_path):
    return edgellm.load(model_path, n_ctx=1024, threads=1)


@pytest.mark.parametrize("bad", (None, "model.gguf", 3))
def test_a_scheduler_needs_an_engine(bad):
    with pytest.raises(ConfigError, match="Scheduler needs an edgellm Engine"):
        Scheduler(bad)


def test_close_cancels_the_batch_being_tokenized(engine, monkeypatch):
    inside, release = threading.Event(), threading.Event()
    real = engine._prompt_ids

    def slow_ids(text):
        inside.set()
        release.wait(10)
        return real(text)

    monkeypatch.setattr(engine, "_prompt_ids", slow_ids)
    s = Scheduler(engine, chunk=4)
    reqs = [s.submit(f"hello {i}", temperature=0, max_tokens=200, ignore_eos=True) for i in range(5)]
    assert inside.wait(10)                 # the worker holds the batch, outside the lock
    closer = threading.Thread(target=s.close)
    closer.start()
    release.set()
    closer.join(60)
    assert not closer.is_alive()
    assert [r.stats.stop_reason for r in reqs] == ["cancelled"] * 5
    assert all(r.stats.generated_tokens <= 1 for r in reqs)


def test_an_unexpected_exception_fails_its_request_not_the_worker(engine, monkeypatch):
    real = engine._prompt_ids

    def ids(text):
        if text == "boom":
            raise AssertionError("an invariant broke")
        return real(text)

    monkeypatch.setattr(engine, "_prompt_ids", ids)
    with Scheduler(engine, chunk=4) as s:
        bad, good = s.submit("boom", **GREEDY), s.submit("hello world", **GREEDY)
        with pytest.raises(EdgeLLMError, match="an invariant broke"):
            bad.result(timeout=30)
        assert good.result(timeout=30) == engine.generate("hello world", **GREEDY)


def test_a_ring_engine_runs_one_request_at_a_time(model_path):
    e = edgellm.load(model_path, n_ctx=256, kv="ring", window=64, sinks=4, threads=1)
    prompts = ["hello world", "the quick brown fox", "zzz top"]
    want = [e.generate(p, **GREEDY) for p in prompts]
    with Scheduler(e, chunk=4) as s:
        reqs = [s.submit(p, **GREEDY) for p in prompts]
        most = 0
        while not all(r.done for r in reqs):
            most = max(most, len(s._worker._active))
        got = [r.result(timeout=30) for r in reqs]
    # (<= 1: a loaded machine can run all three before this loop first looks, and see none)
    assert most <= 1 and got == want


def test_numpy_priorities_and_typed_timeouts(engine):
    with Scheduler(engine, chunk=4) as s:
        r = s.submit("hello", priority=np.int64(3), **GREEDY)
        s.submit("hello", priority=np.float32(0.5), **GREEDY).result(timeout=30)
        for bad in ("1", float("nan"), True):
            with pytest.raises(ConfigError, match="timeout must be a number of seconds"):
                r.result(timeout=bad)
        assert r.result(timeout=30) == engine.generate("hello", **GREEDY)


@pytest.mark.parametrize("priority,value", [(np.uint32(5), 5), (np.uint8(200), 200), (np.int64(-2**63), -2**63),
                                            (np.int8(-128), -128)])
def test_numpy_integer_priorities_keep_their_order(engine, priority, value):
    """The queue orders by -priority: numpy's fixed widths wrapped (-np.uint32(5) is 4294967291,
    -np.int64(-2**63) itself), so priority 5 ran after 0 and the lowest int64 before everything."""
    with Scheduler(engine, chunk=4) as s:
        r = s.submit("hello", priority=priority, **GREEDY)
        assert type(r.priority) is int and r.priority == value and -r.priority == -value
        r.result(timeout=30)


def test_close_cancels_a_request_whose_generation_is_being_made(engine, monkeypatch):
    """Between leaving the waiting list and joining the active one, a request was in no list
    close() cancels: it ran to max_tokens."""
    import edgellm.scheduler as sched

    inside, release = threading.Event(), threading.Event()
    real = sched.Generation

    def slow_generation(*a, **kw):
        inside.set()
        release.wait(10)
        return real(*a, **kw)

    monkeypatch.setattr(sched, "Generation", slow_generation)
    s = Scheduler(engine, chunk=4)
    req = s.submit("hello", temperature=0, max_tokens=200, ignore_eos=True)
    assert inside.wait(10)
    closer = threading.Thread(target=s.close)
    closer.start()
    release.set()
    closer.join(60)
    assert not closer.is_alive()
    assert req.stats.stop_reason == "cancelled" and req.stats.generated_tokens <= 1


# -- from a later probe: starvation within a priority, and handles that outlive their Scheduler -----

class _FakeGen:
    def __init__(self, pending):
        self.pending, self.done, self.in_prefill = [0] * pending, False, True

    def step(self):
        self.pending = self.pending[8:]
        self.in_prefill = bool(self.pending)
        return None


class _FakeJob:
    def __init__(self, rid, pending, priority=0, passed_over_s=0.0):
        self.id, self.priority, self.gen = rid, priority, _FakeGen(pending)
        self.last_chunk = time.perf_counter() - passed_over_s
        self.cancel_token, self.blocks = CancelToken(), 1

    def cancel(self):
        self.cancel_token.cancel()

    def _put(self, piece):
        pass


class _SlowGen(_FakeGen):
    def step(self):
        time.sleep(0.1)
        return super().step()


def test_a_chunk_longer_than_starve_s_does_not_make_its_request_starved(monkeypatch):
    """The clock was stamped before the chunk ran: a chunk over STARVE_S made the request that
    just had one 'starved', and it went again before a short one (a review probe)."""
    from edgellm.scheduler import _Worker

    monkeypatch.setattr(_Worker, "STARVE_S", 0.05)
    w = _Worker(None, 8, "interleave")
    long = _FakeJob(1, 700)
    long.gen = _SlowGen(700)
    w._active = [long]
    w._tick()                                   # the long prompt's chunk: 0.1 s
    short = _FakeJob(2, 5)
    w._active = [long, short]
    before = len(long.gen.pending)
    w._tick()
    assert len(long.gen.pending) == before and len(short.gen.pending) < 5


def test_a_finished_request_the_app_keeps_does_not_keep_the_worker(engine):
    import gc

    def ask():
        s = Scheduler(engine)
        return s.submit("hello world", **GREEDY), s._thread

    r, thread = ask()
    assert r.result(timeout=60)
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive() and r.result() and r.done


def _picked(*jobs):
    """Which prefill the worker gives its next chunk to."""
    from edgellm.scheduler import _Worker

    w = _Worker(None, 8, "interleave")
    w._active = list(jobs)
    before = {j.id: len(j.gen.pending) for j in jobs}
    w._tick()
    return [j.id for j in jobs if len(j.gen.pending) != before[j.id]]


def test_a_prefill_passed_over_too_long_goes_next_within_its_priority():
    """Shortest-remaining-first gave a long prompt no chunk while short requests kept coming (a
    probe: 14 s, until the stream stopped). One passed over for STARVE_S now goes next."""
    from edgellm.scheduler import _Worker

    late = _Worker.STARVE_S + 0.5
    assert _picked(_FakeJob(1, 700), _FakeJob(2, 5)) == [2]                       # shortest first
    assert _picked(_FakeJob(1, 700, passed_over_s=late), _FakeJob(2, 5)) == [1]   # unless starved
    assert _picked(_FakeJob(1, 700, passed_over_s=late), _FakeJob(2, 600, passed_over_s=late + 1),
                   _FakeJob(3, 5)) == [2]                                         # the longest wait first
    # priorities stay strict: a starved lower-priority prefill still waits
    assert _picked(_FakeJob(1, 700, passed_over_s=late), _FakeJob(2, 5, priority=1)) == [2]


def test_a_request_keeps_its_scheduler(engine):
    """A Scheduler made in a helper function and dropped there was collected while the app held
    its requests: the finaliser cancelled them, and result() gave '' (stop_reason 'cancelled')."""
    import gc

    def ask(prompts):
        s = Scheduler(engine)
        return [s.submit(p, **GREEDY) for p in prompts]

    reqs = ask(["hello world", "abc def"])
    gc.collect()
    assert all(r.result(timeout=60) for r in reqs)
    assert [r.stats.stop_reason for r in reqs] == ["max_tokens", "max_tokens"]


# -- from a later probe: close() during the waiting list's sort, cancels of passed-over prefills,
# -- and a ring engine's chunk ------------------------------------------------------------------

class _SortedSlowly(int):
    """A priority whose negation (the sort key) runs `during` while list.sort is under way."""
    during = None

    def __neg__(self):
        type(self).during()
        return int.__neg__(self)


def test_close_during_the_waiting_lists_sort_cancels_every_waiting_request():
    """list.sort empties the list while it runs: a close() on another thread at that moment found
    no waiting request, cancelled none, and the worker then ran them all (93 s for 6,000)."""
    from types import SimpleNamespace

    from edgellm.scheduler import _Worker

    engine = SimpleNamespace(kv=SimpleNamespace(pool=SimpleNamespace(n_blocks=1)))
    w = _Worker(engine, 8, "interleave")
    w._active = [_FakeJob(1, 0)]                            # holds the pool: nothing is admitted
    waiting = [_FakeJob(i, 5) for i in range(2, 6)]
    waiting[2].priority = _SortedSlowly(0)
    w._waiting = list(waiting)
    closer = threading.Thread(target=w.stop, args=(True,))

    def close_meanwhile():
        if not closer.is_alive():
            closer.start()
            time.sleep(0.2)                                 # the closer's moment, mid-sort

    _SortedSlowly.during = close_meanwhile
    w._admit()
    closer.join(10)
    assert not closer.is_alive()
    assert [j.cancel_token.cancelled for j in waiting] == [True] * 4


def test_a_cancelled_prefill_ends_at_the_next_tick_even_when_higher_priorities_run():
    """A lower-priority prefill only saw its cancel inside its own next chunk: while higher
    priorities kept coming it ran on (5.8 s after cancel()), holding its room in the pool."""
    from edgellm.scheduler import _Worker

    class _Engine:
        def end_generation(self, gen):
            gen.closed, gen.done = True, True
            return " held back"                               # what the stop-string check held

    w = _Worker(_Engine(), 8, "interleave")
    high, low = _FakeJob(1, 700, priority=5), _FakeJob(2, 700)
    finished, put = [], []
    low._finish = lambda error=None: finished.append(error)
    low._put = put.append
    w._active = [high, low]
    low.cancel()
    w._tick()
    assert low.gen.closed and put == [" held back"] and finished == [None] and w._active == [high]
    assert len(high.gen.pending) < 700                      # and the tick went on to the others


def test_ending_a_generation_gives_the_text_its_stop_check_held_back(engine):
    """The scheduler's sweep of cancelled requests lost it (a review): a step that sees the cancel
    gives it, and Engine.stream does."""
    from edgellm.generation import Generation

    gen = Generation(engine, engine.tokenize("hello world"), edgellm.api.generation_config(**GREEDY),
                     CancelToken(), time.perf_counter(), time.perf_counter())
    gen.step()

    class Holding:
        def feed(self, text):
            return False, ""

        def flush(self):
            return " United"

    gen.stopper = Holding()
    assert engine.end_generation(gen) == " United" and gen.stats.stop_reason == "cancelled"
    assert engine.end_generation(gen) == ""                  # ended already


def test_a_cancelled_request_waiting_for_chunks_ends_promptly(engine, monkeypatch):
    """The same through a real Scheduler: a low-priority prompt passed over by a long
    high-priority one ends as cancelled while the high one is still in prefill."""
    real = engine.runner.forward

    def slow_forward(*a, **kw):
        time.sleep(0.02)
        return real(*a, **kw)

    monkeypatch.setattr(engine.runner, "forward", slow_forward)
    words = "river stone light garden paper window music winter ".split()
    text = " ".join(words[i % len(words)] for i in range(100))   # 462 tokens: both fit the pool
    with Scheduler(engine, chunk=4) as s:
        low = s.submit(text, priority=0, **GREEDY)
        deadline = time.perf_counter() + 30
        while low._job.gen is None and time.perf_counter() < deadline:
            time.sleep(0.01)
        high = s.submit(text + " again", priority=5, **GREEDY)
        while high._job.gen is None and time.perf_counter() < deadline:
            time.sleep(0.01)
        low.cancel()
        assert low._job._done.wait(2)
        assert low.stats.stop_reason == "cancelled" and not high.done
        high.cancel()


def test_a_ring_engines_scheduler_takes_the_engines_chunk(model_path):
    """On a ring the chunk decides what a prompt longer than the window sees: the default is the
    engine's own (load() caps it at half the room), and a chunk past the room is refused."""
    e = edgellm.load(model_path, kv="ring", window=64, sinks=4, threads=1)
    room = 64 - 4
    assert e.runner.prefill_chunk <= room // 2
    with Scheduler(e) as s:
        assert s.chunk == e.runner.prefill_chunk
    with Scheduler(e, chunk=room) as s:
        assert s.chunk == room
    with pytest.raises(ConfigError, match=f"at most {room}"):
        Scheduler(e, chunk=room + 1)
    e.close()
    with pytest.raises(ConfigError, match="closed"):
        Scheduler(e)


def test_a_pool_engines_scheduler_chunk_defaults_to_128(engine):
    with Scheduler(engine) as s:
        assert s.chunk == 128


class _Decoding(_FakeGen):
    def __init__(self):
        super().__init__(0)
        self.in_prefill, self.steps = False, 0

    def step(self):
        self.steps += 1
        return "x"


def test_priorities_are_strict_for_decoding_requests_too():
    """Only prefill chunks went by priority: a background request's decode steps went on beside a
    foreground one's (56 of its 89 pieces while the higher one ran), though the docs said lower
    priorities wait (a probe of the docs)."""
    from edgellm.scheduler import _Worker

    w = _Worker(None, 8, "interleave")
    low, high = _FakeJob(1, 0), _FakeJob(2, 0, priority=3)
    low.gen, high.gen = _Decoding(), _Decoding()
    w._active = [low, high]
    w._tick()
    w._tick()
    assert (low.gen.steps, high.gen.steps) == (0, 2)
    prefill = _FakeJob(3, 700, priority=3)        # a higher one in prefill holds them too
    w._active = [low, prefill]
    w._tick()
    assert low.gen.steps == 0 and len(prefill.gen.pending) < 700
    w._active = [low]                             # and once it is done, they go on
    w._tick()
    assert low.gen.steps == 1
