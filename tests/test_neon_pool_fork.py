"""A native thread pool held across os.fork (an engine's fused step holds the pool it was loaded
with) kept the parent's pool in the child: no workers there, and a parent worker that held the
pool's mutex at the fork (going to sleep after a job) left it locked, so the child's first job
could wait forever (the fork test of test_engine_sharing.py hung once in CI). The child now starts
a pool of its own on first use."""
import os

import pytest

from edgellm.backends import neon


def test_a_pool_held_across_fork_is_the_childs_own_in_the_child():
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    ok, why = neon.available()
    if not ok:
        pytest.skip(why)
    p = neon.NativePool(2, ())
    parent_ptr, parent_workers = p.ptr, p.worker_tids
    pid = os.fork()
    if pid == 0:   # the child: only exit codes out (no pytest machinery here)
        code = 3
        try:
            ptr = p.ptr
            own = {int(t) for t in os.listdir("/proc/self/task")}   # (its new worker among them)
            code = 0 if (ptr != parent_ptr and len(p.worker_tids) == 1 and p.worker_tids <= own
                         and neon._lib().el_pool_threads(ptr) == 2) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child used the parent's pool (1) or failed (3)"
    assert p.ptr == parent_ptr and p.worker_tids == parent_workers    # the parent's is untouched
