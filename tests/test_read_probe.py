"""The memory read-bandwidth probe (neon/read_probe.c, backends.neon_probe.read_bandwidth) that
`edgellm profile` and the bench's decode floor use. It replaced numpy's sgemv, which measured the
BLAS numpy was built with as much as the memory: the probe must read every byte of its buffer
once (its word sum says so), refuse what it cannot read, and the profile must say when it falls
back to the sgemv."""
import ctypes

import numpy as np
import pytest

from edgellm.backends import neon, neon_probe
from edgellm.device import probes

MiB = 1 << 20
SIZES = probes.ProbeSizes(cluster_gemm=64, small_gemm=(4, 16, 16), gemm_k=32, gemm_n=64, gemm_rows=(1,), runs=3,
                          min_runs=1, budget_s=0.005, overhead_batch=10, bandwidth_bytes=2 * MiB, weight_bytes=MiB)


def _sum(buf: np.ndarray, threads: int, nbytes: int | None = None, offset: int = 0) -> tuple[int, int]:
    pool = neon.NativePool(threads, ())
    out = ctypes.c_uint64()
    rc = neon._lib().el_read_probe(pool.ptr, buf.ctypes.data + offset, buf.nbytes if nbytes is None else nbytes,
                                   ctypes.byref(out))
    return rc, out.value


@pytest.mark.parametrize("threads", (1, 2, 3))
@pytest.mark.parametrize("nbytes", (64, 64 * 5, 64 * 1023, 3 * MiB + 64 * 7))
def test_every_word_is_read_once(threads, nbytes):
    buf = np.random.default_rng(nbytes + threads).integers(0, 2**64 - 1, nbytes // 8, dtype=np.uint64, endpoint=True)
    rc, got = _sum(buf, threads)
    assert rc == 0 and got == int(buf.sum(dtype=np.uint64))     # (both wrap at 2^64)


def test_what_it_cannot_read_is_refused():
    buf = np.ones(64, np.uint64)
    assert _sum(buf, 2, nbytes=100)[0] == -1      # not whole 64-byte lines
    assert _sum(buf, 2, nbytes=0)[0] == -1
    assert _sum(buf, 2, nbytes=64, offset=4)[0] == -1   # misaligned words


def test_the_profile_reads_with_the_library_and_says_when_it_cannot(monkeypatch):
    notes = []
    assert probes.measure_read_bandwidth(SIZES, threads=2, notes=notes) > 0
    assert notes == []
    monkeypatch.setattr(neon, "available", lambda: (False, "no library here"))
    assert probes.measure_read_bandwidth(SIZES, notes=notes) > 0
    assert notes == ["memory bandwidth: measured with numpy's sgemv (the neon library is not available)"]


def test_a_probe_that_skips_part_of_the_buffer_is_not_believed(monkeypatch):
    real = neon._lib()

    class Short:   # reads half the buffer: its sum cannot match
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def el_read_probe(pool, buf, nbytes, out):
            return real.el_read_probe(pool, buf, nbytes // 128 * 64, out)
    monkeypatch.setattr(neon, "_lib", lambda: Short())
    with pytest.raises(RuntimeError, match="did not read the whole buffer"):
        neon_probe.read_bandwidth(MiB, 2, SIZES)
    notes = []
    assert probes.measure_read_bandwidth(SIZES, threads=2, notes=notes) > 0
    assert len(notes) == 1 and "the neon read probe failed (RuntimeError: el_read_probe summed" in notes[0]
