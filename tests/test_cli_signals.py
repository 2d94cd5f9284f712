"""Signals at awkward moments (from a helper's probe of interrupts at random points): a Ctrl-C
held while numpy was imported, a SIGTERM whose SystemExit C code swallowed, and a SIGTERM
while the OpenCL probe child was being waited for (the child outlived the command and went on
writing into EDGELLM_HOME)."""
import signal
import subprocess
import sys
import time

import pytest

from edgellm import cli


def test_a_ctrl_c_held_during_the_numpy_import_exits_130(monkeypatch, capsys):
    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_import_numpy_with_signals_held", interrupted)
    monkeypatch.setattr(sys, "argv", ["edgellm", "--help"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 130 and "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("then_exit", [False, True])
def test_a_sigterm_whose_exit_was_lost_still_exits_143(monkeypatch, then_exit):
    """then_exit: the command ran on to click's own sys.exit(0), which every command ends in (the
    check after app() never ran then)."""
    def swallowed():
        cli._terminated = signal.SIGTERM   # (the handler ran; its SystemExit was lost inside an import)
        if then_exit:
            sys.exit(0)
    monkeypatch.setattr(cli, "app", swallowed)
    monkeypatch.setattr(cli, "_terminated", 0)
    monkeypatch.setattr(sys, "argv", ["edgellm"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 143


def test_the_probe_child_does_not_outlive_a_sigterm_while_it_is_awaited(monkeypatch):
    from edgellm.backends import opencl, opencl_child
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    real = child.communicate
    calls = []

    def terminated(timeout=None):
        calls.append(timeout)
        if len(calls) == 1:
            raise SystemExit(143)    # the SIGTERM handler, while the probe's answer is awaited
        return real(timeout=timeout)
    child.communicate = terminated
    monkeypatch.setattr(opencl_child, "has_pyopencl", lambda: True)
    monkeypatch.setattr(opencl_child, "take_cached", lambda: None)
    monkeypatch.setattr(opencl_child, "take", lambda: (child, time.monotonic()))
    try:
        with pytest.raises(SystemExit):
            opencl._probe()
        assert child.poll() is not None            # killed, not left running
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
