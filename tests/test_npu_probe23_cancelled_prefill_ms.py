"""A prefill cancelled part-way still reports the forward time it spent (probe 23): the prefill's
time was added only when forward returned, so a cancelled prompt reported "prefill 0" ms."""
from __future__ import annotations

import time

import edgellm
from edgellm.engine import CancelToken
from tests.synthetic import write_tiny_model


class _SlowCancel(CancelToken):
    """Cancels at the k-th look; each look before it takes `wait` seconds, so the forward's
    time up to the cancel is at least (k - 1) * wait."""

    def __init__(self, k: int, wait: float):
        super().__init__()
        self.k, self.wait = k, wait

    @property
    def cancelled(self):
        self.k -= 1
        if self.k < 0:
            return True
        time.sleep(self.wait)
        return False

    def reset(self):
        pass


def test_cancelled_prefill_counts_its_time(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    tm = write_tiny_model(tmp_path / "m.gguf", n_layers=4)
    eng = edgellm.load(tm.path, n_ctx=128, units=["reference"])
    cancel = _SlowCancel(3, 0.02)
    out = "".join(eng.stream("hello there, a prompt of a few tokens", max_tokens=4, cancel=cancel))
    s = eng.last_stats
    assert out == "" and s.stop_reason == "cancelled" and s.generated_tokens == 0
    # three looks of 20 ms each happened inside the forward before the cancel
    assert s.prefill_ms >= 40, s
