"""Memory and the KV cache: three measurements, one subcommand each (the machine is shared: print the load).

    python scripts/bench/memory.py cgroup --limit-mb 500 -- python -m coli run "Once upon a time" -n 32
    python scripts/bench/memory.py footprint -m smollm2 -n 16 [--keep-pages]
    python scripts/bench/memory.py kv-types -m smollm2 demo --types f32 f16 q8_0 --threads 2 --pp 512 --tg 64

``cgroup`` (root only): the command in a fresh child of this process's memory cgroup (v1 ``memory.limit_in_bytes``,
v2 ``memory.max`` and no swap), its ``/proc/PID/status`` ``VmHWM`` polled; one JSON line: exit status (137: killed,
e.g. by the OOM killer), peak RSS (MiB), the group's peak charge (v1 ``memory.max_usage_in_bytes``, v2
``memory.peak``: with the page cache of the file reads), the OOM kills, wall seconds, the load. The group is
removed afterwards.

``footprint``: what coli's own code costs in resident memory, in this one process, the resident set (psutil) after
each step: ``import numba``; ``import cpu_kernels``; ``import coli.models.base`` (the shared kernel modules; the
C-symbol kernel loads from Numba's cache and starts its LLVM JIT); the model loaded (the file's dense bytes, the
file pages given back by ``Model.drop_file_pages`` (``--keep-pages``: not given back) and the mapping's resident
bytes beside it); a greedy generate of ``-n`` tokens. ``tracemalloc`` counts Python's and NumPy's allocations; the
rest is native (LLVM, the kernels' code, the libraries). Run it twice: a first run compiles (minutes).

``kv-types``: prompt (pp) and decode (tg) tok/s per ``--cache-type-k/-v``: per model one engine; per round each type
in turn (alternating: a drift of the load falls on every type alike) on a fresh cache: ``--pp`` ids timed whole,
then ``--tg`` decode rows. One JSON line per (model, type, round), then the medians per type.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MiB = 1 << 20


def _read(p, default=None):
    try:
        return open(p).read().strip()
    except OSError:
        return default


def _own_group():
    """(kind, folder of this process's memory cgroup)."""
    lines = open("/proc/self/cgroup").read().splitlines()
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if "memory" in ctrls.split(","):
            return "v1", "/sys/fs/cgroup/memory" + path
    for line in lines:
        if line.startswith("0::"):
            return "v2", "/sys/fs/cgroup" + line[3:]
    raise SystemExit("no memory cgroup found")


def cgroup(a) -> int:
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    kind, parent = _own_group()
    if kind == "v2" and not os.path.exists(os.path.join(parent, "memory.max")):
        parent = "/sys/fs/cgroup"   # v2: a group whose parent has the memory controller (the root's children do)
    g = os.path.join(parent.rstrip("/"), f"coli-bench-{os.getpid()}")
    if kind == "v2":
        try:
            open(os.path.join(parent, "cgroup.subtree_control"), "w").write("+memory")
        except OSError:
            pass
    os.mkdir(g)
    try:
        limits = {"v1": {"memory.limit_in_bytes": int(a.limit_mb * 1e6)},
                  "v2": {"memory.max": int(a.limit_mb * 1e6), "memory.swap.max": 0}}[kind]
        for name, v in limits.items():
            try:
                open(os.path.join(g, name), "w").write(str(v))
            except OSError:
                if name != "memory.swap.max":   # a kernel without swap accounting has no swap.max
                    raise
        procs = os.path.join(g, "cgroup.procs")
        load, t0 = os.getloadavg()[0], time.perf_counter()
        p = subprocess.Popen(cmd, preexec_fn=lambda: open(procs, "w").write(str(os.getpid())))
        hwm = 0
        while p.poll() is None:
            for line in _read(f"/proc/{p.pid}/status", "").splitlines():
                if line.startswith("VmHWM:"):
                    hwm = max(hwm, int(line.split()[1]) * 1024)
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        peak = int(_read(os.path.join(g, "memory.max_usage_in_bytes" if kind == "v1" else "memory.peak"), "0") or 0)
        ev = _read(os.path.join(g, "memory.oom_control" if kind == "v1" else "memory.events"), "")
        oom = next((int(ln.split()[1]) for ln in ev.splitlines() if ln.startswith("oom_kill ")), None)
        print(json.dumps({"cgroup": kind, "limit_mb": a.limit_mb, "exit": p.returncode,
                          "peak_rss_mib": round(hwm / MiB, 1), "group_peak_mib": round(peak / MiB, 1),
                          "oom_kills": oom, "wall_s": round(wall, 2), "load_before": load}), flush=True)
        return 0
    finally:
        for _ in range(50):
            try:
                os.rmdir(g)
                break
            except OSError:
                time.sleep(0.1)


def _file_rss(path: str) -> int:
    """Resident bytes of this process's mappings of the file ``path`` (``/proc/self/smaps``)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                inside = len(head) >= 6 and head[5] == path
            elif inside and head[0] == "Rss:":
                rss += int(head[1]) * 1024
    return rss


def footprint(a) -> int:
    import tracemalloc

    import psutil

    if a.keep_pages:
        from coli.models import base

        base.Model.drop_file_pages = lambda self: 0
    proc = psutil.Process()
    tracemalloc.start()
    rows = []

    def step(name):
        rows.append((name, proc.memory_info().rss, tracemalloc.get_traced_memory()[0]))

    step("python")
    import numba  # noqa: F401
    step("import numba")
    import cpu_kernels  # noqa: F401
    step("import cpu_kernels")
    import coli.models.base  # noqa: F401
    step("import coli.models.base")
    from coli.engine import Engine

    eng = Engine(a.model, threads=a.threads, save_usage=False, quiet=True, ctx=256)
    step("model loaded")
    dense, mapped = eng.model.dense_bytes, _file_rss(str(eng.path.resolve()))
    eng.generate("The capital of France is", max_tokens=a.n)
    step(f"after a {a.n}-token generate")
    kernels = sorted(m[12:] for m in sys.modules if m.startswith("cpu_kernels."))
    mapped_end = _file_rss(str(eng.path.resolve()))
    eng.close()
    print(json.dumps(dict(model=a.model, rss_mib={k: round(v / MiB, 1) for k, v, _ in rows},
                          traced_mib={k: round(t / MiB, 1) for k, _, t in rows},
                          dense_file_mib=round(dense / MiB, 1), dropped_mib=round(eng.model.dropped_bytes / MiB, 1),
                          file_rss_mib_loaded=round(mapped / MiB, 1), file_rss_mib_end=round(mapped_end / MiB, 1),
                          kernel_modules=kernels, load=round(os.getloadavg()[0], 2))))
    print("| step | RSS MiB | + MiB | of which Python/NumPy (traced) | native (RSS - traced) |\n|---|---|---|---|---|")
    prev = 0
    for k, v, t in rows:
        print(f"| {k} | {v / MiB:.1f} | {(v - prev) / MiB:+.1f} | {t / MiB:.1f} | {(v - t) / MiB:.1f} |")
        prev = v
    return 0


def _kv_run(m, types, pp: int, tg: int) -> tuple[float, float]:
    import numpy as np

    m.args.kv_types = types
    kv = m.new_cache(pp + tg + 1)
    t0 = time.perf_counter()
    tok = int(m.forward(np.arange(pp) % 1000 + 10, kv)[-1].argmax())
    t1 = time.perf_counter()
    for _ in range(tg):
        tok = int(m.forward([tok], kv)[0].argmax())
    return pp / (t1 - t0), tg / (time.perf_counter() - t1)


def kv_types(a) -> int:
    import cpu_kernels
    from coli.engine import Engine

    rows = []
    for name in a.models:
        with Engine(name if name != "demo" else None, threads=a.threads, save_usage=False, quiet=True,
                    ctx=a.pp + a.tg + 1) as eng:
            cpu_kernels.set_threads(a.threads)
            load0 = os.getloadavg()[0]
            for t in ["f32", *a.types]:
                _kv_run(eng.model, (t, t), 64, 4)   # warm: kernels compiled, expert cache filled
            res = {t: [] for t in a.types}
            for r in range(a.rounds):
                for t in a.types:
                    pp, tg = _kv_run(eng.model, (t, t), a.pp, a.tg)
                    res[t].append((pp, tg))
                    print(json.dumps(dict(model=name, type=t, round=r, pp_tok_s=round(pp, 2), tg_tok_s=round(tg, 2),
                                          load=round(os.getloadavg()[0], 2))), flush=True)
            rows += [(name, t, statistics.median(x[0] for x in res[t]), statistics.median(x[1] for x in res[t]),
                      load0, os.getloadavg()[0]) for t in a.types]
    print(f"\n| model | KV type | pp{a.pp} tok/s | tg{a.tg} tok/s | load before / after |\n|---|---|---|---|---|")
    for name, t, pp, tg, l0, l1 in rows:
        print(f"| {name} | {t} | {pp:.1f} | {tg:.2f} | {l0:.2f} / {l1:.2f} |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cgroup", help="a command's peak memory under a limit (root only)")
    c.add_argument("--limit-mb", type=float, required=True, help="memory limit in MB (10^6 bytes)")
    c.add_argument("cmd", nargs=argparse.REMAINDER)
    f = sub.add_parser("footprint", help="coli's resident set step by step")
    f.add_argument("-m", "--model", default="smollm2")
    f.add_argument("-n", type=int, default=16)
    f.add_argument("--threads", type=int, default=2)
    f.add_argument("--keep-pages", action="store_true",
                   help="keep the repacked tensors' file pages mapped (the run before Model.drop_file_pages)")
    k = sub.add_parser("kv-types", help="pp / tg tok/s per KV cache type")
    k.add_argument("-m", "--models", nargs="+", default=["smollm2", "demo"])
    k.add_argument("--types", nargs="+", default=["f32", "f16", "q8_0"])
    k.add_argument("--threads", type=int, default=2)
    k.add_argument("--pp", type=int, default=512)
    k.add_argument("--tg", type=int, default=64)
    k.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    return {"cgroup": cgroup, "footprint": footprint, "kv-types": kv_types}[a.what](a)


if __name__ == "__main__":
    sys.exit(main())
