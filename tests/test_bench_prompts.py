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
