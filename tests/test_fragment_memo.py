"""The tokenizer's memo of encoded fragments: bounded, least recently used out first, and an
encode through it gives the ids a fresh encode gives (the goldens of test_tokenizer.py check
those against llama.cpp)."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from edgellm.model.chat_template import ChatTemplate
from edgellm.model.fragment_memo import MIN_CHARS, FragmentMemo
from edgellm.model.gguf_file import read_gguf
from edgellm.model.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data"


def fake_encode(calls: list[str]):
    def encode(text: str) -> list[int]:
        calls.append(text)
        return [ord(c) for c in text]
    return encode


def test_second_encode_is_remembered():
    calls: list[str] = []
    memo = FragmentMemo()
    text = "x" * MIN_CHARS
    assert list(memo.encode(text, fake_encode(calls))) == [ord("x")] * MIN_CHARS
    assert list(memo.encode(text, fake_encode(calls))) == [ord("x")] * MIN_CHARS
    assert calls == [text]


def test_short_fragments_are_not_kept():
    calls: list[str] = []
    memo = FragmentMemo()
    for _ in range(2):
        memo.encode("y" * (MIN_CHARS - 1), fake_encode(calls))
    assert len(calls) == 2 and len(memo) == 0


def test_bound_evicts_least_recently_used():
    calls: list[str] = []
    memo = FragmentMemo(max_ids=3 * MIN_CHARS)
    a, b, c, d = (ch * MIN_CHARS for ch in "abcd")
    for t in (a, b, c):
        memo.encode(t, fake_encode(calls))
    memo.encode(a, fake_encode(calls))          # a is now the most recent
    memo.encode(d, fake_encode(calls))          # over the bound: b (least recent) goes
    assert memo.held_ids == 3 * MIN_CHARS
    calls.clear()
    for t in (a, c, d):
        memo.encode(t, fake_encode(calls))
    assert calls == []
    memo.encode(b, fake_encode(calls))
    assert calls == [b]


def test_a_text_larger_than_the_memo_keeps_its_first_fragments():
    """A ring chat re-renders its whole history every turn: once its fragments held more ids than
    the memo, each new fragment evicted the oldest, which the next turn needed first, and every
    turn encoded all of them again (38 ms at 72k tokens against 13 ms at 65.6k)."""
    memo = FragmentMemo(max_ids=10 * MIN_CHARS)
    text = [chr(ord("a") + i) * MIN_CHARS for i in range(15)]   # 15 fragments, room for 10
    per_turn = []
    for _ in range(4):
        calls: list[str] = []
        call = memo.new_call()
        assert [list(memo.encode(t, fake_encode(calls), call)) for t in text] == [[ord(t[0])] * MIN_CHARS
                                                                                    for t in text]
        per_turn.append(len(calls))
        assert memo.held_ids <= memo.max_ids
    assert per_turn == [15, 5, 5, 5]          # the first 10 stay; plain LRU encoded all 15 each turn
    other: list[str] = []                     # another text still finds room: the oldest go first
    memo.encode("z" * MIN_CHARS, fake_encode(other), memo.new_call())
    assert other and len(memo) == 10


def test_fragment_larger_than_the_memo_is_not_kept():
    calls: list[str] = []
    memo = FragmentMemo(max_ids=MIN_CHARS)
    big = "z" * (2 * MIN_CHARS)
    assert len(memo.encode(big, fake_encode(calls))) == 2 * MIN_CHARS
    assert len(memo) == 0 and memo.held_ids == 0


def test_bad_bound_is_refused():
    with pytest.raises(ValueError, match="max_ids"):
        FragmentMemo(max_ids=0)


def test_threads_keep_the_count_exact():
    memo = FragmentMemo(max_ids=20 * MIN_CHARS)
    texts = [f"{i:04d}" * (MIN_CHARS // 4 + i % 3) for i in range(60)]

    def work(k: int):
        for j in range(400):
            t = texts[(k * 7 + j) % len(texts)]
            assert list(memo.encode(t, lambda s: [ord(c) for c in s])) == [ord(c) for c in t]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert memo.held_ids == sum(len(v) for v in memo._ids.values()) <= memo.max_ids


@pytest.fixture(scope="module")
def smol(real_model_path) -> tuple[Tokenizer, dict]:
    md = dict(read_gguf(Path(real_model_path)).metadata)
    return Tokenizer.from_metadata(md, real_model_path), md


def chat_texts(md: dict, turns: int) -> list[str]:
    template = ChatTemplate.from_metadata(md, "smollm2")
    msgs = [{"role": "system", "content": "You answer in one short paragraph, politely."}]
    out = []
    for t in range(turns):
        # user turns share a long beginning: the memo must tell apart texts that differ late
        msgs.append({"role": "user", "content": "Please answer the next question carefully and briefly. "
                                                f"Question {t}: what is {t} squared, and why? Ünïcode ✓ 12345."})
        out.append(template.render(msgs))
        msgs.append({"role": "assistant", "content": f"{t} squared is {t * t}, since {t} x {t} = {t * t}. "
                                                     "That is all there is to it!"})
    return out


def test_chat_turns_encode_as_without_memo(smol):
    tok, md = smol
    fresh = Tokenizer.from_metadata(md, "fresh")
    calls: list[str] = []
    encode = tok._encoder
    tok._encoder = lambda f: (calls.append(f), encode(f))[1]
    try:
        tok.clear_memo()
        for text in chat_texts(md, 6):
            fresh.clear_memo()
            assert tok.encode(text) == fresh.encode(text)
    finally:
        tok._encoder = encode
    # every earlier turn came from the memo: each fragment long enough to keep was encoded once
    kept = [f for f in calls if len(f) >= MIN_CHARS]
    assert kept and len(kept) == len(set(kept))


def test_clear_memo_forgets(smol):
    tok, md = smol
    tok.encode(chat_texts(md, 2)[-1])
    assert len(tok._memo) > 0
    tok.clear_memo()
    assert len(tok._memo) == 0 and tok._memo.held_ids == 0


def test_spm_fragments_encode_as_without_memo():
    # SPM encodes a fragment with a space prefixed and spaces made visible: the memo keys the text
    # so transformed, the one the model encodes
    golden = json.loads((DATA / "golden_spm_tiny.json").read_text(encoding="utf-8"))
    tok = Tokenizer.from_metadata(golden["metadata"], "spm_tiny.gguf")
    fresh = Tokenizer.from_metadata(golden["metadata"], "fresh")
    words = " ".join(e["text"] for e in golden["tokenize"] if "<" not in e["text"])
    texts = [words, words + "</s>" + words, "<s>" + words, words[::-1]]
    assert all(len(t) >= MIN_CHARS for t in texts)
    for _ in range(2):
        for text in texts:
            fresh.clear_memo()
            assert tok.encode(text) == fresh.encode(text)
    assert len(tok._memo) > 0
