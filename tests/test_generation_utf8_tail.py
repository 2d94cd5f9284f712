"""A generation cut inside a multi-byte character (max_tokens, context_full, a cancel) ended its
text in U+FFFD: on SmolLM2, greedy after "Emoji list: 😀 😃 😄 😁", every odd max_tokens from 1 to
39 did (a probing session, session 26). llama.cpp's Python binding gave none on the same model
and prompt: the unfinished character's bytes are dropped."""
import edgellm

PROMPT = "Emoji list: 😀 😃 😄 😁"


def test_a_cut_inside_a_character_drops_its_bytes(real_model_path):
    e = edgellm.load(real_model_path, n_ctx=256)
    texts = []
    for k in range(1, 7):
        pieces = list(e.stream(PROMPT, max_tokens=k, temperature=0))
        text = e.generate(PROMPT, max_tokens=k, temperature=0)
        assert "".join(pieces) == text and "\ufffd" not in text, (k, pieces)
        texts.append(text)
    # the cut characters are the ones a longer run completes: each text is the next one's start
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts
    assert len(set(texts)) < len(texts)      # some k ended mid-character (the same text as k - 1)
