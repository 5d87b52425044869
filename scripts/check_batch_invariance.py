#!/usr/bin/env python
"""Batch invariance on real prompts (docs/engine.md "Batch invariance"; not a test: minutes on 2 cores): greedy text
of 20 prompts equal across a fresh prefill, the kept KV prefix, and prompt steps of 1 (the decode path), 7, 64 and
512 rows, on the demo MoE and the three real models at the default activations, and on the MoE oracle fixtures (F32
weights) with ``COLI_BATCH_INVARIANT=1``; one long prompt's logits whole against steps of 512 and 64 rows.

    python scripts/check_batch_invariance.py [NAME ...]   (NAME: smollm2, demo, ..., olmoe (flag): a subset)

Prompt steps of ``None`` are the engine's own (``COLI_UBATCH``). Prints one line per model: how many prompts gave the same ids in every mode, and the long prompt's largest logit
difference (0 when bit-equal)."""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from coli import engine as E  # noqa: E402
from coli.engine import Engine  # noqa: E402
from coli.resolve import resolve  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a dragon who",
           "Q: What is 12 times 7?\nA:", "import numpy as np\n\n# load the data", "The best way to learn a language is",
           "In 1969, the first humans", "Here is a haiku about the sea:\n", "SELECT name FROM users WHERE",
           "The three primary colors are", "Photosynthesis is the process by which", "fn main() {\n    let x =",
           "My favourite book is", "The quick brown fox", "To make a cup of tea, first", "The mitochondria is",
           "List of prime numbers: 2, 3, 5,", "Dear hiring manager,", "The weather today is", "Water boils at"]
LONG = " ".join(["The capital of France is Paris. The capital of Germany is Berlin. Once upon a time a small dragon "
                 "loved to read books about the sea, the stars and numbers like 12, 345 and 6789."] * 20)

def gen(eng, ids, n=8, **kw):
    return eng.generate(ids=ids, max_tokens=n, stop_at_eos=False, **kw).ids

def check(path, env=None, label=""):
    t0 = time.time()
    eng = Engine(path, threads=2, quiet=True, save_usage=False, env=env)
    bad = 0
    for p in PROMPTS:
        ids = eng.tokenize(p)
        E.PREFILL_CHUNK = 512
        fresh = gen(eng, ids)
        eng.generate(ids=[0, 1], max_tokens=1, keep_kv=True)
        first = gen(eng, ids, keep_kv=True); again = gen(eng, ids, keep_kv=True)
        outs = {"fresh": fresh, "kept": again, "first": first}
        for c in (1, 7, 64, None):
            E.PREFILL_CHUNK = c
            outs[f"chunk{c}"] = gen(eng, ids)
        E.PREFILL_CHUNK = 512
        if len({tuple(v) for v in outs.values()}) != 1:
            bad += 1
            print("  DIFF", label, repr(p), {k: v for k, v in outs.items()})
    n_long = min(600, eng.ctx - 8)
    ids = eng.tokenize(LONG)[:n_long]
    E.PREFILL_CHUNK = n_long; whole = eng.logits(ids)
    d = {}
    for c in (512, 64):
        E.PREFILL_CHUNK = c; d[c] = float(np.abs(eng.logits(ids) - whole).max())
    E.PREFILL_CHUNK = 512
    eng.close()
    print(f"{label}: {len(PROMPTS) - bad}/{len(PROMPTS)} prompts equal in every mode; {n_long}-token logits whole vs "
          f"chunks 512/64 max diff {d[512]:.3g}/{d[64]:.3g}; {time.time() - t0:.0f} s", flush=True)

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", metavar="NAME", help="a subset: smollm2, demo, ..., olmoe (flag)")
    only = set(ap.parse_args(argv).names)
    for name in ("smollm2", "demo", "gemma3-270m", "qwen2.5-coder-0.5b"):
        if not only or name in only:
            check(resolve(name, quiet=True), label=name)
    for fam in ("mixtral", "olmoe", "qwen2moe", "qwen3moe"):
        if not only or f"{fam} (flag)" in only:
            check(ROOT / "tests" / "fixtures" / "oracles" / f"{fam}.gguf", env={"COLI_BATCH_INVARIANT": "1"},
                  label=f"{fam} (flag)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
