"""A session saved under one precision plan is a miss under a plan that computes otherwise: a
`quality` engine continued, as a hit, the K/V that `balanced` had computed from int8 activations
(the plan's weight formats were covered already: a plan that requantizes runs another file)."""
import logging

import edgellm
from tests.test_kv_engine import GREEDY, text_of, tiny_path  # noqa: F401 - the fixture


def load(path, precision):
    return edgellm.load(path, n_ctx=512, threads=1, precision=precision)


def test_a_session_follows_the_plans_compute(tiny_path, tmp_path, caplog):  # noqa: F811
    saved = {}
    for name in (None, "balanced", "quality"):
        e = load(tiny_path, name)
        e.generate(text_of(e, 20, seed=3), max_tokens=4, **GREEDY)
        saved[name] = tmp_path / f"{name}.session"
        e.save_session(saved[name])
    for name in (None, "balanced", "quality"):
        e = load(tiny_path, name)
        for other, path in saved.items():
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="edgellm"):
                hit = e.load_session(path)
            assert hit == (other == name), (name, other)
            said = [r.getMessage() for r in caplog.records]
            assert hit or any("config hash differs" in m or "model sha256 differs" in m for m in said), said
