#!/usr/bin/env python3
"""Benchmark the device expert tier (docs/tier.md): one prompt, three arms, alternating.

Arms: ``cpu`` (no device), ``tier`` (``device="vulkan", balance=False``: the tier, share fixed at 1) and
``balanced`` (``device="vulkan", balance=True``). Each round runs every arm once, in turn (a different
order each round, so slow drift of the machine hits every arm alike); after one warm-up round (not counted)
it does ``--runs`` rounds and prints each arm's median decode tok/s, its runs, and for the tier arms the %
of the device's time hidden behind the CPU (``(device ms − waited ms) / device ms`` from the tier's
counters), the share of routed pairs the device computed, and the balancer's final share.

Every run opens a fresh ``coli.Engine`` from the same copy of the routing history (``--usage``; the runs do
not save theirs), so each starts from the same warm start. ``--warm-gen N`` first generates N tokens on that
engine, untimed: the measured generate then starts as a running session would (the experts the CPU needs
already read into RAM). Without it, the first CPU use of each expert (a disk read and its preparation) lands
in whichever phase first needs it: the CPU-only arm reads nearly all of them during the prompt, the balanced
arm partly during the decode, which its decode tok/s then pays. On the same prompt the greedy tokens repeat the
warm-up's, so the warm-up should be longer than the measured generate: with ``--warm-gen 32 --tokens 64`` on the
H200's synthetic MoE the last 32 measured tokens still read experts from disk and the CPU-only arm measured 29.8
tok/s where its steady state is 59.6 (docs/notes/benchmarks.md, 2026-12-01 22:39 and 23:13 UTC). The cores: ``--threads`` Numba threads; Lavapipe's
own ``LP_NUM_THREADS`` (``--lp-threads``, set before the Vulkan driver loads) — the header says both.

Usage::

    python scripts/bench/tier.py --model demo --tokens 64 --runs 5 --threads 1 --lp-threads 1
    COLI_VK_TIER_GB=2 python scripts/bench/tier.py --model synth.gguf --threads 16 --runs 5 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ARMS = {"cpu": dict(device=None), "tier": dict(device="vulkan", balance=False),
        "balanced": dict(device="vulkan", balance=True),
        # the balancer without its decode gate (docs/balancer.md "The decode gate"): not in the default arms
        "balanced-nogate": dict(device="vulkan", balance=True, env_extra={"COLI_VK_DECODE_GATE": "0"}),
        # the split by layer (--gpu-layers, docs/vulkan.md "Device layers"): the last --gpu-layers layers whole on
        # the device, the budget --layers-gb; not in the default arms
        "layers": dict(device="vulkan", layers=True),
        # the tier with LFRU alone, every promotion admitted (docs/tier.md "Admission by yield"): not in the default arms
        "tier-yield": dict(device="vulkan", balance=False, env_extra={"COLI_VK_TIER_YIELD": "1"}),
        # the tier and the layers without the clock holder (docs/vulkan.md "Clocks"): not in the default arms
        "tier-noclock": dict(device="vulkan", balance=False, env_extra={"COLI_VK_HOLD_CLOCK": "0"}),
        "layers-noclock": dict(device="vulkan", layers=True, env_extra={"COLI_VK_HOLD_CLOCK": "0"})}


def one_run(model, arm, args, usage_copy):
    from coli.engine import Engine  # after main set LP_NUM_THREADS (read when the driver loads)

    kw = dict(ARMS[arm])
    extra = kw.pop("env_extra", None)
    if kw.pop("layers", False):
        extra = {**(extra or {}), "COLI_VK_LAYERS": str(args.gpu_layers), "COLI_VK_TIER_GB": str(args.layers_gb)}
    if extra:
        kw["env"] = {**os.environ, **extra}
    t0 = time.perf_counter()
    eng = Engine(model, threads=args.threads, usage=usage_copy, save_usage=False, quiet=True,
                 expert_cache=args.expert_cache, **kw)
    try:
        if kw.get("device") and getattr(eng, "tier", None) is None and getattr(eng, "device_layers", None) is None:
            sys.exit(f"bench_tier: arm {arm}: the engine opened no device tier (see the [VK] line above)")
        load_s = time.perf_counter() - t0
        trail = []
        t = getattr(eng, "tier", None)
        if t is not None and t.balancer.enabled:
            bal, upd = t.balancer, t.balancer.update

            def rec(st):
                s = upd(st)
                trail.append((st.device_ms, st.device_rows, st.cpu_ms, st.cpu_rows, st.waited_ms, s,
                              bal.target if bal.target is not None else float("nan")))
                return s
            bal.update = rec
        if args.warm_gen > 0:
            eng.generate(args.prompt, max_tokens=args.warm_gen, temp=0.0, stop_at_eos=False)
        n_warm = len(trail)
        r = eng.generate(args.prompt, max_tokens=args.tokens, temp=0.0, stop_at_eos=False)
        st = dict(r.stats)
        out = {"arm": arm, "decode_tps": st.get("decode_tps", 0.0), "prefill_tps": st.get("prefill_tps", 0.0),
               "load_s": load_s, "ids": list(r.ids)}
        dl = getattr(eng, "device_layers", None)
        if dl is not None:
            out.update(device_layers=len(dl.layers), layer_tokens=dl.tokens, layer_gib=dl.weight_bytes / 2**30)
        t = getattr(eng, "tier", None)
        if t is not None:
            out.update(device_ms=t.device_ms, waited_ms=t.waited_ms, cpu_ms=t.cpu_ms,
                       hidden_pct=100.0 * (t.device_ms - t.waited_ms) / t.device_ms if t.device_ms else None,
                       device_pct=100.0 * t.device_pairs / t.routed_pairs if t.routed_pairs else 0.0,
                       share=t.balancer.share, handed_rows=t.handed_rows, resident=len(t.resident),
                       evictions=t.evictions, uploads=t.uploads, warm_uploads=t.warm_uploads,
                       upload_gib=t.upload_bytes / 2**30, skipped_yield=getattr(t, "skipped_yield", 0), on=t.on,
                       trail=trail, trail_warm=n_warm,
                       without_device=t.tokens_without)
        return out
    finally:
        eng.close()


def plot_share(run, model, a, path):
    """The device share after each batch of one balanced run (a measured run), with the per-batch times."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    tr = np.array(run["trail"], dtype=float)
    x = np.arange(len(tr))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot(x, tr[:, 5], label="device share after the batch")
    ax1.plot(x, tr[:, 6], "--", label="the controller's target (equal finish)")
    ax1.set_ylim(0, 1.05)
    ax1.set_ylabel("device share of resident rows")
    if run.get("trail_warm"):
        for ax in (ax1, ax2):
            ax.axvline(run["trail_warm"] - 0.5, color="gray", ls=":", lw=1)
        ax1.text(run["trail_warm"], 0.95, " the measured generate starts", fontsize=8, va="top")
    ax1.legend(fontsize=8)
    ax1.set_title(f"MEASURED: {Path(model).name}\nwarm-up generate of {a.warm_gen} tokens, then {a.tokens} "
                  f"tokens measured\nNumba threads {a.threads}, LP_NUM_THREADS={os.environ.get('LP_NUM_THREADS', 'unset')}; "
                  f"{run['decode_tps']:.2f} tok/s, {run['device_pct']:.0f}% of pairs on the device", fontsize=8)
    ax2.semilogy(x, np.maximum(tr[:, 0], 1e-3), ".", ms=3, label="device ms (batch)")
    ax2.semilogy(x, np.maximum(tr[:, 2], 1e-3), ".", ms=3, label="CPU ms (issue to join)")
    ax2.semilogy(x, np.maximum(tr[:, 4], 1e-3), ".", ms=3, label="waited ms (join)")
    ax2.set_xlabel("device batch (MoE layer steps that issued one), from the engine's start")
    ax2.set_ylabel("ms")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"share plot: {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="the tier benchmark: cpu / tier / balanced, alternating")
    ap.add_argument("--model", default="demo", help="a GGUF path, a catalog name, or 'demo' (the demo MoE)")
    ap.add_argument("--prompt", default="Write a short story about a lighthouse keeper who finds a map.")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warm-gen", type=int, default=0, metavar="N",
                    help="first generate N tokens on the same engine (not timed): the measured generate then "
                         "starts with the experts in RAM / on the device as a running session has them")
    ap.add_argument("--threads", type=int, default=None, help="Numba threads (default: the engine's)")
    ap.add_argument("--lp-threads", type=int, default=None, help="LP_NUM_THREADS for Lavapipe")
    ap.add_argument("--expert-cache", type=int, default=None, help="RAM expert slots per layer")
    ap.add_argument("--usage", default=None, help="routing history to start every run from (copied)")
    ap.add_argument("--arms", default="cpu,tier,balanced")
    ap.add_argument("--gpu-layers", type=int, default=-1, metavar="N",
                    help="the layers arm: the last N layers on the device (-1: as many as --layers-gb holds)")
    ap.add_argument("--layers-gb", type=float, default=64.0, metavar="GB",
                    help="the layers arm: the device budget (COLI_VK_TIER_GB)")
    ap.add_argument("--json", default=None, help="write every run and the medians here")
    ap.add_argument("--share-plot", default=None, metavar="PNG",
                    help="plot the balancer's device share over the last balanced run (matplotlib)")
    a = ap.parse_args(argv)
    if a.lp_threads is not None:
        os.environ["LP_NUM_THREADS"] = str(a.lp_threads)
    arms = [x for x in a.arms.split(",") if x]
    bad = [x for x in arms if x not in ARMS]
    if bad:
        sys.exit(f"bench_tier: --arms: unknown {bad} ({', '.join(ARMS)})")
    from coli.resolve import resolve

    model = resolve(a.model)
    tmp = Path(tempfile.mkdtemp(prefix="coli-bench-tier-"))
    hist = tmp / "history.coli_usage"
    if a.usage:
        shutil.copy(a.usage, hist)
    print(f"bench_tier: {model}, {a.tokens} tokens, {a.runs} runs per arm after a warm-up round; Numba threads "
          f"{a.threads or 'default'}, LP_NUM_THREADS={os.environ.get('LP_NUM_THREADS', 'unset')}, "
          f"COLI_VK_TIER_GB={os.environ.get('COLI_VK_TIER_GB', 'unset')}, CPUs {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}", flush=True)
    runs = []
    try:
        for rnd in range(a.runs + 1):
            order = arms[rnd % len(arms):] + arms[:rnd % len(arms)]
            for arm in order:
                usage_copy = tmp / f"run-{rnd}-{arm}.coli_usage"
                if hist.exists():
                    shutil.copy(hist, usage_copy)
                r = one_run(model, arm, a, str(usage_copy))
                r["round"] = rnd
                tag = "warm-up" if rnd == 0 else f"round {rnd}"
                extra = "" if r.get("hidden_pct") is None else \
                    (f", {r['device_pct']:.0f}% pairs on the device, {r['hidden_pct']:.0f}% of device time hidden, share "
                     f"{r['share']:.2f}, uploads {r['uploads'] - r['warm_uploads']} after the warm start "
                     f"({r['upload_gib']:.2f} GiB in all), evictions {r['evictions']}, skipped by yield {r['skipped_yield']}")
                if r.get("device_layers"):
                    extra = (f", {r['device_layers']} layers on the device ({r['layer_gib']:.2f} GiB), "
                             f"{r['layer_tokens']} decode tokens there")
                print(f"  {tag:>8} {arm:>9}: {r['decode_tps']:.2f} tok/s{extra}", flush=True)
                if rnd > 0:
                    runs.append(r)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {}
    print("arm        median tok/s   runs                               hidden %   device %")
    for arm in arms:
        rs = [r for r in runs if r["arm"] == arm]
        tps = [r["decode_tps"] for r in rs]
        hid = [r["hidden_pct"] for r in rs if r.get("hidden_pct") is not None]
        dev = [r["device_pct"] for r in rs if "device_pct" in r]
        med[arm] = {"tps": statistics.median(tps), "hidden_pct": statistics.median(hid) if hid else None,
                    "device_pct": statistics.median(dev) if dev else None}
        h = "-" if med[arm]["hidden_pct"] is None else f"{med[arm]['hidden_pct']:.0f}"
        d = "-" if med[arm]["device_pct"] is None else f"{med[arm]['device_pct']:.0f}"
        runs_s = " ".join(f"{x:.2f}" for x in tps)
        print(f"{arm:<10} {med[arm]['tps']:>12.2f}   {runs_s:<34} {h:>8}   {d:>8}")
    ids = {arm: [r["ids"] for r in runs if r["arm"] == arm] for arm in arms}
    if "cpu" in ids and ids["cpu"]:
        same = {arm: all(x == ids["cpu"][0] for x in v) for arm, v in ids.items()}
        print("greedy tokens equal to the CPU-only run: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in same.items()))
    if "balanced" in med:
        others = [med[x]["tps"] for x in ("cpu", "tier") if x in med]
        if others and max(others) > 0:
            print(f"balanced / best of the others: {med['balanced']['tps'] / max(others):.3f}")
    for x in ("tier", "tier-yield", "tier-noclock", "layers", "layers-noclock"):
        if x in med and "cpu" in med and med["cpu"]["tps"] > 0:
            print(f"{x} / cpu: {med[x]['tps'] / med['cpu']['tps']:.3f}")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    bal_runs = [r for r in runs if r["arm"] == "balanced" and r.get("trail")]
    if a.share_plot and bal_runs:
        plot_share(bal_runs[-1], model, a, a.share_plot)
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": runs, "medians": med, "args": vars(a)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
