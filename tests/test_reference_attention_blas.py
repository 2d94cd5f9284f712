"""numpy's BLAS runs on one thread where the reference unit runs attention: its matmuls are small,
and OpenBLAS's caller spin-waits for its workers at each. Beside one CPU-bound process, a
400-token prompt on units npu,reference took 0.9-1.3 s at 2 BLAS threads, 0.45 s at 1 (a probe).
Elsewhere BLAS keeps the engine's threads (the quality preset's large fp32 GEMMs gain from them)."""
from gguf import GGMLQuantizationType as QT
from threadpoolctl import threadpool_info

import edgellm
from tests.synthetic import write_tiny_model


def _blas_threads() -> set[int]:
    return {p["num_threads"] for p in threadpool_info() if p.get("user_api") == "blas"}


def test_blas_threads_follow_where_attention_runs(tmp_path):
    path = write_tiny_model(tmp_path / "t.gguf", tensor_type=QT.F16, seed=2).path
    ref = edgellm.load(path, threads=2, n_ctx=64, units=["reference"])
    assert any(p.op == "attention" and p.unit == "reference" for p in ref.plan.prefill.placements)
    assert _blas_threads() == {1}
    ref.generate("alpha beta", max_tokens=2, temperature=0)
    neon = edgellm.load(path, threads=2, n_ctx=64)
    assert all(p.unit != "reference" for p in neon.plan.prefill.placements if p.op == "attention")
    assert _blas_threads() == {2}
