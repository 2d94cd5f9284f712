"""Ctrl-C (SIGINT -> KeyboardInterrupt) landing in the middle of the engine's KV accounting: the
interrupt still reaches the caller, and the pool is whole afterwards: no block lost, no refcount
off by one, the next greedy text the same as a fresh engine's. Before interrupts.deferred, one
landing in PoolStore.open left 3 of 128 blocks held by nothing, and one in KVPool._release made
every later call fail with KVInvariantError."""
import os
import signal
import threading

import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm import interrupts
from edgellm.kv.pool import KVPool, PoolSequence
from edgellm.kv.prefix import PrefixCache
from edgellm.kv.store import PoolStore
from tests.synthetic import write_tiny_model

GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)
FIRST = "one two three four five six seven eight nine ten " * 3
SECOND = "the quick brown fox jumps over the lazy dog " * 3


def _ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)


def test_deferred_holds_sigint_until_the_outermost_block_ends():
    before = signal.getsignal(signal.SIGINT)
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred():
            with interrupts.deferred():
                _ctrl_c()
                for i in range(1000):     # many bytecodes, calls and jumps: no interrupt here
                    ran.append(abs(i))
            ran.append("inner block ended")
    assert len(ran) == 1001 and signal.getsignal(signal.SIGINT) is before


def test_checkpoint_delivers_a_held_interrupt_there():
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred():
            _ctrl_c()
            ran.append("before")
            interrupts.checkpoint()
            ran.append("after")
    assert ran == ["before"]
    with interrupts.deferred():   # nothing held: a checkpoint is a no-op
        interrupts.checkpoint()


def test_other_threads_and_ignored_sigint_are_left_alone():
    seen = []

    def other():
        with interrupts.deferred():
            seen.append(signal.getsignal(signal.SIGINT))
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [signal.default_int_handler]
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupts.deferred():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            _ctrl_c()               # ignored, as the app asked
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_fork_while_held_gives_the_child_its_handler_back():
    status = []

    def fork_from_a_thread():
        pid = os.fork()
        if pid == 0:
            os._exit(0 if signal.getsignal(signal.SIGINT) is signal.default_int_handler else 1)
        status.append(os.waitpid(pid, 0)[1])
    with interrupts.deferred():
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        t = threading.Thread(target=fork_from_a_thread)
        t.start()
        t.join(timeout=60)
    assert status == [0]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("interrupts") / "tiny.gguf", tensor_type=QT.F32, seed=4,
                            context_length=512).path


# the accounting steps a Ctrl-C can land in, each entered many times by one request
TARGETS = [(KVPool, "_decref"), (KVPool, "_alloc"), (KVPool, "_incref"), (PoolSequence, "free"),
           (PoolSequence, "reserve"), (PoolSequence, "commit"), (PoolSequence, "truncate"),
           (PrefixCache, "register"), (PrefixCache, "lookup"), (PoolStore, "open"), (PoolStore, "close")]


@pytest.mark.parametrize("cls,name", TARGETS, ids=[f"{c.__name__}.{n}" for c, n in TARGETS])
@pytest.mark.parametrize("nth", [1, 2, 3])
@pytest.mark.parametrize("call", ["generate", "warm", "clear_cache"])
def test_a_ctrl_c_inside_the_kv_accounting_leaves_the_pool_whole(model_path, monkeypatch, cls, name, nth, call):
    eng = edgellm.load(model_path, n_ctx=256, threads=1)
    fresh = edgellm.load(model_path, n_ctx=256, threads=1)
    try:
        pool = eng.kv.pool
        eng.generate(FIRST, **GREEDY)               # a kept conversation and cached blocks to let go
        original, count = getattr(cls, name), [0]

        def interrupted(*a, **k):
            count[0] += 1
            if count[0] == nth:
                _ctrl_c()                           # Python delivers it at the next call's entry
            return original(*a, **k)
        monkeypatch.setattr(cls, name, interrupted)
        work = {"generate": lambda: eng.generate(SECOND, **GREEDY), "warm": lambda: eng.warm(SECOND),
                "clear_cache": eng.clear_cache}[call]
        try:
            work()
        except KeyboardInterrupt:
            pass
        else:
            assert count[0] < nth, f"{name} ran {count[0]} times and the Ctrl-C never came"
        monkeypatch.setattr(cls, name, original)
        pool.check()
        eng.clear_cache()
        pool.check()
        assert (pool.free_blocks, pool.live_sequences) == (pool.n_blocks, 0)
        assert eng.generate(SECOND, **GREEDY) == fresh.generate(SECOND, **GREEDY)
    finally:
        eng.close()
        fresh.close()


class _AppTimeout(Exception):
    pass


class _SigLandsAfter:
    """interrupts._sig whose `name` call returns, then raises as another signal's Python handler
    would at the next bytecode (an app's SIGALRM timeout)."""

    def __init__(self, name):
        self.name, self.fired = name, False

    def __getattr__(self, attr):
        real = getattr(interrupts.signal, attr)
        if attr != self.name:
            return real

        def call(*a):
            out = real(*a)
            if not self.fired:     # (one signal: the undo's own calls go through)
                self.fired = True
                raise _AppTimeout()
            return out
        return call


@pytest.mark.parametrize("where", ["getsignal", "signal"])
def test_an_exception_from_another_handler_inside_enter_leaves_nothing_held(monkeypatch, where):
    """A timeout exception landing inside deferred().__enter__ (1 of ~2,400 timed-out generations
    in a probe) left _depth at 1 and SIGINT on the recording handler: every later Ctrl-C outside
    the engine was swallowed, then raised inside some unrelated generate."""
    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(interrupts, "_sig", _SigLandsAfter(where))
    with pytest.raises(_AppTimeout):
        with interrupts.deferred():
            pytest.fail("the block ran")
    monkeypatch.undo()
    assert not interrupts._open() and not interrupts._saved and not interrupts._pending
    assert signal.getsignal(signal.SIGINT) is before
    with pytest.raises(KeyboardInterrupt):   # Ctrl-C raises again, at once
        _ctrl_c()
        for i in range(1000):
            abs(i)


def test_a_timeout_signal_waits_for_the_block_and_every_signal_is_delivered_once_in_order():
    """An app's SIGALRM handler raising its own exception (a timeout around generate) landed in
    the KV accounting like a Ctrl-C: a block's refcount off by one after ~6,000 timed-out calls."""
    got = []

    def on_alarm(signum, frame):
        got.append("alarm")
        raise _AppTimeout()

    def on_usr1(signum, frame):
        got.append("usr1")
    old = signal.signal(signal.SIGALRM, on_alarm), signal.signal(signal.SIGUSR1, on_usr1)
    try:
        ran = []
        with pytest.raises(_AppTimeout):
            with interrupts.deferred():
                os.kill(os.getpid(), signal.SIGUSR1)
                os.kill(os.getpid(), signal.SIGALRM)
                os.kill(os.getpid(), signal.SIGUSR1)    # (pending once, as the OS keeps it)
                for i in range(1000):
                    ran.append(abs(i))
                ran.append("block ended")
        assert len(ran) == 1001 and got == ["usr1", "alarm"]
        assert signal.getsignal(signal.SIGALRM) is on_alarm and signal.getsignal(signal.SIGUSR1) is on_usr1
        with pytest.raises(_AppTimeout):             # raises at once outside a block, as before
            os.kill(os.getpid(), signal.SIGALRM)
            for i in range(1000):
                abs(i)
    finally:
        signal.signal(signal.SIGALRM, old[0])
        signal.signal(signal.SIGUSR1, old[1])


def test_a_signal_after_one_whose_handler_raised_still_comes():
    got = []

    def raising(signum, frame):
        got.append(signum)
        raise _AppTimeout()
    old = signal.signal(signal.SIGUSR2, raising), signal.signal(signal.SIGHUP, raising)
    try:
        with pytest.raises(_AppTimeout):
            with interrupts.deferred():
                os.kill(os.getpid(), signal.SIGUSR2)
                os.kill(os.getpid(), signal.SIGHUP)
        try:
            for i in range(1000):   # (the second, sent again after the first's exception, may land here)
                abs(i)
        except _AppTimeout:
            pass
        assert got == [signal.SIGUSR2, signal.SIGHUP]   # neither lost
    finally:
        signal.signal(signal.SIGUSR2, old[0])
        signal.signal(signal.SIGHUP, old[1])


@pytest.mark.parametrize("cls,name", [(KVPool, "_decref"), (PoolStore, "open"), (PrefixCache, "register")],
                         ids=["KVPool._decref", "PoolStore.open", "PrefixCache.register"])
def test_a_timeout_exception_inside_the_kv_accounting_leaves_the_pool_whole(model_path, monkeypatch, cls, name):
    eng = edgellm.load(model_path, n_ctx=256, threads=1)
    fresh = edgellm.load(model_path, n_ctx=256, threads=1)

    def on_alarm(signum, frame):
        raise _AppTimeout()
    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        pool = eng.kv.pool
        eng.generate(FIRST, **GREEDY)
        original = getattr(cls, name)

        def timed_out(*a, **k):
            os.kill(os.getpid(), signal.SIGALRM)     # the app's timer fires here
            return original(*a, **k)
        monkeypatch.setattr(cls, name, timed_out)
        with pytest.raises(_AppTimeout):
            eng.generate(SECOND, **GREEDY)
        monkeypatch.setattr(cls, name, original)
        pool.check()
        eng.clear_cache()
        assert (pool.free_blocks, pool.live_sequences) == (pool.n_blocks, 0)
        assert eng.generate(SECOND, **GREEDY) == fresh.generate(SECOND, **GREEDY)
    finally:
        signal.signal(signal.SIGALRM, old)
        eng.close()
        fresh.close()


def test_an_asyncio_signal_callback_runs_once_for_a_signal_held_back():
    """The first version raised each held signal again at the block's end: its second wakeup-fd
    byte made asyncio run the callback twice (a review)."""
    import asyncio
    got = []

    async def main():
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, lambda: got.append("usr1"))
        try:
            with interrupts.deferred():
                os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(5):
                await asyncio.sleep(0.02)
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)
    asyncio.run(main())
    assert got == ["usr1"]


def test_a_handler_the_app_installs_inside_a_block_stays():
    """'A second Ctrl-C quits': the first one's handler, delivered at a checkpoint, installs the
    default one; the block's end had put the first back (a review)."""
    calls = []

    def first(signum, frame):
        calls.append("first")
        signal.signal(signal.SIGINT, signal.default_int_handler)
    old = signal.signal(signal.SIGINT, first)
    try:
        with interrupts.deferred():
            _ctrl_c()
            interrupts.checkpoint()
        assert calls == ["first"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, old)


def test_profiling_signals_are_not_held_and_a_leaked_recorder_hands_over():
    seen = []
    old = signal.signal(signal.SIGPROF, lambda s, f: seen.append("prof"))
    try:
        with interrupts.deferred():
            os.kill(os.getpid(), signal.SIGPROF)
            for i in range(1000):
                abs(i)
            assert seen == ["prof"]     # at once, inside the block: a sampler's samples stay put
    finally:
        signal.signal(signal.SIGPROF, old)
    got = []
    old = signal.signal(signal.SIGUSR2, lambda s, f: got.append("usr2"))
    try:
        with interrupts.deferred():
            inside = signal.getsignal(signal.SIGUSR2)    # (the recorder: an app saving it ...)
        signal.signal(signal.SIGUSR2, inside)           # ... and putting it back outside
        os.kill(os.getpid(), signal.SIGUSR2)
        for i in range(1000):
            abs(i)
        assert got == ["usr2"] and signal.getsignal(signal.SIGUSR2) is not inside
    finally:
        signal.signal(signal.SIGUSR2, old)


@pytest.mark.parametrize("target", ["__exit__", "_swap_out", "_close_all"])
def test_an_exception_landing_as_the_block_closes_heals(target):
    """Python checks for signals at every call's entry: another handler's exception there left
    the block counted open for good, and every later Ctrl-C outside the engine was recorded and
    lost (a review). The block dies with its frame; the next block, or the signal, heals."""
    import sys
    before = signal.getsignal(signal.SIGINT)

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_name == target and frame.f_globals.get("__name__") == interrupts.__name__:
            sys.settrace(None)
            raise _AppTimeout()
    with pytest.raises(_AppTimeout):
        with interrupts.deferred():
            sys.settrace(tracer)
    sys.settrace(None)
    assert not interrupts._open()
    with pytest.raises(KeyboardInterrupt):       # outside any block: raised at once
        _ctrl_c()
        for i in range(1000):
            abs(i)
    with interrupts.deferred():                  # and the next block finds a whole state
        pass
    assert signal.getsignal(signal.SIGINT) is before and not interrupts._saved and not interrupts._pending


def test_a_second_ctrl_c_after_the_handler_switched_at_a_checkpoint_still_waits():
    """'Press again to quit': the first Ctrl-C's handler (run at a checkpoint) installs the
    default one; the second Ctrl-C landed raw inside the KV accounting (a review)."""
    def first(signum, frame):
        signal.signal(signal.SIGINT, signal.default_int_handler)
    old = signal.signal(signal.SIGINT, first)
    ran = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupts.deferred():
                _ctrl_c()
                interrupts.checkpoint()          # the first one, handled here
                _ctrl_c()                        # the second: held until the block ends
                for i in range(1000):
                    ran.append(abs(i))
        assert len(ran) == 1000 and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, old)


def test_an_exception_while_the_received_signals_are_collected_delivers_none_twice(monkeypatch):
    """A timeout landing in that loop left the state uncollected: the next block delivered the
    same signals again, and late (a review)."""
    got = []
    old = (signal.signal(signal.SIGUSR1, lambda s, f: got.append("usr1")),
           signal.signal(signal.SIGUSR2, lambda s, f: got.append("usr2")))

    class RaisingSet(set):
        def add(self, x):
            if self:                      # (the second signal: as if a timeout landed there)
                raise _AppTimeout()
            return super().add(x)
    try:
        with pytest.raises(_AppTimeout):
            with interrupts.deferred():
                os.kill(os.getpid(), signal.SIGUSR1)
                os.kill(os.getpid(), signal.SIGUSR2)
                for i in range(1000):
                    abs(i)
                monkeypatch.setattr(interrupts, "set", RaisingSet, raising=False)
        monkeypatch.undo()
        with interrupts.deferred():
            pass
        assert got.count("usr1") <= 1 and got.count("usr2") <= 1
        assert not interrupts._pending and not interrupts._saved
    finally:
        signal.signal(signal.SIGUSR1, old[0])
        signal.signal(signal.SIGUSR2, old[1])


@pytest.mark.parametrize("chained", [["mine"], ["C", "D"]])
def test_handlers_chaining_to_what_they_replaced_inside_blocks_reach_the_original_in_order(chained):
    """signal.signal() inside a block returns the recorder; a handler chaining to it recursed
    without end once a later block had seen it, and of two such handlers the second's call picked
    the first's again (two reviews)."""
    calls, prev = [], {}

    def install(name):
        prev[name] = signal.signal(signal.SIGUSR1, lambda s, f: (calls.append(name), prev[name](s, f)))
    old = signal.signal(signal.SIGUSR1, lambda s, f: calls.append("orig"))
    try:
        for name in chained:
            with interrupts.deferred():
                install(name)
        with interrupts.deferred():
            pass
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGUSR1)
            for i in range(1000):
                abs(i)
        assert calls == (chained[::-1] + ["orig"]) * 2
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_a_held_signal_keeps_no_frame_alive():
    """A recorded (signum, frame) kept the frame of a block's __exit__ alive from a module list,
    and with it the block, counted open for good (a review): only the signal is kept."""
    with interrupts.deferred():
        _ctrl_c()
        for i in range(1000):
            abs(i)
        assert interrupts._pending == [(signal.SIGINT, None)]
        interrupts._pending.clear()
