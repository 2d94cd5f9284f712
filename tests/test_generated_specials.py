"""A generated control token (<|im_start|> where the model opens a turn, <|im_end|> past
ignore_eos) showed its text in the answer; llama.cpp's completions render none (token_to_piece
with special=False), and neither does a generation now. A probe's finding."""
import time

from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.api import generation_config
from edgellm.engine import CancelToken
from edgellm.generation import Generation
from tests.synthetic import write_tiny_model


def test_a_generated_control_token_gives_no_text(tmp_path):
    eng = edgellm.load(write_tiny_model(tmp_path / "t.gguf", tensor_type=QT.F32, seed=3).path, n_ctx=64,
                       threads=1)
    tok = eng.tokenizer
    controls = sorted(tok._control)
    assert controls, "the tiny vocabulary has control tokens"
    plain = eng.tokenize("hello", add_bos=False)
    t = time.perf_counter()
    gen = Generation(eng, eng.tokenize("abc"), generation_config(max_tokens=8, ignore_eos=True), CancelToken(), t, t)
    try:
        for c in controls:
            assert tok.token_piece(c)                    # the control token has a text ...
            assert gen.decoder.push(c) == ""             # ... which an answer does not show
        assert "".join(gen.decoder.push(i) for i in plain) == "hello"
    finally:
        gen.close()
