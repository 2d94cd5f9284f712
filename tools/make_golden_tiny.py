"""Golden logits from llama.cpp for tiny synthetic models (tests/synthetic.py), one per
architecture variant and tensor type the loader supports.

Run with a Python that has llama-cpp-python and gguf (not a test dependency):
    python tools/make_golden_tiny.py [--out tests/data/golden_tiny.json]
The models are rebuilt by the tests from the same specs; their sha256 is recorded so a change in
the writer shows up as a clear failure instead of a silent mismatch.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.synthetic import write_tiny_model  # noqa: E402

# spec: keyword arguments of write_tiny_model (tensor_type by name)
SPECS = [
    {"arch": "llama", "tensor_type": "F32", "seed": 11},
    {"arch": "llama", "tensor_type": "F16", "seed": 12},
    {"arch": "llama", "tensor_type": "Q8_0", "seed": 13},
    {"arch": "llama", "tensor_type": "Q4_0", "seed": 14},
    {"arch": "llama", "tensor_type": "Q4_1", "seed": 15, "tied_embeddings": False},
    {"arch": "qwen2", "tensor_type": "F32", "seed": 16},
    {"arch": "qwen2", "tensor_type": "Q8_0", "seed": 17, "n_heads": 4, "n_kv_heads": 1},
    # linear RoPE scaling, by the current key and by the older one (llama.cpp reads both)
    {"arch": "llama", "tensor_type": "F32", "seed": 18, "extra_metadata": {"llama.rope.scaling.factor": 4.0}},
    {"arch": "llama", "tensor_type": "F32", "seed": 19, "extra_metadata": {"llama.rope.scale_linear": 2.0}},
    # YaRN RoPE scaling: an original context shorter than the ids, so the ramp and mscale matter
    {"arch": "llama", "tensor_type": "F32", "seed": 20,
     "extra_metadata": {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                        "llama.rope.scaling.original_context_length": 32}},
    {"arch": "qwen2", "tensor_type": "F32", "seed": 21,
     "extra_metadata": {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 8.0,
                        "qwen2.rope.scaling.original_context_length": 16}},
    # types load() converts (kquant_repack): BF16, and a Q4_K_M-like mix of K-quants
    {"arch": "llama", "tensor_type": "BF16", "seed": 22},
    {"arch": "llama", "tensor_type": "Q8_0", "seed": 23, "d_model": 256, "d_ff": 512, "n_heads": 4, "n_kv_heads": 2,
     "tied_embeddings": False,
     "tensor_types": {"attn_q.weight": "Q4_K", "attn_k.weight": "Q5_0", "attn_v.weight": "Q6_K",
                      "ffn_gate.weight": "Q4_K", "ffn_up.weight": "Q5_K", "ffn_down.weight": "Q6_K",
                      "output.weight": "Q6_K"}},
    # RoPE keys as llama.cpp reads them: no rope.scaling.yarn_* key for llama / qwen2 (its defaults
    # run), rope.scaling.attn_factor for every scaling type, and a YaRN factor below 1 unscaled
    {"arch": "llama", "tensor_type": "F32", "seed": 24,
     "extra_metadata": {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                        "llama.rope.scaling.original_context_length": 32, "llama.rope.scaling.yarn_ext_factor": 0.5,
                        "llama.rope.scaling.yarn_attn_factor": 1.5, "llama.rope.scaling.yarn_beta_slow": 0.25}},
    {"arch": "qwen2", "tensor_type": "F32", "seed": 25,
     "extra_metadata": {"qwen2.rope.scaling.factor": 2.0, "qwen2.rope.scaling.attn_factor": 1.5}},
    {"arch": "llama", "tensor_type": "F32", "seed": 26,
     "extra_metadata": {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 0.5,
                        "llama.rope.scaling.original_context_length": 16}},
]
IDS = [1, 40, 41, 300, 7, 7, 7, 128, 255, 3, 99, 180, 181, 182, 20, 21]


def build(spec: dict, path: Path):
    from gguf import GGMLQuantizationType as QT

    kw = dict(spec)
    kw["tensor_type"] = QT[kw["tensor_type"]]
    if "tensor_types" in kw:
        kw["tensor_types"] = {k: QT[v] for k, v in kw["tensor_types"].items()}
    return write_tiny_model(path, **kw)


def main() -> None:
    import llama_cpp

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="tests/data/golden_tiny.json")
    ap.add_argument("--append", action="store_true", help="compute only the specs the file lacks and add them")
    args = ap.parse_args()
    have = json.loads(Path(args.out).read_text()) if args.append else None
    out = {"generator": {"tool": "tools/make_golden_tiny.py", "llama_cpp_python": llama_cpp.__version__,
                         "note": "raw logits of every position, teacher-forced, n_threads=1"},
           "ids": IDS, "models": []}
    if have is not None:
        out["models"] = have["models"]
    with tempfile.TemporaryDirectory() as d:
        for spec in SPECS:
            if any(m["spec"] == spec for m in out["models"]):
                continue
            path = Path(d) / "m.gguf"
            build(spec, path)
            llm = llama_cpp.Llama(str(path), n_ctx=64, n_batch=64, logits_all=True, n_threads=1, seed=0,
                                  verbose=False)
            llm.eval(IDS)
            logits = np.array(llm.scores[: len(IDS)], dtype=np.float64)
            out["models"].append({"spec": spec, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                                  "logits": np.round(logits, 6).tolist()})
            del llm
            print(spec, "std of logits", float(logits.std()), file=sys.stderr)
    Path(args.out).write_text(json.dumps(out) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
