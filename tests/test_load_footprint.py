"""What a load and a generation (sampled, by default) keep out of the process: modules that
would only add resident memory (numpy.random ~2.6 MB, psutil ~1.8, the gguf package ~1.6, HF
tokenizers ~3.9 with the native tokenizer in its place, OpenSSL through hashlib ~3.3, jinja2
until a chat needs it; on SmolLM2, whose RSS bound leaves the runtime ~47 MB beside the weights
and the KV cache). The CLI keeps pydantic out (typer 0.29 would bring it to every command)."""
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import write_tiny_model  # noqa: E402

_CHILD = """
import sys
import edgellm
eng = edgellm.load(sys.argv[1], n_ctx=64, threads=1)
eng.wait_loaded()
text = eng.generate("hello", max_tokens=4)
eng.warm("hello hello hello")   # the prefix cache's block hashes
print(sorted(m for m in ("numpy.random", "numpy.random._generator", "psutil", "gguf", "tokenizers",
                         "_hashlib", "jinja2") if m in sys.modules))
"""

_CLI_CHILD = """
import sys
from edgellm.cli import main
sys.argv = ["edgellm", "info", sys.argv[1]]
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
print(sorted(m for m in ("pydantic", "_hashlib", "jinja2") if m in sys.modules))
"""



def _modules_left(tmp_path, child: str, measured: bool = False) -> str:
    """The last line the child prints: the modules on its list that it imported, given a tiny
    model and an empty EDGELLM_HOME (no measured host profile: the load estimates one, as on a
    fresh device), or with `measured` a measured host.yaml there, as `edgellm profile` leaves."""
    m = write_tiny_model(tmp_path / "m.gguf", n_layers=1)
    if measured:
        from dataclasses import replace

        from edgellm.device.host import estimate_host_profile
        from edgellm.device.profile import Measured
        from edgellm.device.profile_yaml import write_profile

        est = estimate_host_profile()
        mm = Measured(date="2026-11-28", tool="edgellm profile (test)", memory_read_bandwidth=20e9, clusters={},
                      others_cpu_share=0.02)
        (tmp_path / "home" / "profiles").mkdir(parents=True)
        write_profile(replace(est, name="host", measured=mm), tmp_path / "home" / "profiles" / "host.yaml")
    env = dict(os.environ, EDGELLM_HOME=str(tmp_path / "home"))
    out = subprocess.run([sys.executable, "-c", child, str(m.path)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_load_and_generate_do_not_import_modules_they_do_not_need(tmp_path):
    assert _modules_left(tmp_path, _CHILD) == "[]"


def test_a_load_from_a_measured_profile_imports_no_more(tmp_path):
    """A measured profile's checks at load (others_cpu_share against BUSY_SHARE) imported the
    profiling probes, and psutil with them: ~1.6 MiB of the RSS after load (bench 'the rest')."""
    assert _modules_left(tmp_path, _CHILD, measured=True) == "[]"


def test_a_cli_command_does_not_import_pydantic(tmp_path):
    assert _modules_left(tmp_path, _CLI_CHILD) == "[]"
