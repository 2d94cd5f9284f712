"""Fuzz the GGUF header walk: mutate valid small files (byte flips, truncation, insertion, deletion,
boundary integers written over the header's count/length/type/offset fields) and require that
reading either succeeds with a self-consistent result or raises ModelFormatError: no other
exception, no hang (each example under 1 s).

EDGELLM_FUZZ_EXAMPLES sets the number of examples (default 2000)."""
from __future__ import annotations

import atexit
import itertools
import os
import shutil
import struct
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import gguf_layout, write_tiny_model  # noqa: E402

from edgellm.errors import ModelFormatError  # noqa: E402
from edgellm.backends import reference
from edgellm.model.loader import open_model
from edgellm.model.gguf_file import tensor_view  # noqa: E402

settings.register_profile(
    "edgellm-fuzz",
    max_examples=int(os.environ.get("EDGELLM_FUZZ_EXAMPLES", "2000")),
    deadline=timedelta(seconds=1),
    database=None,  # keep the checkout clean; a failure prints its falsifying example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture],
)
FUZZ = settings.get_profile("edgellm-fuzz")


def fuzz_target(path: str) -> None:
    """What the fuzzer drives: the whole open path (header walk, config against tensors,
    tokenizer metadata) and the weight preparation. Raises ModelFormatError on a malformed file;
    anything else is a bug."""
    mf = open_model(path)
    g = mf.gguf
    for info in g.tensors.values():
        assert g.data_offset <= info.offset and info.offset + info.nbytes <= g.file_size
        tensor_view(g, info)
    with np.errstate(all="ignore"):  # mutated weights may hold NaN/inf: a numeric, not a format, matter
        reference.prepare(mf)


@dataclass(frozen=True)
class Base:
    data: bytes
    header_end: int
    fields: tuple[tuple[int, int], ...]  # (offset, width) of the header's integer fields


# /dev/shm where there is one: a file per example, and tmpfs makes writing it cheap
_DIR = Path("/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")) \
    / f"edgellm-fuzz-{os.getpid()}"


def _bases() -> list[Base]:
    _DIR.mkdir(parents=True, exist_ok=True)
    small = dict(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64)
    out = []
    for name, kw in {"f32": {}, "q8_0": {"tensor_type": QT.Q8_0, "tied_embeddings": False,
                                         "extra_metadata": {"general.alignment": 64}}}.items():
        m = write_tiny_model(_DIR / f"base-{name}.gguf", **small, **kw)
        data = Path(m.path).read_bytes()
        lay = gguf_layout(data)
        out.append(Base(data, lay.header_end, tuple(lay.int_fields())))
    return out


BASES = _bases()
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)
BOUNDARY = (0, 1, 2, 3, 4, 7, 8, 31, 32, 33, 63, 64, 65, 255, 256, 2**16 - 1, 2**16, 2**24,
            2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1)


# Strategies built once: building them inside each draw costs more than the parse itself.
_N_MUTATIONS = st.integers(1, 4)
_KIND = st.sampled_from(("field", "field", "overwrite", "flip", "truncate", "insert", "delete"))
_FRACTION = st.integers(0, 1 << 16)  # a position as a fraction of a region, in 1/65536
_IN_HEADER = st.booleans()
_WIDTH = st.sampled_from((4, 8))
_VALUE = st.one_of(st.sampled_from(BOUNDARY), st.integers(0, 2**64 - 1))
_NUDGE = st.sampled_from((0, 1, -1))
_XOR = st.integers(1, 255)
_INSERT = st.binary(min_size=1, max_size=16)
_DELETE = st.integers(1, 16)
_BASE = st.sampled_from(range(len(BASES)))
_FIELDS = [st.sampled_from(b.fields) for b in BASES]


@st.composite
def mutated(draw) -> bytes:
    i = draw(_BASE)
    base = BASES[i]
    data = bytearray(base.data)
    for _ in range(draw(_N_MUTATIONS)):
        n = len(data)
        # most mutations land in the header, where the parser's decisions are
        region = min(base.header_end, n) if draw(_IN_HEADER) else n
        # past the fixed header (fixtures cover it, and "field" mutations hit its counts)
        pos = 24 + (max(region - 24, 0) * draw(_FRACTION) >> 16)
        kind = draw(_KIND)
        if kind in ("field", "overwrite"):
            if kind == "field":
                pos, width = draw(_FIELDS[i])
            else:
                width = draw(_WIDTH)
            value = (draw(_VALUE) + draw(_NUDGE)) % (1 << (8 * width))
            data[pos:pos + width] = struct.pack("<I" if width == 4 else "<Q", value)[:max(n - pos, 0)]
        elif kind == "flip" and pos < n:
            data[pos] ^= draw(_XOR)
        elif kind == "truncate":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(_INSERT)
        elif kind == "delete":
            del data[pos:pos + draw(_DELETE)]
    return bytes(data)


_counter = itertools.count()


@FUZZ
@given(data=mutated())
def test_fuzz_read_gguf(data: bytes) -> None:
    path = _DIR / f"case-{next(_counter)}.gguf"
    path.write_bytes(data)
    try:
        fuzz_target(str(path))
    except ModelFormatError:
        pass
    finally:
        path.unlink()


def test_fuzz_bases_are_valid() -> None:
    for b in BASES:
        path = _DIR / "valid.gguf"
        path.write_bytes(b.data)
        fuzz_target(str(path))
