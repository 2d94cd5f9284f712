"""`edgellm plan --kv ring` shows the chunk a ring runs: load() caps it at half of what the window
leaves a chunk, and the plan showed the pool's (544 tokens against a ring's 126 at window 256)."""
import json

from typer.testing import CliRunner

import edgellm
from edgellm.cli import app
from tests.synthetic import write_tiny_model


def _plan(path, *flags):
    r = CliRunner().invoke(app, ["plan", "--model", path, "--prompt-tokens", "200", "--ctx", "512", "--json", *flags])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout[r.stdout.index("{"):])


def test_the_plan_shows_the_chunk_a_ring_runs(tmp_path, home):
    path = write_tiny_model(tmp_path / "m.gguf", context_length=512).path
    pool = _plan(path)
    ring = _plan(path, "--kv", "ring", "--window", "64", "--sinks", "4")
    e = edgellm.load(path, kv="ring", window=64, sinks=4)
    try:
        assert ring["chunk_tokens"] == e.plan.chunk.tokens == 30      # half of 64 - 4
    finally:
        e.close()
    assert pool["chunk_tokens"] > 30
    assert any("the ring's cap" in line for line in ring["chunk_derivation"])


def test_window_without_a_ring_is_said_to_be_ignored(tmp_path, home):
    path = write_tiny_model(tmp_path / "m.gguf").path
    r = CliRunner().invoke(app, ["plan", "--model", path, "--window", "64"])
    assert r.exit_code == 0 and "--window and --sinks size --kv ring; with --kv pool they are ignored" in r.output


def test_ctx_with_a_ring_is_ignored_as_run_ignores_it(tmp_path, home):
    path = write_tiny_model(tmp_path / "m.gguf", context_length=512).path
    r = CliRunner().invoke(app, ["plan", "--model", path, "--kv", "ring", "--window", "64", "--ctx", "100"])
    assert r.exit_code == 0 and "--ctx does not size --kv ring (its --window does): ignored" in r.output, r.output
