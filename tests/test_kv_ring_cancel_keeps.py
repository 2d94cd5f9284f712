"""A ring's conversation survives a cancelled answer (a stop button, a dropped stream, Ctrl-C in
chat): freed, the next turn recomputed the whole conversation through the window (SmolLM2, 800
tokens of chat on a 256-token ring: 1.5 s instead of 40 ms), where a block pool keeps the blocks."""
import edgellm
from tests.test_kv_engine import GREEDY, text_of, tiny_path  # noqa: F401 - the fixture


def load(path, **kw):
    return edgellm.load(path, threads=1, **kw)


KW = dict(kv="ring", window=48, sinks=4)


def test_a_cancelled_ring_answer_continues_as_one_cut_by_max_tokens(tiny_path):  # noqa: F811
    a, b = load(tiny_path, **KW), load(tiny_path, **KW)
    first = text_of(a, 70, seed=21)              # past the window: the ring has evicted
    tok, got = edgellm.CancelToken(), ""
    for i, piece in enumerate(a.stream(first, max_tokens=40, cancel=tok, **GREEDY)):
        got += piece
        if i == 3:
            tok.cancel()
    assert a.last_stats.stop_reason == "cancelled"
    k = a.last_stats.generated_tokens
    assert b.generate(first, max_tokens=k, **GREEDY) == got
    assert a.kv.ring.total_tokens == b.kv.ring.total_tokens > a.kv.ring.window
    nxt = first + got + text_of(a, 6, seed=22)
    want = b.generate(nxt, max_tokens=8, **GREEDY)
    assert a.generate(nxt, max_tokens=8, **GREEDY) == want
    assert a.last_stats.cached_tokens == b.last_stats.cached_tokens


def test_a_dropped_ring_stream_keeps_the_conversation(tiny_path):  # noqa: F811
    a = load(tiny_path, **KW)
    first = text_of(a, 70, seed=23)
    it = a.stream(first, max_tokens=40, **GREEDY)
    next(it), next(it)
    it.close()
    assert a.last_stats.stop_reason == "cancelled"
    assert len(a.kv.history) == a.kv.ring.total_tokens > a.kv.ring.window


def test_a_cancelled_ring_prefill_retried_gives_the_uncancelled_text(tiny_path):  # noqa: F811
    """The chunks committed before the cancel stay (they evicted: they cannot be undone), and the
    retry continues after them on the same chunk boundaries."""
    from tests.cancel_after import CancelAfter
    kw = dict(KW, prefill_chunk=8)
    a, fresh = load(tiny_path, **kw), load(tiny_path, **kw)
    p = text_of(a, 90, seed=24)
    a.generate(p, max_tokens=4, cancel=CancelAfter(8), **GREEDY)
    assert a.last_stats.stop_reason == "cancelled"
    assert a.kv.ring.total_tokens > a.kv.ring.window     # it had slid before the cancel
    assert a.generate(p, max_tokens=6, **GREEDY) == fresh.generate(p, max_tokens=6, **GREEDY)
    assert a.last_stats.cached_tokens > 0


def test_numpy_fixed_width_window_and_sinks_load(tiny_path):  # noqa: F811
    """np.int32 sinks=2 raised an untyped OverflowError from the load's memory figures."""
    import numpy as np
    for window, sinks in ((64, np.int32(2)), (np.int32(64), 4), (np.uint8(64), np.uint8(2)), (np.int16(64), np.int16(0))):
        e = load(tiny_path, kv="ring", window=window, sinks=sinks)
        assert type(e.kv.kv.window) is int and type(e.kv.kv.sinks) is int
        assert e.kv.kv.window == int(window) and e.kv.kv.sinks == int(sinks)
        e.generate("alpha beta", max_tokens=2, **GREEDY)


def test_a_ring_without_sinks_warns_once(tiny_path, caplog):  # noqa: F811
    """sinks=0 was taken without a word, though the count SmolLM2 gave ran "39, 39, 39" right after
    the window slid (StreamingLLM's finding); with the default 4 sinks it counted on."""
    import logging
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        load(tiny_path, kv="ring", window=64, sinks=0)
        load(tiny_path, kv="ring", window=64, sinks=1)
        load(tiny_path, kv="ring", window=64)
    said = [r.getMessage() for r in caplog.records if "0 sink tokens" in r.getMessage()]
    assert len(said) == 1 and "degrades" in said[0], said


def test_an_error_after_the_forward_ends_as_error_and_the_ring_is_not_kept(tiny_path):  # noqa: F811
    """Non-finite logits at a decode token (the sampler's error, raised after the forward) ended
    the generation through the stream's close: stop_reason "cancelled", and a ring kept the K/V
    of the step that made them as a cancel's (a review)."""
    import numpy as np
    import pytest
    a = load(tiny_path, **KW, prefill_chunk=8)
    first = text_of(a, 70, seed=25)
    forward, n = a.runner.forward, [0]

    def nan_at_third_decode(seq, ids, **kw):
        out = forward(seq, ids, **kw)
        n[0] += len(ids) == 1
        return np.full_like(out, np.nan) if len(ids) == 1 and n[0] == 3 else out

    a.runner.forward = nan_at_third_decode
    with pytest.raises(edgellm.EdgeLLMError, match="finite"):
        a.generate(first, max_tokens=20, **GREEDY)
    assert a.last_stats.stop_reason == "error"
    assert len(a.kv.history) == 0 and a.kv.ring.total_tokens == 0
