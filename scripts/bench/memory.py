"""Memory: two measurements, one ``--op`` each (the machine is shared: print the load).

    python scripts/bench/memory.py --op cgroup --limit-mb 500 -- python -m coli run "Once upon a time" -n 32
    python scripts/bench/memory.py --op footprint -m smollm2 -n 16 [--keep-pages]

Prompt and decode speed per KV cache type is ``coli bench -m smollm2 -ctk q8_0 -ctv q8_0 -p 512 -n 64``, a run per type.

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
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from pathlib import Path

if not os.environ.get("PYTHONPATH"):    # this checkout's coli, not the one installed (as the other scripts)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from timing import about, run_op  # noqa: E402

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


def cgroup(argv) -> int:
    ap = argparse.ArgumentParser(prog="memory.py --op cgroup", description=about(__doc__, "cgroup"))
    ap.add_argument("--limit-mb", type=float, required=True, help="memory limit in MB (10^6 bytes)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
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


def footprint(argv) -> int:
    ap = argparse.ArgumentParser(prog="memory.py --op footprint", description=about(__doc__, "footprint"))
    ap.add_argument("-m", "--model", default="smollm2")
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep-pages", action="store_true",
                    help="keep the repacked tensors' file pages mapped (the run before Model.drop_file_pages)")
    a = ap.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(run_op(__doc__, {"cgroup": cgroup, "footprint": footprint}))
