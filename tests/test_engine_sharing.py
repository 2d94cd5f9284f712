"""One engine used the ways an app uses it: from several threads at once, beside a scheduler, and
through streams it stops reading. Every generation gives its direct, alone-on-the-engine text,
and no stream keeps KV blocks after it is dropped."""
import gc
import os
import threading

import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.errors import ConfigError
from edgellm.scheduler import Scheduler
from tests.synthetic import write_tiny_model

GREEDY = dict(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = ["hello world", "the quick brown fox", "zzz", "abc def ghi abc def", "one two three", "x y z w"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tm = write_tiny_model(tmp_path_factory.mktemp("sharing") / "tiny.gguf", tensor_type=QT.Q4_1, seed=3,
                          context_length=512)
    return edgellm.load(tm.path, n_ctx=256, threads=2)


def _in_threads(fn, args):
    out, errors = {}, []

    def run(a):
        try:
            out[a] = fn(a)
        except BaseException as e:   # collected: an assertion below names it
            errors.append(e)

    ts = [threading.Thread(target=run, args=(a,)) for a in args]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts), "a generation hung"
    return out, errors


def test_threads_generating_on_one_engine_get_their_alone_text(engine):
    """Generations from several threads at once take turns a step at a time: each thread's text
    is the one it gets alone (they used to share the native step's buffers mid-step: NaN logits
    and each other's K/V)."""
    want = {p: engine.generate(p, **GREEDY) for p in PROMPTS}
    for _ in range(3):
        got, errors = _in_threads(lambda p: engine.generate(p, **GREEDY), PROMPTS)
        assert not errors, errors
        assert got == want
    assert not engine.kv.pool._live - {engine.kv.last}


def test_a_thread_generating_beside_a_scheduler_waits_its_turn(engine):
    """The scheduler's worker and an app thread calling the engine directly share it a step at
    a time; both give their alone text."""
    want = {p: engine.generate(p, **GREEDY) for p in PROMPTS}
    with Scheduler(engine, chunk=4) as s:
        reqs = {p: s.submit(p, **GREEDY) for p in PROMPTS[:3]}
        got, errors = _in_threads(lambda p: engine.generate(p, **GREEDY), PROMPTS[3:])
        assert not errors, errors
        got.update({p: r.result(timeout=60) for p, r in reqs.items()})
    assert got == want


@pytest.mark.parametrize("drop", ["close", "del", "exception"])
def test_a_stream_stopped_early_frees_its_kv(engine, drop):
    """A stream the app stops reading (closed, dropped, or left by an exception in the loop
    body) ends as cancelled and releases its sequence: far more such streams than the pool has
    blocks for leave it as usable as before (its sequences used to stay live until the pool was
    full)."""
    engine.clear_cache()
    pool = engine.kv.pool
    free0 = pool.free_blocks
    for i in range(3 * pool.n_blocks):
        prompt = f"story {i} " + "abc def ghi " * 8
        it = engine.stream(prompt, **GREEDY)
        if drop == "exception":
            with pytest.raises(KeyError):
                for _ in it:
                    raise KeyError("the app's loop body failed")
        else:
            next(it)
            next(it)
            if drop == "close":
                it.close()
        del it
        gc.collect()
        assert engine.last_stats.stop_reason == "cancelled"
        assert not pool._live - {engine.kv.last}
    engine.clear_cache()
    assert pool.free_blocks == free0
    assert engine.generate(PROMPTS[0], **GREEDY) == engine.generate(PROMPTS[0], **GREEDY)


def test_a_generation_dropped_inside_a_turn_ends_when_that_turn_ends(engine):
    """A garbage collector may finalise a dropped stream while some thread is mid-step (its
    turn held): ending it there would change the KV store under that step, so it waits for the
    turn's end. (It waited for the next turn: an idle engine held the dropped stream's KV, from a
    helper's long-run probe.)"""
    import time

    from edgellm.api import generation_config
    from edgellm.engine import CancelToken
    from edgellm.generation import Generation

    engine.clear_cache()
    t = time.perf_counter()
    gen = Generation(engine, engine.tokenize(PROMPTS[1]), generation_config(**GREEDY), CancelToken(), t, t)
    gen.step()
    gen.step()
    with engine.turn():
        gen.close()
        assert not gen.done and gen.seq in engine.kv.pool._live      # not inside the turn
        with engine.turn():                                             # (nor at a nested turn's end)
            pass
        assert not gen.done
    assert gen.done and gen.stats.stop_reason == "cancelled"          # ended as the turn ended
    assert gen.seq not in engine.kv.pool._live


def test_loading_an_engine_with_other_threads_leaves_a_running_engine_its_pool(tmp_path_factory):
    """Engines share the neon module: a load configured it for its own thread count and destroyed
    the one native pool, under another engine's step running on it, which then waited forever
    (a helper: 5 hangs in 5 runs of 20 loads beside a generating engine). Each engine's fused step
    now holds the pool it was loaded with; a pool is freed only when nothing holds it."""
    from edgellm.backends import neon
    tm = write_tiny_model(tmp_path_factory.mktemp("pools") / "tiny.gguf", tensor_type=QT.Q4_0, n_layers=4, d_model=128,
                          n_heads=4, n_kv_heads=2, d_ff=256, seed=3, context_length=4096)
    kw = dict(max_tokens=300, temperature=0, ignore_eos=True)
    a = edgellm.load(tm.path, n_ctx=2048, threads=2)
    want = a.generate("hello there", **kw)
    out = []
    t = threading.Thread(target=lambda: out.extend(a.generate("hello there", **kw) for _ in range(6)), daemon=True)
    t.start()
    for i in range(24):
        edgellm.load(tm.path, n_ctx=64, threads=1 + i % 2, prefault=False)
    t.join(120)
    assert not t.is_alive(), "engine A hung while other engines were loaded"
    assert out == [want] * 6
    # A keeps its two threads after a one-thread engine's load, and its workers their cores
    step = next(v for v in vars(a.runner).values() if hasattr(v, "_npool"))
    before = neon.pool_affinity(step._npool)
    edgellm.load(tm.path, n_ctx=64, threads=1, prefault=False)
    assert neon.pool_affinity(step._npool) == before and len(before) == 2


def test_two_engines_stepping_op_by_op_in_two_threads_keep_their_numbers(tmp_path_factory):
    """A model whose fused QKV mixes weight types runs op by op on neon; neon.matmul's int8
    activation scratch was one buffer for every engine, and two engines stepping in two threads
    overwrote each other's (a helper: 18 of 40 logits calls wrong, most NaN)."""
    import numpy as np
    tm = write_tiny_model(tmp_path_factory.mktemp("mixed") / "m.gguf", tensor_type=QT.Q4_0,
                          tensor_types={"attn_v.weight": QT.Q8_0}, n_layers=4, d_model=256, n_heads=8, n_kv_heads=4,
                          d_ff=512, context_length=512)
    e1, e2 = (edgellm.load(tm.path, n_ctx=512, threads=2) for _ in range(2))
    assert not e1.runner._fused_phases                      # (the op-by-op path is the one tested)
    ids = [e1.tokenize("hello world " * 40), e1.tokenize("the cat is in the hat " * 25)]
    ref = [e1.logits(x) for x in ids]
    out, errors = _in_threads(lambda k: [float(np.abs((e1, e2)[k].logits(ids[k]) - ref[k]).max()) for _ in range(12)],
                              [0, 1])
    assert not errors and max(out[0] + out[1]) <= 1e-4


_FORK_SCRIPT = """
import faulthandler, os, signal, sys, threading, time
# a hang prints every thread's stack and ends the process (before the test's timeout): SIGALRM
# dumps, then its default action; the child arms its own alarm in the first after-fork hook
# (faulthandler.dump_traceback_later would not do: re-armed in a child it waits on the parent's
# watchdog thread, which the child does not have)
faulthandler.register(signal.SIGALRM, all_threads=True, chain=True)
os.register_at_fork(after_in_child=lambda: signal.alarm(70))
signal.alarm(75)
import edgellm
from edgellm.errors import ConfigError
from edgellm.scheduler import Scheduler
e = edgellm.load(sys.argv[1], n_ctx=256, threads=2)
kw = dict(temperature=0, max_tokens=24, ignore_eos=True)
want = e.generate("hello", **kw)
sched = Scheduler(e)
busy = threading.Event()
def hold():
    with e.turn():
        busy.set()
        time.sleep(1.0)
threading.Thread(target=hold, daemon=True).start()
busy.wait()
pid = os.fork()
if pid == 0:
    import numpy as np
    np.ones((512, 512)) @ np.ones((512, 512))     # threads of the child's own (BLAS)
    assert e.generate("hello", **kw) == want, "the child's text differs"
    try:
        sched.submit("x")
        raise AssertionError("a Scheduler without its worker took a request")
    except ConfigError:
        pass
    print("child ok", flush=True)
    sys.exit(0)                                    # the interpreter's exit: finalizers run
_, status = os.waitpid(pid, 0)
sched.close()
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
"""


def test_a_forked_child_uses_the_engine_and_exits(tmp_path_factory):
    """After os.fork the child's exit hung joining the parent's pool workers (their handles
    reused by the child's own threads), and a fork while another thread held the engine's turn
    left the child's first request waiting forever on the lock. A Scheduler in the child says
    its worker is in the parent."""
    import os
    import subprocess
    import sys
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    tm = write_tiny_model(tmp_path_factory.mktemp("fork") / "m.gguf", tensor_type=QT.Q4_1, seed=3, context_length=512)
    try:
        r = subprocess.run([sys.executable, "-c", _FORK_SCRIPT, tm.path], capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the forked child (or its parent) hung; output so far: {e.stdout!r} {e.stderr!r}")
    assert "child ok" in r.stdout and "child exit 0" in r.stdout, r.stdout + r.stderr[-2000:]


def test_a_stream_left_open_at_exit_says_nothing(tmp_path_factory):
    """A script that read one piece of a stream and ended printed 'Exception ignored in:
    <generator ...> NameError: name 'open' is not defined' (the stream's end ran in the
    interpreter's teardown)."""
    import subprocess
    import sys
    tm = write_tiny_model(tmp_path_factory.mktemp("exit") / "m.gguf", tensor_type=QT.Q4_1, seed=3, context_length=512)
    script = ("import sys, edgellm\n"
              "def ask(prompt):\n"     # (the engine referenced only through its stream)
              "    return edgellm.load(sys.argv[1], n_ctx=256, threads=2).stream(prompt, max_tokens=50, "
              "temperature=0, ignore_eos=True)\n"
              "s = ask('hello')\n"
              "next(s)\n")
    r = subprocess.run([sys.executable, "-c", script, tm.path], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Exception ignored" not in r.stderr, r.stderr[-1500:]


_PIN_SCRIPT = """
import os, sys, threading
import edgellm
from edgellm.backends import neon
whole = sorted(os.sched_getaffinity(0))
ready, done, seen = threading.Event(), threading.Event(), []
def app_thread():   # an app's own thread, on the core the app chose
    os.sched_setaffinity(0, {whole[-1]})
    ready.set(); done.wait(); seen.append(sorted(os.sched_getaffinity(0)))
t = threading.Thread(target=app_thread, daemon=True); t.start(); ready.wait()
e = edgellm.load(sys.argv[1], n_ctx=64, threads=2, prefault=False, pin=sys.argv[2] == "1")
e.generate("hi", max_tokens=2, temperature=0)
step = next(v for v in vars(e.runner).values() if hasattr(v, "_npool"))
done.set(); t.join()
print(seen[0], e.pinning.ok, e.pinning.reason, neon.pool_affinity(step._npool))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell the affinities apart")
def test_pin_false_leaves_the_apps_threads_where_it_put_them(tmp_path_factory):
    """load pinned every thread of the process to the big cores, the app's own threads included,
    with no way out for an app that manages affinity itself. pin=False leaves them (and the
    native pool's workers) alone."""
    import subprocess
    import sys
    tm = write_tiny_model(tmp_path_factory.mktemp("pin") / "m.gguf", tensor_type=QT.Q4_0)
    whole = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "EDGELLM_HOME": str(tmp_path_factory.mktemp("pinhome"))}
    runs = {flag: subprocess.run([sys.executable, "-c", _PIN_SCRIPT, tm.path, flag], capture_output=True, text=True,
                                 env=env, timeout=120) for flag in ("0", "1")}
    for r in runs.values():
        assert r.returncode == 0, r.stderr
    assert runs["1"].stdout.startswith(f"{whole} True")          # pinned: moved onto the big cores
    kept = runs["0"].stdout
    assert kept.startswith(f"{[whole[-1]]} False pin=False"), kept
    with pytest.raises(ConfigError, match="pin must be True or False"):
        edgellm.load(tm.path, n_ctx=64, pin="no")


def test_each_thread_reads_its_own_last_stats(engine):
    """last_stats was one engine-wide value: a thread read another thread's request's figures
    after its own generate() (from a helper's probe of the run statistics)."""
    started, seen = threading.Event(), []

    def other():
        s = engine.stream(PROMPTS[1], **GREEDY)
        next(s)                  # a generation of this thread has started (and set its stats)
        started.set()
        list(s)

    engine.generate(PROMPTS[0], **GREEDY)
    t = threading.Thread(target=other)
    t.start()
    assert started.wait(60)
    seen.append(engine.last_stats.prompt_tokens)      # this thread's own, after the other began
    t.join(60)
    assert seen == [len(engine.tokenize(PROMPTS[0]))] != [len(engine.tokenize(PROMPTS[1]))]


def test_engine_cancel_is_not_lost_when_another_thread_starts_a_request(engine):
    """engine.cancel() set one shared token that every new request reset: a cancel aimed at a
    thread's generation was lost when another thread made a request before that generation's
    next step, and it ran on to max_tokens (from a helper's concurrency probe)."""
    engine.clear_cache()
    it = engine.stream(PROMPTS[0], temperature=0, max_tokens=200, ignore_eos=True)
    next(it)
    engine.cancel()
    other = engine.stream(PROMPTS[1], **GREEDY)   # another thread's request, made before ours steps again
    list(it)
    assert engine.last_stats.stop_reason == "cancelled"
    assert "".join(other) == engine.generate(PROMPTS[1], **GREEDY)      # made after the cancel: runs


_FORK_IN_LOAD_SCRIPT = """
import os, signal, sys, threading, time, edgellm
path = sys.argv[1]
stop = threading.Event()
def loader():
    while not stop.is_set():
        edgellm.load(path, n_ctx=64, threads=1, prefault=False).close()
edgellm.load(path, n_ctx=64, threads=1, prefault=False).close()   # (imported: a fork mid-import is Python's hazard)
t = threading.Thread(target=loader, daemon=True); t.start()
codes = []
for _ in range(8):
    time.sleep(0.01)   # (the loader is in a load most of the time)
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)
        edgellm.load(path, n_ctx=64, threads=1, prefault=False).generate("hi", max_tokens=2, temperature=0)
        os._exit(0)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
stop.set(); t.join()
print("codes", codes)
"""


def test_a_child_forked_while_another_thread_loads_can_load(tmp_path_factory):
    """A fork while another thread was inside load() left the load lock held in the child, by a
    thread it does not have: every load() there waited forever."""
    import subprocess
    import sys
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    tm = write_tiny_model(tmp_path_factory.mktemp("forkload") / "m.gguf", tensor_type=QT.Q4_1, seed=3)
    r = subprocess.run([sys.executable, "-c", _FORK_IN_LOAD_SCRIPT, tm.path], capture_output=True, text=True,
                       timeout=200)
    assert r.stdout.strip() == "codes [0, 0, 0, 0, 0, 0, 0, 0]", r.stdout + r.stderr[-2000:]
