"""Checks shared by the CLI tests."""
from __future__ import annotations


def one_line_error(r, needle: str) -> None:
    """A CliRunner result that failed as the CLI promises: exit 1 and one stderr line,
    `edgellm: error: ...`, containing `needle`."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 1, r.output
    assert len(lines) == 1 and lines[0].startswith("edgellm: error:") and needle in lines[0], r.stderr
