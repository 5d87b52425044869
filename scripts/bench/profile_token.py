#!/usr/bin/env python
"""Per-part timers of one decode token and one prefill chunk of a coli model, as a table.

    python scripts/bench/profile_token.py MODEL [-t THREADS] [--tokens 32] [--prompt 64 [--chunk N]] [--cpu-act int8|f32]
                                          [--py-spy out.svg] [--calls] [--head-apart]

MODEL: a GGUF path, a name ``coli.fetch`` knows (smollm2, qwen25, gemma3), ``demo`` (the demo MoE) or the file
of ``scripts/make_synthetic_moe.py``. The script wraps the forward path's parts (the methods of the blocks in
``coli.models.blocks`` and of ``coli.models.base.Model``, and the kernels they call) with timers and charges each wrapped call's *exclusive* time to a
part named by where it was called from:

=====================  ==================================================================================
attention matmuls      q/k/v/o projections (``mm`` / ``qkv`` called from ``attention``)
attention core         RoPE, q/k norms, the KV write, ``attend`` (the rest of ``attention``)
attention block        a decode row's whole attention block in one compiled call (``cpu_kernels.decode``:
                       norm, q/k/v, RoPE, KV write, attend, output projection, residual)
norms                  the layer RMSNorms and the final norm (with the input's int8 quantization when fused)
dense FFN              gate/up/down and the activation of a dense layer (a decode row: the compiled block
                       with its norm and residual)
token region           a dense model's decode row through every layer in one compiled call, with the output
                       norm and head in it where they can run there (``Model.token_head``; ``--head-apart``:
                       the head as its own call, timed as lm_head / norms)
router                 router logits and top-k (``moe`` less the step)
MoE experts            ``MoEStep.run`` (the CPU experts, the join, the rank-order sum) less the two below
MoE gate/up GEMM       a prompt step's gate/up/activation launch of its experts (``experts.ffn_gate_up_gemm``)
MoE down GEMM          and its down launch (``experts.mm_grouped_gemm``)
lm_head                the output projection
embed                  token embedding lookup (a decode row's: one compiled call, ``cpu_kernels.embed``)
python / other         ``forward``'s own time: everything not in a part above
=====================  ==================================================================================

The prompt rows before the timed decode tokens (4) are charged too: a part that only the prompt runs (attention
matmuls, dense FFN, norms ... of a dense model whose decode rows run in the token region) shows a small figure
with calls/token 0 or 1.

``--calls`` counts Python-level calls and np.empty/np.zeros per decode token with cProfile. The untimed run's
ms/token is printed too: the timers add ~1 us per wrapped call. ``--py-spy`` records the
decode loop with py-spy (when installed) into a flame graph. Speed numbers are only comparable within one run
on a quiet machine (docs/cpu_kernels.md); the load average is printed with the table.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import cpu_kernels  # noqa: E402,F401  (threading layer before numba)
import numpy as np  # noqa: E402

PARTS = ["attention matmuls", "attention core", "attention block", "layer region (attention + dense FFN)",
         "token region (every layer)", "token region (every layer + head)", "norms", "dense FFN", "router",
         "MoE experts", "MoE gate/up GEMM", "MoE down GEMM", "lm_head", "embed", "python / other"]

# (wrapped name, the part it is charged to given the innermost wrapped caller)
_KERNELS = {  # module-level kernel names in coli.models.blocks / base / the family file; part by caller
    "rms_norm": {"heads": "attention core", None: "norms"},
    "rms_norm_heads": {None: "attention core"},
    "apply_rope": {None: "attention core"},
    "attend": {None: "attention core"},
    "swiglu": {None: "dense FFN", "moe": "MoE experts", "step": "MoE experts"},
    "geglu_tanh": {None: "dense FFN"},
    "mla_attend": {None: "attention core"},
    "dsa_topk": {None: "attention core"},
    "kda": {None: "attention core"},                  # coli/models/kimi.py: the KDA recurrence + gated norm
    "causal_conv1d_silu": {None: "attention core"},   # and its short convolutions
}
_METHODS = {  # (class, method) of the blocks and the model: the part of their own (exclusive) time
    ("Attention", "__call__"): ("attention", "attention core"),
    ("Attention", "heads"): ("heads", "attention core"),
    ("Attention", "qkv"): ("qkv", "attention matmuls"),
    ("Attention", "out"): ("out", "attention matmuls"),
    ("MLP", "__call__"): ("dense_ffn", "dense FFN"),
    ("MoE", "__call__"): ("moe", "router"),
    ("Model", "embed"): ("embed", "embed"),
    ("Model", "forward"): ("forward", "python / other"),
    ("Model", "norm_in"): ("norm_in", "norms"),  # RMSNorm and the int8 quantization of the layer input
    ("MLA", "__call__"): ("attention", "attention core"),   # coli/models/mla.py (deepseek2, glm-dsa)
    ("MLA", "project"): ("qkv", "attention matmuls"),
    ("MLA", "attend"): ("mla_attend_block", "attention core"),
    ("DSA", "__call__"): ("attention", "attention core"),   # coli/models/glmdsa.py: the indexer is attention core
    ("Indexer", "__call__"): ("indexer", "attention core"),
    ("KDA", "__call__"): ("kda_block", "attention core"),   # coli/models/kimi.py: its matmuls are attention matmuls
    ("KDA", "projections"): ("qkv", "attention matmuls"),
    ("AttentionDecode", "__call__"): ("attention_block", "attention block"),  # cpu_kernels/decode.py
    ("FFNDecode", "__call__"): ("ffn_block", "dense FFN"),
    ("LayerDecode", "__call__"): ("layer_block", "layer region (attention + dense FFN)"),
    ("TokenDecode", "__call__"): ("token_block", "token region (every layer)"),  # "+ head": set in main
}
_MM = {"qkv": "attention matmuls", "out": "attention matmuls", "dense_ffn": "dense FFN", "forward": "lm_head",
       "moe": "router", "mla_attend_block": "attention matmuls", "indexer": "attention core",
       "kda_block": "attention matmuls"}


class Profiler:
    def __init__(self):
        self.t = defaultdict(float)
        self.n = defaultdict(int)
        self.stack = []  # [name, start, child time]

    def wrap(self, name, fn, part_of):
        prof = self

        def wrapper(*a, **kw):
            caller = prof.stack[-1][0] if prof.stack else None
            part = part_of(caller)
            fr = [name, time.perf_counter(), 0.0]
            prof.stack.append(fr)
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - fr[1]
                prof.stack.pop()
                if prof.stack:
                    prof.stack[-1][2] += dt
                prof.t[part] += dt - fr[2]
                prof.n[part] += 1

        return wrapper

    def reset(self):
        self.t.clear()
        self.n.clear()


def instrument(model, prof: Profiler):
    """Wrap the model's parts (the block classes' methods, the kernel names the blocks, coli.models.base and the
    model's family module call); returns an undo."""
    import importlib

    import coli.models.base as base
    import coli.models.blocks as blocks
    import coli.models.glmdsa as glmdsa
    import coli.models.kimi as kimi
    import coli.models.mla as mla
    import cpu_kernels.decode as decode

    undo = []

    def patch(obj, name, wrapped):
        orig = obj.__dict__[name] if isinstance(obj, type) else getattr(obj, name)
        setattr(obj, name, wrapped)
        undo.append(lambda: setattr(obj, name, orig))

    family = importlib.import_module(type(model).__module__)
    for mod in {blocks, base, family, mla, glmdsa, kimi}:
        for name, table in _KERNELS.items():
            if name in vars(mod):
                patch(mod, name, prof.wrap(name, vars(mod)[name], lambda c, t=table: t.get(c, t.get(None))))
    classes = {"Attention": blocks.Attention, "MLP": blocks.MLP, "MoE": blocks.MoE, "Model": base.Model,
               "MLA": mla.MLA, "DSA": glmdsa.DSA, "Indexer": glmdsa.Indexer, "KDA": kimi.KDA,
               "AttentionDecode": decode.AttentionDecode, "FFNDecode": decode.FFNDecode,
               "LayerDecode": decode.LayerDecode, "TokenDecode": decode.TokenDecode}
    for (cls_name, meth), (label, part) in _METHODS.items():
        cls = classes[cls_name]
        patch(cls, meth, prof.wrap(label, getattr(cls, meth), lambda c, p=part: p))
    patch(base.Model, "mm", prof.wrap("mm", base.Model.mm, lambda c: _MM.get(c, "python / other")))
    import cpu_kernels.experts as experts

    # a prompt step's expert GEMM launches (``experts._experts_gemm``), apart from the rest of the step
    patch(experts, "ffn_gate_up_gemm", prof.wrap("gu_gemm", experts.ffn_gate_up_gemm, lambda c: "MoE gate/up GEMM"))
    patch(experts, "mm_grouped_gemm", prof.wrap("down_gemm", experts.mm_grouped_gemm, lambda c: "MoE down GEMM"))
    step = getattr(model, "step", None)
    if step is not None:
        step.run = prof.wrap("step", step.run, lambda c: "MoE experts")
        undo.append(lambda: delattr(step, "run"))
    return lambda: [u() for u in reversed(undo)]


def resolve(name: str) -> str:
    p = Path(name)
    if p.exists():
        return str(p)
    if name == "demo":
        from coli.demo import demo_model_path

        return str(demo_model_path(quiet=True))
    from coli.fetch import model_path

    return str(model_path(name, quiet=True))


def table(prof: Profiler, ntok: int, title: str, untimed_ms: float, timed_ms: float) -> str:
    tot = sum(prof.t.values())
    lines = [f"### {title}", "", "| part | ms/token | % | calls/token |", "|---|---|---|---|"]
    for p in PARTS:
        if p in prof.t:
            lines.append(f"| {p} | {prof.t[p] / ntok * 1e3:.3f} | {prof.t[p] / tot:.0%} | {prof.n[p] / ntok:.0f} |")
    lines.append(f"| **total (timed)** | {timed_ms:.3f} | | |")
    lines.append(f"| **total (untimed)** | {untimed_ms:.3f} | | |")
    return "\n".join(lines)


def call_counts(decode, ntok: int) -> str:
    """Python-level calls per decode token under cProfile (every function and C call it sees, the Numba
    dispatches included) and the allocations the issue counts (np.empty, np.zeros, np.empty_like, np.zeros_like),
    with the ten most frequent callees."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    decode(ntok)
    pr.disable()
    st = pstats.Stats(pr).stats
    calls = sum(v[1] for v in st.values())
    lines = [f"### Python calls per decode token (cProfile, {ntok} tokens)", "",
             f"all calls: {calls / ntok:.0f}"]
    for name in ("numpy.empty", "numpy.zeros", "empty_like", "zeros_like"):
        n = sum(v[1] for k, v in st.items() if k[2].endswith(name) or k[2] == f"<built-in method {name}>")
        lines.append(f"{name}: {n / ntok:.1f}")
    top = sorted(st.items(), key=lambda kv: -kv[1][1])[:10]
    lines.append("most called: " + ", ".join(f"{k[2]} {v[1] / ntok:.0f}" for k, v in top))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens timed")
    ap.add_argument("--prompt", type=int, default=64, help="rows of the prefill chunk timed (0: skip)")
    ap.add_argument("--reps", type=int, default=3, help="prefills timed")
    ap.add_argument("--chunk", type=int, default=0,
                    help="run the prompt in steps of this many rows, as the engine does (Engine.prompt_chunk); "
                         "0: the whole prompt in one step")
    ap.add_argument("--cpu-act", default=None)
    ap.add_argument("--py-spy", default=None, metavar="SVG", help="also record the decode loop with py-spy")
    ap.add_argument("--calls", action="store_true",
                    help="also count Python-level calls and np.empty/np.zeros per decode token (cProfile)")
    ap.add_argument("--layer-regions", action="store_true",
                    help="a dense model's layers as one region each (timed apart), not one region per token")
    ap.add_argument("--head-apart", action="store_true",
                    help="a dense model's output head as its own call (Model.head, timed apart), not in the token "
                         "region")
    ap.add_argument("--split-layers", action="store_true",
                    help="a dense layer's attention and FFN blocks as two regions (timed apart), not one")
    a = ap.parse_args(argv)

    from coli.engine import Engine
    from cpu_kernels import set_threads

    path = resolve(a.model)
    eng = Engine(path, threads=a.threads, cpu_act=a.cpu_act, quiet=True, save_usage=False)
    m = eng.model
    set_threads(eng.threads)  # the model is called directly below, not through the engine's calls that set them
    if a.split_layers or a.layer_regions:
        m.token_dec = None
    if a.head_apart:
        m.token_head = False
    if getattr(m, "token_head", False) and m.token_dec is not None:
        _METHODS[("TokenDecode", "__call__")] = ("token_block", "token region (every layer + head)")
    if a.split_layers:
        for L in m.layers:
            if getattr(L, "layer_dec", None) is not None:
                L.layer_dec = None
    rng = np.random.default_rng(0)
    vocab = min(eng.args.vocab, 30000)
    ntok = a.tokens
    ids = rng.integers(100, vocab, size=max(ntok, a.prompt) + 8)

    def decode(n):
        kv = m.new_cache(n + 8)
        m.forward(ids[:4], kv)
        t0 = time.perf_counter()
        for i in range(n):
            m.forward([int(ids[4 + i])], kv)
        return (time.perf_counter() - t0) / n * 1e3

    step = a.chunk or a.prompt

    def prompt(T):
        kv = m.new_cache(T + 8)
        for s in range(0, T, step):
            m.forward(ids[s:min(T, s + step)], kv)

    def prefill(T, reps):
        best = 1e9
        for _ in range(reps):
            t0 = time.perf_counter()
            prompt(T)
            best = min(best, time.perf_counter() - t0)
        return best * 1e3

    decode(4)  # JIT, page cache, RAM expert cache
    if a.prompt:
        prefill(a.prompt, 1)
    untimed = decode(ntok)
    prof = Profiler()
    undo = instrument(m, prof)
    timed = decode(ntok)
    out = [f"model {Path(path).name}, threads {eng.threads}, cpu_act {eng.cpu_act}, "
           f"loadavg {open('/proc/loadavg').read().split()[:3]}", ""]
    out.append(table(prof, ntok, f"decode (1 row at position ~{ntok // 2}), {ntok} tokens", untimed, timed))
    if a.prompt:
        undo()
        untimed_p = prefill(a.prompt, a.reps)
        prof.reset()
        undo = instrument(m, prof)
        t0 = time.perf_counter()
        for _ in range(a.reps):
            prompt(a.prompt)
        timed_p = (time.perf_counter() - t0) / a.reps * 1e3
        for k in prof.t:
            prof.t[k] /= a.reps
            prof.n[k] = int(prof.n[k] / a.reps)
        out += ["", table(prof, 1, f"prefill of {a.prompt} rows in steps of {step} (ms per prefill; best untimed "
                                   f"{a.prompt / untimed_p * 1e3:.1f} tok/s)", untimed_p, timed_p)]
    undo()
    print("\n".join(out))
    print(f"\ndecode {1e3 / untimed:.1f} tok/s untimed; loadavg after {open('/proc/loadavg').read().split()[:3]}")
    if a.calls:
        print("\n" + call_counts(decode, ntok))
    if a.py_spy:
        here = os.getpid()
        try:
            spy = subprocess.Popen(["py-spy", "record", "-o", a.py_spy, "-p", str(here), "-r", "200"])
        except FileNotFoundError:
            print("py-spy: not installed (pip install py-spy)", file=sys.stderr)
        else:
            time.sleep(1.0)
            decode(max(ntok, 64))
            spy.terminate()
            spy.wait()
            print(f"py-spy flame graph: {a.py_spy}")
    eng.close()


if __name__ == "__main__":
    main()
