"""Where a prompt is cut into prefill chunks (chunking.chunk_bounds): no chunk of one row where
that can be helped, because a one-row chunk runs the decode kernels and its rows' results would
depend on the cut. With step 2 the old rule moved a one-token last chunk's boundary back and left
the chunk before it one token (15 by 2: ..., 12, 13, 15): SmolLM2's last-row logits moved by 0.578
and its greedy text changed (a probing session, session 26)."""
import numpy as np
import pytest

import edgellm
from edgellm.chunking import chunk_bounds


def _sizes(bounds):
    return [b - a for a, b in zip(bounds, bounds[1:])]


def test_no_one_row_chunk_from_step_2_up():
    for step in range(2, 21):
        for n in range(2, 120):
            b = chunk_bounds(n, step)
            sizes = _sizes(b)
            assert b[0] == 0 and b[-1] == n and 1 not in sizes, (n, step, b)
            assert max(sizes) <= max(step, 3)


def test_step_2_ends_in_one_chunk_of_3_unless_a_limit_forbids():
    assert chunk_bounds(15, 2) == [0, 2, 4, 6, 8, 10, 12, 15]
    assert chunk_bounds(15, 2, limit=2) == [0, 2, 4, 6, 8, 10, 12, 14, 15]   # a ring of room 2
    assert chunk_bounds(257, 256) == [0, 255, 257]
    assert chunk_bounds(5, 1) == [0, 1, 2, 3, 4, 5]


def test_prefill_chunk_2_gives_the_default_chunks_bits(real_model_path):
    text = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
            "combined movable metal type, oil-based ink and a wooden press into a practical system.")
    a = edgellm.load(real_model_path, n_ctx=128, threads=2)
    b = edgellm.load(real_model_path, n_ctx=128, threads=2, prefill_chunk=2)
    for n in (15, 33):
        ids = a.tokenize(text)[:n]
        assert len(ids) == n
        assert np.array_equal(a.logits(ids), b.logits(ids)), n
    prompt = a.detokenize(a.tokenize(text)[:15])
    assert a.generate(prompt, max_tokens=40, temperature=0) == b.generate(prompt, max_tokens=40, temperature=0)
