"""Requantize a real model with requant.requantize_gguf and check that the result loads and
generates in edgellm and in llama.cpp (llama-cpp-python).

    python tools/check_quantized_llama_cpp.py [--model PATH] [-o OUT.gguf] [--llama-python PY]

Default recipe (--down/--gate-up to change it): every ffn_down -> q8_0, every ffn_gate/ffn_up ->
q4_0, the rest copied. Prints the SQNR summary, the file sizes (source, predicted, written), and
greedy continuations of the prompt from edgellm (reference unit) and llama.cpp on both files.

llama-cpp-python is not a dependency of edgellm: it runs in a subprocess of --llama-python (a
venv that has it; default: this interpreter if it can import llama_cpp, else /tmp/llamaenv).
Exit status 1 when a file fails to load or generate in either runtime, or the size prediction
misses.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

_LLAMA_SCRIPT = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
path, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
m = Llama(model_path=path, n_ctx=256, logits_all=False, verbose=False)
hi = m.tokenize(b"hi")
ids = m.tokenize(prompt.encode(), add_bos=True, special=True)
m.eval(ids)
out = []
for _ in range(n):
    # with logits_all=False llama.cpp keeps one row of logits: the last evaluated position
    tok = int(np.argmax(np.ctypeslib.as_array(m._ctx.get_logits(), shape=(m.n_vocab(),))))
    if tok == m.token_eos():
        break
    out.append(tok)
    m.eval([tok])
print(json.dumps({"hi": hi, "prompt_ids": ids, "ids": out,
                  "text": m.detokenize(out).decode("utf-8", "replace")}))
"""


def _llama_python(arg: str | None) -> str:
    if arg:
        return arg
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    return "/tmp/llamaenv/bin/python"


def llama_cpp_greedy(python: str, path: str, prompt: str, n: int) -> dict:
    r = subprocess.run([python, "-c", _LLAMA_SCRIPT, path, prompt, str(n)], capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def edgellm_greedy(path: str, prompt: str, n: int) -> dict:
    import edgellm

    try:
        eng = edgellm.load(path, units=["reference"], n_ctx=256)
        text = eng.generate(prompt, max_tokens=n, temperature=0)
        return {"prompt_ids": list(eng.tokenize(prompt)), "text": text}
    except Exception as e:  # report, do not stop: the other runtime's result is still worth seeing
        return {"error": f"{type(e).__name__}: {e}"}


def main() -> int:
    from edgellm.model.loader import open_model
    from edgellm.model.registry import resolve_model
    from edgellm.requant import format_report, plan_formats, requantize_gguf

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="source GGUF (default: the registry's smollm2-135m)")
    ap.add_argument("-o", "--out", default="/tmp/edgellm-requant-check.gguf")
    ap.add_argument("--down", default="q8_0", help="format for every ffn_down (gguf = keep)")
    ap.add_argument("--gate-up", default="q4_0", help="format for every ffn_gate/ffn_up (gguf = keep)")
    ap.add_argument("--prompt", default="Hello")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--llama-python", default=None)
    ap.add_argument("--full-report", action="store_true", help="print every converted tensor")
    args = ap.parse_args()

    src = args.model or str(resolve_model("smollm2-135m", pull_if_missing=False))
    recipe = {"ffn_down": args.down, "ffn_gate_up": args.gate_up}
    formats = plan_formats(open_model(src), lambda layer, op: recipe.get(op, "gguf"))
    t = time.perf_counter()
    rep = requantize_gguf(src, args.out, formats)
    dt = time.perf_counter() - t
    lines = format_report(rep).splitlines()
    summary = ("  SQNR", "  note", "  tensor data", "  no tensors")
    print("\n".join(lines if args.full_report else [lines[0]] + [ln for ln in lines if ln.startswith(summary)]))
    print(f"requantized {sum(t.requantized for t in rep.tensors)} of {len(rep.tensors)} tensors in {dt:.1f} s; "
          f"source file {os.path.getsize(src)} bytes, output {rep.actual_size} bytes "
          f"(predicted {rep.predicted_size})")

    ok = rep.predicted_size == rep.actual_size
    py = _llama_python(args.llama_python)
    for label, path in (("source", src), ("requantized", args.out)):
        e = edgellm_greedy(path, args.prompt, args.tokens)
        ll = llama_cpp_greedy(py, path, args.prompt, args.tokens)
        print(f"\n[{label}] {path}")
        print(f"  edgellm   : {e.get('text', '')!r}" + (f"  ERROR {e['error']}" if "error" in e else ""))
        print(f"  llama.cpp : {ll.get('text', '')!r}" + (f"  ERROR {ll['error']}" if "error" in ll else
                                                         f"  (tokenize(b'hi') = {ll['hi']})"))
        if "error" in e or "error" in ll:
            ok = False
        elif e["prompt_ids"] != ll["prompt_ids"]:
            print(f"  prompt ids differ: edgellm {e['prompt_ids']} llama.cpp {ll['prompt_ids']}")
        else:
            print(f"  same greedy text: {e['text'] == ll['text']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
