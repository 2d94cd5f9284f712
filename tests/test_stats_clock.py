"""What the stats clock counts (from a helper's probe of the run statistics): time an app spends
between stream() and its first next(), and between its last token and closing the stream, is
not the engine's. The margins are wide on purpose (the app's pause is 0.6 s; the tiny model's
work a few ms): these check what is measured, not how fast."""
import time

import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.generation import GenerationStats
from tests.synthetic import write_tiny_model

PAUSE = 0.6


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    return edgellm.load(write_tiny_model(tmp_path_factory.mktemp("st") / "m.gguf", tensor_type=QT.Q8_0, seed=1).path,
                        n_ctx=128, threads=1)


def test_the_clock_starts_at_the_first_piece_asked_for(eng):
    """tokenize_ms and ttft_ms were 500 ms when the app slept 0.5 s after stream()."""
    s = eng.stream("hello world", max_tokens=3, temperature=0, ignore_eos=True)
    time.sleep(PAUSE)
    list(s)
    st = eng.last_stats
    assert st.tokenize_ms < PAUSE * 1e3 / 2 and st.ttft_ms < PAUSE * 1e3 / 2, st


def test_decode_time_ends_at_the_last_token(eng):
    """decode_ms ran to the generation's wind-up: a stream closed after a pause counted it
    (523 ms, 3.8 tok/s), and an EOS step counted a token it did not count."""
    s = eng.stream("hello world", max_tokens=50, temperature=0, ignore_eos=True)
    for _ in range(4):
        next(s)
    time.sleep(PAUSE)
    s.close()
    st = eng.last_stats
    assert st.stop_reason == "cancelled" and st.generated_tokens >= 3
    assert st.decode_ms < PAUSE * 1e3 / 2, st


def test_a_request_with_no_token_shows_no_ttft():
    """A Ctrl-C during prefill printed 'TTFT 0 ms', which reads as instant."""
    st = GenerationStats(prompt_tokens=900, tokenize_ms=0.5, stop_reason="cancelled")
    assert "TTFT - (no token)" in st.summary()
    assert "TTFT 12 ms" in GenerationStats(prompt_tokens=9, ttft_ms=12.0, generated_tokens=1).summary()


def test_the_apps_time_between_pieces_is_not_decode_time(eng):
    """decode_ms ran from the first token to the last: an app that repainted between pieces (50
    ms each) made 308 tok/s read 18.5 (from a helper's probe of the day's features)."""
    s = eng.stream("hello world", max_tokens=6, temperature=0, ignore_eos=True)
    for _ in s:
        time.sleep(PAUSE / 6)
    st = eng.last_stats
    assert st.generated_tokens == 6 and st.decode_ms < PAUSE * 1e3 / 2, st
