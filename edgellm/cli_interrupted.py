"""What the CLI says when a signal stops a command, and the signals Python cannot deliver where
they land: one line naming the signal and what became of each output the command was to write
(nothing written, left as it was, written whole: outputs are renamed into place, never partial),
then the shell's exit status (128 + N). cli.friendly and cli.main drive it."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from .fileio import file_state

command = ""        # the command running (for the line an interrupt prints)
outputs: dict = {}  # flag -> (path, its state before the command wrote it): said at an interrupt
said = False        # the interrupt's line is printed (once)
late: list = []     # a signal that came after the command had ended


def begin(name: str) -> None:
    """A command starts: nothing said, no outputs noted."""
    global command, said
    command, said = name, False
    outputs.clear()


def reset() -> None:
    """The program starts (main): as begin, and no late signal."""
    begin("")
    late.clear()


def will_write(flag: str, path) -> None:
    """Notes an output the command writes, as it is now: an interrupt says what became of it."""
    outputs[flag] = (Path(path), file_state(Path(path)))


def signal_of_exit(code) -> int:
    """The signal a SystemExit stands for: 143 and 129 are raised only by the SIGTERM and SIGHUP
    handlers (main's, toolchain.stop_on_sigterm's); 0 for any other exit."""
    for name in ("SIGTERM", "SIGHUP"):
        n = getattr(signal, name, None)
        if n is not None and code == 128 + n:
            return n
    return 0


def _signal_words(signum: int) -> str:
    if signum == signal.SIGINT:
        return "Ctrl-C (SIGINT)"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _remove_own_temps(path: Path) -> None:
    """This process's temporary files beside an output (fileio.temp_beside's names): the writers
    remove theirs as an interrupt unwinds, except one that lands between the file's creation and
    the writer's try; whatever is left of them here is removed."""
    from .fileio import _TAGGED_FILE, _TEMP_NAME_MAX, cut_name, writer_tag

    prefix = f".{cut_name(path.name, _TEMP_NAME_MAX, _TEMP_NAME_MAX // 2)}.{writer_tag()}."
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return
    for e in entries:
        if e.name.startswith(prefix) and _TAGGED_FILE.match(e.name):
            try:
                if e.is_file(follow_symlinks=False):
                    os.unlink(e.path)
            except OSError:
                pass


def _outputs_left() -> list[str]:
    """What became of each output the command was to write: as it was, or written whole (they
    are written to a temporary file and renamed), never a part."""
    lines = []
    for flag, (path, before) in outputs.items():
        _remove_own_temps(path)
        now = file_state(path)
        if now == before:
            lines.append(f"{flag} {path} was left as it was" if before else f"nothing was written to {flag} {path}")
        elif now is None:
            lines.append(f"{flag} {path} is no longer there")
        else:
            lines.append(f"{flag} {path} was written whole before the signal")
    return lines


def line(signum: int, *what: str) -> str | None:
    """The one line for a command stopped by a signal: which, and what became of its outputs (an
    interrupted quantize exited 130 with an empty line; on SIGTERM, with nothing); None once said."""
    global said
    if said:
        return None
    said = True
    head = f"edgellm: {command}: " if command else "edgellm: "
    parts = [*what, *_outputs_left()]
    try:
        tty = sys.stderr is not None and sys.stderr.isatty()
    except (OSError, ValueError):
        tty = False
    # (at a terminal the cursor is after "^C", a progress line or a streamed answer)
    return (("\n" if tty else "") + f"{head}interrupted by {_signal_words(signum)}"
            + "".join(f"; {p}" for p in parts))


def reraise_from_finalizers() -> None:
    """A Ctrl-C (or main's SIGTERM exit) raised inside a finalizer (a __del__, a weakref callback:
    the garbage collector runs them wherever it runs) cannot propagate: Python printed it as
    "Exception ignored in ... KeyboardInterrupt" with a traceback, and the command ran on to
    exit 0 (a probe: 5 of 20 Ctrl-C just after `run --session` saved). The signal is raised
    again instead, at the next point of plain code, where the command ends as for any Ctrl-C:
    from another thread (from this one, still inside the finalizer, it landed in this hook);
    where no thread can start, main() takes it as a late signal."""
    import _thread
    import threading

    previous = sys.unraisablehook
    if getattr(previous, "_edgellm", False):
        return

    def hook(unraisable) -> None:
        exc = unraisable.exc_value
        signum = (signal.SIGINT if isinstance(exc, KeyboardInterrupt)
                  else signal_of_exit(exc.code) if isinstance(exc, SystemExit) else 0)
        if not signum:
            previous(unraisable)
            return
        in_hook = [True]

        def again() -> None:
            # once the hook has returned: raised at once, it landed in this hook's own last lines
            # (Thread.start waits for the thread), and Python printed it there
            while in_hook:
                time.sleep(0.001)
            time.sleep(0.005)
            _thread.interrupt_main(signum)

        try:
            threading.Thread(target=again, daemon=True).start()
        except BaseException:   # (at shutdown: no new threads)
            if not late:
                late.append(signum)
        finally:
            in_hook.clear()

    hook._edgellm = True
    sys.unraisablehook = hook


def hold_late_signals() -> None:
    """From the command's end on, SIGINT, SIGTERM and SIGHUP are recorded, not raised: a Ctrl-C
    then raised KeyboardInterrupt in whatever ran at the interpreter's teardown (a weakref
    callback), which Python prints as "Exception ignored in ..." with a traceback, and the exit
    status stayed 0 (after `run --session` had saved). Signals that come once Python has put the
    default handlers back end the process as the shell expects (status 128 + N, no output)."""
    def record(signum, frame):
        if not late:
            late.append(signum)

    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        n = getattr(signal, name, None)
        if n is None:
            continue
        try:
            if callable(signal.getsignal(n)):   # (an ignored SIGHUP, under nohup, stays ignored)
                signal.signal(n, record)
        except (ValueError, OSError):
            pass
