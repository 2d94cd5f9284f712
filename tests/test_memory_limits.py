"""The memory a load may take: the cgroup's and the address-space rlimit's headroom beside
MemAvailable, and a load past a limit is a typed refusal, not a MemoryError or ENOMEM traceback."""
import subprocess
import sys

from gguf import GGMLQuantizationType as QT

from edgellm.procmem import _cgroup_headroom, available_bytes
from tests.synthetic import write_tiny_model


def test_cgroup_v2_and_v1_headroom(tmp_path):
    v2 = tmp_path / "v2"
    (v2 / "app").mkdir(parents=True)
    (v2 / "app" / "memory.max").write_text("1000000\n")
    (v2 / "app" / "memory.current").write_text("400000\n")
    (tmp_path / "cg2").write_text("0::/app\n")
    assert _cgroup_headroom(str(v2), str(tmp_path / "cg2")) == 600000
    (v2 / "app" / "memory.max").write_text("max\n")
    assert _cgroup_headroom(str(v2), str(tmp_path / "cg2")) is None
    v1 = tmp_path / "v1"
    (v1 / "memory" / "uid_10001").mkdir(parents=True)
    (v1 / "memory" / "uid_10001" / "memory.limit_in_bytes").write_text("5000000\n")
    (v1 / "memory" / "uid_10001" / "memory.usage_in_bytes").write_text("1000000\n")
    (tmp_path / "cg1").write_text("5:cpuset:/\n4:memory:/uid_10001\n0::/\n")
    assert _cgroup_headroom(str(v1), str(tmp_path / "cg1")) == 4000000
    (v1 / "memory" / "uid_10001" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))   # v1's "no limit"
    assert _cgroup_headroom(str(v1), str(tmp_path / "cg1")) is None
    assert _cgroup_headroom(str(v1), str(tmp_path / "missing")) is None
    assert available_bytes() > 0


_LIMITED = """
import resource, sys
import edgellm
from edgellm.errors import ConfigError
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), resource.RLIM_INFINITY))
try:
    edgellm.load(sys.argv[1], n_ctx=int(sys.argv[3]), threads=1, kv_precision="f32")
except ConfigError as e:
    print("REFUSED", e)
else:
    print("LOADED")
"""


def test_a_load_past_the_address_space_limit_is_a_typed_refusal(tmp_path):
    """`ulimit -v`: the load failed with a MemoryError traceback from the KV pool, or ENOMEM
    from the model's mapping; MemAvailable did not see the limit."""
    tm = write_tiny_model(tmp_path / "t.gguf", tensor_type=QT.F32, n_layers=2, d_model=256, n_heads=4, n_kv_heads=4,
                          seed=1, context_length=1 << 20)
    # the interpreter with numpy and edgellm imported, plus ~64 MiB: far from a 2^20-token f32 KV cache
    probe = subprocess.run([sys.executable, "-c", "import edgellm.api, resource;"
                            "print(int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024)"],
                           capture_output=True, text=True, check=True)
    limit = int(probe.stdout) + (64 << 20)
    r = subprocess.run([sys.executable, "-c", _LIMITED, tm.path, str(limit), str(1 << 18)], capture_output=True,
                       text=True, timeout=120)
    assert "REFUSED not enough memory" in r.stdout, r.stdout + r.stderr[-2000:]
