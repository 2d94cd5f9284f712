"""The cost model's measured rates: the rows a last-row op computes."""
from __future__ import annotations

from dataclasses import replace

from edgellm.costmodel import cpu_unit, estimate
from tests.profiles import cpu_only
from tests.test_dispatch import CFG, OPS

# a rate that grows as fast as the rows from 1 to 16 (the same time for both), as small steps
# measure on a machine where a call's fixed work dominates
STEEP = ((1, 0.1e9), (16, 1.6e9), (64, 3.2e9), (256, 6.4e9))


def _ref(**kw):
    return replace(cpu_unit("reference", cpu_only()), peak={"fp32": 100e9}, **kw)


def test_a_last_row_op_in_a_chunk_runs_at_its_one_row_rate():
    """The output norm of a prefill chunk computes one row, but its measured rate was read at
    the chunk's token count (0.4 us at 256 tokens for 2304 FLOPs measured at 4.4 us per row)."""
    u = _ref(op_curves=(("rmsnorm", STEEP),))
    one = estimate(u, OPS["output_norm"], CFG, 1, 0, "f32", 2.0, True)
    chunk = estimate(u, OPS["output_norm"], CFG, 256, 0, "f32", 2.0, True)
    assert chunk.cost.flops == one.cost.flops
    assert chunk.ms == one.ms
