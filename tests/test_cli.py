"""The command line on a tiny synthetic model: run, info, bench, errors as one line."""
import json
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QT
from typer.testing import CliRunner

from edgellm.cli import app
from tests.synthetic import write_tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cli") / "tiny.gguf", tensor_type=QT.Q8_0, seed=5).path


def test_run_streams_text_and_stats(tiny):
    r = runner.invoke(app, ["run", "hello", "--model", tiny, "--max-tokens", "5", "--temperature", "0"])
    assert r.exit_code == 0, r.output
    assert "TTFT" in r.stderr and "tok/s" in r.stderr
    r2 = runner.invoke(app, ["run", "hello", "--model", tiny, "--max-tokens", "5", "--temperature", "0", "--no-stats"])
    assert r2.exit_code == 0 and "TTFT" not in r2.stderr
    assert r2.stdout == r.stdout  # greedy is deterministic


def test_run_chat_mode(tiny):
    r = runner.invoke(app, ["run", "hi", "--model", tiny, "--chat", "-n", "3", "--temperature", "0", "--no-stats"])
    assert r.exit_code == 0, r.output


def test_info_prints_architecture_and_memory(tiny):
    r = runner.invoke(app, ["info", tiny])
    assert r.exit_code == 0, r.output
    for word in ("architecture", "llama", "Q8_0", "memory at ctx", "file size", "heads (q / kv)", "KV cache (f16)",
                 "on the neon unit (read in place, quantized)", "where the reference unit runs every op"):
        assert word in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["run", "x", "--model", "/nonexistent/model.gguf"], "no such file"),
    (["run", "x", "--model", "not-a-registry-name"], "not-a-registry-name"),
    (["run", "x", "--temperature", "-1", "--model", "TINY"], "temperature"),
    (["info", "/nonexistent.gguf"], "no such file"),
    (["bench", "--prompt-tokens", "a,b", "--model", "TINY"], "--prompt-tokens"),
    (["run", "x", "--model", "TINY", "--threads", "257"], "--threads must be an integer in 1..256, got 257"),
    (["run", "x", "--model", "TINY", "--ctx", "-5"], "--ctx must be an integer >= 1, got -5"),
    (["info", "TINY", "--ctx", "0"], "--ctx must be >= 1, got 0"),
    (["info", "/dev/null"], "/dev/null: expected a model file, found no regular file"),
    (["pull", "/tmp/some.gguf"], "a .gguf file needs no pull: give its path to --model"),
    (["bench", "--model", "TINY", "--prompt-tokens", "8", "--concurrent", "--delay-ms", "-5"],
     "--delay-ms must be a finite number >= 0, got -5.0"),
    (["bench", "--model", "TINY", "--prompt-tokens", "8", "--concurrent", "--delay-ms", "nan"],
     "--delay-ms must be a finite number >= 0, got nan"),
    (["bench", "--model", "TINY", "--prompt-tokens", "8", "--concurrent", "--short-tokens", "0"],
     "--short-tokens must be >= 1, got 0"),
    (["bench", "--model", "TINY", "--prompt-tokens", "8", "--concurrent", "--short-tokens", "8"],
     "--short-tokens (8) must be fewer than the long request's --prompt-tokens (8)"),
    (["plan", "--model", "TINY", "--plot", "roofline.txt"], "expected a file ending in .png, .pdf, .svg"),
    (["bench", "--model", "TINY", "--prompt-tokens", "8", "--json", "/nonexistent-dir/b.json"],
     "--json /nonexistent-dir/b.json: the folder /nonexistent-dir does not exist"),
])
def test_errors_are_one_line_without_traceback(tiny, args, needle):
    _assert_one_line_error([tiny if a == "TINY" else a for a in args], needle)


def _assert_one_line_error(args, needle):
    r = runner.invoke(app, args)
    assert r.exit_code == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("edgellm: error:") and needle in lines[0], r.stderr
    assert "Traceback" not in r.output


def test_malformed_file_names_file_and_field(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 8)
    r = runner.invoke(app, ["info", str(bad)])
    assert r.exit_code == 1 and str(bad) in r.stderr


def test_bench_writes_json_records(tiny, tmp_path):
    out = tmp_path / "b.json"
    r = runner.invoke(app, ["bench", "--model", tiny, "--prompt-tokens", "8,16", "--gen-tokens", "3",
                            "--runs", "2", "--json", str(out)])
    assert r.exit_code == 0, r.output
    recs = json.loads(out.read_text())
    assert [set(x) >= {"prompt_tokens", "ttft_ms_p50", "ttft_ms_p95", "prefill_tps", "decode_tps",
                       "peak_rss_mb", "load_ms"} for x in recs] == [True, True]
    assert recs[0]["prompt_tokens"] == 8 and recs[0]["ttft_ms_p95"] >= recs[0]["ttft_ms_p50"] > 0


def test_run_session_file_continues_the_conversation(tiny, tmp_path, monkeypatch):
    """`run --session FILE`: the first run saves prompt and answer beside their KV; the next run
    continues them (its stats count them cached) and saves the longer conversation; a bare name
    that is not a valid cache name says how to give a file instead."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    f = str(tmp_path / "talk.edgesess")
    base = ["run", "--model", tiny, "-n", "4", "--temperature", "0", "--session", f]
    r1 = runner.invoke(app, base + ["hello there"])
    assert r1.exit_code == 0, r1.output
    n1 = int(r1.stderr.split("[session: saved ")[1].split(" tokens")[0])
    r2 = runner.invoke(app, base + [" and more"])
    assert r2.exit_code == 0, r2.output
    assert f"[session: continuing {n1} cached tokens from {f}]" in r2.stderr
    assert f" tok, {n1} cached, TTFT" in r2.stderr                # the saved KV, not recomputed
    n2 = int(r2.stderr.split("[session: saved ")[1].split(" tokens")[0])
    assert n2 > n1
    bad = runner.invoke(app, base[:-1] + ["talk.session", "hi"])
    assert bad.exit_code == 1 and "a file is a path (./talk.session) or ends in .edgesess" in bad.stderr
    assert "entry_path" not in bad.stderr and "1 to 128 letters" in bad.stderr   # (an internal name leaked)



@pytest.mark.parametrize("args", [
    ["bench", "--model", "TINY", "--prompt-tokens", "8", "--runs", "1", "--no-floor", "--json", "DIR"],
    ["plan", "--model", "TINY", "--plot", "DIR"],
    ["profile", "--quick", "--out", "DIR"],
    ["quantize", "TINY", "--plan", "fast", "-o", "DIR"],
])
def test_an_output_path_that_is_a_directory_is_refused_before_the_work(tiny, tmp_path, args):
    """(They wrote after the work, and raised IsADirectoryError; plan --plot DIR wrote DIR.png
    beside the folder.)"""
    flag = {"-o": "--out"}.get(args[args.index("DIR") - 1], args[args.index("DIR") - 1])
    _assert_one_line_error([tiny if a == "TINY" else str(tmp_path) if a == "DIR" else a for a in args],
                           f"{flag} {tmp_path}: is a directory; give a file path")
    assert list(tmp_path.iterdir()) == [] and not tmp_path.with_suffix(".png").exists()


def test_system_errors_are_one_line_too(tiny, tmp_path, monkeypatch):
    """An OSError (here EDGELLM_HOME is a file, so the session cache cannot be made) prints one
    line naming the path, not a traceback."""
    home = tmp_path / "home"
    home.write_text("not a folder")
    monkeypatch.setenv("EDGELLM_HOME", str(home))
    _assert_one_line_error(["run", "x", "--model", tiny, "-n", "2", "--session", "talk"], str(home))


def test_a_full_disk_under_stdout_is_one_line(tiny):
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "edgellm.cli", "run", "hello", "--model", tiny, "-n", "4",
                            "--temperature", "0", "--no-stats"], stdout=full, stderr=subprocess.PIPE, text=True,
                           timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and lines == ["edgellm: error: cannot write to stdout: No space left on device"], r.stderr


def test_ctrl_c_before_a_command_runs_exits_130_quietly(monkeypatch, capsys):
    from edgellm import cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "app", interrupted)
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 130 and "Traceback" not in capsys.readouterr().err


def test_session_never_overwrites_a_file_that_is_not_a_session(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    doc = tmp_path / "thesis.md"
    doc.write_text("my thesis")
    _assert_one_line_error(["run", "x", "--model", tiny, "-n", "2", "--session", str(doc)],
                           f"--session {doc}: exists and is not an edgellm session file")
    assert doc.read_text() == "my thesis"
    _assert_one_line_error(["run", "x", "--model", tiny, "-n", "2", "--session", str(tmp_path / "no" / "s.edgesess")],
                           f"the folder {tmp_path / 'no'} does not exist")


def test_a_session_whose_kv_does_not_fit_keeps_its_conversation(tiny, tmp_path, monkeypatch):
    """A session saved with f16 KV and continued with --kv-precision int8 is a cache miss (one
    warning naming the layout); the run used to start from nothing and save over the file, and
    the conversation was gone. It now continues the saved messages, their KV recomputed."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    f = str(tmp_path / "c.edgesess")
    base = ["run", "--model", tiny, "-n", "3", "--temperature", "0", "--chat", "--session", f]
    assert runner.invoke(app, base + ["my name is Ada"]).exit_code == 0
    r = runner.invoke(app, base + ["what is my name?", "--kv-precision", "int8"])
    assert r.exit_code == 0, r.output
    assert "its KV is recomputed" in r.stderr
    from edgellm.kv.session_file import read_header
    msgs = read_header(f).meta["messages"]
    assert [m["content"] for m in msgs if m["role"] == "user"] == ["my name is Ada", "what is my name?"]
    assert len(msgs) == 4


def test_ring_sessions_are_refused_before_the_work(tiny, tmp_path, monkeypatch):
    """(The ring has no sessions: it said so at save time, after the whole answer.)"""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    _assert_one_line_error(["run", "x", "--model", tiny, "-n", "2", "--kv", "ring", "--session", "talk"],
                           "--session needs --kv pool")


def test_a_chat_session_continues_only_as_a_chat(tiny, tmp_path, monkeypatch):
    """A session keeps its mode: continuing a --chat session as plain text (or the other way
    round) dropped the saved conversation and overwrote it."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    chat, text = str(tmp_path / "c.edgesess"), str(tmp_path / "t.edgesess")
    base = ["run", "--model", tiny, "-n", "3", "--temperature", "0"]
    assert runner.invoke(app, base + ["hi", "--chat", "--session", chat]).exit_code == 0
    assert runner.invoke(app, base + ["hi", "--session", text]).exit_code == 0
    before = open(chat, "rb").read()
    _assert_one_line_error(base + ["more", "--session", chat],
                           f"--session {chat} holds a chat: continue it with --chat")
    _assert_one_line_error(base + ["more", "--chat", "--session", text], "holds plain text: continue it with `edgellm run` without --chat")
    assert open(chat, "rb").read() == before
    r = runner.invoke(app, base + ["more", "--chat", "--session", chat])
    assert r.exit_code == 0 and "[session: continuing" in r.stderr


def test_cache_info_and_clear_all_cover_every_cache(tmp_path, monkeypatch):
    """`cache info` counted sessions only, and nothing removed the requantized models (~90 MB
    each) or the OpenCL program cache."""
    home = tmp_path / "home"
    monkeypatch.setenv("EDGELLM_HOME", str(home))
    (home / "cache" / "precision" / "models").mkdir(parents=True)
    (home / "cache" / "precision" / "models" / "m.gguf").write_bytes(b"x" * 2**20)
    (home / "cache" / "opencl").mkdir()
    (home / "cache" / "opencl" / "k.bin").write_bytes(b"y" * 10)
    r = runner.invoke(app, ["cache", "info"])
    assert r.exit_code == 0 and "precision/   1 file(s), 1.0 MiB" in r.stdout and "opencl/      1 file(s)" in r.stdout
    assert runner.invoke(app, ["cache", "clear"]).exit_code == 0
    assert (home / "cache" / "opencl" / "k.bin").exists()              # sessions only without --all
    r = runner.invoke(app, ["cache", "clear", "--all"])
    assert r.exit_code == 0 and not (home / "cache" / "precision").exists() and not (home / "cache" / "opencl").exists()


def _pty_chat(tiny, tmp_path, keys: list[bytes], timeout: float = 20.0) -> tuple[int, str]:
    """`edgellm chat` on a pseudo-terminal: waits for each prompt, sends the next keys; returns
    (exit code, everything the terminal showed)."""
    import os
    import pty
    import select
    import subprocess
    import sys
    import time
    import fcntl
    import termios
    main, child = pty.openpty()
    env = {**os.environ, "EDGELLM_HOME": str(tmp_path / "home")}

    def controlling_tty():   # (a new session whose terminal is the pty: its ^C sends SIGINT, as a shell's)
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    p = subprocess.Popen([sys.executable, "-c", "from edgellm.cli import main; main()", "chat", "-m", tiny, "-n", "3",
                          "--temperature", "0"], stdin=child, stdout=child, stderr=child, env=env, close_fds=True,
                         start_new_session=True, preexec_fn=controlling_tty)
    os.close(child)
    seen, t_end = b"", time.monotonic() + timeout
    try:
        for k in keys:
            n_prompts = seen.count(b"> ")
            while seen.count(b"> ") == n_prompts and time.monotonic() < t_end:   # the next prompt
                if select.select([main], [], [], 0.2)[0]:
                    try:
                        seen += os.read(main, 4096)
                    except OSError:
                        break
            os.write(main, k)
        while time.monotonic() < t_end and p.poll() is None:
            if select.select([main], [], [], 0.2)[0]:
                try:
                    seen += os.read(main, 4096)
                except OSError:
                    break
        return p.wait(timeout=max(0.1, t_end - time.monotonic())), seen.decode(errors="replace")
    finally:
        if p.poll() is None:
            p.kill()
        os.close(main)


def test_ctrl_c_at_the_chat_prompt_is_answered_and_does_not_quit(tiny, tmp_path):
    """Ctrl-C at the prompt quit the chat with exit 0 (the help says Ctrl-D or /exit quits), and
    about 1 press in 4 was not answered at all: a native pool or BLAS worker took the signal
    while the main thread sat in its read."""
    for _ in range(6):
        rc, shown = _pty_chat(tiny, tmp_path, [b"half typed\x03", b"\x04"])
        assert "(Ctrl-D or /exit quits)" in shown and rc == 0, shown[-500:]


def test_chat_answers_alone_go_to_stdout(tiny, tmp_path):
    """The '> ' prompt was written to stdout: `chat < questions > answers` got '> ' before every
    answer and a stray one at the end."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", "from edgellm.cli import main; main()", "chat", "-m", tiny, "-n", "3",
                        "--temperature", "0"], input="hello\n\n/reset\nhi\n", capture_output=True, text=True,
                       env={**os.environ, "EDGELLM_HOME": str(tmp_path / "home")}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "> " not in r.stdout and r.stdout.strip("\n") == r.stdout.strip() and "[conversation cleared]" in r.stderr


def test_a_session_saved_by_another_run_meanwhile_is_not_replaced_silently(tiny, tmp_path, monkeypatch):
    """Two runs continuing one session: the last save won and the other turn was lost, without
    a word. The second save now warns that it replaces a session changed since it was read."""
    import edgellm.api as api
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    f = str(tmp_path / "s.edgesess")
    base = ["run", "--model", tiny, "-n", "2", "--temperature", "0", "--session", f]
    assert runner.invoke(app, base + ["one"]).exit_code == 0
    real_stream = api.Engine.stream

    def stream_while_another_run_saves(self, *a, **k):
        out = list(real_stream(self, *a, **k))
        self.save_session(f, meta={"text": "the other run's conversation"})   # another process, meanwhile
        return iter(out)

    monkeypatch.setattr(api.Engine, "stream", stream_while_another_run_saves)
    r = runner.invoke(app, base + ["two"])
    assert r.exit_code == 0 and "changed since this run read it" in r.stderr


def test_chat_takes_the_sampling_options_of_run(tiny, tmp_path):
    """`chat` had no --min-p, --repeat-penalty or --stop (and sampled without min-p, which `run`
    applies by default). A stop string ends the answer unprinted, as in `run`."""
    import os
    import subprocess
    import sys

    def chat(*extra):
        return subprocess.run([sys.executable, "-c", "from edgellm.cli import main; main()", "chat", "-m", tiny, "-n",
                               "6", "--temperature", "0", *extra], input="hello\n", capture_output=True, text=True,
                              env={**os.environ, "EDGELLM_HOME": str(tmp_path / "home")}, timeout=60)

    plain = chat("--min-p", "0.1", "--repeat-penalty", "1.1")
    assert plain.returncode == 0 and plain.stdout == "\n" * 6 + "\n", plain   # (the tiny model's greedy answer)
    cut = chat("--stop", "\n\n\n")
    assert cut.returncode == 0 and cut.stdout == "\n", cut   # (the answer starts with the stop string)
    for flag, bad in (("--min-p", "2"), ("--repeat-penalty", "-1")):
        r = chat(flag, bad)
        assert r.returncode == 1 and f"edgellm: error: {flag}: expected" in r.stderr, r.stderr


def test_plan_refuses_a_prompt_longer_than_its_ctx(tiny):
    """`plan --ctx 64 --prompt-tokens 100` grew the context to 100 without a word: a plan for a
    prompt `run` would refuse (from a helper's probe of the cost model)."""
    r = runner.invoke(app, ["plan", "--model", tiny, "--ctx", "64", "--prompt-tokens", "100"])
    assert r.exit_code == 1 and "--prompt-tokens 100 does not fit --ctx 64" in r.stderr, r.output


def test_kv_options_the_chosen_layout_ignores_are_said_to_be(tiny):
    """--window/--sinks with --kv pool (even invalid ones) and --ctx with --kv ring were taken
    without a word (from a helper's probe of feature combinations)."""
    base = ["run", "hi", "--model", tiny, "-n", "1", "--temperature", "0", "--no-stats"]
    r = runner.invoke(app, base + ["--window", "8", "--sinks", "9"])
    assert r.exit_code == 0 and "--window and --sinks size a --kv ring; with --kv pool they are ignored" in r.stderr
    r = runner.invoke(app, base + ["--kv", "ring", "--ctx", "8"])
    assert r.exit_code == 0 and "--ctx does not size a --kv ring" in r.stderr
    r = runner.invoke(app, base)
    assert r.exit_code == 0 and "warning" not in r.stderr


def test_plan_refuses_a_prompt_longer_than_the_default_ctx(tiny):
    """Without --ctx, plan grew the context to the prompt (context 5000, TTFT 7.6 s) while `run`
    refuses that prompt at the default context."""
    r = runner.invoke(app, ["plan", "--model", tiny, "--ctx", "64", "--prompt-tokens", "100"])
    assert r.exit_code == 1 and "--prompt-tokens 100 does not fit --ctx 64" in r.stderr, r.output
    big = write_tiny_model(Path(tiny).parent / "long.gguf", tensor_type=QT.Q8_0, seed=5, context_length=4096).path
    r = runner.invoke(app, ["plan", "--model", big, "--prompt-tokens", "3000"])
    assert r.exit_code == 1 and "--prompt-tokens 3000 does not fit --ctx 2048 (the default)" in r.stderr, r.output


def test_bench_says_up_front_when_its_runs_do_not_fit_and_why_a_floor_is_missing(tiny, tmp_path):
    """bench over the model's trained context failed after the first runs, advising a --ctx it
    does not have; with --gen-tokens 1 it said the bandwidth probe had failed, which it had not
    (from a helper's probe of the run statistics)."""
    r = runner.invoke(app, ["bench", "--model", tiny, "--prompt-tokens", "300", "--runs", "1", "--no-floor"])
    assert r.exit_code == 1 and "these runs need" in r.stderr and "its trained context" in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and not r.stdout   # before the load: no n_ctx warning first
    r = runner.invoke(app, ["bench", "--model", tiny, "--prompt-tokens", "8", "--runs", "1", "--gen-tokens", "1"])
    assert r.exit_code == 0 and "no decode step to compare: --gen-tokens 1" in r.stdout, r.output


def _session_chat(tiny, tmp_path, f):
    """chat(lines, *flags): `edgellm chat --session f` on the tiny model, lines on stdin."""
    import os
    import subprocess
    import sys

    def chat(lines, *extra):
        return subprocess.run([sys.executable, "-c", "from edgellm.cli import main; main()", "chat", "-m", tiny, "-n",
                               "2", "--temperature", "0", "--session", str(f), *extra], input=lines,
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "EDGELLM_HOME": str(tmp_path / "home")})
    return chat


def test_chat_continues_and_saves_a_session(tiny, tmp_path):
    """`chat` had no --session (run --chat had one): a conversation ended with the process."""
    from edgellm.kv.session_file import read_header
    f = tmp_path / "c.edgesess"

    chat = _session_chat(tiny, tmp_path, f)
    r = chat("hello\n")
    assert r.returncode == 0 and f"[session: saved" in r.stderr, r.stderr
    assert [m["role"] for m in read_header(f).meta["messages"]] == ["user", "assistant"]
    r = chat("again\n")
    assert r.returncode == 0 and "[session: continuing" in r.stderr, r.stderr
    assert [m["content"] for m in read_header(f).meta["messages"] if m["role"] == "user"] == ["hello", "again"]
    r = chat("x\n", "--kv", "ring")
    assert r.returncode == 1 and "--session needs --kv pool" in r.stderr


def test_reset_in_a_saved_chat_keeps_its_system_turn_and_only_that(tiny, tmp_path):
    """/reset kept messages[:1] when --system was given, which in a saved chat was its first user
    turn; without --system it dropped the session's own system prompt; and a /reset followed by
    Ctrl-D left the old conversation in the file (from a helper's probe of the day's features)."""
    from edgellm.kv.session_file import read_header
    f = tmp_path / "c.edgesess"

    chat = _session_chat(tiny, tmp_path, f)
    assert chat("My name is Zork.\n", "--system", "Be brief.").returncode == 0
    r = chat("/reset\n")                                  # then Ctrl-D: no answer after the reset
    assert r.returncode == 0 and not f.exists(), r.stderr
    assert chat("Hi\n", "--system", "Be brief.").returncode == 0
    assert chat("/reset\nAgain\n").returncode == 0       # the session's own system turn stays
    roles = [(m["role"], m["content"]) for m in read_header(f).meta["messages"]]
    assert roles[:2] == [("system", "Be brief."), ("user", "Again")] and len(roles) == 3, roles


def test_plan_refuses_a_prompt_that_fills_its_context_as_run_does(tiny):
    """`run` refuses a prompt of exactly n_ctx tokens (no position left for the first token);
    plan refused only longer ones, and its default prompt on a model trained on 512 tokens or
    fewer was one `run` refuses (a helper's probe of the docs)."""
    r = runner.invoke(app, ["plan", "--model", tiny, "--ctx", "64", "--prompt-tokens", "64"])
    assert r.exit_code == 1 and "--prompt-tokens 64 does not fit --ctx 64" in r.stderr, r.output
    r = runner.invoke(app, ["plan", "--model", tiny, "--prompt-tokens", "256"])      # trained on 256
    assert r.exit_code == 1 and "'s trained context of 256 tokens" in r.stderr, r.output
    r = runner.invoke(app, ["plan", "--model", tiny, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["prompt_tokens"] == 255


def test_the_api_says_when_the_kv_layout_ignores_an_option_as_the_cli_does(tiny, caplog):
    """load(kv="ring", n_ctx=100) and load(kv="pool", window=8, sinks=9) were taken without a word
    (the CLI warned); the CLI's own warning stays the only one there."""
    import logging

    import edgellm
    with caplog.at_level(logging.WARNING, logger="edgellm"):
        edgellm.load(tiny, kv="ring", n_ctx=100, window=64)
        edgellm.load(tiny, kv="pool", window=8, sinks=9)
        edgellm.load(tiny, kv="pool", n_ctx=64)
        edgellm.load(tiny, kv="ring", window=64, sinks=2)
    said = [r.getMessage() for r in caplog.records]
    assert said.count("n_ctx does not size kv='ring' (its window does): ignored") == 1, said
    assert said.count("window and sinks size kv='ring'; with kv='pool' they are ignored") == 1, said
    r = runner.invoke(app, ["run", "hi", "--model", tiny, "-n", "1", "--no-stats", "--window", "8"])
    assert r.exit_code == 0 and r.stderr.count("ignored") == 1, r.stderr


def test_info_says_when_it_caps_ctx_at_the_trained_context(tiny):
    r = runner.invoke(app, ["info", tiny, "--ctx", "100000"])
    assert r.exit_code == 0 and "--ctx 100000 is above" in r.stderr and "trained context: using 256" in r.stderr
    assert "memory at ctx 256" in r.stdout
    r = runner.invoke(app, ["info", tiny])
    assert r.exit_code == 0 and "warning" not in r.stderr and "memory at ctx 256" in r.stdout
