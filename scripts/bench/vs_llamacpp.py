#!/usr/bin/env python3
"""coli beside llama.cpp's and ik_llama.cpp's ``llama-bench`` on the same GGUF files and threads, alternating
(docs/benchmarks.md).

For every (model, threads) and every round, the engines run one after the other, each round starting with the
next one (llama.cpp, ik_llama.cpp, coli; then ik_llama.cpp, coli, llama.cpp; ...: slow drift of a shared machine
hits all alike): ``llama-bench -p N -n 0`` for every prompt length N of ``-p`` and ``-p 0 -n M`` (separate
processes, so a crash of one test does not lose the others) and ``coli bench -p N1,N2,.. -n M`` (one process per
(model, threads): Numba's pool is sized at start). Each engine's figure is the median over the rounds of its
per-run average (llama-bench's and coli's ``avg_ts``, both after their own warm-up).

llama-bench: ``--llama-bench PATH``; else the cached build ``<coli cache>/llama.cpp/build/bin/llama-bench``;
else it is built there once by ``scripts/build_llama_bench.sh`` (from the ``llama-cpp-python`` sdist, or from
``--llama-src TARBALL``, a tar of llama.cpp's tree, on a machine without network). ``GGML_NATIVE`` builds turn
on llama.cpp's AMX code where the CPU reports AMX; on some VMs the prompt test then dies with an illegal
instruction (SIGILL, exit 132): that test is run again with ``--repack 0`` (no repacked "extra buffer" weights,
so no AMX) and the table says so; a test killed by another signal (a SIGSEGV of the prompt test was seen on the
2-core VM) is retried the same way.

ik_llama.cpp's llama-bench: ``--ik-bench PATH``; else the cached build
``<coli cache>/ik_llama.cpp/build/bin/llama-bench``; else built there once from ``--ik-src TARBALL`` (a tar of
its tree) by the same script, without AMX code (``-mno-amx-*``) where ``cpu_kernels.amx.probe`` says the tile
instructions do not run; else left out (``--peers`` picks the peers).

Prints one table (model, threads, test, each engine's tok/s, coli's ratio to each peer, load average before/after
each model's runs) and writes every record to ``--json``.

Usage::

    python scripts/bench/vs_llamacpp.py                                  # the four models, 2 threads
    python scripts/bench/vs_llamacpp.py -m synth.gguf -t 1,4,8,16 --llama-src llama.cpp-0.3.36-vendor-trim.tar.xz
    python scripts/bench/vs_llamacpp.py -m smollm2 -m demo -p 128,512,2048 --peers ik_llama.cpp \\
        --ik-src ik_llama.cpp-8337e4cd3-trim.tar.xz
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from timing import load  # noqa: E402  (this folder: the script's own, first on sys.path)

DEFAULT_MODELS = ("smollm2", "qwen25", "gemma3", "demo")
SIGILL_CODES = (-signal.SIGILL, 128 + signal.SIGILL)   # killed by the signal / a shell's 132


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def resolve_model(name: str) -> Path:
    """A path, ``demo`` (coli's demo MoE, built on first use) or a model name (``coli.resolve.resolve``)."""
    from coli.base.errors import ColiError
    from coli.resolve import resolve
    try:
        return Path(resolve(name)).resolve()
    except ColiError as e:
        sys.exit(f"bench_vs_llamacpp: model {e}")


#: configure flags that keep a GGML_NATIVE build out of AMX code (gcc's -march=native turns it on where CPUID
#: reports AMX, also on a VM that kills the process at the first tile instruction)
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def peer_bench(a, peer: str) -> Path | None:
    """A peer's llama-bench binary: given (``--llama-bench`` / ``--ik-bench``), else the cached build
    ``<coli cache>/<peer>/build/bin`` (llama.cpp: ``--build-dir``), else built there once by
    ``scripts/build_llama_bench.sh`` from the tree's tarball (``--llama-src`` / ``--ik-src``; llama.cpp without one:
    the llama-cpp-python sdist; ik_llama.cpp without AMX code where the AMX probe, ``cpu_kernels.amx``, says no).
    None for ik_llama.cpp when none of these is there; exits with a message when a build fails."""
    ik = peer == "ik_llama.cpp"
    given, src, flag = (a.ik_bench, a.ik_src, "--ik-bench") if ik else (a.llama_bench, a.llama_src, "--llama-bench")
    if given:
        if not os.access(given, os.X_OK):
            sys.exit(f"bench_vs_llamacpp: {flag} {given}: not an executable file")
        return Path(given)
    from coli.base.paths import cache_dir
    work = Path(a.build_dir) if a.build_dir and not ik else cache_dir(peer)
    exe = work / "build" / "bin" / "llama-bench"
    if os.access(exe, os.X_OK):
        return exe
    if ik and not src:
        return None
    env = dict(os.environ, **({"LLAMA_SRC": str(Path(src).resolve())} if src else {}))
    if ik:
        from cpu_kernels.amx import probe
        ok, line = probe()
        log(f"bench_vs_llamacpp: {line}" + ("" if ok else "; ik_llama.cpp built without AMX code"))
        for k in ("CFLAGS", "CXXFLAGS") if not ok else ():  # the first configure reads them (CMAKE_C_FLAGS ...)
            env[k] = (env.get(k, "") + " " + NO_AMX_FLAGS).strip()
    env.setdefault("JOBS", str(a.jobs or os.cpu_count() or 2))
    env.setdefault("PIP", f"{sys.executable} -m pip")
    log(f"bench_vs_llamacpp: building llama-bench into {work} (once; scripts/build_llama_bench.sh)")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_bench.sh"), str(work)], env=env)
    if r.returncode != 0 or not os.access(exe, os.X_OK):
        sys.exit(f"bench_vs_llamacpp: building llama-bench in {work} failed (exit {r.returncode})")
    return exe


def run_llama(exe: Path, model: Path, threads: int, test: str, n: int, reps: int, extra=(), retry=True) -> dict:
    """One llama-bench process for one test ("pp" or "tg"). Returns {"ts": avg tok/s or None, "rc", "sigill",
    "repack0", "record" | "error"}; a SIGILL is retried once with ``--repack 0`` when ``retry`` (llama.cpp's
    flag; ik_llama.cpp's llama-bench has none)."""
    args = ["-p", str(n), "-n", "0"] if test == "pp" else ["-p", "0", "-n", str(n)]
    out = {"repack0": False}
    for attempt in range(2):
        cmd = [str(exe), "-m", str(model), "-t", str(threads), "-r", str(reps), "-o", "json", *args, *extra]
        if attempt:
            cmd += ["--repack", "0"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        out["rc"] = r.returncode
        out["cmd"] = " ".join(cmd)
        if retry and attempt == 0 and (r.returncode < 0 or r.returncode > 128):
            # killed by a signal: SIGILL is AMX code on a CPU that refuses it; a SIGSEGV of the prompt test was
            # seen here too (2026-11-30, 2-core VM): both are retried without the repacked weights
            sig = -r.returncode if r.returncode < 0 else r.returncode - 128
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"
            out["sigill"] = r.returncode in SIGILL_CODES
            out["signal"] = name
            what = "illegal instruction (AMX code on a CPU that refuses it)" if out["sigill"] else f"killed by {name}"
            log(f"  llama-bench {test}{n} t={threads}: {what}, exit {r.returncode}; running it again with --repack 0")
            out["repack0"] = True
            continue
        if r.returncode != 0:
            out["error"] = (r.stderr or r.stdout)[-400:] or f"exit {r.returncode}"
            out["ts"] = None
            log(f"  llama-bench {test}{n} t={threads}: exit {r.returncode}: {out['error'].strip()[-200:]}")
            return out
        try:
            recs = json.loads(r.stdout)
            rec = recs[0]
        except (ValueError, IndexError) as e:
            out["error"] = f"unreadable output ({e}): {r.stdout[-200:]}"
            out["ts"] = None
            return out
        out["record"] = rec
        out["ts"] = float(rec["avg_ts"])
        return out
    return out


def run_coli(model: Path, threads: int, n_prompt: list, n_gen: int, reps: int, extra=()) -> dict:
    """One ``coli bench`` process (every pp length and tg). Returns {"ppN": tok/s, ..., "tgM", "rc", "records" |
    "error"}."""
    cmd = [sys.executable, "-m", "coli", "bench", "-m", str(model), "-t", str(threads), "-p",
           ",".join(str(n) for n in n_prompt), "-n", str(n_gen), "-r", str(reps), "--json", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT))
    out = {"rc": r.returncode, "cmd": " ".join(cmd)}
    if r.returncode != 0:
        out["error"] = (r.stderr or r.stdout)[-400:]
        log(f"  coli bench t={threads}: exit {r.returncode}: {out['error'].strip()[-200:]}")
        return out
    recs = json.loads(r.stdout)
    out["records"] = recs
    for rec in recs:
        out[f"pp{rec['n_prompt']}" if rec["n_prompt"] else f"tg{rec['n_gen']}"] = float(rec["avg_ts"])
    return out


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", action="append", default=None,
                   help=f"GGUF path, 'demo' or a coli.fetch name (repeatable; default: {' '.join(DEFAULT_MODELS)})")
    p.add_argument("-t", "--threads", default="2", help="comma-separated thread counts (default 2)")
    p.add_argument("-p", "--n-prompt", default="128", help="comma-separated prompt lengths (default 128)")
    p.add_argument("-n", "--n-gen", type=int, default=64, help="generated tokens of the tg test (0: no tg test)")
    p.add_argument("-r", "--repetitions", type=int, default=3, help="runs per test inside each process")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the engines")
    p.add_argument("--peers", default="llama.cpp,ik_llama.cpp",
                   help="engines beside coli, comma-separated from llama.cpp, ik_llama.cpp (default both; "
                        "ik_llama.cpp only where its binary is given, cached or built from --ik-src)")
    p.add_argument("--llama-bench", default=None, metavar="PATH", help="a llama-bench binary to use")
    p.add_argument("--llama-src", default=None, metavar="TARBALL",
                   help="build llama-bench from this tarball of llama.cpp's tree (no network needed)")
    p.add_argument("--build-dir", default=None, help="where to build llama-bench (default: <coli cache>/llama.cpp)")
    p.add_argument("--ik-bench", default=None, metavar="PATH", help="ik_llama.cpp's llama-bench binary to use")
    p.add_argument("--ik-src", default=None, metavar="TARBALL",
                   help="build ik_llama.cpp's llama-bench from this tarball of its tree into "
                        "<coli cache>/ik_llama.cpp (once)")
    p.add_argument("--jobs", type=int, default=None, help="compile jobs for a build (default: all cores)")
    p.add_argument("--coli-arg", action="append", default=[], help="extra argument for coli bench (repeatable)")
    p.add_argument("--json", default=None, metavar="OUT", help="write every record here")
    a = p.parse_args(argv)
    try:
        threads = [int(t) for t in a.threads.split(",") if t.strip()]
        n_prompt = [int(n) for n in a.n_prompt.split(",") if n.strip()]
    except ValueError:
        sys.exit(f"bench_vs_llamacpp: -t {a.threads!r} / -p {a.n_prompt!r}: comma-separated integers expected")
    if not threads or min(threads) < 1 or a.n_gen < 0 or a.rounds < 1 or a.repetitions < 1 or not n_prompt or min(n_prompt) < 1:
        sys.exit("bench_vs_llamacpp: threads, prompt lengths, --rounds and -r must be >= 1, -n >= 0")
    peers = [x.strip() for x in a.peers.split(",") if x.strip()]
    if set(peers) - {"llama.cpp", "ik_llama.cpp"}:
        sys.exit(f"bench_vs_llamacpp: --peers {a.peers!r}: llama.cpp and/or ik_llama.cpp expected")
    exes = {x: peer_bench(a, x) for x in ("llama.cpp", "ik_llama.cpp") if x in peers}
    if exes.get("ik_llama.cpp", 0) is None:
        del exes["ik_llama.cpp"]
        log("bench_vs_llamacpp: ik_llama.cpp left out (no --ik-bench, no cached build, no --ik-src)")
    engines = list(exes) + ["coli"]
    tests = [f"pp{n}" for n in n_prompt] + ([f"tg{a.n_gen}"] if a.n_gen > 0 else [])  # -n 0: prompts only
    models = [(Path(m).stem if Path(m).exists() else m, resolve_model(m)) for m in (a.model or DEFAULT_MODELS)]
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_name(),
            "cores": os.cpu_count(), "peers": {k: str(v) for k, v in exes.items()},
            "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
            "n_prompt": n_prompt, "n_gen": a.n_gen, "reps": a.repetitions, "rounds": a.rounds}
    log(f"bench_vs_llamacpp: {info['date']}, {info['cpu']} ({info['cores']} CPUs), "
        + ", ".join(f"{k} {v}" for k, v in exes.items()))
    rows, raw = [], []
    for name, path in models:
        for t in threads:
            load0 = " ".join(load())
            runs = {(e, x): [] for e in engines for x in tests}
            notes = set()
            for rnd in range(a.rounds):
                k = rnd % len(engines)  # each round starts with the next engine (slow drift hits all alike)
                for side in engines[k:] + engines[:k]:
                    if side == "coli":
                        rc = run_coli(path, t, n_prompt, a.n_gen, a.repetitions, a.coli_arg)
                        if rc["rc"] != 0:
                            notes.add("coli failed: " + rc.get("error", "")[-80:])
                        for x in tests:
                            runs[("coli", x)].append(rc.get(x))
                        raw.append({"model": name, "threads": t, "round": rnd, "engine": "coli", "run": rc})
                    else:
                        res = {}
                        for x in tests:
                            r = run_llama(exes[side], path, t, x[:2], int(x[2:]), a.repetitions,
                                          retry=side == "llama.cpp")
                            res[x] = r
                            if r.get("repack0"):
                                notes.add(f"{side} {x[:2]}: {r.get('signal', 'SIGILL')}, rerun with --repack 0")
                            if r.get("ts") is None:
                                notes.add(f"{side} failed: " + str(r.get("error", ""))[-80:])
                            runs[(side, x)].append(r.get("ts"))
                        raw.append({"model": name, "threads": t, "round": rnd, "engine": side, "tests": res})
                    log(f"  {name} t={t} round {rnd} {side}: "
                        + " ".join(f"{x} {fmt(runs[(side, x)][-1])}" for x in tests) + f" (load {' '.join(load())})")
            load1 = " ".join(load())
            for x in tests:
                row = {"model": name, "file": path.name, "threads": t, "test": x, "load_before": load0,
                       "load_after": load1, "notes": sorted(notes)}
                for e in engines:
                    row[e] = med(runs[(e, x)])
                    row[e + "_runs"] = runs[(e, x)]
                for e in exes:
                    row["coli/" + e] = row["coli"] / row[e] if row["coli"] and row[e] else None
                rows.append(row)
            if a.json:      # after every model: a run cut off by a timeout keeps what it measured
                Path(a.json).parent.mkdir(parents=True, exist_ok=True)
                Path(a.json).write_text(json.dumps({"info": info, "rows": rows, "raw": raw}, indent=1))
    print(f"# coli vs {', '.join(exes) or 'nothing'}, {info['date']}, {info['cpu']} ({info['cores']} CPUs); tok/s, "
          f"median of {a.rounds} alternating rounds of -r {a.repetitions}")
    print(f"# command: {info['command']}")
    print("| model | threads | test | coli | " + " | ".join(exes) + " | "
          + " | ".join(f"coli / {e}" for e in exes) + " | load before -> after | notes |")
    print("|---|---:|---|---:|" + "---:|" * (2 * len(exes)) + "---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['threads']} | {r['test']} | {fmt(r['coli'])} | "
              + "".join(f"{fmt(r[e])} | " for e in exes) + "".join(f"{fmt(r['coli/' + e], 2)} | " for e in exes)
              + f"{r['load_before']} -> {r['load_after']} | {'; '.join(r['notes'])} |")
    if a.json:
        log(f"bench_vs_llamacpp: records in {a.json}")
    bad = [r for r in rows if r["test"].startswith("tg") and any(r[e] is None for e in engines)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
