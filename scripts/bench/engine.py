#!/usr/bin/env python3
"""Decode/prefill throughput of coli beside llama.cpp on the same GGUF files, 2 threads by default.

    .venv/bin/python scripts/bench/engine.py [--threads 2] [--llama-bench PATH] [--models smollm2,qwen25,gemma3,demo]

Runs ``coli bench`` (pp128, tg64, llama-bench's method) in a fresh process per model; with ``--llama-bench`` it
also runs llama.cpp's ``llama-bench -t N -p 128 -n 64 -r 3 -o json`` on the same file, alternating the two;
without it, the llama.cpp figures measured on this machine kind earlier (docs/notes/benchmarks.md, "The first table") are used (2 threads:
SmolLM2 Q4_1 tg 121, Qwen2.5-0.5B Q4_K_M 50.9, Gemma-3-270M 79). Prints a table and writes ``--json``.
``--rounds K`` repeats the coli/llama.cpp alternation K times per model and keeps each side's best avg_ts (the
machine is shared: docs/benchmarks.md); every round's figures and the load average before each run are kept in
the JSON, with the Numba threading layer. The memory-bandwidth probe beside the kernels' GB/s is
``scripts/bench/kernels.py`` (this script does not run it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

QUOTED_TG = {"smollm2": 121.0, "qwen25": 50.9, "gemma3": 79.0}


def model_file(name: str) -> Path:
    if name == "demo":
        from coli.demo import demo_model_path

        return demo_model_path(quiet=True)
    if name.startswith("demo4f16"):
        from coli.demo import demo_model_path

        return demo_model_path(n_experts=4, expert_type="F16", quiet=True)
    from coli.fetch import model_path

    return model_path(name, quiet=True)


def coli_bench(path: Path, threads: int, reps: int, extra=()) -> dict:
    cmd = [sys.executable, "-m", "coli", "bench", "-m", str(path), "-t", str(threads), "-r", str(reps), "--json", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"coli bench failed on {path}: {r.stderr[-2000:]}")
    return {x["test"]: x for x in json.loads(r.stdout)}


def llama_bench(exe: str, path: Path, threads: int, reps: int) -> dict:
    cmd = [exe, "-m", str(path), "-t", str(threads), "-p", "128", "-n", "64", "-r", str(reps), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama-bench failed on {path}: {r.stderr[-2000:]}")
    out = {}
    for x in json.loads(r.stdout):
        t = f"pp{x['n_prompt']}" if x["n_prompt"] else f"tg{x['n_gen']}"
        out[t] = x
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--models", default="smollm2,qwen25,gemma3,demo")
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--cpu-act", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=1, help="coli/llama.cpp alternations per model; best avg_ts kept")
    a = ap.parse_args()
    extra = ["--cpu-act", a.cpu_act] if a.cpu_act else []
    layer = subprocess.run([sys.executable, "-c", "import cpu_kernels; print(cpu_kernels.threading_layer())"],
                           capture_output=True, text=True, cwd=ROOT).stdout.strip()
    rows = []
    for name in a.models.split(","):
        path = model_file(name)
        rounds = []
        for _ in range(max(1, a.rounds)):
            rd = {"load_coli": os.getloadavg()}
            c = coli_bench(path, a.threads, a.reps, extra)
            rd["coli"] = {t: {"avg_ts": x["avg_ts"], "stddev_ts": x["stddev_ts"], "cpu_act": x.get("cpu_act")}
                          for t, x in c.items()}
            if a.llama_bench:
                rd["load_llama"] = os.getloadavg()
                l = llama_bench(a.llama_bench, path, a.threads, a.reps)
                rd["llama"] = {t: {"avg_ts": x["avg_ts"], "stddev_ts": x["stddev_ts"], "samples_ts": x["samples_ts"]}
                               for t, x in l.items()}
            rounds.append(rd)

        def best(side, test):
            return max((r[side][test] for r in rounds), key=lambda x: x["avg_ts"])

        c_tg, c_pp = best("coli", "tg64"), best("coli", "pp128")
        ref_tg, ref_pp, src = QUOTED_TG.get(name), None, "quoted (docs/notes/benchmarks.md)"
        if a.llama_bench:
            ref_tg, ref_pp, src = best("llama", "tg64")["avg_ts"], best("llama", "pp128")["avg_ts"], "llama-bench (same run)"
        rows.append(dict(model=name, file=path.name, coli_pp128=c_pp["avg_ts"], coli_tg64=c_tg["avg_ts"],
                         coli_tg64_sd=c_tg["stddev_ts"], llama_pp128=ref_pp, llama_tg64=ref_tg, source=src,
                         ratio_tg=(c_tg["avg_ts"] / ref_tg) if ref_tg else None, cpu_act=c_tg["cpu_act"],
                         cpu_act_pp=c_pp["cpu_act"], threading_layer=layer, threads=a.threads, reps=a.reps,
                         rounds=rounds))
        r = rows[-1]
        print(f"{name:10s} pp128 {r['coli_pp128']:8.1f}  tg64 {r['coli_tg64']:7.1f} ± {r['coli_tg64_sd']:.1f} tok/s"
              + (f"  | llama.cpp tg64 {ref_tg:.1f} ({src}): ratio {r['ratio_tg']:.2f}" if ref_tg else "")
              + (f", pp128 {ref_pp:.1f}" if ref_pp else ""), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
