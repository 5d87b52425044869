"""Memory: two measurements, one ``--op`` each (the machine is shared: print the load).

    python scripts/bench/memory.py --op cgroup --limit-mb 500 -- python -m coli run "Once upon a time" -n 32
    python scripts/bench/memory.py --op versus -m demo.gguf --limit-mb 500 --llama-bench PATH -t 2 -n 16
    python scripts/bench/memory.py --op footprint -m smollm2 -n 16 [--keep-pages]

Prompt and decode speed per KV cache type is ``coli bench -m smollm2 -ctk q8_0 -ctv q8_0 -p 512 -n 64``, a run per type.

``cgroup`` (root only): the command in a fresh child of this process's memory cgroup (v1 ``memory.limit_in_bytes``,
v2 ``memory.max`` and no swap), its ``/proc/PID/status`` ``VmHWM`` polled; one JSON line: exit status (137: killed,
e.g. by the OOM killer), peak RSS (MiB), the group's peak charge (v1 ``memory.max_usage_in_bytes``, v2
``memory.peak``: with the page cache of the file reads), the OOM kills, wall seconds, the load. The group is
removed afterwards.

``versus`` (root only): coli's and llama.cpp's decode of one model, each in a memory cgroup of ``--limit-mb``
(``cgroup`` above), default settings (``coli bench -t T -p 0 -n N -r R -o json``; ``llama-bench`` the same flags:
llama.cpp maps the file), the file's pages dropped before each run (``posix_fadvise(DONTNEED)``), rounds of both
arms in alternating order; one table row a run (tok/s, exit, OOM kills, peak RSS, the group's peak, wall, load) and
the ratio of the medians. The container targets: the demo MoE in 500 MB, the 7 GB synthetic in 4 GiB (4294.97 MB).

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
    print(json.dumps(in_cgroup(cmd, a.limit_mb)), flush=True)
    return 0


def in_cgroup(cmd, limit_mb: float, stdout=None, timeout: float | None = None) -> dict:
    """``cmd`` run in a fresh child of this process's memory cgroup limited to ``limit_mb`` MB (``cgroup``'s
    paragraph above); its output to ``stdout`` (a file; None: this process's); killed after ``timeout`` seconds
    (exit -9). Returns the JSON line's fields."""
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
        limits = {"v1": {"memory.limit_in_bytes": int(limit_mb * 1e6)},
                  "v2": {"memory.max": int(limit_mb * 1e6), "memory.swap.max": 0}}[kind]
        for name, v in limits.items():
            try:
                open(os.path.join(g, name), "w").write(str(v))
            except OSError:
                if name != "memory.swap.max":   # a kernel without swap accounting has no swap.max
                    raise
        procs = os.path.join(g, "cgroup.procs")
        load, t0 = os.getloadavg()[0], time.perf_counter()
        p = subprocess.Popen(cmd, stdout=stdout, preexec_fn=lambda: open(procs, "w").write(str(os.getpid())))
        hwm = 0
        while p.poll() is None:
            for line in _read(f"/proc/{p.pid}/status", "").splitlines():
                if line.startswith("VmHWM:"):
                    hwm = max(hwm, int(line.split()[1]) * 1024)
            if timeout is not None and time.perf_counter() - t0 > timeout:
                p.kill()
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        peak = int(_read(os.path.join(g, "memory.max_usage_in_bytes" if kind == "v1" else "memory.peak"), "0") or 0)
        ev = _read(os.path.join(g, "memory.oom_control" if kind == "v1" else "memory.events"), "")
        oom = next((int(ln.split()[1]) for ln in ev.splitlines() if ln.startswith("oom_kill ")), None)
        return {"cgroup": kind, "limit_mb": limit_mb, "exit": p.returncode, "peak_rss_mib": round(hwm / MiB, 1),
                "group_peak_mib": round(peak / MiB, 1), "oom_kills": oom, "wall_s": round(wall, 2),
                "load_before": load}
    finally:
        for _ in range(50):
            try:
                os.rmdir(g)
                break
            except OSError:
                time.sleep(0.1)


def _drop_pages(path: str) -> None:
    """The file's pages out of the page cache (written back first: ``posix_fadvise(DONTNEED)`` drops clean pages
    only), so that the next run reads it from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def versus(argv) -> int:
    ap = argparse.ArgumentParser(prog="memory.py --op versus", description=about(__doc__, "versus"))
    ap.add_argument("-m", "--model", required=True, help="a GGUF file (on a disk: a tmpfs file is RAM already)")
    ap.add_argument("--limit-mb", type=float, required=True, help="the group's memory limit in MB (10^6 bytes)")
    ap.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench (CPU build)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=16, help="tokens a timed run decodes (tgN)")
    ap.add_argument("-r", type=int, default=1, help="timed runs an arm (each arm's first, untimed, warms up)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both arms, their order alternating")
    ap.add_argument("--timeout", type=float, default=600, help="seconds an arm may run (then killed: no figure)")
    ap.add_argument("--json", help="write the rows here (a JSON array)")
    a = ap.parse_args(argv)
    import statistics
    import tempfile

    model = os.path.abspath(a.model)
    arms = {"coli": [sys.executable, "-m", "coli", "bench", "-m", model, "-t", str(a.threads), "-p", "0",
                     "-n", str(a.n), "-r", str(a.r), "-o", "json"],
            "llama.cpp": [a.llama_bench, "-m", model, "-t", str(a.threads), "-p", "0", "-n", str(a.n),
                          "-r", str(a.r), "-o", "json"]}
    rows = []
    print(f"| round | arm | tok/s | exit | oom kills | peak RSS MiB | group peak MiB | wall s | load |\n"
          f"|---|---|---|---|---|---|---|---|---|", flush=True)
    for rnd in range(a.rounds):
        for arm in (("coli", "llama.cpp") if rnd % 2 == 0 else ("llama.cpp", "coli")):
            _drop_pages(model)
            with tempfile.TemporaryFile("w+") as out:
                r = in_cgroup(arms[arm], a.limit_mb, stdout=out, timeout=a.timeout)
                out.seek(0)
                text = out.read()
            try:
                rec = json.loads(text[text.index("["):])[-1]
                tps = float(rec["avg_ts"])
            except (ValueError, KeyError, IndexError):
                rec, tps = {}, None
            r.update(round=rnd + 1, arm=arm, tok_s=tps, tail=text[-300:] if tps is None else "",
                     expert_cache=rec.get("expert_cache"), expert_bytes_read=rec.get("expert_bytes_read"))
            rows.append(r)
            print(f"| {rnd + 1} | {arm} | {'-' if tps is None else f'{tps:.3f}'} | {r['exit']} | {r['oom_kills']} | "
                  f"{r['peak_rss_mib']} | {r['group_peak_mib']} | {r['wall_s']} | {r['load_before']:.1f} |",
                  flush=True)
    med = {arm: statistics.median([r["tok_s"] for r in rows if r["arm"] == arm and r["tok_s"]] or [0])
           for arm in arms}
    ratio = med["coli"] / med["llama.cpp"] if med["llama.cpp"] else float("nan")
    print(f"median tok/s: coli {med['coli']:.3f}, llama.cpp {med['llama.cpp']:.3f}: {ratio:.2f}x "
          f"({os.path.basename(model)}, {a.limit_mb:g} MB, tg{a.n}, -t {a.threads})", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


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
    sys.exit(run_op(__doc__, {"cgroup": cgroup, "versus": versus, "footprint": footprint}))
