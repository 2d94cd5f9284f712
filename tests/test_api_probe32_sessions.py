"""Probe 32 (files a user keeps): Engine.save_session through a link."""
from __future__ import annotations

import os

import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from tests.synthetic import write_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tm = write_tiny_model(tmp_path_factory.mktemp("s32") / "tiny.gguf", tensor_type=QT.Q8_0, seed=2)
    return edgellm.load(tm.path, n_ctx=128, threads=1)


def test_save_session_through_a_link_writes_its_target_and_keeps_the_link(engine, tmp_path):
    """save_session replaced a link (current.edgesess -> chat-3.edgesess) with a file, and the
    target kept the old conversation; `run --session LINK` follows it (a probe)."""
    engine.generate("hello", max_tokens=2)
    target, link = tmp_path / "chat-3.edgesess", tmp_path / "current.edgesess"
    engine.save_session(target)
    old = target.read_bytes()
    link.symlink_to(target.name)
    engine.generate("hello world again", max_tokens=3)
    n = engine.save_session(link)
    assert link.is_symlink() and os.readlink(link) == target.name
    assert target.read_bytes() != old
    assert engine.load_session(link) and len(engine.kv.snapshot()[0]) == n
    dangling = tmp_path / "new.edgesess"
    dangling.symlink_to("made.edgesess")
    engine.save_session(dangling)
    assert dangling.is_symlink() and (tmp_path / "made.edgesess").is_file()
