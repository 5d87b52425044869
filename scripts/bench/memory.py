"""Run a command inside a fresh memory-limited cgroup and report its peak memory (root only).

    python scripts/bench/memory.py --limit-mb 500 -- python -m coli run "Once upon a time" -n 32

Creates a child group of this process's own memory cgroup (v1: ``memory.limit_in_bytes`` under
``/sys/fs/cgroup/memory``; v2: ``memory.max`` under the cgroup2 mount), starts the command in it, polls the
command's ``/proc/PID/status`` for ``VmHWM`` (its peak resident set), and prints one JSON line: exit status (137:
killed, e.g. by the OOM killer), peak RSS (VmHWM, MiB), the group's peak charge (v1 ``memory.max_usage_in_bytes``,
v2 ``memory.peak``: includes the page cache of the file reads), the OOM-kill count, wall seconds and the load
average. The command's stdout and stderr pass through. The group is removed afterwards.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MiB = 1 << 20


def _own_group():
    """(kind, folder of this process's memory cgroup)."""
    for line in open("/proc/self/cgroup").read().splitlines():
        hid, ctrls, path = line.split(":", 2)
        if "memory" in ctrls.split(","):
            return "v1", "/sys/fs/cgroup/memory" + path
    for line in open("/proc/self/cgroup").read().splitlines():
        if line.startswith("0::"):
            return "v2", "/sys/fs/cgroup" + line[3:]
    raise SystemExit("no memory cgroup found")


def _read(p, default=None):
    try:
        return open(p).read().strip()
    except OSError:
        return default


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit-mb", type=float, required=True, help="memory limit in MB (10^6 bytes)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    kind, parent = _own_group()
    limit = int(a.limit_mb * 1e6)
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
        if kind == "v1":
            open(os.path.join(g, "memory.limit_in_bytes"), "w").write(str(limit))
        else:
            open(os.path.join(g, "memory.max"), "w").write(str(limit))
            try:
                open(os.path.join(g, "memory.swap.max"), "w").write("0")
            except OSError:
                pass
        procs = os.path.join(g, "cgroup.procs")
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, preexec_fn=lambda: open(procs, "w").write(str(os.getpid())))
        hwm = 0
        while p.poll() is None:
            s = _read(f"/proc/{p.pid}/status", "")
            for line in s.splitlines():
                if line.startswith("VmHWM:"):
                    hwm = max(hwm, int(line.split()[1]) * 1024)
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        if kind == "v1":
            peak = int(_read(os.path.join(g, "memory.max_usage_in_bytes"), "0"))
            ooms = _read(os.path.join(g, "memory.oom_control"), "")
            oom = next((int(l.split()[1]) for l in ooms.splitlines() if l.startswith("oom_kill ")), None)
        else:
            peak = int(_read(os.path.join(g, "memory.peak"), "0") or 0)
            ev = _read(os.path.join(g, "memory.events"), "")
            oom = next((int(l.split()[1]) for l in ev.splitlines() if l.startswith("oom_kill ")), None)
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


if __name__ == "__main__":
    sys.exit(main())
