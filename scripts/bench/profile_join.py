#!/usr/bin/env python
"""Where the host's time goes in a decode token of device layers whose experts are (partly) on the CPU: one table.

    python -m scripts.bench.profile_join --model M [--gpu-layers 16] (--cpu-moe | --n-cpu-moe N | --tier-gb G)
                                         [--threads 16] [--warm 16] [--tokens 64] [--ctx 512] [--spin-ms 2]

Opens the engine with that placement and ``COLI_VK_JOIN_PROFILE=1`` (docs/vulkan.md "Experts on the CPU"), decodes
``--warm`` tokens (compiles, faults the experts into the RAM cache, first submits), forgets them, decodes
``--tokens`` greedy tokens and prints the join profile (``coli.vulkan.join_profile``: host ms a token per part,
calls a token, the device's own ms by its timestamps) and the run's decode tok/s. ``--spin-ms``: how long the host
spins on a layer's flag before it sleeps on the timeline semaphore (``DeviceLayers.spin_s``). Speed numbers only mean
something on a quiet machine; the load average is printed.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import cpu_kernels  # noqa: E402,F401  (threading layer before numba)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--gpu-layers", type=int, default=-1)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--cpu-moe", action="store_true")
    g.add_argument("--n-cpu-moe", type=int, default=None)
    ap.add_argument("--tier-gb", type=float, default=None)
    ap.add_argument("--threads", "-t", type=int, default=None)
    ap.add_argument("--warm", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--spin-ms", type=float, default=None)
    ap.add_argument("--cpu-act", default=None)
    a = ap.parse_args(argv)

    from coli.base import settings
    from coli.engine import Engine

    cpu_moe = -1 if a.cpu_moe else a.n_cpu_moe
    env = settings.overlay(None, COLI_VK_LAYERS=a.gpu_layers, COLI_VK_CPU_MOE=cpu_moe, COLI_VK_TIER_GB=a.tier_gb,
                           COLI_VK_JOIN_PROFILE=True)
    kw = {} if a.cpu_act is None else {"cpu_act": a.cpu_act}
    usage = os.path.join(tempfile.mkdtemp(prefix="coli_pj"), "usage")
    e = Engine(a.model, threads=a.threads, ctx=a.ctx, device="vulkan", env=env, quiet=True, silent=True,
               save_usage=False, usage=usage, **kw)
    try:
        dl = e.model.device_layers
        if dl is None or dl.prof is None or not dl.resident:
            print("profile_join: no device layers with experts on the CPU in this placement", file=sys.stderr)
            return 2
        print(dl.describe())
        if a.spin_ms is not None:
            dl.spin_s = a.spin_ms / 1e3
        ids = [1, 2, 3, 4]
        e.generate(ids=ids, max_tokens=a.warm + 1, temp=0.0, stop_at_eos=False)
        dl.prof.reset()
        sp, sl = dl.spun, dl.slept
        r = e.generate(ids=ids, max_tokens=a.tokens + 1, temp=0.0, stop_at_eos=False)
        print(dl.prof.table(f"{Path(a.model).name}, {len(dl.resident)} layers with CPU experts, "
                            f"{a.threads or 'default'} threads"))
        print(f"decode {r.stats['decode_tps']:.1f} tok/s over {a.tokens} tokens; flags seen spinning {dl.spun - sp}, "
              f"slept {dl.slept - sl}; routed pairs device {dl.dev_rows} cpu {dl.cpu_rows}; "
              f"load {os.getloadavg()[0]:.2f}")
        dl.prof = None      # printed here, not again at close
    finally:
        e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
