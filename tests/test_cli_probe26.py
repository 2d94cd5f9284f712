"""The command line under hostile conditions (a helper's probe, session 26): click's own output
(--help, --version) on a full disk, COLUMNS=0, SIGHUP (the terminal
closed under a chat), a Ctrl-C at a piped chat's prompt just before the next line, a chat whose
stderr cannot be written, stdin open for writing only, slash lines that are not exactly a command,
and a --system prompt longer than the context. Each was a traceback, a silent exit, a lost line or
a file left behind before."""
import os
import signal
import subprocess
import sys
import time

import pytest
from gguf import GGMLQuantizationType as QT

from tests.synthetic import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cli26") / "tiny.gguf", tensor_type=QT.Q8_0, seed=5).path


def _env(tmp_path, **extra):
    env = {**os.environ, "EDGELLM_HOME": str(tmp_path / "home"), **extra}
    return {k: v for k, v in env.items() if v is not None}


def _cli(tmp_path, *args, env=None, **kw):
    """`edgellm ARGS` through the command's entry point in a child process."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.run([sys.executable, "-c", "from edgellm._entry import main; main()", *args],
                          env=_env(tmp_path, **(env or {})), timeout=120, **kw)


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["run", "--help"]])
def test_clicks_own_output_on_a_full_disk_is_one_line(tmp_path, args):
    with open("/dev/full", "wb") as full:
        r = _cli(tmp_path, *args, stdout=full)
    err = r.stderr.decode()
    assert r.returncode == 1 and err == "edgellm: error: cannot write the output: No space left on device\n", err


def test_columns_zero_still_shows_usage_errors(tmp_path):
    r = _cli(tmp_path, "run", "--bogus", env={"COLUMNS": "0"})
    assert r.returncode == 2 and b"No such option" in r.stderr and b"--bogus" in r.stderr, r.stderr


def _chat(tmp_path, tiny, *extra, stderr=subprocess.PIPE):
    return subprocess.Popen([sys.executable, "-c", "from edgellm._entry import main; main()", "chat", "-m", tiny,
                             "-n", "2", "--temperature", "0", *extra], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=stderr, env=_env(tmp_path))


def _wait_for(stream, needle: bytes, timeout=60) -> bytes:
    seen, end = b"", time.monotonic() + timeout
    while needle not in seen and time.monotonic() < end:
        more = os.read(stream.fileno(), 4096)
        if not more:
            break
        seen += more
    assert needle in seen, seen
    return seen


def test_sighup_unwinds_a_chat_as_sigterm_does(tmp_path, tiny):
    """The default action killed the process where it stood: during a session's save, its temporary
    file stayed beside it for good."""
    p = _chat(tmp_path, tiny)
    try:
        _wait_for(p.stderr, b"/help")
        p.send_signal(signal.SIGHUP)
        assert p.wait(timeout=60) == 128 + signal.SIGHUP
    finally:
        p.kill()


def test_a_ctrl_c_at_a_piped_prompt_loses_no_line(tmp_path, tiny):
    """As a KeyboardInterrupt, one landing just after readline() returned dropped the line the app
    had sent right after it (1 in 3 runs); now it only says how to quit."""
    alone = _cli(tmp_path, "chat", "-m", tiny, "-n", "2", "--temperature", "0", input=b"Hi\n/exit\n").stdout
    assert alone.strip(b"\n") == b"" and len(alone) >= 2      # (the tiny model's answers are newlines)
    for _ in range(3):
        p = _chat(tmp_path, tiny)
        try:
            _wait_for(p.stderr, b"/help")
            time.sleep(0.3)                  # (the banner printed: the chat is waiting for a line)
            p.send_signal(signal.SIGINT)
            p.stdin.write(b"Hi\n")
            p.stdin.flush()
            err = _wait_for(p.stderr, b"(Ctrl-D or /exit quits)")
            p.stdin.write(b"/exit\n")
            p.stdin.close()
            out = p.stdout.read()
            assert p.wait(timeout=60) == 0, err
            assert out == alone, out         # "Hi" answered, as without the Ctrl-C
        finally:
            p.kill()


def test_a_chat_answers_with_stderr_on_a_full_disk(tmp_path, tiny):
    """The banner's failed write ended the chat before its first answer."""
    chat = ("chat", "-m", tiny, "-n", "2", "--temperature", "0")
    alone = _cli(tmp_path, *chat, input=b"Hi\nthere\n")
    assert alone.returncode == 0 and alone.stdout.count(b"\n") >= 2
    with open("/dev/full", "wb") as full:
        r = _cli(tmp_path, *chat, input=b"Hi\nthere\n", stderr=full)
    assert r.returncode == 0 and r.stdout == alone.stdout, r.stdout


def test_stdin_open_for_writing_only_is_named(tmp_path, tiny):
    with open(os.devnull, "wb") as wo:
        r = _cli(tmp_path, "chat", "-m", tiny, stdin=wo)
    err = r.stderr.decode()
    assert r.returncode == 1 and "stdin cannot be read" in err and "Traceback" not in err, err


def test_slash_lines_are_commands_or_refused_never_turns(tmp_path, tiny):
    chat = ("chat", "-m", tiny, "-n", "2", "--temperature", "0")
    turn = _cli(tmp_path, *chat, input=b" /help me with this\n").stdout   # a turn, the space first
    r = _cli(tmp_path, *chat, input=b"/exit now\n/\n/Help\n /help me with this\n/EXIT\nnever read\n")
    err = r.stderr.decode()
    assert err.count("edgellm: error: unknown command") == 2, err           # "/exit now", "/"
    assert "'/exit now'" in err and "put a space before it" in err
    assert "/reset forgets the conversation" in err                          # /Help
    assert r.stdout == turn and turn and r.returncode == 0, (r.stdout, err)  # one turn: " /help me ..."


def test_a_system_prompt_longer_than_the_context_is_refused_up_front(tmp_path, tiny):
    r = _cli(tmp_path, "chat", "-m", tiny, "--ctx", "64", "--system", "word " * 200, input=b"Hi\n")
    err = r.stderr.decode()
    assert r.returncode == 1 and "--system takes" in err and "the context holds 64" in err, err
    assert err.count("\n") == 1 and r.stdout == b""


def test_json_dash_is_refused_not_a_file_named_dash(tmp_path, tiny):
    """`bench --json -` wrote a file literally named '-' in the working folder."""
    r = _cli(tmp_path, "bench", "-m", tiny, "--json", "-", cwd=tmp_path)
    err = r.stderr.decode()
    assert r.returncode == 1 and "--json -: output files only" in err, err
    assert not (tmp_path / "-").exists()
