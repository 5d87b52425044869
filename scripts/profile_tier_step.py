#!/usr/bin/env python
"""Where a decode token goes when the device tier is on: per-part timers of the MoE layer step, as a table.

    python scripts/profile_tier_step.py MODEL [-t THREADS] [--tokens 32] [--warm 32] [--arms cpu,tier]
                                              [--rounds 1]

MODEL: a GGUF path or a name ``coli.fetch`` knows; the tier's budget comes from ``COLI_VK_TIER_GB`` as for
``coli run``. Each arm opens its own ``coli.Engine`` (``cpu``: no device; ``tier``: ``device="vulkan"``, not
balanced; ``balanced``; the variants ``tier-blocks``, ``tier-rate0``, ``tier-norec`` of :func:`run_arm`),
generates max(``--warm``, ``--tokens``) tokens untimed (on the same prompt a generate longer than any before
it routes experts not loaded yet, docs/engine.md "KV cache": the warm-up covers the measured length), then
``--tokens`` tokens twice: once plain and once with timers around the step's parts (inclusive ms per decode
token, the prompt's forward left out; the timers add ~1 us per wrapped call):

=====================  ==================================================================================
token                  one decode token (``Model.forward``)
attention region       a decode row's compiled attention block (``cpu_kernels.decode.AttentionDecode``)
MoE layer region       the compiled MoE layer (attention, router, experts: ``cpu_kernels.decode_moe``); with
                       the tier on it stops after the router and calls the step: the step's time is inside
router                 the MoE block's logits and top-k (``MoE.logits`` and its ``route``)
step                   ``MoEStep.run``: everything below, and its own Python
 issue_step            ``Tier.issue_step`` / ``issue_row`` (a decode row): settle, split, the batch's submit
  settle               ``Tier.settle`` (finished uploads become resident, promotions decided)
  split                ``Tier.split`` (device / CPU experts, the balancer's hand-over)
  submit               ``Device.submit_experts`` (checks, grouping, tables, recording, ``vkQueueSubmit``)
 cpu experts           ``MoEStep._compute_many`` / ``_run_row`` / ``ExpertsRow.pairs`` (the CPU's pairs)
 join                  ``MoEStep._join_device``: the fence wait, copying ``y``, the balancer's update
  fence wait           ``vkWaitForFences`` (``Batch._wait``)
 combine               the rank-order sum of the pair outputs
=====================  ==================================================================================

The device's own time per batch (timestamps) and the tier's run line come from the tier's counters. Speed
numbers compare only within one run (docs/benchmarks.md); the load average is printed.
"""
from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cpu_kernels  # noqa: E402,F401  (threading layer before numba)

_T = defaultdict(float)
_N = defaultdict(int)


_PROMPT = [True]   # the generate's first forward is the prompt's: its timers are dropped
_TIER: list = [None, None]   # the tier being measured, and its counters when the prompt's forward ended


def _tier_counters(t):
    return (t.device_ms, t.batches, t.device_pairs, t.routed_pairs)


def _wrap(owner, name, part):
    f = getattr(owner, name, None)
    if f is None:
        return None

    def w(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            _T[part] += time.perf_counter() - t0
            _N[part] += 1
            if part == "token" and _PROMPT[0]:
                _PROMPT[0] = False
                _T.clear()
                _N.clear()
                if _TIER[0] is not None:
                    _TIER[1] = _tier_counters(_TIER[0])
    raw = inspect.getattr_static(owner, name)
    setattr(owner, name, staticmethod(w) if isinstance(raw, staticmethod) else w)
    return (owner, name, raw)


def _targets():
    from coli.models import base, blocks
    from cpu_kernels import decode, decode_moe
    from scheduler import step, tier
    t = [(base.Model, "forward", "token"), (decode.AttentionDecode, "__call__", "attention region"),
         (decode_moe.MoELayerDecode, "__call__", "MoE layer region"), (blocks.MoE, "logits", "router"),
         (step.MoEStep, "run", "step"), (tier.Tier, "issue_step", " issue_step"), (tier.Tier, "settle", "  settle"),
         (tier.Tier, "split", "  split"), (step.MoEStep, "_compute_many", " cpu experts"),
         (step.MoEStep, "_run_row", " cpu experts"), (decode.ExpertsRow, "pairs", " cpu experts"),
         (tier.Tier, "issue_row", " issue_step"),
         (step.MoEStep, "_join_device", " join"), (step.MoEStep, "combine", " combine")]
    try:
        from coli.vulkan import device as vkd
        t += [(vkd.Device, "submit_experts", "  submit"), (vkd.Batch, "_wait", "  fence wait")]
    except Exception:  # noqa: BLE001 - no Vulkan module: the CPU arm only
        pass
    return t


ORDER = ["token", "attention region", "MoE layer region", "router", "step", " issue_step", "  settle", "  split",
         "  submit", " cpu experts", " join", "  fence wait", " combine"]


ARMS = {"cpu": dict(device=None), "tier": dict(device="vulkan", balance=False),
        "balanced": dict(device="vulkan", balance=True)}
ARM_NAMES = ("cpu", "tier", "balanced", "tier-blocks", "tier-rate0", "tier-norec", "tier-spin", "balanced-nogate")


def run_arm(arm, a):
    """One arm: ``cpu``, ``tier``, ``balanced``, or ``tier-blocks`` (the tier with the decode row's attention and
    router as separate compiled calls, not one region: the layout before the router region), ``tier-rate0``
    (the tier with no promotions after its warm start: ``COLI_VK_TIER_RATE=0``), ``tier-norec`` (every device
    batch planned and recorded anew: ``COLI_VK_REUSE=0``), ``tier-spin`` (the join polls its fence up to 2 ms
    before it blocks: ``COLI_VK_SPIN_US=2000``) or ``balanced-nogate`` (the balancer without its decode
    gate: ``COLI_VK_DECODE_GATE=0``)."""
    from coli.engine import Engine
    from scheduler.step import MoEStep
    base, _, variant = arm.partition("-")
    kw = ARMS[base]
    env = {"rate0": {"COLI_VK_TIER_RATE": "0"}, "norec": {"COLI_VK_REUSE": "0"},
           "spin": {"COLI_VK_SPIN_US": "2000"}, "nogate": {"COLI_VK_DECODE_GATE": "0"}}.get(variant, {})
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    rr = MoEStep.router_region_ok
    if variant == "blocks":
        MoEStep.router_region_ok = lambda self: False
    try:
        eng = Engine(a.model, threads=a.threads, save_usage=False, quiet=True, **kw)
        return _measure(eng, arm, kw, a)
    finally:
        MoEStep.router_region_ok = rr
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _measure(eng, arm, kw, a):
    try:
        if kw["device"] and getattr(eng, "tier", None) is None:
            sys.exit(f"profile_tier_step: arm {arm}: the engine opened no device tier (see the [VK] line)")
        if a.warm:   # as long as the measured generates: their positions' experts loaded (docs/engine.md)
            eng.generate(a.prompt, max_tokens=max(a.warm, a.tokens), temp=0.0, stop_at_eos=False)
        r = eng.generate(a.prompt, max_tokens=a.tokens, temp=0.0, stop_at_eos=False)
        plain = r.stats.get("decode_tps", 0.0)
        undo = [u for u in (_wrap(*t) for t in _targets()) if u is not None]
        _T.clear()
        _N.clear()
        _PROMPT[0] = True
        t = getattr(eng, "tier", None)
        _TIER[:] = [t, _tier_counters(t) if t is not None else None]
        w0 = t.tokens_without if t is not None else 0
        try:
            r2 = eng.generate(a.prompt, max_tokens=a.tokens, temp=0.0, stop_at_eos=False)
        finally:
            for owner, name, f in undo:
                setattr(owner, name, f)
        n_tok = max(1, _N["token"])
        out = {"arm": arm, "plain_tps": plain, "timed_tps": r2.stats.get("decode_tps", 0.0), "tokens": n_tok}
        for k in ORDER:
            out[k] = (1e3 * _T[k] / n_tok, _N[k] / n_tok)
        if t is not None:
            dev0 = _TIER[1]
            db = t.batches - dev0[1]
            out["device ms/batch"] = (t.device_ms - dev0[0]) / max(1, db)
            out["batches/token"] = db / n_tok
            out["device pairs %"] = 100.0 * (t.device_pairs - dev0[2]) / max(1, t.routed_pairs - dev0[3])
            out["without %"] = 100.0 * (t.tokens_without - w0) / n_tok
        return out
    finally:
        eng.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--warm", type=int, default=32)
    ap.add_argument("--arms", default="cpu,tier", help=f"comma-separated, from {', '.join(ARM_NAMES)}")
    ap.add_argument("--rounds", type=int, default=1, help="the arms in turn this many times (one column each)")
    ap.add_argument("--prompt", default="Write a short story about a lighthouse keeper who finds a map.")
    a = ap.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x]
    bad = [x for x in arms if x not in ARM_NAMES]
    if bad or not arms:
        ap.error(f"--arms: unknown {bad or a.arms!r} (the arms: {', '.join(ARM_NAMES)})")
    if not os.path.exists(a.model):
        from coli.fetch import MODELS, model_path
        if a.model not in MODELS:
            ap.error(f"model {a.model!r}: no such file, nor a model coli.fetch knows ({', '.join(MODELS)})")
        a.model = str(model_path(a.model))
    print(f"profile_tier_step: arms {', '.join(arms)}; the first engine compiles Numba's kernels (minutes, once)",
          flush=True)
    if a.threads:
        cpu_kernels.set_threads(a.threads)
    res = [run_arm(arm, a) for _ in range(a.rounds) for arm in arms]
    la = os.getloadavg()
    print(f"\nprofile_tier_step: {Path(a.model).name}, threads {a.threads or 'default'}, {a.tokens} tokens, "
          f"COLI_VK_TIER_GB={os.environ.get('COLI_VK_TIER_GB', 'unset')}, load {la[0]:.2f} {la[1]:.2f}")
    print("| part | " + " | ".join(f"{r['arm']} ms/token (calls)" for r in res) + " |")
    print("|---|" + "---|" * len(res))
    for k in ORDER:
        if any(r[k][1] for r in res):
            cells = [f"{r[k][0]:.3f} ({r[k][1]:.3g})" if r[k][1] else "-" for r in res]
            print(f"| {k.replace(' ', '&nbsp;', k.count(' ') - k.strip().count(' '))} | " + " | ".join(cells) + " |")
    print("| tok/s untimed / timed | " + " | ".join(f"{r['plain_tps']:.2f} / {r['timed_tps']:.2f}" for r in res) + " |")
    for r in res:
        if "device ms/batch" in r:
            print(f"{r['arm']}: device {r['device ms/batch']:.3f} ms a batch, {r['batches/token']:.1f} batches a "
                  f"token, {r['device pairs %']:.0f}% of routed pairs on the device, {r['without %']:.0f}% of "
                  f"the tokens without the device (the decode gate)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
