"""Sensitivity-cache contents are checked before the search trusts them: a NaN or negative KL, a
layer outside the model, a missing or doubled measurement is a cache miss with one warning line,
and the analysis runs again. The search itself never counts a NaN KL as within its budget."""
from __future__ import annotations

import hashlib
import json
import re
import logging
import math

import pytest
from gguf import GGMLQuantizationType as QT

import edgellm
from edgellm.calibration import load_calibration
from edgellm.precision_search import search
from edgellm.sensitivity import Entry, Sensitivity, analyze
from tests.synthetic import write_tiny_model

N_LAYERS = 2
KW = dict(formats=("q8_0",), ops=("attn_out",), activations=("int8",), max_tokens=24)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tm = write_tiny_model(tmp_path_factory.mktemp("sc") / "tiny.gguf", tensor_type=QT.F32, n_layers=N_LAYERS, seed=5)
    return edgellm.load(tm.path, n_ctx=128, threads=1, units=["reference"])


def _entries(d: dict, kind: str) -> list:
    return [e for e in d["entries"] if e["kind"] == kind]


def _set_kl(value):
    def edit(d):
        d["entries"][0]["kl"] = value
    return edit


def _layer_999(d):
    d["entries"][0]["layer"] = 999


def _drop_activations(d):
    d["entries"] = _entries(d, "weights")


def _twice(d):
    d["entries"][1] = dict(d["entries"][0])


@pytest.mark.parametrize("edit", [_set_kl("nan"), _set_kl(-7.5), _set_kl("inf"), _layer_999, _drop_activations, _twice],
                         ids=["kl-nan", "kl-negative", "kl-inf", "layer-999", "no-activations", "entry-twice"])
def test_damaged_entries_are_a_miss_with_one_warning(engine, tmp_path, monkeypatch, caplog, edit):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    text = load_calibration("builtin")
    first = analyze(engine, text, **KW)
    (path,) = (tmp_path / "cache" / "precision").glob("*.json")
    d = json.loads(path.read_text().split("\n", 1)[1])     # (after the sha256 line)
    edit(d)
    body = json.dumps(d).encode()
    # a valid checksum over bad content (what a writer bug would leave): the content checks see it
    path.write_bytes(hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
    with pytest.raises(ValueError):
        Sensitivity.from_json(body.decode())
    calls = []
    real = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        again = analyze(engine, text, **KW)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "sensitivity cache miss" in warned[0], warned
    assert len(calls) == 1 + N_LAYERS * 2                    # measured again, not served
    assert [e.kl for e in again.entries] == [e.kl for e in first.entries]
    assert Sensitivity.from_json(path.read_text().split("\n", 1)[1]) == again  # and the file rewritten whole


def test_a_fresh_analysis_reads_back(engine, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    res = analyze(engine, load_calibration("builtin"), cache=False, **KW)
    assert Sensitivity.from_json(res.to_json()) == res


def test_search_never_counts_a_nan_kl_within_the_budget():
    ops = ("qkv", "attn_out", "ffn_gate_up", "ffn_down", "lm_head")
    entries = [Entry(li, op, kind, fmt, 1.0, 30.0)
               for li in (0, 1, None) for op in ops if (li is None) == (op == "lm_head")
               for kind, fmt in (("weights", "q4_0"), ("activations", "int8"))]
    entries[0] = Entry(0, "qkv", "weights", "q4_0", math.nan, 30.0)
    entries[2] = Entry(0, "attn_out", "weights", "q4_0", 0.0005, 30.0)
    sens = Sensitivity("m", "c", 2, 64, ("q4_0",), ops, ("int8",), tuple(entries))
    times = {op: {("gguf", "fp32"): 10.0, ("q4_0", "fp32"): 5.0, ("gguf", "int8"): 10.0, ("q4_0", "int8"): 5.0}
             for op in ops}
    res = search(sens, times, 0.001, "decode", 2, ("q4_0",))
    assert [(c.layer, c.op) for c in res.changes] == [(0, "attn_out")]
    assert math.isfinite(res.predicted_kl) and res.predicted_kl <= 0.001


def test_an_edited_table_is_a_miss(engine, tmp_path, monkeypatch, caplog):
    """Every KL set to 99 in the cached table was served as measured, with no warning (a probing
    helper, session 25): the table now carries its sha256."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    text = load_calibration("builtin")
    first = analyze(engine, text, **KW)
    (path,) = (tmp_path / "cache" / "precision").glob("*.json")
    raw = path.read_text()
    path.write_text(re.sub(r'"kl": [0-9.e+-]+', '"kl": 99.0', raw))
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        again = analyze(engine, text, **KW)
    assert "its checksum does not match" in caplog.text
    assert [e.kl for e in again.entries] == [e.kl for e in first.entries]


@pytest.mark.parametrize("how", ["fifo", "devzero"])
def test_a_special_file_in_its_place_is_a_miss(engine, tmp_path, monkeypatch, caplog, how):
    """A FIFO hung `precision analyze`; /dev/zero ran it out of memory."""
    import os
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    text = load_calibration("builtin")
    first = analyze(engine, text, **KW)
    (path,) = (tmp_path / "cache" / "precision").glob("*.json")
    path.unlink()
    os.mkfifo(path) if how == "fifo" else path.symlink_to("/dev/zero")
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        again = analyze(engine, text, **KW)
    assert "unreadable" in caplog.text and [e.kl for e in again.entries] == [e.kl for e in first.entries]
