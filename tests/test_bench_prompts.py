"""bench's prompts on a model that adds BOS (from a helper's probe of the day's features): the
text was written out with its BOS, so the table said 32 tokens while the request ran 31 (the
engine strips a BOS the text starts with), and --shared-prefix put a BOS mid-prompt."""
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.bench import prompt_of_length
from tests.synthetic import BOS_ID, write_tiny_model


def test_prompt_lengths_match_the_requests_on_a_bos_model(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", tensor_type=QT.Q8_0, seed=1,
                            extra_metadata={"tokenizer.ggml.add_bos_token": True}).path
    eng = edgellm.load(path, n_ctx=256, threads=1)
    for n in (8, 32, 100):
        text, count = prompt_of_length(eng, n)
        eng.generate(text, max_tokens=1, temperature=0)
        assert count == n == eng.last_stats.prompt_tokens
        assert eng._prompt_ids(text).count(BOS_ID) == 1


def test_concurrent_bench_alternates_its_policies(tmp_path):
    """All interleaved runs, then all queued ones, put a drifting host's speed into the ratio
    (a probe); the policies now alternate run by run."""
    import edgellm
    from edgellm.bench import run_concurrent
    from gguf import GGMLQuantizationType as QT

    from tests.synthetic import write_tiny_model

    eng = edgellm.load(write_tiny_model(tmp_path / "t.gguf", tensor_type=QT.F32, seed=2).path, n_ctx=256, threads=1)
    seen = []
    rec = run_concurrent(eng, 120, 8, 1.0, 2, 2, chunk=16, on_run=lambda p, r, m: seen.append((p, r)))
    assert seen == [("interleave", 0), ("fifo", 0), ("fifo", 1), ("interleave", 1)]
    assert rec["short_ttft_ratio"] > 0 and rec["runs"] == 2
    assert rec["long_prompt_tokens"] > rec["short_prompt_tokens"]
