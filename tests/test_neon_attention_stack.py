"""Attention from an app's thread with a small stack. The caller's thread runs tiles too, and the
prefill tile kept ~325 KB of scratch on the stack: from a thread with a 256-320 KB stack it died
with SIGSEGV (a review's probe). The tile's scratch is now per thread on the heap; the decode
path keeps ~80 KB. Run in a child: a crash must fail the test, not end pytest."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import sys, threading
import numpy as np
from edgellm.backends import neon, reference
kb, T, start = map(int, sys.argv[1:])
rng = np.random.default_rng(0)
H, KVH, hd = 9, 3, 64
q = rng.standard_normal((T, H, hd)).astype(np.float32)
k = rng.standard_normal((KVH, start + T, hd)).astype(np.float32)
v = rng.standard_normal((KVH, start + T, hd)).astype(np.float32)
want = reference.attention(q, k, v, start)
neon.attention(q, k, v, start)                   # the pool's workers start on the main thread
got = []
threading.stack_size(kb << 10)
t = threading.Thread(target=lambda: got.append(neon.attention(q, k, v, start)))
t.start(); t.join()
err = float(np.max(np.abs(got[0].reshape(want.shape) - want)))
print("max abs err", err)
sys.exit(0 if err < 1e-4 else 3)
"""


@pytest.mark.parametrize("T,start", [(200, 100), (1, 700)], ids=["prefill tiles", "decode"])
@pytest.mark.parametrize("kb", [256, 160])
def test_attention_runs_on_a_thread_with_a_small_stack(kb, T, start):
    r = subprocess.run([sys.executable, "-c", CHILD, str(kb), str(T), str(start)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "max abs err" in r.stdout


CHILD_I8 = """
import sys, threading, types
import numpy as np
from edgellm.backends import neon
kb = int(sys.argv[1])
rng = np.random.default_rng(0)
H, KVH, hd, bt, start = 9, 3, 64, 16, 700
nb = (start + bt) // bt
shape = (nb, 1, bt, KVH, hd)   # (blocks, layers, block_tokens, kv heads, hd)
k = rng.integers(-127, 128, shape, dtype=np.int8)
v = rng.integers(-127, 128, shape, dtype=np.int8)
ks = rng.uniform(0.005, 0.02, shape[:-1]).astype(np.float32)
vs = rng.uniform(0.005, 0.02, shape[:-1]).astype(np.float32)
pool = types.SimpleNamespace(k=k, v=v, k_scale=ks, v_scale=vs, block_tokens=bt, n_kv_heads=KVH)
table = np.arange(nb, dtype=np.int32)
q = rng.standard_normal((1, H, hd)).astype(np.float32)
# the reference: dense fp32 K/V dequantized as the pool's reader does, (KVH, n, hd)
kd = (k * ks[..., None]).reshape(-1, KVH, hd)[:start + 1].transpose(1, 0, 2)
vd = (v * vs[..., None]).reshape(-1, KVH, hd)[:start + 1].transpose(1, 0, 2)
want = neon.attention(q, np.ascontiguousarray(kd), np.ascontiguousarray(vd), start)
neon.attention_pool(q, pool, table, 0, start)   # the pool's workers start on the main thread
got = []
threading.stack_size(kb << 10)
t = threading.Thread(target=lambda: got.append(neon.attention_pool(q, pool, table, 0, start)))
t.start(); t.join()
err = float(np.max(np.abs(got[0] - want)))
print("max abs err", err)
sys.exit(0 if err < 1e-4 else 3)
"""


@pytest.mark.parametrize("kb", [256, 160])
def test_int8_kv_decode_runs_on_a_thread_with_a_small_stack(kb):
    """int8 K/V decode dequantizes each chunk of keys into 256 KB of buffers: on the stack they
    crashed (SIGSEGV) a generation with kv_precision int8 from a thread with a 256-320 KB stack."""
    r = subprocess.run([sys.executable, "-c", CHILD_I8, str(kb)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "max abs err" in r.stdout
