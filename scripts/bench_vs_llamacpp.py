#!/usr/bin/env python3
"""coli beside llama.cpp's ``llama-bench`` on the same GGUF files and threads, alternating (docs/benchmarks.md).

For every (model, threads) and every round, the two engines run one after the other (llama.cpp first in even
rounds, coli first in odd ones, so slow drift of a shared machine hits both alike): ``llama-bench -p N -n 0``
and ``-p 0 -n M`` (separate processes, so a crash of one test does not lose the other) and ``coli bench -p N
-n M`` (one process per (model, threads): Numba's pool is sized at start). Each side's figure is the median
over the rounds of its per-run average (llama-bench's and coli's ``avg_ts``, both after their own warm-up).

llama-bench: ``--llama-bench PATH``; else the cached build ``<coli cache>/llama.cpp/build/bin/llama-bench``;
else it is built there once by ``scripts/build_llama_bench.sh`` (from the ``llama-cpp-python`` sdist, or from
``--llama-src TARBALL``, a tar of llama.cpp's tree such as a trimmed vendor tree, on a machine
without network). ``GGML_NATIVE`` builds turn on llama.cpp's AMX code where the CPU reports AMX; on some VMs
the prompt test then dies with an illegal instruction (SIGILL, exit 132): that test is run again with
``--repack 0`` (no repacked "extra buffer" weights, so no AMX) and the table says so; a test killed by another
signal (a SIGSEGV of the prompt test was seen on the 2-core VM) is retried the same way.

Prints one table (model, threads, coli pp/tg, llama.cpp pp/tg, ratios, load average before/after each
model's runs) and writes every record to ``--json``.

Usage::

    python scripts/bench_vs_llamacpp.py                                  # the four models, 2 threads
    python scripts/bench_vs_llamacpp.py -m synth.gguf -t 1,4,8,16 --llama-src .peers/llama.cpp-0.3.36-vendor-trim.tar.xz
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_MODELS = ("smollm2", "qwen25", "gemma3", "demo")
SIGILL_CODES = (-signal.SIGILL, 128 + signal.SIGILL)   # killed by the signal / a shell's 132


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def resolve_model(name: str) -> Path:
    """A path, ``demo`` (coli's demo MoE, built on first use) or a model name (``coli.fetch.resolve``)."""
    from coli.base.errors import ColiError
    from coli.fetch import resolve
    try:
        return Path(resolve(name)).resolve()
    except ColiError as e:
        sys.exit(f"bench_vs_llamacpp: model {e}")


def llama_bench_path(a) -> Path:
    """The llama-bench binary: given, cached, or built now (once) into the cache."""
    if a.llama_bench:
        p = Path(a.llama_bench)
        if not os.access(p, os.X_OK):
            sys.exit(f"bench_vs_llamacpp: --llama-bench {p}: not an executable file")
        return p
    from coli.base.paths import cache_dir
    work = Path(a.build_dir) if a.build_dir else cache_dir("llama.cpp")
    exe = work / "build" / "bin" / "llama-bench"
    if os.access(exe, os.X_OK):
        return exe
    env = dict(os.environ)
    if a.llama_src:
        env["LLAMA_SRC"] = str(Path(a.llama_src).resolve())
    env.setdefault("JOBS", str(a.jobs or os.cpu_count() or 2))
    env.setdefault("PIP", f"{sys.executable} -m pip")
    log(f"bench_vs_llamacpp: building llama-bench into {work} (once; scripts/build_llama_bench.sh)")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_bench.sh"), str(work)], env=env)
    if r.returncode != 0 or not os.access(exe, os.X_OK):
        sys.exit(f"bench_vs_llamacpp: building llama-bench failed (exit {r.returncode})")
    return exe


def run_llama(exe: Path, model: Path, threads: int, test: str, n: int, reps: int, extra=()) -> dict:
    """One llama-bench process for one test ("pp" or "tg"). Returns {"ts": avg tok/s or None, "rc", "sigill",
    "repack0", "record" | "error"}; a SIGILL is retried once with ``--repack 0``."""
    args = ["-p", str(n), "-n", "0"] if test == "pp" else ["-p", "0", "-n", str(n)]
    out = {"repack0": False}
    for attempt in range(2):
        cmd = [str(exe), "-m", str(model), "-t", str(threads), "-r", str(reps), "-o", "json", *args, *extra]
        if attempt:
            cmd += ["--repack", "0"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        out["rc"] = r.returncode
        out["cmd"] = " ".join(cmd)
        if attempt == 0 and (r.returncode < 0 or r.returncode > 128):
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
            out["error"] = (r.stderr or r.stdout)[-400:]
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


def run_coli(model: Path, threads: int, n_prompt: int, n_gen: int, reps: int, extra=()) -> dict:
    """One ``coli bench`` process (pp and tg). Returns {"pp", "tg", "rc", "records" | "error"}."""
    cmd = [sys.executable, "-m", "coli", "bench", "-m", str(model), "-t", str(threads), "-p", str(n_prompt),
           "-n", str(n_gen), "-r", str(reps), "--json", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT))
    out = {"rc": r.returncode, "cmd": " ".join(cmd)}
    if r.returncode != 0:
        out["error"] = (r.stderr or r.stdout)[-400:]
        log(f"  coli bench t={threads}: exit {r.returncode}: {out['error'].strip()[-200:]}")
        return out
    recs = json.loads(r.stdout)
    out["records"] = recs
    for rec in recs:
        out["pp" if rec["n_prompt"] else "tg"] = float(rec["avg_ts"])
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
    p.add_argument("-p", "--n-prompt", type=int, default=128)
    p.add_argument("-n", "--n-gen", type=int, default=64)
    p.add_argument("-r", "--repetitions", type=int, default=3, help="runs per test inside each process")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the two engines")
    p.add_argument("--llama-bench", default=None, metavar="PATH", help="a llama-bench binary to use")
    p.add_argument("--llama-src", default=None, metavar="TARBALL",
                   help="build llama-bench from this tarball of llama.cpp's tree (no network needed)")
    p.add_argument("--build-dir", default=None, help="where to build llama-bench (default: <coli cache>/llama.cpp)")
    p.add_argument("--jobs", type=int, default=None, help="compile jobs for the build (default: all cores)")
    p.add_argument("--coli-arg", action="append", default=[], help="extra argument for coli bench (repeatable)")
    p.add_argument("--json", default=None, metavar="OUT", help="write every record here")
    a = p.parse_args(argv)
    try:
        threads = [int(t) for t in a.threads.split(",") if t.strip()]
    except ValueError:
        sys.exit(f"bench_vs_llamacpp: -t {a.threads!r}: comma-separated integers expected")
    if not threads or min(threads) < 1 or a.rounds < 1 or a.repetitions < 1:
        sys.exit("bench_vs_llamacpp: threads, --rounds and -r must be >= 1")
    exe = llama_bench_path(a)
    models = [(Path(m).stem if Path(m).exists() else m, resolve_model(m)) for m in (a.model or DEFAULT_MODELS)]
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_name(),
            "cores": os.cpu_count(), "llama_bench": str(exe), "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
            "n_prompt": a.n_prompt, "n_gen": a.n_gen, "reps": a.repetitions, "rounds": a.rounds}
    log(f"bench_vs_llamacpp: {info['date']}, {info['cpu']} ({info['cores']} CPUs), llama-bench {exe}")
    rows, raw = [], []
    for name, path in models:
        for t in threads:
            load0 = loadavg()
            lp, lt, cp, ct, notes = [], [], [], [], set()
            for rnd in range(a.rounds):
                order = ("llama", "coli") if rnd % 2 == 0 else ("coli", "llama")
                for side in order:
                    if side == "llama":
                        rp = run_llama(exe, path, t, "pp", a.n_prompt, a.repetitions)
                        rt = run_llama(exe, path, t, "tg", a.n_gen, a.repetitions)
                        for r in (rp, rt):
                            if r.get("repack0"):
                                notes.add(f"llama.cpp {'pp' if r is rp else 'tg'}: {r.get('signal', 'SIGILL')}, "
                                          f"rerun with --repack 0")
                            if r.get("ts") is None:
                                notes.add("llama.cpp failed: " + str(r.get("error", ""))[-80:])
                        lp.append(rp.get("ts"))
                        lt.append(rt.get("ts"))
                        raw.append({"model": name, "threads": t, "round": rnd, "engine": "llama.cpp", "pp": rp, "tg": rt})
                    else:
                        rc = run_coli(path, t, a.n_prompt, a.n_gen, a.repetitions, a.coli_arg)
                        if rc["rc"] != 0:
                            notes.add("coli failed: " + rc.get("error", "")[-80:])
                        cp.append(rc.get("pp"))
                        ct.append(rc.get("tg"))
                        raw.append({"model": name, "threads": t, "round": rnd, "engine": "coli", "run": rc})
                    log(f"  {name} t={t} round {rnd} {side}: pp {fmt((lp if side == 'llama' else cp)[-1])} "
                        f"tg {fmt((lt if side == 'llama' else ct)[-1])} (load {loadavg()})")
            row = {"model": name, "file": path.name, "threads": t, "coli_pp": med(cp), "coli_tg": med(ct),
                   "llama_pp": med(lp), "llama_tg": med(lt), "coli_pp_runs": cp, "coli_tg_runs": ct,
                   "llama_pp_runs": lp, "llama_tg_runs": lt, "load_before": load0, "load_after": loadavg(),
                   "notes": sorted(notes)}
            row["ratio_pp"] = row["coli_pp"] / row["llama_pp"] if row["coli_pp"] and row["llama_pp"] else None
            row["ratio_tg"] = row["coli_tg"] / row["llama_tg"] if row["coli_tg"] and row["llama_tg"] else None
            rows.append(row)
            if a.json:      # after every row: a run cut off by a timeout keeps what it measured
                Path(a.json).parent.mkdir(parents=True, exist_ok=True)
                Path(a.json).write_text(json.dumps({"info": info, "rows": rows, "raw": raw}, indent=1))
    print(f"# coli vs llama-bench, {info['date']}, {info['cpu']} ({info['cores']} CPUs); pp{a.n_prompt} / "
          f"tg{a.n_gen} tok/s, median of {a.rounds} alternating rounds of -r {a.repetitions}")
    print(f"# command: {info['command']}")
    print("| model | threads | coli pp | coli tg | llama.cpp pp | llama.cpp tg | ratio pp | ratio tg | load before -> after | notes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['threads']} | {fmt(r['coli_pp'])} | {fmt(r['coli_tg'])} | {fmt(r['llama_pp'])} | "
              f"{fmt(r['llama_tg'])} | {fmt(r['ratio_pp'], 2)} | {fmt(r['ratio_tg'], 2)} | {r['load_before']} -> "
              f"{r['load_after']} | {'; '.join(r['notes'])} |")
    if a.json:
        log(f"bench_vs_llamacpp: records in {a.json}")
    bad = [r for r in rows if r["coli_tg"] is None or r["llama_tg"] is None]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
