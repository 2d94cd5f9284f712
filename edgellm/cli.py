"""The `edgellm` command line: run, chat, info, pull, bench."""
from __future__ import annotations

import codecs
import functools
import json
import logging
import math
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from . import cli_interrupted as interrupted
from .errors import ContextFull, EdgeLLMError, shown
from .fileio import file_state

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="edgellm: on-device LLM runtime. Run `edgellm run \"Hello\"` to generate with the default model.")

MODEL_HELP = "GGUF file path or registry name (default: smollm2-135m, pulled on first use)"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("edgellm")
    except PackageNotFoundError:   # (a source tree on sys.path, not installed)
        from . import __version__
        return __version__


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"edgellm {_version()}")
        raise typer.Exit(0)


@app.callback()
def _options(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                          help="Print edgellm's version and exit")):
    pass


def _note(text: str) -> None:
    """A line for the person at the terminal (stderr), best effort: with stderr on a full disk
    (2>/dev/full) the chat's banner ended the chat before its first answer. Answers go to stdout
    whatever becomes of these."""
    try:
        typer.echo(text, err=True)
    except OSError:
        pass


def _err(msg: str) -> None:
    _note(f"edgellm: error: {msg}")


def _stdout_failed(e: OSError) -> bool:
    """Whether e came from writing stdout: a `sys.stdout` write in our code, or a stream on
    descriptor 1 in click's echo (a full disk under `> file`, /dev/full)."""
    import traceback

    tb, frames = e.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    last = traceback.extract_tb(e.__traceback__)[-1:]
    if last and "sys.stdout" in (last[0].line or ""):
        return True
    for frame in frames[-3:]:
        for name in ("file", "stream", "self"):
            try:
                if frame.f_locals[name].fileno() == 1:
                    return True
            except Exception:
                continue
    return False


def friendly(fn):
    """One clear line and a non-zero exit for our errors and the system's (a file that cannot be
    written, a full disk under stdout, a read-only EDGELLM_HOME); no traceback."""
    @functools.wraps(fn)
    def wrapper(*a, **k):
        interrupted.begin(fn.__name__.replace("_", " "))
        try:
            home_check()   # every command, first: a file there read as "model not downloaded"
            if fn.__name__ not in _NO_KERNELS:
                neon_lib_check()
            return fn(*a, **k)
        except EdgeLLMError as e:
            _stop_probe_child()
            _err(_in_flag_names(str(e)))
            raise typer.Exit(1)
        except BrokenPipeError:
            raise   # stdout closed by the reader (| head): click ends quietly
        except OSError as e:
            _stop_probe_child()
            if e.filename and e.strerror:
                _err(f"{e.filename}: {e.strerror}")
            elif _stdout_failed(e):   # (a full disk or a closed descriptor under stdout)
                _err(f"cannot write to stdout: {e.strerror or e}")
            else:
                _err(str(e))
            raise typer.Exit(1)
        except KeyboardInterrupt:
            _stop_probe_child()
            _say_interrupted(signal.SIGINT)
            raise typer.Exit(130)
        except SystemExit as e:   # SIGTERM (main's handler): the probe child too, as for Ctrl-C
            _stop_probe_child()
            signum = _terminated or interrupted.signal_of_exit(e.code)
            if signum:
                _say_interrupted(signum)
            raise
        finally:
            _release_session_locks()
    return wrapper


def _say_interrupted(signum: int, *what: str) -> None:
    """The interrupt's one line on stderr (cli_interrupted.line), once."""
    text = interrupted.line(signum, *what)
    if text is not None:
        _note(text)


# the API's parameter names that start its messages, as the command line names them ("n_ctx must
# be an integer >= 1" answered `--ctx 0`, "sampling.seed: expected None or ..." `--seed -1`)
_FLAG_OF = {"n_ctx": "--ctx", "threads": "--threads", "max_tokens": "--max-tokens", "kv_precision": "--kv-precision",
            "sampling.seed": "--seed", "sampling.temperature": "--temperature", "sampling.top_k": "--top-k",
            "sampling.top_p": "--top-p", "sampling.min_p": "--min-p", "sampling.repeat_penalty": "--repeat-penalty",
            "sampling.stop": "--stop"}


def _in_flag_names(msg: str) -> str:
    # the checks' own forms only: a model file named n_ctx had its errors ("n_ctx: version: ...")
    # start with --ctx
    m = re.match(r"[a-z_]+(?= must be | for kv=)|sampling\.[a-z_]+(?=: expected )", msg)
    if m is None or m[0] not in _FLAG_OF:
        return msg
    msg = (_FLAG_OF[m[0]] + msg[m.end():]).replace("expected None or ", "expected ", 1)
    return re.sub(r"for kv='(pool|ring)'", r"for --kv \1", msg, count=1)


# commands that run no kernel: an EDGELLM_NEON_LIB for the device (set while building its bundle)
# does not concern them
_NO_KERNELS = frozenset({"build", "pull", "cache_list", "cache_info", "cache_clear"})


def neon_lib_check() -> None:
    """A library EDGELLM_NEON_LIB names must load, and the library choices set must be valid
    (neon_lib.named_library_problem)."""
    from .backends import neon_lib
    from .errors import ConfigError

    problem = neon_lib.named_library_problem()
    if problem:
        raise ConfigError(problem)


def check_out_path(path, flag: str, suffixes: tuple[str, ...] = (), replaces=None) -> Path | None:
    """Refuses, before any long work, an output path that cannot be written: a directory, a
    path ending in '/', a missing or read-only folder, a suffix the writer does not know, and
    an existing file the writer must not replace: replaces=(test(its first KiB and last 4 KiB),
    what) names the files it may (`bench --json` over a model file replaced the model with 500
    bytes of JSON).
    Returns it as a Path (None for None).

    The options are taken as strings, not typer Paths: pathlib drops a trailing slash, and
    `--out /tmp/x/dev.yaml/` (a path the user marked as a folder) measured for a minute and then
    wrote the file dev.yaml."""
    from .errors import ConfigError

    if path is None:
        return None
    raw = os.fspath(path)
    if not raw.strip():   # ("" read as ".": "--out .: is a directory")
        raise ConfigError(f"{flag}: the path is empty; give a file path")
    if raw == "-":   # (`bench --json -` wrote a file named "-"; stdout carries the command's own report)
        raise ConfigError(f"{flag} -: output files only, not stdout (the report goes there); give a file path")
    p = Path(raw)
    if p.is_dir():
        raise ConfigError(f"{flag} {p}: is a directory; give a file path")
    if raw.endswith(tuple(filter(None, (os.sep, os.altsep)))):
        raise ConfigError(f"{flag} {raw}: ends in '/', which names a folder; give a file path")
    if p.exists() and not p.is_file():
        # the file is written beside and renamed over the path: a device (as root, /dev/null) or
        # a pipe there was replaced by a regular file, and /dev/full "took" the whole write
        raise ConfigError(f"{flag} {p}: is not a regular file (a device, pipe or socket); give a file path")
    check_out_folder(p.parent if str(p.parent) else Path("."), flag, p)
    if suffixes and p.name.lower() in suffixes:   # ('.yaml' is a name without a suffix to Python)
        raise ConfigError(f"{flag} {p}: the file name before {p.name} is missing")
    if suffixes and p.suffix.lower() not in suffixes:
        raise ConfigError(f"{flag} {p}: expected a file ending in {', '.join(suffixes)}")
    if replaces is not None and p.is_file() and p.stat().st_size:
        test, what = replaces
        try:
            with open(p, "rb") as f:
                head = f.read(1024)
                if p.stat().st_size > 1024:
                    f.seek(max(1024, p.stat().st_size - 4096))
                    head += f.read(4096)
        except OSError as e:
            raise ConfigError(f"{flag} {p}: cannot be checked before it is replaced: {e.strerror or e}") from None
        if not test(head):
            raise ConfigError(f"{flag} {p}: exists and is not {what}; give another path, or remove it first")
    interrupted.will_write(flag, p)
    return p


# what a --json output may replace: what that command wrote there before (any JSON was replaced:
# `--json package.json` destroyed the app's own file)
BENCH_JSON = (lambda head: head.lstrip()[:1] == b"[" and b'"prompt_tokens"' in head and b'"ttft_ms_p50"' in head,
              "bench records edgellm wrote")
ANALYSIS_JSON = (lambda head: head.lstrip()[:1] == b"{" and b'"calibration_sha256"' in head and b'"schema"' in head,
                 "a sensitivity analysis edgellm wrote")
# what the YAML and plot outputs may replace: what edgellm wrote there before (a hand-edited plan,
# a user's own profile or drawing was replaced without a word)
PROFILE_FILE = (lambda head: head.startswith(b"# edgellm device profile"), "a profile edgellm wrote")
PLAN_FILE = (lambda head: head.startswith(b"# edgellm precision plan"), "a precision plan edgellm wrote")
PLOT_FILE = (lambda head: b"Matplotlib" in head or b"matplotlib" in head, "a plot edgellm (matplotlib) drew")


def check_out_folder(parent: Path, flag: str, out: Path) -> None:
    """The folder `out` is written into must exist and be writable. A regular file on the way
    (`--out afile/x`) is said to be one: "the folder afile does not exist" sent the user looking
    for a missing folder beside the file that was there."""
    from .errors import ConfigError

    if parent.is_dir():
        if not os.access(parent, os.W_OK):
            raise ConfigError(f"{flag} {out}: the folder {parent} is not writable")
        # access() passes what the file system itself refuses (root in /proc or /sys, a FUSE or
        # network folder): a file made and removed there says so now, in the system's words
        # (quantize -o /proc/x said "needs 89.7 MiB but /proc has 0.0 MiB free")
        from .fileio import os_error_text, temp_beside

        try:
            fd, tmp = temp_beside(out)
        except OSError as e:
            raise ConfigError(f"{flag} {out}: cannot write a file in {parent}: {os_error_text(e)}") from None
        os.unlink(tmp)      # (then the fd and its lock: unlocked, another cleaner may take it first)
        os.close(fd)
        return
    file_above = next((a for a in (parent, *parent.parents) if a.exists() and not a.is_dir()), None)
    if file_above is not None:
        raise ConfigError(f"{flag} {out}: {file_above} is a file, not a folder")
    raise ConfigError(f"{flag} {out}: the folder {parent} does not exist")


def _check_analysis_args(formats: tuple[str, ...], ops: tuple[str, ...], max_tokens: int) -> None:
    """The analysis's own checks, made before the model loads and "measuring N forward passes"
    is printed; an empty list is refused (--ops "" ran and measured nothing)."""
    from . import requant
    from .errors import ConfigError
    from .sensitivity import ANALYZED_OPS, _check_names

    if not formats:
        raise ConfigError("--formats names no weight format")
    if not ops:
        raise ConfigError("--ops names no op")
    _check_names(formats, requant.FORMATS, "weight format")
    _check_names(ops, ANALYZED_OPS, "op")
    if max_tokens < 2:
        raise ConfigError(f"--max-tokens must be >= 2, got {max_tokens}")


def _context_short(cfg, need: int, parts: dict[str, int]) -> str:
    """bench's runs need more context than the model has: the message names the flags that ask
    for it, the largest first (an 8000-token --shared-prefix was blamed on --prompt-tokens)."""
    asked = {f: v for f, v in parts.items() if v}
    rest = need - sum(asked.values())    # (with --concurrent, the short request's generated tokens too)
    terms = " + ".join([*(f"{f} {v}" for f, v in asked.items()), f"{rest} of margin"])
    flag = max(asked, key=asked.get)
    room = cfg.context_length - (need - asked[flag])
    advice = f"shorten {flag} (at most {room} here)" if room >= 1 else f"shorten {' and '.join(asked)}"
    return (f"these runs need {need} tokens of context ({terms}) but {cfg.name} holds "
            f"{cfg.context_length}, its trained context: {advice}")


def _calibration_engine(model, max_tokens: int, text: str):
    """The reference engine a sensitivity analysis runs on. Its context is sized to the tokens the
    text can give (at most one per byte, and a BOS) within the model's trained context:
    --max-tokens 100000 asked for a context the model lacks ("n_ctx 100001 is above ... using
    8192") for tokens the text does not have."""
    import edgellm

    path, mf = _resolved(model)
    trained = mf.config.context_length
    n_ctx = min(max(min(max_tokens, len(text.encode()) + 2) + 1, 256), trained)
    return edgellm.load(path, n_ctx=n_ctx, units=["reference"], progress=Progress())


def _analyze(eng, text: str, formats: tuple[str, ...], ops: tuple[str, ...], max_tokens: int):
    """sensitivity.analyze with its progress on stderr, and what it measures said once it starts
    measuring (said up front, it also showed for a result read from the cache)."""
    from .sensitivity import analyze, forward_passes

    n = forward_passes(eng.config.n_layers, ops, formats, ("int8",))
    used = min(max_tokens, eng.n_ctx, len(eng.tokenize(text)))   # as analyze() takes them
    prog, said = Progress(), []

    def progress(done: int, total: int) -> None:
        if not said:
            typer.echo(f"measuring sensitivities: {n} forward passes of {used} tokens (cached afterwards)", err=True)
            said.append(True)
        prog("analyzing", done, total)

    return analyze(eng, text, formats=formats, ops=ops, max_tokens=max_tokens, progress=progress)


def write_output(path: Path, flag: str, data: bytes) -> None:
    """An output file written whole or not at all (a failed write used to leave a good file
    truncated, or a new one empty), its failure one line naming the flag and the path."""
    from .errors import ConfigError
    from .fileio import write_atomic

    from .fileio import os_error_text

    try:
        write_atomic(path, data, mode=0o644)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write it: {os_error_text(e)}") from None


def home_check() -> None:
    """EDGELLM_HOME must be a folder where it exists (a regular file there read as an empty cache)."""
    from .errors import ConfigError
    from .model.registry import edgellm_home

    home = edgellm_home()
    if home.exists() and not home.is_dir():
        raise ConfigError(f"EDGELLM_HOME {home}: is not a folder")


def cache_check(flag: str = "") -> None:
    """EDGELLM_HOME/cache must be a folder where it exists: a file there read as an empty cache,
    and a session then failed with 'File exists'."""
    from .errors import ConfigError
    from .kv.disk_cache import cache_dir

    d = cache_dir()
    if d.is_symlink() and not d.is_dir():   # (exists() is False for a dangling link or a loop)
        raise ConfigError(f"{flag}EDGELLM_HOME/cache {d}: is a link that leads to no folder")
    if d.exists() and not d.is_dir():
        raise ConfigError(f"{flag}EDGELLM_HOME/cache {d}: is not a folder")


def _stop_probe_child() -> None:
    # a command that fails before its load used the OpenCL probe child it started: stop it
    from .backends import opencl_child

    opencl_child.discard()


def _model_given(arg: str | None, opt: str | None) -> str | None:
    """MODEL or -m/--model (`info` and `quantize` take both: `info -m NAME` was 'No such option'),
    not two different ones."""
    from .errors import ConfigError

    if arg is not None and opt is not None and arg != opt:
        raise ConfigError(f"two models given: {arg} and --model {opt}; give one")
    return opt if opt is not None else arg


def _resolved(model: str | None):
    """(path, opened ModelFile) of MODEL, pulled with its progress shown if it is not here yet:
    for the commands that read the model's header before (or instead of) loading it."""
    from .model.loader import open_model
    from .model.registry import resolve_model

    path = str(resolve_model(model, progress=_pull_progress()))
    return path, open_model(path)


def _pull_progress():
    """A download's progress(done, total), throttled by one Progress (a new one per call printed
    every call without a terminal: 200 lines for 200 calls)."""
    prog = Progress()
    return lambda done, total: prog("pull", done, total)


class Progress:
    """A one-line progress report on stderr (rewritten in place on a terminal)."""

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.last = {}

    # the stages that take minutes: without a terminal they still report, in 25% steps (an analysis
    # said nothing for two minutes in a log)
    SLOW = ("pull", "analyzing", "requantizing")

    def __call__(self, stage: str, done: int, total: int) -> None:
        pct = int(100 * done / total) if total else 100
        # without a terminal (logs, CI): the slow stages in 25% steps, the fast local ones not at all
        if not self.tty and (stage not in self.SLOW or (self.last.get(stage, -100) + 25 > pct and done < total)):
            return
        self.last[stage] = pct
        label = {"pull": "downloading model", "prepare": "preparing weights"}.get(stage, stage)
        # (done is the pull's share in GGUF bytes, not bytes received: the size said is the total)
        size = f" of {total / 2**20:.0f} MiB" if stage == "pull" else ""
        end = "\n" if done >= total or not self.tty else ""
        sys.stderr.write(f"\r{label}: {pct:3d}%{size}" + end)
        sys.stderr.flush()


def _start_probe_child() -> None:
    """The OpenCL probe child, started before the runtime is imported (backends/opencl_child.py);
    a command that fails before its load took the child's answer stops it (friendly)."""
    from .backends import opencl_child

    opencl_child.spawn()


def _load(model, ctx, threads, kv="pool", kv_precision=None, window=None, sinks=None, device=None, units=None,
          precision=None, quality_guard=False):
    from . import load   # starts the OpenCL probe child before importing the runtime
    from .errors import ConfigError

    # options that do nothing with the other KV layout are said to (they were taken silently;
    # --window 8 --sinks 9 with --kv pool, invalid on a ring, ran with exit 0)
    # (said here in the options' own names; load() is then not given them, and says nothing)
    if kv != "ring" and (window is not None or sinks is not None):
        typer.echo("edgellm: warning: --window and --sinks size a --kv ring; with --kv pool they are ignored", err=True)
        window = sinks = None
    if kv == "ring" and ctx is not None:
        typer.echo("edgellm: warning: --ctx does not size a --kv ring (its --window does); with --kv ring it is "
                   "ignored", err=True)
        ctx = None
    unit_list = _units(units)

    try:
        eng = load(model, device, n_ctx=ctx, threads=threads, kv=kv, kv_precision=kv_precision, window=window,
                   sinks=sinks, units=unit_list, precision=precision, quality_guard=quality_guard,
                   progress=Progress())
    except ConfigError as e:
        if not str(e).startswith("not enough memory"):
            raise
        raise ConfigError(_memory_advice_in_flags(str(e), kv, window)) from None
    for w in eng.plan.warnings:
        if w not in _logged:
            typer.echo(f"edgellm: warning: {w}", err=True)
    if quality_guard:   # its switches are INFO records, which no handler showed: --quality-guard said nothing
        _show_log("edgellm.quality_guard")
    return eng


def _memory_advice_in_flags(msg: str, kv: str, window: int) -> str:
    """The API's memory refusal with the flags the user typed for its parameters: a ring is sized
    by --window ("lower n_ctx" sent them to --ctx, which a ring ignores)."""
    flag = "--window" if kv == "ring" else "--ctx"
    msg = re.sub(r"at window=(\d+) \(kv='ring'\)", r"at --window \1", msg)
    msg = re.sub(r"at n_ctx=(\d+)", f"at --window {window}" if kv == "ring" else r"at --ctx \1", msg)
    msg = msg.replace("lower n_ctx", f"lower {flag}").replace("lower window", "lower --window")
    return msg.replace("kv_precision='int8'", "--kv-precision int8")


def _show_log(name: str) -> None:
    import logging

    lg = logging.getLogger(name)
    if not any(getattr(h, "_edgellm_cli", False) for h in lg.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("edgellm: %(message)s"))
        h._edgellm_cli = True
        lg.addHandler(h)
        lg.setLevel(logging.INFO)
        lg.propagate = False   # (its warnings would print again through main's handler)


def _units(text: str | None) -> list[str] | None:
    """--units as a list, checked before the model is resolved (a bad name waited for a download)."""
    from .backends import names
    from .errors import ConfigError

    if text is None:
        return None
    units = [u.strip() for u in text.split(",") if u.strip()]
    if not units:   # ("," meant no restriction at all)
        raise ConfigError(f"--units {text!r} names no unit (units: {', '.join(names())})")
    bad = [u for u in units if u not in names()]
    if bad:
        raise ConfigError(f"--units: unknown unit(s) {', '.join(bad)} (known: {', '.join(names())})")
    if len(set(units)) != len(units):
        raise ConfigError(f"--units {text}: lists a unit twice")
    return units


PRECISION_HELP = ("Precision plan: quality, balanced, fast (edgellm/precision_presets) or a plan YAML "
                  "(`edgellm precision plan` writes one); default: the file's weights, each unit's own precision")
GUARD_HELP = ("Quality guard: a decode step with next-token entropy > 4 nats or top-1 p < 0.1 switches the "
              "next 16 steps to fp32 compute (the quality plan's), logged")
DEVICE_HELP = ("Device profile the dispatcher plans with: host (default: measured by `edgellm profile`, else "
               "estimated), a shipped name (exynos2100, tensor-g1, rk3588, raspberry-pi-5) or a YAML path")
UNITS_HELP = ("Restrict placement to these units, in preference order, e.g. opencl,neon (units: neon, opencl, "
              "npu, reference); an op none of them runs goes to reference with a warning")


def _conversation_only(path: Path, chat: bool) -> dict:
    """The conversation a session file holds when its KV cannot be used here (another KV
    precision or layout, model or context; the warning said which): its chat messages or text,
    from the header, to be prefilled again. A run that ignored them saved over the file and the
    conversation was lost. {} when the header cannot be read or holds none."""
    from .kv.session_file import SessionFileError, read_header

    try:
        h = read_header(path, whole=False)   # (a file cut short in its data keeps its header)
    except SessionFileError as e:
        _keep_aside(path, e)
        return {}
    return _conversation_in(h.meta if h is not None else {})


def _keep_aside(path: Path, why) -> None:
    """A session file whose header cannot be read (damaged, or a newer format) is renamed aside,
    not replaced: the run's save wrote over it, and the conversation it held was gone (a probe:
    7 turns lost to one flipped header byte, or to a newer edgellm's file after a downgrade). An
    empty file is a new session, as before."""
    from .errors import ConfigError

    try:
        if os.stat(path).st_size == 0:
            return
    except OSError:
        return
    stamp = f".unreadable-{time.strftime('%Y%m%d-%H%M%S')}"
    from .fileio import cut_name

    # (the rename failed past 228 bytes, silently, and the save overwrote the file)
    name = cut_name(path.name, 240 - len(stamp), 200)
    aside, n = path.with_name(name + stamp), 1
    while os.path.lexists(aside):   # (two in one second: the second rename replaced the first)
        aside, n = path.with_name(f"{name}{stamp}-{n}"), n + 1
    try:
        os.rename(path, aside)
    except OSError as e:
        raise ConfigError(f"{path} cannot be read ({getattr(why, 'reason', why)}) and could not be kept aside "
                          f"({e.strerror or e}): move it away, or give another --session") from None
    typer.echo(f"edgellm: warning: {path} cannot be read ({getattr(why, 'reason', why)}): kept as {aside.name}; "
               f"this run starts a new conversation", err=True)


def _conversation_in(meta: dict) -> dict:
    """The chat messages or the text a session's meta holds, checked; {} when it holds neither
    (or something else under their names: an int "text" was a TypeError traceback in `run`, a
    list of ints as "messages" an AttributeError in `chat`)."""
    from .errors import ConfigError
    from .model.chat_template import ChatTemplate

    if "messages" in meta:
        try:
            ChatTemplate.check_messages(meta["messages"])
        except ConfigError:
            return {}
        return {"messages": list(meta["messages"])}
    return {"text": meta["text"]} if isinstance(meta.get("text"), str) else {}


def _open_session(eng, name: str | None, chat: bool) -> tuple[Path | None, dict, tuple | None]:
    """(the session file, the conversation it holds, its state as read) for --session NAME: a
    session file carries the conversation so far (chat messages or plain text) beside its KV."""
    from .errors import ConfigError
    from .kv.session_file import FOREIGN, foreign_file

    if name is None:
        return None, {}, None
    session = _session_path(eng, name)
    check_out_path(session, "--session")
    why = foreign_file(session)
    entry = not _is_session_file(name)   # a cache entry: edgellm's folder, edgellm's name
    if why is not None and not (why == FOREIGN and entry):   # (a user's document given by mistake: kept)
        raise ConfigError(f"--session {session}: {why}")
    _hold_session(session)   # (until the command ends: another run on it waits for this one)
    if foreign_file(session) == FOREIGN and entry:
        # an entry damaged in its magic is kept aside, as one damaged in its header: it was an
        # error for good ("is not an edgellm session file"), until the user found and removed it
        _keep_aside(session, FOREIGN)
    # taken before the load: a save by another writer during it (an app's engine, or a run that
    # could take no lock) then warns at this run's save (at worst needlessly, when the load read
    # the new file); taken after, a save that landed after the load's read was replaced silently
    seen = file_state(session)
    if eng.load_session(session):
        saved = _conversation_in(eng.session_meta)
        n = eng.session_meta.get("n_tokens")
        if not saved:
            typer.echo(f"edgellm: warning: {session} holds no readable conversation beside its KV; starting a "
                       f"new one", err=True)
        elif isinstance(n, int) and not isinstance(n, bool):
            saved["n_tokens"] = n
    else:
        saved = _conversation_only(session, chat)
        if seen is not None and file_state(session) is None:
            seen = None   # (kept aside: the save writes a new file, and says nothing of a change)
    if "messages" in saved and not chat:
        raise ConfigError(f"--session {session} holds a chat: continue it with --chat")
    if "text" in saved and chat:
        raise ConfigError(f"--session {session} holds plain text: continue it with `edgellm run` without --chat")
    if saved.get("n_tokens"):
        typer.echo(f"[session: continuing {saved['n_tokens']} cached tokens from {session}]", err=True)
    elif saved:
        typer.echo(f"[session: continuing the conversation in {session}; its KV is recomputed]", err=True)
    return session, saved, seen


_session_locks: list = []   # the session locks this command holds (released when it ends)


def _hold_session(session: Path) -> None:
    """One run at a time on a session (kv.session_lock): waits, saying so, for a run holding it."""
    from .kv import session_lock

    def waiting(pid: int | None) -> None:
        who = f"another edgellm run (pid {pid})" if pid else "another edgellm run"
        typer.echo(f"[session: {session} is in use by {who}; waiting for it to end (Ctrl-C to stop)]", err=True)

    lock, why = session_lock.hold(session, waiting)
    if lock is None:
        typer.echo(f"edgellm: warning: cannot lock {session} against other runs ({why}); runs on it at once "
                   f"are not serialized", err=True)
    else:
        _session_locks.append(lock)


def _release_session_locks() -> None:
    while _session_locks:
        _session_locks.pop().release()


def _save_session(eng, session: Path, meta: dict, seen: tuple | None) -> tuple | None:
    """Saves the conversation (warning when another run saved to the file since it was read);
    returns the file's new state."""
    now = file_state(session)
    if now is None and seen is not None:   # (`cache clear`, or rm: not "another run saved to it")
        typer.echo(f"edgellm: warning: {session} was removed since this run read it; this conversation is "
                   f"saved there again", err=True)
    elif now != seen:   # (two runs on one session: the last save wins, silently before)
        typer.echo(f"edgellm: warning: {session} changed since this run read it (another run saved to it); "
                   f"this conversation replaces that one", err=True)
    n = eng.save_session(session, meta=meta)
    typer.echo(f"[session: saved {n} tokens to {session}]", err=True)
    return file_state(session)


def _is_session_file(name: str) -> bool:
    return "/" in name or name.endswith(".edgesess")


def check_session_arg(name: str | None) -> None:
    """--session's own checks, made before the model is resolved (a bad name waited for a download,
    and a file at EDGELLM_HOME/cache failed with 'File exists' after the load)."""
    from .errors import ConfigError
    from .kv import disk_cache

    if name is None:
        return
    if _is_session_file(name):
        check_out_path(name, "--session")   # (the string: Path() drops a trailing '/')
        return
    try:
        disk_cache.entry_path("0" * 16, name)   # (validates the name; the model's hash comes later)
    except ValueError:
        raise ConfigError(f"--session {name!r}: a session name is 1 to 128 letters, digits, '_' or '-'; a file "
                          f"is a path ({_shown('./' + name)}) or ends in .edgesess") from None
    cache_check(f"--session {name}: ")


def _session_path(eng, name: str) -> Path:
    """A bare name is an entry of the on-disk cache (per model); anything path-like is a file."""
    from .kv import disk_cache

    from .errors import ConfigError

    if _is_session_file(name):
        # a link is followed for the save too: the save replaced the link with a file, and its
        # target kept the old conversation (a probe)
        return Path(os.path.realpath(name)) if os.path.islink(name) else Path(name)
    check_session_arg(name)
    disk_cache.cache_dir(create=True)
    path = disk_cache.entry_path(eng.model_sha256(), name)
    if path.is_symlink():   # (`cache list` calls such an entry invalid: the cache follows no link)
        raise ConfigError(f"--session {name}: {path} is a link; the on-disk cache follows no links (remove it, "
                          f"or give a file path to --session)")
    return path


KV_HELP = "KV cache: 'pool' (blocks + prefix cache, n_ctx tokens) or 'ring' (sliding window + sinks, endless chat)"


@app.command()
@friendly
def run(
    prompt: str = typer.Argument(..., help="Prompt text"),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Tokens to generate at most"),
    temperature: float = typer.Option(0.8, help="Sampling temperature; 0 = greedy"),
    top_k: int = typer.Option(40, help="Keep the k most likely tokens; 0 = off"),
    top_p: float = typer.Option(0.95, help="Nucleus sampling mass; 1 = off, 0 = the most probable token"),
    min_p: float = typer.Option(0.05, help="Drop tokens below min_p x the top probability; 0 = off"),
    repeat_penalty: float = typer.Option(1.0, help="Penalty for repeated tokens; 1 = off"),
    seed: Optional[int] = typer.Option(None, help="Random seed for reproducible sampling"),
    stop: Optional[List[str]] = typer.Option(None, "--stop", help="Stop string (repeatable); not printed"),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template"),
    ctx: Optional[int] = typer.Option(None, "--ctx", help="Context size in tokens (KV cache capacity; default "
                                      "2048, or the model's trained context when shorter)"),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help="Compute threads (default: one per big core this process may use)"),
    stats: bool = typer.Option(True, "--stats/--no-stats", help="Print timing statistics to stderr"),
    session: Optional[str] = typer.Option(None, "--session", help="Continue the conversation saved under this "
                                          "name (in the cache, see `edgellm cache`) or in this file (a path), when "
                                          "it matches the model, and save it back afterwards"),
    kv: str = typer.Option("pool", "--kv", help=KV_HELP),
    kv_precision: Optional[str] = typer.Option(None, "--kv-precision", help="KV storage: f16, f32, or int8 "
                                               "(pool or ring); default: the precision plan's, else f16"),
    window: Optional[int] = typer.Option(None, help="--kv ring: window in tokens, sinks included (default 1024)"),
    sinks: Optional[int] = typer.Option(None, help="--kv ring: attention-sink tokens kept forever (default 4)"),
    device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
    units: Optional[str] = typer.Option(None, "--units", help=UNITS_HELP),
    precision: Optional[str] = typer.Option(None, "--precision", help=PRECISION_HELP),
    quality_guard: bool = typer.Option(False, "--quality-guard/--no-quality-guard", help=GUARD_HELP),
):
    """Generate text from a prompt, streamed to stdout."""
    _start_probe_child()
    from .api import generation_config
    from .errors import ConfigError

    prompt = _utf8_arg("the prompt", prompt)
    stop = [_utf8_arg("--stop", s) for s in stop or ()]
    gen = generation_config(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, repeat_penalty=repeat_penalty, seed=seed, stop=tuple(stop or ()))
    if not prompt:   # (with --chat the template's text around it was taken as a prompt)
        raise ConfigError("the prompt is empty: give some text")
    if session is not None and kv == "ring":   # (refused at save time before: after the whole answer)
        raise ConfigError("--session needs --kv pool: the ring buffer keeps no sessions")
    check_session_arg(session)
    eng = _load(model, ctx, threads, kv, kv_precision, window, sinks, device, units,  # after validating the options
                precision, quality_guard)
    session, saved, seen = _open_session(eng, session, chat)
    if session is not None:   # (as it is now: a file kept aside is not this run's doing)
        interrupted.will_write("--session", session)
    if chat:
        messages = list(saved.get("messages", [])) + [{"role": "user", "content": prompt}]
        text = eng.render_chat(messages)
    else:
        text = saved.get("text", "") + prompt
    # a chat goes through chat_stream: a template that writes BOS itself then gets one (through
    # stream() the model's add_bos made it two: Llama 3, Mistral, Gemma, DeepSeek)
    pieces = eng.chat_stream(messages, config=gen) if chat else eng.stream(text, config=gen)
    previous = signal.signal(signal.SIGINT, lambda *_: eng.cancel())
    answer = []
    try:
        for piece in pieces:
            answer.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    finally:
        signal.signal(signal.SIGINT, previous)
    sys.stdout.write("\n")
    if session is not None and eng.last_stats.stop_reason not in ("cancelled", ""):
        meta = ({"messages": messages + [{"role": "assistant", "content": "".join(answer)}]} if chat
                else {"text": text + "".join(answer)})
        from .interrupts import deferred

        # a Ctrl-C or SIGTERM during the save waits for its end (a few ms; the file is whole
        # either way, being renamed into place): then the command ends with one line saying the
        # session was saved, not "Exception ignored in ..." from a handler run mid-teardown
        with deferred():
            _save_session(eng, session, meta, seen)
    if stats:
        typer.echo(f"[load {eng.load_ms:.0f} ms] {eng.last_stats.summary()}", err=True)
    if eng.last_stats.stop_reason == "cancelled":
        _say_interrupted(signal.SIGINT, "the answer above is cut")
        raise typer.Exit(130)   # Ctrl-C: the shell's convention
    if eng.last_stats.stop_reason == "context_full":
        # said even with --no-stats, and exit 1 as chat's: a script took the cut answer as whole
        typer.echo(f"edgellm: warning: the answer was cut: the context is full at {eng.n_ctx} tokens; raise "
                   f"--ctx or use --kv ring", err=True)
        raise typer.Exit(1)


@app.command()
@friendly
def chat(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt"),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Tokens per answer at most"),
    temperature: float = typer.Option(0.8, help="Sampling temperature; 0 = greedy"),
    top_k: int = typer.Option(40, help="Keep the k most likely tokens; 0 = off"),
    top_p: float = typer.Option(0.95, help="Nucleus sampling mass; 1 = off, 0 = the most probable token"),
    min_p: float = typer.Option(0.05, help="Drop tokens below min_p x the top probability; 0 = off"),
    repeat_penalty: float = typer.Option(1.0, help="Penalty for repeated tokens; 1 = off"),
    seed: Optional[int] = typer.Option(None, help="Random seed"),
    stop: Optional[List[str]] = typer.Option(None, "--stop", help="Stop string (repeatable); ends the answer, "
                                             "not printed"),
    ctx: Optional[int] = typer.Option(None, "--ctx", help="Context size in tokens (default 2048, or the "
                                      "model's trained context when shorter)"),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help="Compute threads"),
    stats: bool = typer.Option(False, "--stats/--no-stats", help="Print statistics after each answer"),
    kv: str = typer.Option("pool", "--kv", help=KV_HELP),
    kv_precision: Optional[str] = typer.Option(None, "--kv-precision", help="KV storage: f16, f32, or int8 "
                                               "(pool or ring); default: the precision plan's, else f16"),
    window: Optional[int] = typer.Option(None, help="--kv ring: window in tokens, sinks included (default 1024)"),
    sinks: Optional[int] = typer.Option(None, help="--kv ring: attention-sink tokens kept forever (default 4)"),
    device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
    units: Optional[str] = typer.Option(None, "--units", help=UNITS_HELP),
    precision: Optional[str] = typer.Option(None, "--precision", help=PRECISION_HELP),
    quality_guard: bool = typer.Option(False, "--quality-guard/--no-quality-guard", help=GUARD_HELP),
    session: Optional[str] = typer.Option(None, "--session", help="Continue the conversation saved under this "
                                          "name or .edgesess file, and save it after every answer (--kv pool)"),
):
    """Interactive chat. Ctrl-C stops the current answer; Ctrl-D or /exit quits; /reset forgets.
    Earlier turns stay in the KV cache, so each answer starts after computing only the new turn."""
    _start_probe_child()
    from .api import generation_config

    stop = [_utf8_arg("--stop", s) for s in stop or ()]
    system = _utf8_arg("--system", system) if system is not None else None
    # (the same sampling options and defaults as `run`: a chat sampled without min_p before)
    gen = generation_config(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, repeat_penalty=repeat_penalty, seed=seed, stop=tuple(stop))
    from .errors import ConfigError

    if sys.stdin is None:   # (started with <&-: an AttributeError traceback)
        raise ConfigError("stdin is closed: chat reads its turns from stdin")
    if session is not None and kv == "ring":
        raise ConfigError("--session needs --kv pool: the ring buffer keeps no sessions")
    check_session_arg(session)
    eng = _load(model, ctx, threads, kv, kv_precision, window, sinks, device, units, precision, quality_guard)
    session, saved, seen = _open_session(eng, session, chat=True)
    messages = [{"role": "system", "content": system}] if system else []
    if saved.get("messages"):   # the saved conversation goes on; its own system turn, if any, stays
        if system and saved["messages"][0] != messages[0]:
            _note("edgellm: warning: --system is ignored: the session's conversation goes on as it was")
        messages = list(saved["messages"])
    # what /reset keeps: the system turn, --system's or the session's own (messages[:1] kept a
    # session's first user turn, or dropped its system prompt)
    system_turn = messages[:1] if messages and messages[0].get("role") == "system" else []
    if system:   # a template without a system role (Gemma, Mistral v1) refused every turn, /reset too
        first = eng.tokenize(eng.render_chat(system_turn + [{"role": "user", "content": "hello"}]))
        if kv == "pool" and len(first) >= eng.n_ctx:
            # (every turn failed, advising a /reset that keeps the system prompt)
            raise ConfigError(f"--system takes {len(first)} tokens with a one-word turn, and the context holds "
                              f"{eng.n_ctx}: shorten it or raise --ctx")
    _note(f"edgellm chat with {eng.config.name} — Ctrl-C stops an answer, Ctrl-D or /exit quits, /reset "
          f"clears, /help")
    tty, failed = sys.stdin.isatty(), 0
    while True:
        try:
            if tty:   # (the prompt on stderr: stdout carries the answers alone, for a pipe)
                _note_raw("> ")
            line = _read_line()
        except EOFError:
            _note("")
            if failed:
                raise typer.Exit(1)   # (a script feeding the chat learns that turns failed)
            return
        except KeyboardInterrupt:     # at the prompt (or just after an answer): not a quit
            _note("\n(Ctrl-D or /exit quits)")
            continue
        except UnicodeDecodeError as e:
            enc = "UTF-8" if codecs.lookup(e.encoding).name == "utf-8" else e.encoding
            _err(f"that line is not valid {enc}; it was skipped")
            failed += 1
            continue
        except LineTooLong as e:
            _err(str(e))
            failed += 1
            continue
        command = line.strip()
        # a line that starts with a /word is a command, whatever its case or what follows it
        # ("/EXIT", "/exit now" went to the model as turns); " /word" (a space first) is a turn
        if re.match(r"/[A-Za-z]*(\s|$)", line):
            if command.lower() != command.split()[0].lower() or command.lower() not in (
                    "/exit", "/quit", "/reset", "/help"):
                _err(f"unknown command {shown(command, 40)}: /reset, /exit, /quit, /help (no arguments; "
                     f"a turn that starts with a / word: put a space before it)")
                continue
            command = command.lower()
            if command in ("/exit", "/quit"):
                if failed:
                    raise typer.Exit(1)   # (as at Ctrl-D)
                return
            if command == "/reset":
                messages = list(system_turn)
                removed = False
                if session is not None:   # (the cleared state is the session's, even if no answer follows)
                    try:
                        session.unlink(missing_ok=True)
                        removed, seen = True, None
                    except OSError as e:   # (a read-only disk ended the chat, blaming only the path)
                        _err(f"/reset: {session} could not be removed ({e.strerror or e}); the conversation is "
                             f"cleared here, and the next answer's save replaces the file if it can")
                _note("[conversation cleared]" + (f"; {session} removed until the next answer" if removed else ""))
            elif command == "/help":
                _note("/reset forgets the conversation (the system prompt stays), /exit or /quit (or Ctrl-D) "
                      "quits; Ctrl-C stops an answer")
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": line})
        previous = signal.signal(signal.SIGINT, lambda *_: eng.cancel())
        answer = []
        try:
            for piece in eng.chat_stream(messages, config=gen):
                answer.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except EdgeLLMError as e:
            full = isinstance(e, ContextFull) and kv == "pool"
            _err(f"{e}" + ("; /reset starts the conversation over, and --kv ring keeps a chat going past the "
                           "context" if full else ""))
            messages.pop()
            failed += 1
            continue
        finally:
            signal.signal(signal.SIGINT, previous)
        sys.stdout.write("\n")
        if eng.last_stats.stop_reason == "cancelled":
            _note("[cancelled]")
        elif eng.last_stats.stop_reason == "context_full":
            _note(f"[context full at {eng.n_ctx} tokens: the answer was cut; /reset starts over, --kv ring "
                  f"keeps a chat going past the context]")
            failed += 1   # (a cut answer is a failed turn: exit 1, as the README says)
        messages.append({"role": "assistant", "content": "".join(answer)})
        if session is not None and eng.last_stats.stop_reason != "cancelled":
            # Ctrl-C just after an answer is not a quit (see _read_line): during the save it is
            # ignored (it ended the chat, the turn unsaved); a failed save (a full disk) is a failed
            # turn, not the end of the chat
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                seen = _save_session(eng, session, {"messages": messages}, seen)
            except (EdgeLLMError, OSError) as e:
                _err(f"{e}; the conversation goes on here, unsaved")
                failed += 1
            finally:
                signal.signal(signal.SIGINT, previous)
        if stats:
            _note(eng.last_stats.summary())


MAX_LINE_BYTES = 2 ** 20   # a chat turn read from stdin: `chat < /dev/zero` grew without limit


def _note_raw(text: str) -> None:
    """text on stderr without a newline (the tty prompt), best effort as _note."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except OSError:
        pass


MAX_SKIP_BYTES = 64 * 2 ** 20   # what is read past a too long line to find its end, at most


class LineTooLong(Exception):
    """A line of stdin over MAX_LINE_BYTES, read to its end and dropped: the chat skips it."""


def _turn_length(raw: bytes | str) -> int:
    """A line's length without its LF or CRLF."""
    nl, cr = (b"\n", b"\r") if isinstance(raw, bytes) else ("\n", "\r")
    if not raw.endswith(nl):
        return len(raw)
    return len(raw) - (2 if raw[:-1].endswith(cr) else 1)


def _readline_capped() -> bytes | str:
    """stdin's next line. One longer than MAX_LINE_BYTES is read to its end and dropped
    (LineTooLong: the chat goes on with the next line; it ended the chat, the lines after it
    unanswered); one with no end within MAX_SKIP_BYTES more (`chat < /dev/zero`) ends the chat."""
    from .errors import ConfigError

    stream = sys.stdin.buffer if hasattr(sys.stdin, "buffer") else sys.stdin
    newline = b"\n" if stream is not sys.stdin else "\n"
    too_long = LineTooLong(f"a line of stdin is longer than {MAX_LINE_BYTES // 2**20} MiB, chat's limit for a "
                           f"turn; it was skipped")
    try:
        raw = stream.readline(MAX_LINE_BYTES + 2)   # (the limit is the turn's: a CRLF line gets it too)
        if raw.endswith(newline) or len(raw) < MAX_LINE_BYTES + 2:   # the whole line, or the last one
            if _turn_length(raw) > MAX_LINE_BYTES:
                raise too_long
            return raw
        skipped = 0
        while skipped < MAX_SKIP_BYTES:
            rest = stream.readline(2 ** 20)
            if not rest or rest.endswith(newline):
                raise too_long
            skipped += len(rest)
    except OSError as e:   # (0>/dev/null: stdin open for writing only, "[Errno 9] Bad file descriptor")
        raise ConfigError(f"stdin cannot be read ({e.strerror or e}): chat reads its turns from stdin") from None
    raise ConfigError(f"a line of stdin is longer than {MAX_LINE_BYTES // 2**20} MiB, chat's limit for a turn, and "
                      f"has no end in the {MAX_SKIP_BYTES // 2**20} MiB after it: is stdin a text?")


def _read_line() -> str:
    """A line of stdin, without its newline; EOFError at the end. It waits in select() on stdin
    and a signal wakeup pipe, so a Ctrl-C is answered whenever it comes: one that landed between
    Python's last signal check and input()'s read() was noticed only after the next key."""
    import select

    if not hasattr(signal, "set_wakeup_fd") or not sys.stdin.isatty():
        # (a pipe: its lines may sit in Python's buffer, which select() does not see.) A Ctrl-C
        # here only says how to quit, as at a terminal's prompt; as a KeyboardInterrupt it could
        # land just after readline() returned and drop the line the app had sent (1 in 3 when
        # the line followed the Ctrl-C at once)
        previous = signal.signal(signal.SIGINT, lambda *_: _note("\n(Ctrl-D or /exit quits)"))
        try:
            return _decode_line(_readline_capped())
        finally:
            signal.signal(signal.SIGINT, previous)
    r, w = os.pipe()
    os.set_blocking(w, False)
    old = signal.set_wakeup_fd(w)
    try:
        while True:
            ready, _, _ = select.select([sys.stdin, r], [], [])
            if r in ready:
                os.read(r, 512)    # a signal: its Python handler runs at the next bytecode
                continue
            return _decode_line(_readline_capped())
    finally:
        signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)


def _utf8_arg(what: str, text: str) -> str:
    """An argument as text. Python decodes argv with the locale's encoding and keeps bytes it
    cannot decode as lone surrogates: under an ASCII locale (LC_ALL=C without UTF-8 mode) valid
    UTF-8 such as an emoji came out so, and was refused as "not valid UTF-8"; its bytes are read
    as UTF-8 here. Bytes that are not UTF-8 either are refused by name (they failed later with the
    API's advice about a position in the rendered template, and a --stop of such bytes could
    never match)."""
    from .errors import ConfigError

    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as e:
        try:
            return os.fsencode(text).decode("utf-8")
        except (UnicodeError, ValueError):
            bad = text[e.start].encode("utf-8", "surrogateescape")
            raise ConfigError(f"{what} is not valid UTF-8 (byte 0x{bad.hex()} at character {e.start + 1})") from None


def _decode_line(raw) -> str:
    """One line read as bytes, decoded alone: a line that is not valid text in stdin's encoding
    raises UnicodeDecodeError for itself only. (Read as text, one bad byte under a strict
    decoder lost the whole buffered chunk, and the next read looked like the end: every line
    piped after it went unanswered.)"""
    if not raw:
        raise EOFError
    if isinstance(raw, bytes):
        enc = getattr(sys.stdin, "encoding", None) or "utf-8"
        # ASCII (PYTHONIOENCODING=ascii, a C locale without UTF-8 mode) is read as UTF-8, its
        # superset: valid UTF-8 input was refused there
        raw = raw.decode("utf-8" if codecs.lookup(enc).name == "ascii" else enc)
    # a CRLF line (a Windows file, a serial console) kept its '\r' in the turn and the session
    return raw[:-2] if raw.endswith("\r\n") else raw[:-1] if raw.endswith("\n") else raw


def _memory_text(mf, n_ctx: int) -> str:
    """What load() adds to the mapped file: the KV cache, and weights that depend on the unit.
    The neon unit reads the quantized matrices in place (only the norm vectors are copied); the
    fp32 reference unit, where it runs everything, holds a dequantized copy."""
    from .api import memory_needed
    from .backends import neon, reference

    from .kquant_repack import conversions, copy_growth

    kv = memory_needed(mf, n_ctx, placement={})
    mib = 2 ** 20
    text = (f"{kv / mib:.0f} MiB KV cache (f16) beside the mapped file ({mf.file_size / mib:.1f} MiB); weights "
            f"add {neon.prepared_nbytes(mf.config) / mib:.1f} MiB on the neon unit (read in place, quantized), "
            f"{reference.prepared_nbytes(mf.config) / mib:.0f} MiB of fp32 copies where the reference unit runs "
            f"every op")
    grows, conv = copy_growth(mf)
    if conv:   # (load() runs them from a copy of the file: that copy is what is mapped)
        text += (f"; its {len(conv)} tensors in types no unit computes with run from a copy of the file "
                 f"({conversions(mf.gguf.tensors, conv)}), {(mf.file_size + grows) / mib:.1f} MiB mapped in its "
                 f"place (written once to EDGELLM_HOME/cache/precision/models)")
    return text


@app.command()
@friendly
def info(model: Optional[str] = typer.Argument(None, help="GGUF file path or registry name (default: smollm2-135m; "
                                               "info never downloads: `edgellm pull` does)"),
         ctx: Optional[int] = typer.Option(None, "--ctx", help="Context size for the memory estimate (default "
                                           "2048, or the model's trained context when shorter)"),
         model_opt: Optional[str] = typer.Option(None, "--model", "-m", help="The model, as the other commands "
                                                 "name it (or give it as MODEL)")):
    """Architecture, hyperparameters, tensor types, file size and memory needed."""
    from .api import DEFAULT_CTX
    from .errors import ConfigError
    from .model.loader import open_model
    from .model.registry import resolve_model

    model = _model_given(model, model_opt)
    if ctx is not None and ctx < 1:
        raise ConfigError(f"--ctx must be >= 1, got {ctx}")
    mf = open_model(resolve_model(model, pull_if_missing=False))
    c = mf.config
    n_ctx = min(ctx if ctx is not None else DEFAULT_CTX, c.context_length)
    if ctx is not None and ctx > c.context_length:   # (as run and plan say it)
        typer.echo(f"edgellm: warning: --ctx {ctx} is above {c.name}'s trained context: using {n_ctx}", err=True)
    rows = [
        ("file", mf.path), ("name", c.name), ("architecture", c.arch),
        ("layers", c.n_layers), ("width", c.d_model), ("ffn width", c.d_ff),
        ("heads (q / kv)", f"{c.n_heads} / {c.n_kv_heads}"), ("head dim", c.head_dim),
        ("vocabulary", c.vocab_size), ("trained context", c.context_length),
        ("rope", f"{c.rope_style}, theta {c.rope_theta:g}, dims {c.rope_dim}"
                 + (f", YaRN scaling x{1 / c.rope_freq_scale:g} from a {c.rope_yarn.n_ctx_orig}-token context"
                    if c.rope_yarn is not None else
                    f", linear scaling x{1 / c.rope_freq_scale:g}" if c.rope_freq_scale != 1.0 else "")),
        ("rms eps", f"{c.norm_eps:g}"),
        ("tied embeddings", c.tied_embeddings), ("qkv bias", c.qkv_bias),
        ("tensor types", ", ".join(f"{k} x{v}" for k, v in sorted(mf.tensor_type_counts.items()))),
        ("file size", f"{mf.file_size / 2**20:.1f} MiB"),
        (f"memory at ctx {n_ctx}", _memory_text(mf, n_ctx)),
    ]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        typer.echo(f"{k:<{w}}  {v}")


@app.command()
@friendly
def pull(name: str = typer.Argument("smollm2-135m", help="Registry name of the model"),
         force: bool = typer.Option(False, "--force", help="Download again even when cached")):
    """Download a model from the registry into the user cache (EDGELLM_HOME)."""
    from .model.registry import model_path, pull as do_pull

    try:
        interrupted.will_write("the model", model_path(name))
    except EdgeLLMError:
        pass   # (an unknown name: pull says so)
    prog = Progress()
    path = do_pull(name, force=force, progress=lambda d, t: prog("pull", d, t))
    typer.echo(str(path))


@app.command()
@friendly
def bench(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    prompt_tokens: str = typer.Option("128,512,1024", help="Comma-separated prompt lengths in tokens"),
    gen_tokens: int = typer.Option(64, help="Tokens generated per run (EOS ignored)"),
    runs: int = typer.Option(5, help="Measured runs per prompt length (after one warm-up)"),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help="Compute threads"),
    json_path: Optional[str] = typer.Option(None, "--json", metavar="PATH", help="Write the records as JSON here"),
    concurrent: bool = typer.Option(False, "--concurrent", help="Also measure a short request arriving during "
                                    "a long prefill: interleaved vs queued (long = the largest --prompt-tokens)"),
    short_tokens: Optional[int] = typer.Option(None, help="--concurrent: prompt tokens of the short request "
                                               "(default 32)"),
    shared_prefix: int = typer.Option(0, "--shared-prefix", metavar="N", help="Measure prompts that share an "
                                      "N-token system prefix: cold TTFT vs TTFT with the prefix cached "
                                      "(--prompt-tokens are then the lengths of the user message after it; the "
                                      "prefix, the longest message and --gen-tokens must fit the model's context). "
                                      "0: no shared prefix"),
    delay_ms: Optional[float] = typer.Option(None, help="--concurrent: the short request arrives this long after "
                                             "the long one (default 50)"),
    device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP + ". The runs are timed on this "
                                         "machine, whichever profile plans them: another device's is said to be one"),
    units: Optional[str] = typer.Option(None, "--units", help=UNITS_HELP),
    precision: Optional[str] = typer.Option(None, "--precision", help=PRECISION_HELP),
    floor: bool = typer.Option(True, "--floor/--no-floor", help="Report decode time against the memory floor: "
                               "weight bytes per token / read bandwidth, probed (as `edgellm profile --quick` "
                               "does) before and after each length's runs; ~3 s per probe"),
):
    """Measure TTFT (median, p95), prefill and decode tok/s, peak RSS, decode vs its memory floor."""
    t_start = time.perf_counter()   # (the cold start's clock: before the runtime is imported)
    _start_probe_child()
    from . import bench as b
    from .errors import ConfigError

    items = prompt_tokens.split(",")
    if not prompt_tokens.strip():
        raise ConfigError("--prompt-tokens names no length: give comma-separated token counts, e.g. 128,512")
    try:   # (an empty item, "32,,64", was dropped without a word)
        lengths = [int(x) for x in items]
    except ValueError:
        raise ConfigError(f"--prompt-tokens must be comma-separated integers, got {prompt_tokens!r}") from None
    if min(lengths) < 1:
        raise ConfigError(f"--prompt-tokens must be >= 1 each, got {prompt_tokens!r}")
    for flag, value in (("--runs", runs), ("--gen-tokens", gen_tokens)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if not concurrent and (short_tokens is not None or delay_ms is not None):
        typer.echo("edgellm: warning: --short-tokens and --delay-ms shape the --concurrent run; without it they "
                   "are ignored", err=True)
    short_tokens = 32 if short_tokens is None else short_tokens
    delay_ms = 50.0 if delay_ms is None else delay_ms
    if shared_prefix < 0:
        raise ConfigError("--shared-prefix must be >= 0")
    if concurrent and short_tokens < 1:
        raise ConfigError(f"--short-tokens must be >= 1, got {short_tokens}")
    if concurrent and not (math.isfinite(delay_ms) and delay_ms >= 0):
        raise ConfigError(f"--delay-ms must be a finite number >= 0, got {delay_ms}")
    if concurrent and short_tokens >= max(lengths):
        # (a 4000-token "short" request after a 16-token "long" one ran for 46 s and reported a ratio)
        raise ConfigError(f"--short-tokens ({short_tokens}) must be fewer than the long request's --prompt-tokens "
                          f"({max(lengths)}): --concurrent measures a short request arriving during a long prefill")
    json_path = check_out_path(json_path, "--json", replaces=BENCH_JSON)
    need = max(lengths) + shared_prefix + gen_tokens + 32 + (short_tokens + gen_tokens + 16 if concurrent else 0)
    from .api import device_profile
    from .precision import load_plan

    # checked before the model is resolved (it may download), as load() checks them
    _units(units)
    device_profile(device)
    if precision is not None:
        load_plan(precision)
    # only the header's config is kept: the opened ModelFile (its tokenizer and metadata, ~3.3
    # MiB) held for the whole bench sat in the RSS after load and every run's peak beside the
    # engine's own copy
    model, mf = _resolved(model)
    cfg = mf.config
    del mf
    if need > cfg.context_length:
        # (before the load: after it, a warning that n_ctx is above the trained context came first;
        # after the first runs, it advised a --ctx bench has not)
        raise ConfigError(_context_short(cfg, need, {"--shared-prefix": shared_prefix, "--prompt-tokens": max(lengths),
                                                     "--gen-tokens": gen_tokens,
                                                     "--short-tokens": short_tokens if concurrent else 0}))
    eng = _load(model, min(max(2048, need), cfg.context_length), threads, device=device, units=units,
                precision=precision)
    eng.wait_loaded()   # the weights' paging-in belongs to load: its RSS, not the first run's TTFT
    # the cold start an app sees: importing the runtime, the device profile, the model, its
    # weights paged in (load_ms, the engine's own figure, starts after the first two)
    load_wall_ms = (time.perf_counter() - t_start) * 1e3
    plan_name = eng.precision_plan.name if eng.precision_plan is not None else "none"
    from .device.host import another_machine, machine_name
    # a profile of another device plans this machine as if it were that one: the figures are
    # still this machine's (--device rk3588 printed "profile rk3588" and an x86 host's timings)
    other = another_machine(eng.profile)
    typer.echo(f"model {eng.config.name}, threads {eng.threads}, load {eng.load_ms:.0f} ms, profile "
               f"{eng.profile.name}{' (ANOTHER DEVICE)' if other else ''}, units {','.join(eng.plan.units_used())}, "
               f"chunk {eng.plan.chunk.tokens}, precision plan {plan_name}", err=True)
    if other:
        typer.echo(f"  the profile {eng.profile.name} describes {eng.profile.soc}, not this machine ({other}): the "
                   f"figures below are this machine's ({machine_name()}), run on the plan made for that device, "
                   f"not a measure of it", err=True)
    if shared_prefix:
        recs = b.run_shared_prefix(
            eng, shared_prefix, lengths, gen_tokens, runs,
            on_run=lambda n, r, m: typer.echo(f"  {shared_prefix}+{n} tok run {r + 1}/{runs}: TTFT cold "
                                              f"{m['ttft_ms']:.0f} ms, cached {m['ttft_ms_cached']:.0f} ms "
                                              f"({m['cached']} tokens cached)", err=True))
    else:
        from .bench_floor import read_bandwidth_gbs
        recs = b.run(eng, lengths, gen_tokens, runs,
                     on_run=lambda n, r, m: typer.echo(f"  {n} tok run {r + 1}/{runs}: TTFT {m['ttft_ms']:.0f} ms, "
                                                       f"decode {m['decode_tps']:.1f} tok/s", err=True),
                     bandwidth=read_bandwidth_gbs if floor else None)
    typer.echo(f"{'prompt':>7} {'TTFT p50':>9} {'p95':>8} {'prefill':>9} {'decode':>8} {'peak RSS':>9}")
    for r in recs:
        typer.echo(f"{r['prompt_tokens']:>7} {r['ttft_ms_p50']:>7.0f}ms {r['ttft_ms_p95']:>6.0f}ms "
                   f"{r['prefill_tps']:>5.0f}t/s {r['decode_tps']:>5.1f}t/s {r['peak_rss_mb']:>6.0f} MiB")
    for r in recs:
        r["load_wall_ms"] = round(load_wall_ms, 1)
        r["profile"], r["profile_of_this_machine"] = eng.profile.name, other is None
    m = recs[0]
    if "first_request_ttft_ms" in m:
        typer.echo(f"cold start: load {load_wall_ms:.0f} ms (runtime import, profile, model, weights paged in; "
                   f"the engine's own load {m['load_ms']:.0f} ms), then the first request's TTFT "
                   f"{m['first_request_ttft_ms']:.0f} ms ({m['first_request_tokens']} tokens)")
    parts = (f" (model file {m['rss_model_mapped_mb']:.1f} MiB mapped, KV cache {m['kv_cache_mb']:.1f} MiB, "
             f"the rest {m['rss_runtime_mb']:.1f} MiB)" if "rss_model_mapped_mb" in m else "")
    peak = max(m["rss_load_peak_mb"], *(r["peak_rss_mb"] for r in recs))   # (each length's own, and load's)
    over = f"; the peak is {peak - m['rss_bound_mb']:.1f} MiB OVER the bound" if peak > m["rss_bound_mb"] else ""
    typer.echo(f"memory: peak RSS {peak:.1f} MiB, {m['rss_after_load_mb']:.0f} MiB "
               f"right after load{parts}; bound 1.5 x {m['model_file_mb']:.1f} MiB file + {m['kv_cache_mb']:.1f} MiB "
               f"KV cache = {m['rss_bound_mb']:.1f} MiB{over}")
    for r in recs:
        if r.get("decode_vs_floor") is not None:
            bws = " and ".join(f"{x:.1f}" if x else "-" for x in r["read_bandwidth_gbs"])
            typer.echo(f"decode at {r['prompt_tokens']}: {r['decode_ms_per_token']:.2f} ms/token = "
                       f"{r['decode_vs_floor']:.2f}x the memory floor of {r['decode_floor_ms']:.2f} ms "
                       f"({r['decode_weight_mb']:.1f} MB of weights + {r.get('decode_kv_mb', 0):.1f} MB of KV cache per "
                       f"token at the mean of {bws} GB/s, measured before and after the runs)"
                       + ("; under 1: the probe read slower than decode streamed (a busy machine's memory, "
                          "or numpy's sgemv where the neon library is missing)" if r["decode_vs_floor"] < 1 else ""))
        elif "decode_weight_mb" in r:
            why = ("no decode step to compare: --gen-tokens 1 produces its one token from the prefill"
                   if r.get("decode_tps") == 0 and any(r.get("read_bandwidth_gbs") or ()) else
                   "no memory floor (the bandwidth probe failed)")
            typer.echo(f"decode at {r['prompt_tokens']}: {why}")
    for r in recs if other is None else ():
        if "predicted_ttft_ms" not in r:
            continue
        cached = (f"; cached prefix: TTFT {r['predicted_ttft_ms_cached']:.1f} ms (measured "
                  f"{r['ttft_ms_p50_cached']:.1f})" if "predicted_ttft_ms_cached" in r else "")
        typer.echo(f"plan's prediction at {r['prompt_tokens']}: TTFT {r['predicted_ttft_ms']:.1f} ms (measured "
                   f"{r['ttft_ms_p50']:.1f}), decode {r['predicted_decode_tps']:.0f} tok/s (measured "
                   f"{r['decode_tps']:.0f}){cached}")
    if shared_prefix:
        for r in recs:
            typer.echo(f"shared prefix: {r['cached_prefix_tokens']} of {r['prompt_tokens']} tokens cached: TTFT "
                       f"{r['ttft_ms_p50_cached']:.0f} ms vs {r['ttft_ms_p50']:.0f} ms cold "
                       f"(ratio {r['cached_ttft_ratio']:.3f}) right after warm(); the next request on the "
                       f"prefix: {r['cached_prefix_tokens_next']} cached, {r['ttft_ms_p50_cached_next']:.0f} ms "
                       f"(ratio {r['cached_ttft_ratio_next']:.3f})")
    if concurrent:
        c = b.run_concurrent(eng, max(lengths), short_tokens, delay_ms, gen_tokens, runs,
                             on_run=lambda p, r, m: typer.echo(f"  concurrent {p} run {r + 1}/{runs}: short TTFT "
                                                               f"{m['short_ttft_ms']:.0f} ms", err=True))
        typer.echo(f"concurrent: {c['short_prompt_tokens']}-token request {c['delay_ms']:.0f} ms after a "
                   f"{c['long_prompt_tokens']}-token prefill: TTFT {c['short_ttft_ms_p50_interleaved']:.0f} ms "
                   f"interleaved vs {c['short_ttft_ms_p50_queued']:.0f} ms queued (ratio {c['short_ttft_ratio']:.2f})")
        if c["long_ttft_ms_p50_queued"] <= c["delay_ms"]:
            # (the long prefill ended before the short request came: the ratio measured no
            # interleaving, and read as if it had, 1.02 for a 64-token "long" prompt: a probe)
            typer.echo(f"edgellm: warning: the {c['long_prompt_tokens']}-token prefill took "
                       f"{c['long_ttft_ms_p50_queued']:.0f} ms, no longer than the {c['delay_ms']:.0f} ms delay: the "
                       f"requests did not overlap and the ratio measures no interleaving (a longer --prompt-tokens, "
                       f"or a shorter --delay-ms)", err=True)
        c["profile"], c["profile_of_this_machine"] = eng.profile.name, other is None
        recs.append(c)
    if json_path:
        write_output(json_path, "--json", (json.dumps(recs, indent=2) + "\n").encode())


@app.command()
@friendly
def plan(
    device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    prompt_tokens: Optional[int] = typer.Option(None, "--prompt-tokens", help="Prompt length the TTFT prediction "
                                                "is for (default: 512, or the model's trained context if shorter)"),
    ctx: Optional[int] = typer.Option(None, "--ctx", help="Context size in tokens (default 2048, or the model's "
                                      "trained context when shorter)"),
    units: Optional[str] = typer.Option(None, "--units", help=UNITS_HELP),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help="Compute threads the CPU units' figures "
                                          "are scaled to (default: for the host, one per big core this process "
                                          "may use, as `run`; for another device, all its big cores)"),
    kv: str = typer.Option("pool", "--kv", help=KV_HELP),
    kv_precision: Optional[str] = typer.Option(None, "--kv-precision", help="KV storage: f16, f32, or int8; "
                                               "default: the precision plan's, else f16"),
    window: Optional[int] = typer.Option(None, help="--kv ring: window in tokens, sinks included (default 1024); "
                                         "a ring's prefill chunk is at most half of what it leaves the chunk"),
    sinks: Optional[int] = typer.Option(None, help="--kv ring: attention-sink tokens kept forever (default 4)"),
    precision: Optional[str] = typer.Option(None, "--precision", help=PRECISION_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as one JSON object"),
    plot_path: Optional[str] = typer.Option(None, "--plot", metavar="PATH", help="Draw each unit's roofline with "
                                            "the ops as points into this .png, .pdf or .svg file (needs "
                                            "matplotlib: edgellm\\[plot])"),
):
    """Show where each op runs per phase, why, and the predicted TTFT and decode speed.

    For the host (the default) units are probed; for another device the units its profile
    describes are assumed present, so the plan is a prediction for that device."""
    from . import plan_report
    from .api import DEFAULT_CTX, _ring_chunk_cap, device_profile, memory_needed, ring_chunk_why
    from .dispatch import Dispatcher
    from .errors import ConfigError
    from .kv.store import KVConfig
    from .ops import layer_ops, model_ops, weight_formats

    from .precision import load_plan
    from .precision_runtime import ComputeTable, planned_formats

    plot_path = check_out_path(plot_path, "--plot", (".png", ".pdf", ".svg"), replaces=PLOT_FILE)
    # the values known up front, checked before the model is resolved (and perhaps downloaded)
    if prompt_tokens is not None and prompt_tokens < 1:
        raise ConfigError(f"--prompt-tokens must be >= 1, got {prompt_tokens}")
    if ctx is not None and ctx < 1:
        raise ConfigError(f"--ctx must be >= 1, got {ctx}")
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    host = device in (None, "host")
    threads_given = threads
    if threads is None and host:   # as load() counts them, so the plan is the one `run` gets
        from .device.topology import detect_clusters, select_big
        threads = len(select_big(detect_clusters()))
    unit_list = _units(units)
    pplan = load_plan(precision) if precision is not None else None
    if kv != "ring" and (window is not None or sinks is not None):
        typer.echo(f"edgellm: warning: --window and --sinks size --kv ring; with --kv {kv} they are ignored", err=True)
    if kv == "ring" and ctx is not None:   # (as load() ignores n_ctx for a ring: the plan is run's)
        typer.echo("edgellm: warning: --ctx does not size --kv ring (its --window does): ignored", err=True)
        ctx = None
    kv_cfg = KVConfig(kind=kv, precision=kv_precision or (pplan.kv_precision if pplan else "f16"),   # validates them
                      window=1024 if window is None else window, sinks=4 if sinks is None else sinks)
    profile = device_profile(device)
    if host:   # the figures this process's threads are planned from, said as `run` says it
        from .api import _warn_if_measured_elsewhere
        from .device.topology import current_affinity
        _warn_if_measured_elsewhere(profile, current_affinity())
    mf = _resolved(model)[1]
    formats, compute = weight_formats(mf), None
    if pplan is not None:
        pplan.check_model(mf.config.n_layers)
        formats, compute = planned_formats(mf, pplan), ComputeTable(pplan, mf.config.n_layers)
    trained = mf.config.context_length
    n_ctx = ctx if ctx is not None else min(DEFAULT_CTX, trained)
    if n_ctx > trained:   # as load() caps it, so the plan is the one `run` gets
        typer.echo(f"edgellm: warning: --ctx {n_ctx} is above {mf.config.name}'s trained context: using "
                   f"{trained}", err=True)
        n_ctx = trained
    # `run` refuses a prompt that fills the context (no position is left for the first token):
    # the default leaves one, and a longer one is refused here too
    if prompt_tokens is None:
        prompt_tokens = max(1, min(512, n_ctx - 1))
    if prompt_tokens >= n_ctx:
        why = "`run` would refuse the prompt (ContextFull: it must leave a position for the first token)"
        if prompt_tokens >= trained:
            raise ConfigError(f"--prompt-tokens {prompt_tokens} does not fit {mf.config.name}'s trained context of "
                              f"{trained} tokens: {why}; shorten the prompt")
        raise ConfigError(f"--prompt-tokens {prompt_tokens} does not fit --ctx {n_ctx}"
                          f"{'' if ctx is not None else ' (the default)'}: {why}; raise --ctx or shorten the prompt")
    from .costmodel import big_cpu

    n_big = sum(len(c.cores) for c in big_cpu(profile))
    if threads_given is not None and threads_given > n_big:
        # (the cost model uses at most the big cores: -t 1000 gave -t 2's figures without a word.
        # Only a -t given is named: a profile made under taskset lists fewer cores than the host)
        typer.echo(f"edgellm: warning: -t {threads}: {profile.name} has {n_big} big core(s); the CPU units' "
                   f"figures are for {n_big} threads", err=True)
    disp = Dispatcher(profile, mf.config, formats, probe=host, override=unit_list, kv_bytes=kv_cfg.bytes_per_elem,
                      compute=compute, threads=threads)
    # an app may use about half of the device's memory; the chunk may take a quarter of what the model leaves
    spare = profile.memory_total_bytes / 2 - memory_needed(mf, n_ctx, kv_cfg)
    p = disp.plan(prompt_tokens=prompt_tokens, n_ctx=n_ctx, memory_budget=max(spare / 4, 16 * 2**20))
    ring_cap = _ring_chunk_cap(kv_cfg, None)
    if ring_cap and p.chunk.tokens > ring_cap:   # as load() caps it (the plan showed a chunk a ring never runs)
        p = disp.plan(prompt_tokens=prompt_tokens, n_ctx=n_ctx, chunk=ring_cap, chunk_why=ring_chunk_why(kv_cfg),
                      memory_budget=max(spare / 4, 16 * 2**20))
    # what this plan takes: the mapped file, the units' own weights and the KV cache (counted as
    # all-fp32 reference weights, SmolLM2 read 558 MiB where a run peaks at 191)
    from .kquant_repack import copy_growth

    need = mf.file_size + copy_growth(mf)[0] + memory_needed(mf, n_ctx, kv_cfg, p.placement())
    if need > profile.memory_total_bytes / 2:
        # (a profile with 64 MiB of memory got a full TTFT prediction for a 140 MiB load)
        typer.echo(f"edgellm: warning: {mf.config.name} with a {n_ctx}-token context needs about "
                   f"{need / 2**20:.0f} MiB, more than half of {profile.name}'s memory "
                   f"({profile.memory_total_bytes / 2**20:.0f} MiB), the share an app can count on: "
                   f"this plan may not load there (lower --ctx, or a smaller model)", err=True)
    if as_json:
        typer.echo(json.dumps({"model": mf.config.name, "soc": profile.soc, "threads": min(threads or n_big, n_big),
                               "precision_plan": pplan.name if pplan else None, **p.to_json()}, indent=1))
    else:
        ops = {o.name: o for o in (*layer_ops(mf.config), *model_ops(mf.config))}
        if pplan is not None:
            typer.echo(f"precision plan: {pplan.name} ({pplan.description}); KV {kv_cfg.precision}")
        typer.echo(plan_report.render(p, model_name=mf.config.name, soc=profile.soc, ops_by_name=ops))
    if plot_path is not None:
        plan_report.plot(p, str(plot_path), title=f"{mf.config.name} on {profile.name} ({profile.soc})")
        typer.echo(f"roofline plot written to {plot_path}", err=True)


@app.command()
@friendly
def profile(
    out: Optional[str] = typer.Option(None, "--out", metavar="PATH", help="Write the profile here (default: "
                                       "EDGELLM_HOME/profiles/host.yaml, which `--device host` reads)"),
    quick: bool = typer.Option(False, "--quick", help="Fewer shapes and runs: a rougher profile in less time"),
):
    """Measure this machine: pinned GEMM throughput per CPU cluster and precision, memory read
    bandwidth, and each available unit's GEMM throughput by rows and per-call overhead."""
    from .device.probes import gemm_peak_share, measure_host

    out = check_out_path(out, "--out", (".yaml", ".yml"), replaces=PROFILE_FILE)
    if out is None:   # the default in EDGELLM_HOME, checked before the minute of measuring too
        from .device.profile_yaml import user_profiles_dir
        from .errors import ConfigError

        folder = user_profiles_dir()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            # (a file or a dangling link there said "File exists")
            why = "it is not a folder" if os.path.lexists(folder) and not folder.is_dir() else e.strerror or e
            raise ConfigError(f"cannot make {folder} for the profile: {why}; set --out or "
                              f"EDGELLM_HOME") from None
        # a hand-written host.yaml there is the user's: replaced silently before (--out refused it)
        check_out_path(folder / "host.yaml", "the profile's default path", replaces=PROFILE_FILE)
    tty = sys.stderr.isatty()

    def prog(stage: str, done: int, total: int) -> None:
        # one line rewritten in place on a terminal; one line per step in a log
        line = f"profiling: {int(100 * done / total) if total else 100:3d}% {stage}"
        sys.stderr.write(f"\r{line[:78]:<78}" + ("\n" if done >= total else "") if tty else line + "\n")
        sys.stderr.flush()

    from .device.probes import ProfileNotWritten
    from .errors import ConfigError

    try:
        result = measure_host(out, quick=quick, progress=prog)
    except ProfileNotWritten as e:
        # (a full disk lost the whole measurement: the error named no file, and printed nothing)
        typer.echo(e.text, nl=False)
        raise ConfigError(f"{e}; the measured profile is printed above: save it as a .yaml file, or run "
                          f"again with --out on another disk") from None
    m = result.profile.measured
    typer.echo(f"memory read bandwidth {m.memory_read_bandwidth / 1e9:.1f} GB/s")
    for name, figs in m.clusters.items():
        typer.echo(f"cluster {name}: " + ", ".join(f"{p} {f / 1e9:.1f} G{'OPS' if p.startswith('int') else 'FLOPS'}"
                                                   for p, f in figs.items()))
    for c in result.profile.clusters:
        typer.echo(f"cluster {c.name}: peak per core " + ", ".join(
            f"{p} {f / 1e9:.0f} G{'OPS' if p.startswith('int') else 'FLOPS'}" for p, f in c.peak_per_core.items()))
    for name, u in m.units.items():
        curve = ", ".join(f"{g.m}:{g.flops / 1e9:.3g}" for g in u.gemm)   # (.0f showed a 1-row GEMV as 0)
        attn = "".join(f", attention GFLOPS by (tokens after cached) "
                       + ", ".join(f"{a.tokens}@{a.context}:{a.flops / 1e9:.1f}" for a in u.attention)
                       for _ in [0] if u.attention)
        typer.echo(f"unit {name}: {u.threads} threads, call overhead {u.call_overhead_s * 1e6:.1f} us, "
                   f"GEMM GFLOPS by rows {curve}{attn}")
        share = gemm_peak_share(result.profile, name, u)
        if share:
            typer.echo(f"unit {name}: {share}")
    for note in result.notes:
        typer.echo(f"note: {note}", err=True)
    use = "host" if out is None else result.path
    typer.echo(f"profile written to {result.path} in {result.seconds:.1f} s (use --device {use})", err=True)


@app.command()
@friendly
def build(
    target: str = typer.Option("aarch64-linux-gnu", "--target", help="aarch64-linux-gnu (gcc-aarch64-linux-gnu, "
                               "else zig cc from the ziglang package) or aarch64-linux-android (ANDROID_NDK_HOME)"),
    cpu: Optional[str] = typer.Option(None, "--cpu", help="Tune for this core, e.g. cortex-a78 (the dotprod "
                                      "variant is built for it; the base variant stays plain Armv8.0)"),
    out: Optional[Path] = typer.Option(None, "--out", help="Bundle folder (default ./edgellm-bundle-TARGET): a new "
                                       "or empty folder, or an earlier bundle, which is replaced whole; the folder "
                                       "it goes in must exist and be writable (checked before compiling)"),
    api: Optional[int] = typer.Option(None, "--api", help="Android API level for the NDK compiler (default 28)"),
):
    """Cross-compile the NEON kernel library and its self-test for a device: a bundle with
    libedgellm_neon_{base,dotprod}.so, selftest_{base,dotprod}, selftest_cases.bin and bundle.json
    (target, CPU features, compiler and version, source hash). On the device, run
    `./selftest_dotprod selftest_cases.bin`, then point EDGELLM_NEON_LIB at the library."""
    from .toolchain import build_bundle, stop_on_sigterm

    if out is not None:   # (its missing parents were made, where every other --out refuses them)
        check_out_folder(out.expanduser().parent, "--out", out)
    if out is not None or not target.endswith("android"):   # (the NDK's default name adds the API level)
        interrupted.will_write("--out", out.expanduser() if out is not None else Path(f"edgellm-bundle-{target}"))

    with stop_on_sigterm():
        path = build_bundle(target, cpu, out, api=api, progress=lambda msg: typer.echo(msg, err=True))
    typer.echo(str(path))


@app.command()
@friendly
def quantize(
    model: Optional[str] = typer.Argument(None, help=MODEL_HELP),
    plan: str = typer.Option(..., "--plan", help="Precision plan: a preset (quality, balanced, fast) or a "
                             "plan YAML (schema: edgellm/precision_presets/README.md)"),
    out: str = typer.Option(..., "-o", "--out", metavar="PATH", help="The GGUF file to write (a new file, "
                            "unless --force)"),
    force: bool = typer.Option(False, "--force", help="Replace --out if it exists (never the source model)"),
    model_opt: Optional[str] = typer.Option(None, "--model", "-m", help="The model, as the other commands name it "
                                            "(or give it as MODEL)"),
):
    """Write a copy of MODEL whose weights are in the formats the precision PLAN names, as a GGUF
    that llama.cpp and the gguf package read. Formats GGUF has no type for are written as the
    nearest GGUF block type (int8 per channel -> Q8_0, int4 groups -> Q4_0), and said so. Prints
    each conversion's SQNR and the file size predicted from the plan beside the size written."""
    from .errors import ConfigError

    from .precision import load_plan
    from .requant import format_report, plan_formats, requantize_gguf

    model = _model_given(model, model_opt)
    # an existing file is someone's: a user's text or another model was replaced without a word
    out = check_out_path(out, "--out", replaces=None if force else (lambda head: False, "a file to replace "
                                                                    "(pass --force to replace it)"))
    if not force and out.is_symlink() and not out.exists():   # (a link to nothing is someone's too)
        raise ConfigError(f"--out {out}: is a link to a missing file; give another path, or pass --force to "
                          "replace the link")
    try:   # (before the model is resolved: a bad --plan waited for a download)
        p = load_plan(plan)
    except ConfigError as e:
        raise ConfigError(f"--plan {plan}: {e}") from None
    src, mf = _resolved(model)
    n = mf.config.n_layers
    formats = plan_formats(mf, lambda layer, op: p.weight_format(layer, op, n))
    prog = Progress()
    # (without --force, a file made at OUT during the write is not replaced either)
    report = requantize_gguf(src, out, formats, progress=lambda d, t: prog("requantizing", d, t), replace=force)
    typer.echo(format_report(report))


precision_app = typer.Typer(help="Per-layer mixed precision: measure sensitivities, search a plan under a KL budget "
                            "(use a plan with --precision; write its weights with edgellm quantize --plan).",
                            no_args_is_help=True)
app.add_typer(precision_app, name="precision")


@precision_app.command("analyze")
@friendly
def precision_analyze(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    calib: str = typer.Option("builtin", "--calib", help="Calibration text: builtin (English prose and code "
                              "written for edgellm) or a UTF-8 file"),
    formats: str = typer.Option("q8_0,int8,q4_0,int4-32", "--formats", help="Candidate weight formats, comma-separated"),
    ops: str = typer.Option("qkv,attn_out,ffn_gate_up,ffn_down,lm_head", "--ops", help="Ops to measure"),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Calibration tokens per forward pass"),
    top: int = typer.Option(10, "--top", help="Print the N most sensitive entries"),
    json_out: Optional[str] = typer.Option(None, "--json", metavar="PATH", help="Write every entry as JSON here"),
):
    """Quantize one layer's op at a time to each candidate format (and its input activations to
    int8) and measure the mean KL of the next-token distribution against the unquantized model on
    calibration text. One forward pass per (layer, op, format); cached per model and settings."""
    from .calibration import load_calibration
    from .errors import ConfigError

    if top < 0:
        raise ConfigError(f"--top must be >= 0, got {top}")
    json_out = check_out_path(json_out, "--json", replaces=ANALYSIS_JSON)
    fmts = tuple(f.strip() for f in formats.split(",") if f.strip())
    op_list = tuple(o.strip() for o in ops.split(",") if o.strip())
    _check_analysis_args(fmts, op_list, max_tokens)
    text = load_calibration(calib)
    res = _analyze(_calibration_engine(model, max_tokens, text), text, fmts, op_list, max_tokens)
    if res.from_cache:
        typer.echo(f"{len(res.entries)} entries over {res.n_tokens} tokens, read from the cache (measured with "
                   f"{res.forward_passes} forward passes in {res.seconds:.1f} s)")
    else:
        typer.echo(f"{len(res.entries)} entries over {res.n_tokens} tokens, {res.forward_passes} forward passes "
                   f"in {res.seconds:.1f} s")
    for e in res.ranked("weights")[:top]:
        layer = "head" if e.layer is None else f"blk.{e.layer}"
        typer.echo(f"  {layer:>8} {e.op:12} {e.format:8} KL {e.kl:.3e}  SQNR {e.sqnr_db:.1f} dB")
    for sk in res.skipped:
        typer.echo(f"  skipped: {'head' if sk.layer is None else f'blk.{sk.layer}'} {sk.op} {sk.format}: {sk.reason}")
    if json_out:
        write_output(json_out, "--json", res.to_json().encode())


cache_app = typer.Typer(help="The on-disk caches in EDGELLM_HOME/cache: saved sessions (list, info, clear), and "
                        "with info / clear --all the requantized models, sensitivity tables and compiled kernels.",
                        no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@cache_app.command("list")
@friendly
def cache_list():
    """One line per cached session: tokens, size, model, layout; invalid files with the reason."""
    from .kv import disk_cache

    cache_check()
    entries = disk_cache.list_entries()
    if not entries:
        typer.echo(f"(empty: {disk_cache.cache_dir()})")
    for e in entries:
        what = (f"{e.n_tokens:>6} tok  {e.size / 2**20:7.1f} MiB  {_shown(e.model_name or e.model_short)}  "
                f"{_shown(e.kv_layout)}" if e.valid else f"invalid: {_shown(e.reason)}")
        typer.echo(f"{_shown(e.path.name)}  {what}")


def _shown(text) -> str:
    """A file name or header string on one line: a newline in an entry's name split it in two."""
    text = str(text)
    return text if text.isprintable() else repr(text)


@cache_app.command("info")
@friendly
def cache_info():
    """Directory, entry count and total size; the other caches' sizes, and the npu caches' cap."""
    from .backends import npu_cache
    from .kv import disk_cache

    cache_check()
    cap = npu_cache.cap_bytes()      # a bad EDGELLM_NPU_CACHE_MB: the error alone, before any line
    for k, v in disk_cache.info().items():
        typer.echo(f"{k:<12} {v}")
    # the other caches beside the sessions (`cache clear --all` removes them too)
    for d in _other_caches():
        files = [f for f in _walk(d) if not f.is_dir() or f.is_symlink()]
        size = sum(_lsize(f) for f in files)
        typer.echo(f"{d.name + '/':<12} {len(files)} file(s), {size / 2**20:.1f} MiB")
    # the npu graph caches are bounded, each folder on its own (backends/npu_cache.py): use vs cap
    for d, suffix in npu_cache.folders():
        u = npu_cache.usage(d, suffix)
        typer.echo(f"{'npu/' + d.name + '/':<12} {u.files} file(s), {u.bytes / 2**20:.1f} MiB of a "
                   f"{cap / 2**20:g} MiB cap ({npu_cache.CAP_ENV})")


def _lsize(p: Path) -> int:
    try:
        return p.lstat().st_size   # (a link's own size: what it points to is not the cache's)
    except OSError:
        return 0


def _walk(d: Path) -> list[Path]:
    """Everything under folder d, deepest first (a folder after its contents). Links are entries
    themselves, never followed: a link to a folder outside EDGELLM_HOME had its files counted by
    `cache info` and removed by `cache clear --all`."""
    out, todo = [], [d]
    while todo:
        try:
            with os.scandir(todo.pop()) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue   # (gone meanwhile, or unreadable: skipped, as Path.rglob did)
        for e in entries:
            out.append(Path(e.path))
            if e.is_dir(follow_symlinks=False):
                todo.append(Path(e.path))
    return sorted(out, key=lambda p: -len(p.parts))


# the folders edgellm writes in EDGELLM_HOME/cache beside the sessions (precision_runtime,
# sensitivity, opencl_runtime, npu_onnx/npu_tflite): any other folder there is not ours. With
# EDGELLM_HOME at a folder whose cache/ other programs use (/var, /data/local/tmp), every folder
# was taken for a cache: `clear --all` removed apt's and fontconfig's files (a probe)
_OWN_CACHES = ("npu", "opencl", "precision")


def _other_caches() -> list[Path]:
    """The folders of EDGELLM_HOME/cache that hold no sessions: requantized models and
    sensitivity tables (precision/), OpenCL program binaries (opencl/), NPU graphs (npu/). A
    link there is no cache of ours (it may point anywhere): left alone, as is any other folder."""
    from .kv import disk_cache

    root = disk_cache.cache_dir()
    return [p for p in (root / n for n in _OWN_CACHES) if p.is_dir() and not p.is_symlink()]


@cache_app.command("clear")
@friendly
def cache_clear(everything: bool = typer.Option(False, "--all", help="Also remove the requantized models, "
                                                "sensitivity tables and compiled kernels (rebuilt when needed)")):
    """Remove every cached session file (with --all, every cache in EDGELLM_HOME/cache)."""
    from .kv import disk_cache

    cache_check()
    in_use: list = []
    typer.echo(f"removed {disk_cache.clear(in_use=in_use)} session file(s) from {disk_cache.cache_dir()}")
    for f in in_use:
        typer.echo(f"kept {f.name}: a running edgellm run or chat holds it (it would save it again)")
    from .kv import session_lock
    session_lock.remove_unheld()   # (the sessions' lock files no run holds: made again when needed)
    failed: list[str] = []
    if everything:
        from .fileio import remove_if_writer_dead

        for d in _other_caches():
            n = kept = 0
            for f in _walk(d):               # files, then their folders
                folder = f.is_dir() and not f.is_symlink()   # (a link is unlinked, its target kept)
                try:
                    if folder:
                        f.rmdir()            # (one a writer still uses is not empty: left)
                        continue
                    # (a dead writer's temp file is removed under its lock: a writer taking the
                    # name meanwhile makes another)
                    alive = remove_if_writer_dead(f)
                    if alive:
                        kept += 1            # another process is writing it: its run would fail
                        continue
                    if alive is None:        # (no temp name, or one that cannot be judged)
                        f.unlink()
                    n += 1
                except FileNotFoundError:
                    pass                     # (another clear took it)
                except OSError as e:         # (a read-only home: "removed 0 files", exit 0, before)
                    if not folder:
                        failed.append(f"{f}: {e.strerror or e}")
            try:
                d.rmdir()
            except OSError:
                pass
            typer.echo(f"removed {n} file(s) from {d}" + (f"; kept {kept} being written" if kept else ""))
    if failed:
        from .errors import ConfigError
        raise ConfigError(f"could not remove {len(failed)} file(s), e.g. {failed[0]}")




@precision_app.command("plan")
@friendly
def precision_plan(
    device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
    budget_kl: float = typer.Option(0.02, "--budget-kl", help="Summed measured KL the plan may add against the "
                                    "quality plan (nats, mean over calibration positions)"),
    objective: str = typer.Option("ttft", "--objective", help="What to minimise: ttft (prefill) or decode"),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    calib: str = typer.Option("builtin", "--calib", help="Calibration text: builtin or a UTF-8 file"),
    formats: str = typer.Option("q4_0", "--formats", help="Candidate weight formats, comma-separated (each "
                                "measured once per layer and op by the sensitivity analysis, then cached)"),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Calibration tokens per forward pass"),
    prompt_tokens: int = typer.Option(512, "--prompt-tokens", help="Prompt length TTFT is predicted for "
                                      "(decode: the context length)"),
    out: Optional[str] = typer.Option(None, "--out", "-o", metavar="PATH", help="Plan YAML to write (default: "
                                       "EDGELLM_HOME/plans/<model>-<device>-<objective>-kl<budget>.yaml)"),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Measure the plan's KL end to end on this "
                                "machine (the objective's phase, teacher-forced on the calibration text)"),
):
    """Choose per layer and op the weight format and compute precision that minimise the device's
    predicted TTFT (or decode time) while the summed measured KL stays within the budget; write
    the plan, and print predicted vs verified KL and the predicted speed-up over `quality`."""
    import edgellm

    from .api import device_profile
    from .calibration import load_calibration
    from .dispatch import Dispatcher
    from .errors import ConfigError
    from .kv.store import KVConfig
    from .model.registry import edgellm_home
    from .ops import weight_formats
    from .precision import dump_plan, load_plan
    from .precision_runtime import ComputeTable, planned_formats
    from .precision_search import SEARCH_OPS, op_times, search, teacher_forced_logits, mean_kl

    if objective not in ("ttft", "decode"):
        raise ConfigError(f"--objective must be ttft or decode, got {objective!r}")
    if not (math.isfinite(budget_kl) and budget_kl > 0):   # (checked again by search, after minutes of analysis)
        raise ConfigError(f"--budget-kl must be a positive number of nats, got {budget_kl}")
    if prompt_tokens < 1:
        raise ConfigError(f"--prompt-tokens must be >= 1, got {prompt_tokens}")
    out = check_out_path(out, "--out", (".yaml", ".yml"), replaces=PLAN_FILE)
    fmts = tuple(f.strip() for f in formats.split(",") if f.strip())
    _check_analysis_args(fmts, SEARCH_OPS, max_tokens)
    profile = device_profile(device)      # a bad name is refused now, not after minutes of analysis
    text = load_calibration(calib)
    ref = _calibration_engine(model, max_tokens, text)
    mf, cfg = ref.model, ref.config
    sens = _analyze(ref, text, fmts, SEARCH_OPS, max_tokens)
    ids = ref.tokenize(text)[: sens.n_tokens]
    del ref
    host = device in (None, "host")
    files = weight_formats(mf)
    disp = Dispatcher(profile, cfg, files, probe=host)
    times = op_times(disp, objective, prompt_tokens, files, fmts)
    res = search(sens, times, budget_kl, objective, cfg.n_layers, fmts)
    name = Path(mf.path).name.removesuffix(".gguf")
    path = out or edgellm_home() / "plans" / f"{name}-{profile.name}-{objective}-kl{budget_kl:g}.yaml"

    def predicted_both(plan):
        """(TTFT ms, decode ms per token) the dispatcher predicts with `plan` (None: no plan)."""
        d = (Dispatcher(profile, cfg, files, probe=host) if plan is None else
             Dispatcher(profile, cfg, planned_formats(mf, plan), probe=host, compute=ComputeTable(plan, cfg.n_layers),
                        kv_bytes=KVConfig(precision=plan.kv_precision).bytes_per_elem))
        p = d.plan(prompt_tokens=prompt_tokens, n_ctx=max(prompt_tokens + 1, 2048), memory_budget=1 << 30)
        return p.predicted_ttft_ms, 1e3 / p.predicted_decode_tps

    def predicted(plan):
        return predicted_both(plan)[0 if objective == "ttft" else 1]

    q_ms = predicted(load_plan("quality"))
    s_both, none_both = predicted_both(res.plan), predicted_both(None)
    s_ms = s_both[0 if objective == "ttft" else 1]
    by_kind: dict[str, int] = {}
    for c in res.changes:
        by_kind[f"{c.kind} {c.format}"] = by_kind.get(f"{c.kind} {c.format}", 0) + 1
    typer.echo(f"plan: {len(res.changes)} changes from quality: "
               + (", ".join(f"{v} x {k}" for k, v in sorted(by_kind.items())) or "none"))
    what = "TTFT" if objective == "ttft" else "decode time per token"
    n_ms = none_both[0 if objective == "ttft" else 1]
    typer.echo(f"  predicted {what} on {profile.name}: {s_ms:.2f} ms vs {q_ms:.2f} ms for quality "
               f"(speed-up {q_ms / s_ms:.3f}x) and {n_ms:.2f} ms with no plan ({n_ms / s_ms:.3f}x)")
    # the phase the search left alone keeps quality's fp32 compute: with no plan each unit runs
    # its own precision (a ttft plan decoded at 44 tok/s where no plan gave 169: a probe)
    other, other_objective, o = ("decode", "decode", 1) if objective == "ttft" else ("prefill", "ttft", 0)
    if s_both[o] > 1.05 * none_both[o]:
        unit = "ms per token" if o else "ms TTFT"
        typer.echo(f"  note: {other} keeps quality's fp32 compute in this plan: predicted {s_both[o]:.2f} {unit} "
                   f"against {none_both[o]:.2f} with no plan; search with --objective {other_objective} for a "
                   f"plan that speeds it up, or run without --precision for the units' own precision")
    typer.echo(f"  predicted KL (sum of measured sensitivities): {res.predicted_kl:.5f} of the {budget_kl:g} budget")
    if res.note:
        typer.echo(f"  note: {res.note}")
    if verify:
        phase = "prefill" if objective == "ttft" else "decode"

        def logits(plan):
            e = edgellm.load(mf.path, n_ctx=max(len(ids) + 1, 256), precision=plan)
            return teacher_forced_logits(e, ids, phase)

        kl = mean_kl(logits(load_plan("quality")), logits(res.plan))
        # (a plan of no changes predicts 0: no ratio to show)
        vs = f"verified / predicted = {kl / res.predicted_kl:.2f}" if res.predicted_kl > 0 else "no change predicted"
        typer.echo(f"  verified KL on this machine ({phase}, {len(ids)} calibration tokens): {kl:.5f} "
                   f"({vs}); {'within' if kl <= budget_kl else 'OVER'} the budget")
        if not kl <= budget_kl:
            # written only once verified: a plan over the budget (exit 0, file written) was taken
            # by scripts as one that keeps the quality asked for (README: exit 1, nothing written)
            raise ConfigError(f"--budget-kl {budget_kl:g}: the plan's verified KL {kl:.5f} is over the budget; "
                              f"{path} not written (raise --budget-kl, or --no-verify to keep the prediction)")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_output(path, "--out" if out else "the plan's default path", dump_plan(res.plan).encode())
    typer.echo(f"plan written to {path}")


_logged: set[str] = set()   # warnings the handler below printed: _load does not echo them again


class _WarningLine(logging.Handler):
    """edgellm's warnings as `edgellm: warning: ...` lines on stderr. Without a handler Python's
    last resort printed them bare, and `run` then echoed the plan's warnings a second time."""

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        _logged.add(msg)
        try:
            sys.stderr.write(f"edgellm: {record.levelname.lower()}: {msg}\n")
        except Exception:
            self.handleError(record)


def _log_warnings_to_stderr() -> None:
    lg = logging.getLogger("edgellm")
    if not any(isinstance(h, _WarningLine) for h in lg.handlers):
        h = _WarningLine(logging.WARNING)
        lg.addHandler(h)


_terminated = 0   # the SIGTERM or SIGHUP that arrived, if any


def _terminate(signum, frame) -> None:
    """SIGTERM (a service manager, `kill`, a CI timeout) and SIGHUP (the terminal closed under a
    chat) unwind like Ctrl-C: half-written outputs (a session's temporary file, a requantized
    model's, a bundle's folder) are removed on the way out; the default action left them behind
    (a SIGHUP during a session's save: an 11 MB temporary file beside it, for good)."""
    global _terminated
    _terminated = signum
    sys.exit(128 + signum)


def _import_numpy_with_signals_held() -> None:
    """numpy's BLAS starts its threads when imported: started with SIGINT and SIGTERM blocked they
    keep them blocked, so the kernel hands Ctrl-C to the main thread. One that took it left the
    main thread blocked in a read (a chat's prompt ignored about 1 Ctrl-C in 4)."""
    if hasattr(signal, "pthread_sigmask"):
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            import numpy  # noqa: F401
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _output_failed(e: OSError) -> None:
    """One line and exit 1 for output click wrote itself and could not (a 67-line traceback for
    `--version > /dev/full`). stdout is pointed at /dev/null first: its buffered rest would fail
    again at exit."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 1)
        os.close(fd)
    except OSError:
        pass
    _err(f"cannot write the output: {e.strerror or e}")
    sys.exit(1)


def _stderr_to_devnull_if_closed() -> None:
    """Started with 2>&- the answer still goes to stdout; diagnostics go nowhere. `run` printed
    nothing and exited 1 (Python starts with sys.stderr None), or, where a file the launcher
    opened took descriptor 2 read-only, printed the answer and exited 1 on the stats line's
    EBADF. Descriptor 2 is pointed at /dev/null, so no file opened later takes it and receives a
    native library's stderr."""
    try:
        import fcntl
        if fcntl.fcntl(2, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
            if sys.stderr is None:   # (open, but Python saw it closed at its start)
                sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False)
            return
    except ImportError:
        return   # (no fcntl: not a POSIX system; its stderr is as the system gave it)
    except OSError:
        pass     # closed
    fd = os.open(os.devnull, os.O_WRONLY)
    if fd != 2:
        os.dup2(fd, 2)
        os.close(fd)
    sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False)


def main() -> None:
    interrupted.reset()
    signal.signal(signal.SIGTERM, _terminate)
    interrupted.reraise_from_finalizers()
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:   # (nohup: ignored, stays so)
        signal.signal(signal.SIGHUP, _terminate)
    try:
        _import_numpy_with_signals_held()
    except KeyboardInterrupt:   # (one held during the import lands when the mask is restored)
        _say_interrupted(signal.SIGINT)
        sys.exit(130)
    _stderr_to_devnull_if_closed()
    if sys.stdout is None:   # (started with >&-: an AttributeError traceback)
        sys.stderr.write("edgellm: error: stdout is closed: run me with somewhere to write to\n")
        sys.exit(1)
    # text the terminal's encoding cannot show (LC_ALL=C without Python's UTF-8 mode) comes out as
    # '?' rather than a UnicodeEncodeError in the middle of an answer
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    _log_warnings_to_stderr()
    columns = os.environ.get("COLUMNS")
    if columns is not None and (not columns.strip().isdigit() or int(columns) == 0):
        os.environ.pop("COLUMNS")   # (COLUMNS=0: rich printed usage errors and --help as nothing)
    code = 0
    try:
        app()
    except KeyboardInterrupt:   # Ctrl-C before a command's body (imports, option parsing)
        _say_interrupted(signal.SIGINT)
        code = 130
    except SystemExit as e:
        # a SystemExit raised in the handler can be lost inside C code (an import): the command
        # then ran on, to click's own exit (0); at least the exit status says so
        code = e.code
    except OSError as e:   # click's own output (--help, --version, a usage error) on a full or closed stream
        _output_failed(e)
    finally:
        interrupted.hold_late_signals()
    if _terminated:   # (as above, where a command returns instead of exiting)
        _say_interrupted(_terminated)
        code = 128 + _terminated
    elif interrupted.late and code in (0, None):
        # the command had finished (its outputs whole); the signal still sets the exit status
        _say_interrupted(interrupted.late[0], "it came as edgellm was exiting, after the command had finished")
        code = 128 + interrupted.late[0]
    sys.exit(code)


if __name__ == "__main__":
    main()
