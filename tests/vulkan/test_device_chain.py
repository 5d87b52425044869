"""Device layers whose routed experts stay (partly) on the CPU (coli/vulkan/device_layers.py ``resident``; the CLI's
--cpu-moe / --n-cpu-moe, --gpu-layers with --tier-gb; docs/vulkan.md "Experts on the CPU"): the device runs the
attention, router, shared expert and the resident experts, the CPU the other experts from the RAM expert cache,
joined mid-layer in rank order. Decode logits equal the CPU-only run's within the device layers' tolerance (f32 both
sides), greedy tokens equal the CPU-only run's with int8 activations on both sides (the CPU's experts int8 here as
there), both sides did work (dispatches, CPU rows), and a device lost mid-layer hands the layers back to the CPU."""
from __future__ import annotations

import re

import numpy as np
import pytest

from coli.base import settings
from tests.vk_util import IDS, decode_rows, device_engine, lose_device_on_call, rel_err, requires_vulkan, tier_gb

pytestmark = requires_vulkan

# the ways a decode token with CPU experts runs (layer_join.chain_way) and the COLI_VK_CHAIN value of each
WAYS = {"semaphore": "on", "event": "event", "split": "off"}


@pytest.mark.parametrize("way", WAYS)
def test_every_expert_on_the_cpu(device_moe, moe_cpu, way):
    """--cpu-moe (COLI_VK_CPU_MOE=-1) alone: every layer on the device, no expert uploaded, every routed pair of a
    decode row computed on the CPU, the logits the CPU-only run's (prompt chunks: tests/vulkan/test_device_prompt_chain.py).
    ``way``: one submit a token (timeline semaphores), one command buffer (host-set events), a submit a segment; only
    what the way runs is recorded (the segments, or the one command buffer)."""
    dev = device_engine(device_moe, COLI_VK_CPU_MOE=-1, COLI_VK_CHAIN=WAYS[way])
    try:
        dl = dev.model.device_layers
        assert dl is not None and dl.first == 0 and dev.tier is None
        assert dl.way == way and (dl._erec is not None) == (way == "event") and bool(dl.segs) == (way != "event")
        assert bool(dl._ev) == (way == "semaphore")     # host events only where the host writes mid-submit
        chain = way != "split"
        dl.spin_s = 30.0 if chain else 0.0      # the flag path: the host spins until each layer's flag is up
        assert sorted(dl.resident) == [0, 1, 2, 3] and not any(m.any() for m in dl.resident.values())
        assert "routed experts: 0 of 32 on the device" in dl.describe()
        assert ("timeline semaphore" in dl.describe()) == (way == "semaphore")
        assert ("through events" in dl.describe()) == (way == "event")
        d0 = dev.device.layer_dispatches
        ref, _ = decode_rows(moe_cpu, IDS, 5)
        got, _ = decode_rows(dev, IDS, 5)
        n = len(IDS) - 5
        assert dl.tokens == n and dl.prompt_tokens == 5
        assert dev.device.layer_dispatches - d0 >= 8 * 4 * n      # each layer's attention and router a token
        assert dl.cpu_rows == n * 4 * dl.k and dl.dev_rows == 0
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
        assert (dl.spun, dl.slept) == ((n * 4, 0) if chain else (0, 0))
        if way == "event" and dev.device.timestamps:
            # the one buffer's timestamps hold its waits for the host's events: with the host 20 ms slow a layer,
            # gpu_wait_s holds at least those 2 tokens x 4 layers x 20 ms, the device's own time (gpu_s) the rest of
            # the first to last timestamp, and both lie within the submits' wall time
            import time

            ranks, g0, w0, t0, s0 = dl._cpu_ranks, dl.gpu_s, dl.gpu_wait_s, dl.gpu_tokens, dl.submit_s
            dl._cpu_ranks = lambda *a: (time.sleep(0.02), ranks(*a))[1]
            dl.stamp_every = 1
            decode_rows(dev, IDS[:7], 5)
            dl._cpu_ranks = ranks
            waited, own = dl.gpu_wait_s - w0, dl.gpu_s - g0
            assert dl.gpu_tokens - t0 == 2 and own > 0
            assert 2 * 4 * 0.02 * 0.95 <= waited and waited + own <= dl.submit_s - s0, (waited, own, dl.submit_s - s0)
    finally:
        dev.close()


@pytest.mark.parametrize("way", WAYS)
def test_a_token_failed_in_the_hosts_part_leaves_the_next_right(device_moe, moe_cpu, way):
    """An error in the host's part of a decode token (its first CPU ranks raise: a RAM cache's file error, an
    interrupt in a program that goes on) propagates; the token's program, released, has ended before the caller goes
    on, so the same token again and the next one are the CPU-only run's logits (1e-5) on the device layers still
    (the semaphore chain read the next token's params and input while the last one ran: logits off by 0.8; the
    event buffer was refused its next submit, the device layers dropped)."""
    ref, _ = decode_rows(moe_cpu, IDS[:8], 5)
    dev = device_engine(device_moe, COLI_VK_CPU_MOE=-1, COLI_VK_CHAIN=WAYS[way])
    try:
        dl, m = dev.model.device_layers, dev.model
        assert dl.way == way
        got, c = decode_rows(dev, IDS[:6], 5)
        ranks, pos = dl._cpu_ranks, c.pos

        def fail(*a, **k):
            raise RuntimeError("the host's part failed")
        dl._cpu_ranks = fail
        with pytest.raises(RuntimeError, match="the host's part failed"):
            m.forward([IDS[6]], c)
        dl._cpu_ranks = ranks
        c.pos = pos
        got = np.concatenate([got, [m.forward([t], c)[-1] for t in IDS[6:8]]])
        assert m.device_layers is dl and dl.tokens == 3
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
    finally:
        dev.close()


@pytest.mark.parametrize("way", WAYS)
def test_part_resident_by_budget(device_moe, moe_cpu, way):
    """--n-cpu-moe 1 with --gpu-layers -1 and a --tier-gb that holds the layers and 9 experts: layer 0's experts on
    the CPU, 9 of the others' 24 on the device (the history's order, then lowest ids a layer in turn); a decode row's
    pairs split between the two sides, the logits the CPU-only run's; the run's stats and coli bench's records count
    both sides' expert rows."""
    from coli.bench import run_bench

    m = moe_cpu.model
    dev = device_engine(device_moe, COLI_VK_LAYERS=-1, COLI_VK_CPU_MOE=1, COLI_VK_TIER_GB=tier_gb(m, 9),
                        COLI_VK_CHAIN=WAYS[way])
    try:
        dl = dev.model.device_layers
        assert dl is not None and dl.first == 0 and dl.way == way
        assert sorted(dl.resident) == [0, 1, 2, 3]
        assert not dl.resident[0].any() and sum(int(dl.resident[il].sum()) for il in (1, 2, 3)) == 9
        ref, _ = decode_rows(moe_cpu, IDS, 5)
        got, _ = decode_rows(dev, IDS, 5)
        assert dl.cpu_rows > 0 and dl.dev_rows > 0
        assert dl.cpu_rows + dl.dev_rows == (len(IDS) - 5) * 4 * dl.k
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
        r = dev.generate(ids=IDS[:5], max_tokens=4, temp=0.0, stop_at_eos=False)
        assert r.stats["device_expert_rows"] > 0 and r.stats["cpu_expert_rows"] > 0
        assert r.stats["device_prompt_rows"] == 5
        whole = device_engine(device_moe, COLI_VK_LAYERS=-1, COLI_VK_CPU_MOE=2)   # layers 2 and 3 whole: their rows count too
        try:
            r = whole.generate(ids=IDS[:5], max_tokens=4, temp=0.0, stop_at_eos=False)
            k = whole.model.device_layers.k
            # the prompt's 5 rows: layers 0-1 on the CPU (below the device's experts: --n-cpu-moe 2), layers 2-3
            assert (r.stats["device_expert_rows"], r.stats["cpu_expert_rows"]) == (8 * 2 * k, 8 * 2 * k)
        finally:
            whole.close()
        recs = run_bench(dev, n_prompt=0, n_gen=3, reps=1, warmup=False)
        assert recs[0]["device_expert_rows"] + recs[0]["cpu_expert_rows"] == 3 * 4 * dl.k
        assert recs[0]["device_expert_rows"] > 0 and recs[0]["cpu_expert_rows"] > 0
    finally:
        dev.close()


def test_tier_gb_keeps_whole_layers_that_fit(device_moe):
    """--gpu-layers N --tier-gb G where N whole layers fit G, or --gpu-layers -1 (as many as fit): whole layers, every
    expert on the device, as before; N that do not fit whole: their experts placed apart."""
    from coli.vulkan import layer_plan as LP

    ref = device_engine(device_moe)
    m = ref.model
    whole2 = LP.fixed_bytes(m, 64, settings.get("COLI_VK_PROMPT_ROWS") or LP.PROMPT_ROWS) + 2 * LP.layer_bytes(m, 3, 64)
    ref.close()
    for layers, first, apart in ((2, 2, False), (-1, 2, False), (4, 0, True)):
        e = device_engine(device_moe, COLI_VK_LAYERS=layers, COLI_VK_TIER_GB=(whole2 + 100) / 2**30)
        try:
            dl = e.model.device_layers
            assert (dl.first, bool(dl.resident)) == (first, apart), layers
        finally:
            e.close()


@pytest.mark.parametrize("way", ["semaphore", "event"])
def test_device_lost_mid_layer_in_one_submit(device_moe, moe_cpu, monkeypatch, way):
    """One submit a token: the device fails while the host waits for the second layer's route (after the first
    layer's CPU experts were joined; the event way: when the host sets the second layer's event, its CPU experts
    computed): one line, the layers back on the CPU, the logits the CPU's bits, and the queue drained (the host
    signalled the token's last value, or set every event left: closing does not hang)."""
    dev = device_engine(device_moe, COLI_VK_CPU_MOE=-1, COLI_VK_CHAIN=WAYS[way])
    try:
        ref, _ = decode_rows(moe_cpu, IDS[:7], 4)
        dl = dev.model.device_layers
        assert dl.way == way
        dl.spin_s = 0.0                          # every layer's route waited for on the timeline (event: polled)
        calls = lose_device_on_call(monkeypatch, dl.K, "wait_value" if way == "semaphore" else "set_event", 2)
        got, _ = decode_rows(dev, IDS[:7], 4)
        joined = 1 if way == "semaphore" else 2  # the layers whose CPU experts ran before the failure
        # event: after the failed set, the host sets the events of layers 1, 2 and 3 (the buffer drains)
        assert len(calls) == (2 if way == "semaphore" else 5)
        assert dev.model.device_layers is None and dl.cpu_rows == joined * dl.k
        assert rel_err(got[:1], ref[:1]) < 1e-5         # the prompt's rows on the device
        assert np.array_equal(got[1:], ref[1:])          # then every layer of every row on the CPU: its bits
        assert (dl.spun, dl.slept) == (0, 2)
        if way == "semaphore":
            assert dl._tl == 4                   # a token of 4 cut layers: the host's values 1 .. 4, the last signalled
        else:
            assert not dl.K.running(dl._erec[0])     # the token's one command buffer ran to its end (events set)
    finally:
        dev.close()


def test_device_lost_mid_layer(device_moe, moe_cpu, monkeypatch):
    """A submit a segment: the device fails at the second segment of a token (after the first layer's route was read
    and its CPU experts computed): one line, the layers back on the CPU, the logits the CPU's bits."""
    dev = device_engine(device_moe, COLI_VK_CPU_MOE=-1, COLI_VK_CHAIN="off")
    try:
        ref, _ = decode_rows(moe_cpu, IDS[:7], 4)
        dl = dev.model.device_layers
        assert dl.way == "split"
        calls = lose_device_on_call(monkeypatch, dl.K, "submit", 2,     # the token's segments, not the K/V upload
                                    lambda rec: any(rec is r for _, r, _ in dl.segs if r is not None))
        got, _ = decode_rows(dev, IDS[:7], 4)
        assert len(calls) == 2 and dev.model.device_layers is None and dl.cpu_rows == dl.k
        assert rel_err(got[:1], ref[:1]) < 1e-5         # the prompt's rows on the device
        assert np.array_equal(got[1:], ref[1:])          # then every layer of every row on the CPU: its bits
    finally:
        dev.close()


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "qwen3moe", "qwen2moe"])
def test_families_int8_tokens(family):
    """The oracle families with every layer on the device: every expert on the CPU (--cpu-moe), part of them
    resident (--gpu-layers L with a --tier-gb where L whole layers do not fit, holding about half of them), and every
    expert on the CPU streamed to the device for the prompt (COLI_VK_PROMPT_EXPERTS=stream): 8 greedy tokens equal
    the CPU-only run's with int8 activations on both sides (the CPU's experts int8 as in that run; the device's parts
    f32), the prompt's rows on the device, the prompt's last logits and the decode logits within 2e-3 of the largest
    (int8 rounding of slightly different inputs), both sides' expert rows counted."""
    from tests.conftest import FIXTURES

    path = FIXTURES / "oracles" / f"{family}.gguf"
    ids = [int(t) for t in np.load(FIXTURES / "oracles" / f"{family}.npz")["ids"]]
    cpu = device_engine(path, act="int8")
    try:
        m = cpu.model
        n = len(m.layers)
        half = tier_gb(m, m.args.n_experts * n // 2, expert_layer=0)
        r_cpu = cpu.generate(ids=ids, max_tokens=8, temp=0.0, stop_at_eos=False)
        ref_prompt = cpu.model.forward(ids, cpu.model.new_cache(64, 64))
        ref, _ = decode_rows(cpu, ids + list(r_cpu.ids)[:4], len(ids))
        for env in (dict(COLI_VK_CPU_MOE=-1), dict(COLI_VK_LAYERS=n, COLI_VK_TIER_GB=half),
                    dict(COLI_VK_CPU_MOE=-1, COLI_VK_PROMPT_EXPERTS="stream")):
            dev = device_engine(path, act="int8", **env)
            try:
                dl = dev.model.device_layers
                assert dl is not None and dl.first == 0 and dl.resident
                r = dev.generate(ids=ids, max_tokens=8, temp=0.0, stop_at_eos=False)
                assert list(r.ids) == list(r_cpu.ids), env
                assert r.stats["cpu_expert_rows"] > 0 and r.stats["device_decode_rows"] == 7
                assert r.stats["device_prompt_rows"] == len(ids)
                stream = "COLI_VK_PROMPT_EXPERTS" in env
                assert (dl.p_cpu_rows == 0 and dl.streamed_bytes > 0) if stream else dl.p_cpu_rows > 0
                if "COLI_VK_TIER_GB" in env:
                    assert r.stats["device_expert_rows"] > 0 and dl.p_dev_rows > 0
                got = dev.model.forward(ids, dev.model.new_cache(64, 64))
                assert rel_err(got, ref_prompt) < 2e-3, rel_err(got, ref_prompt)
                got, _ = decode_rows(dev, ids + list(r_cpu.ids)[:4], len(ids))
                assert rel_err(got, ref) < 2e-3, rel_err(got, ref)
            finally:
                dev.close()
    finally:
        cpu.close()


def test_cli_flags(device_moe, capsys):
    """--cpu-moe / --n-cpu-moe: bad values and clashes are one ColiError line naming the flag (exit 2); --reproducible
    is the expert tier's (--balance is taken: test_balance_with_device_layers)."""
    from coli.cli import main

    for argv, msg in ((["--n-cpu-moe", "-2"], "--n-cpu-moe"), (["--cpu-moe", "--n-cpu-moe", "2"], "--cpu-moe"),
                      (["--cpu-moe", "--device", "cpu"], "--device cpu"), (["--cpu-moe", "--reproducible"], "--reproducible")):
        assert main(["run", "-m", str(device_moe), "-n", "2", "-p", "hi", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_demo_moe_tokens(demo_path):
    """The demo MoE (30 layers, 8 experts top-2, Q8_0 experts) with every layer on the device: every expert on the CPU
    (--cpu-moe) and the last 15 layers' experts resident (--n-cpu-moe 15): 6 greedy tokens equal to the CPU-only
    run's with int8 activations on both sides, each side's expert rows as placed."""
    from coli.engine import Engine

    cpu = Engine(demo_path, cpu_act="int8", quiet=True, silent=True, save_usage=False, ctx=64)
    try:
        ids = cpu.tokenize("The capital of France is")
        ref = list(cpu.generate(ids=ids, max_tokens=6, temp=0.0, stop_at_eos=False).ids)
    finally:
        cpu.close()
    for n_cpu in (-1, 15):
        e = Engine(demo_path, cpu_act="int8", device="vulkan", env=settings.overlay(None, COLI_VK_CPU_MOE=n_cpu),
                   quiet=True, silent=True, save_usage=False, ctx=64)
        try:
            dl = e.model.device_layers
            assert dl is not None and dl.first == 0 and len(dl.resident) == (30 if n_cpu < 0 else 15)
            r = e.generate(ids=ids, max_tokens=6, temp=0.0, stop_at_eos=False)
            assert list(r.ids) == ref, n_cpu
            assert r.stats["device_decode_rows"] == 5 and dl.cpu_rows == 5 * 2 * len(dl.resident)
            assert (r.stats["device_expert_rows"] > 0) == (n_cpu > 0)
        finally:
            e.close()


def test_hot_experts_swapped_in(device_moe, moe_cpu):
    """--gpu-layers 4 with a --tier-gb that holds the layers and 9 of their 32 experts: after each decode token the
    tier's LFRU rule inside a layer (scheduler/layer_residency.py) swaps the token's hottest non-resident expert in
    for the coldest resident once its heat passes 1.25 x that one's + 4 and the reuse gate finds it repays the upload;
    the resident count of each layer stays, the expert table follows (the logits stay the CPU-only run's), and the
    policy alone gives the same swaps."""
    from coli.vulkan.join_profile import JoinProfile
    from scheduler.layer_residency import LayerLFRU
    from scheduler.tier_policy import ReuseGate

    m = moe_cpu.model
    dev = device_engine(device_moe, COLI_VK_LAYERS=4, COLI_VK_TIER_GB=tier_gb(m, 9))
    try:
        dl = dev.model.device_layers
        assert dl.first == 0 and dl.on_token is not None
        start = {il: mk.copy() for il, mk in dl.resident.items()}
        seen = []
        real = dl.swap
        dl.swap = lambda il, a, b: (seen.append((il, a, b)), real(il, a, b))[1]
        shadow = LayerLFRU({il: mk.copy() for il, mk in start.items()},
                           reuse=ReuseGate(settings.get("COLI_VK_TIER_PAYBACK")))
        hook = dl.on_token

        def both(d, ids):
            for il, a, b in shadow.token(ids):
                shadow.resident[il][a], shadow.resident[il][b] = True, False
            hook(d, ids)

        dl.on_token = both
        ids = IDS + IDS[::-1] + IDS
        ref, _ = decode_rows(moe_cpu, ids, 3)
        dl.prof = P = JoinProfile()     # the hook's time is a part of its own in the join profile
        got, _ = decode_rows(dev, ids, 3)
        assert P.n["expert swaps"] == P.tokens == len(ids) - 3
        # every copy ran while the next token did (COLI_VK_SWAP_ASYNC), both experts on the CPU meanwhile
        assert dl.swaps_overlapped == dl.swaps == len(seen) - len(dl._swapping) > 0
        dl.swaps_land(wait=True)
        assert dl.swaps == len(seen)
        for il in start:
            assert dl.resident[il].sum() == start[il].sum()
            assert (dl.resident[il] == shadow.resident[il]).all()
            on = np.flatnonzero(dl.per[il]["tab_np"][:, 0])
            assert (on == np.flatnonzero(dl.resident[il])).all()
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
    finally:
        dev.close()


def test_join_profile(device_moe, moe_cpu):
    """COLI_VK_JOIN_PROFILE=1 with every expert on the CPU, one submit a token: each decode token's host time charged
    to its parts (one submit, a wait / route read / compiled-call share / signal per cut layer, one tail), the parts
    summing to no more than the token's time, the timestamps read every token, the logits unchanged; off, nothing is
    timed and the timestamps are read one token in ``stamp_every``. coli bench's profile counts its timed runs, not
    its warm-up."""
    from coli.bench import run_bench
    on = device_engine(device_moe, COLI_VK_CPU_MOE=-1, COLI_VK_JOIN_PROFILE=1, COLI_VK_CHAIN="on")
    off = device_engine(device_moe, COLI_VK_CPU_MOE=-1, COLI_VK_CHAIN="on")
    try:
        dl, dl0 = on.model.device_layers, off.model.device_layers
        assert dl.way == "semaphore" and dl.prof is not None and dl0.prof is None
        ref, _ = decode_rows(moe_cpu, IDS, 5)
        got, _ = decode_rows(on, IDS, 5)
        n = len(IDS) - 5
        P = dl.prof
        assert P.tokens == n and rel_err(got, ref) < 1e-5
        assert P.n["submit"] == n and P.n["tail"] == n and P.n["signal"] == 4 * n and P.n["route read"] == 4 * n
        assert P.n["wait: flag"] + P.n["wait: semaphore"] == 4 * n == dl.spun + dl.slept
        assert P.n["rows out"] == 4 * n and P.n["rest of the token"] == n
        assert P.n["routing history"] == n and P.n["expert swaps"] == 0 and dl.on_token is None    # no residents
        assert all(v >= 0 for v in P.s.values()) and sum(P.s.values()) <= P.total_s * 1.0001
        assert P.n["timestamps"] == (n if on.device.timestamps else 0) and dl.gpu_tokens == P.n["timestamps"]
        t = P.table()
        assert "| experts: compiled call |" in t and f"({n} decode tokens" in t
        t0, s0 = P.tokens, P.n["submit"]
        run_bench(on, n_prompt=0, n_gen=3, reps=2)          # a one-token warm-up, then 2 timed runs of 3 tokens
        assert dl.tokens - t0 == 7 and P.tokens - t0 == 6 and P.n["submit"] - s0 == 6
        decode_rows(off, IDS, 5)
        assert dl0.tokens == n and dl0.gpu_tokens == (-(-n // dl0.stamp_every) if off.device.timestamps else 0)
    finally:
        on.close()
        off.close()


def test_n_cpu_moe_below_the_device_layers_warns(device_moe, capsys):
    """--gpu-layers 2 --n-cpu-moe 1 on the 4-layer MoE: N counts from layer 0 (llama.cpp's meaning) and layer 0 runs on
    the CPU anyway, so the placement is --gpu-layers 2's (whole layers, every expert on the device): one warning line
    says so at start and the run goes on (exit 0); --n-cpu-moe 3 reaches a device layer: no warning, its experts on
    the CPU."""
    from coli.cli import main

    bench = ["bench", "-m", str(device_moe), "-p", "0", "-n", "2", "-r", "1", "--ctx", "64"]
    assert main([*bench, "--gpu-layers", "2", "--n-cpu-moe", "1"]) == 0
    err = capsys.readouterr().err
    warn = [ln for ln in err.splitlines() if "warning: --n-cpu-moe 1 has no effect" in ln]
    assert len(warn) == 1 and "layer 0 is on the CPU anyway (the device holds layers 2-3)" in warn[0], err
    assert "routed experts:" not in err and "Traceback" not in err
    assert main([*bench, "--gpu-layers", "2", "--n-cpu-moe", "3"]) == 0
    err = capsys.readouterr().err
    assert "no effect" not in err and "joined mid-layer in 1 layer " in err, err
    assert main([*bench, "--gpu-layers", "1", "--n-cpu-moe", "2"]) == 0  # one device layer: "layer 3", not "layers 3-3"
    err = capsys.readouterr().err
    assert "layers 0-1 are on the CPU anyway (the device holds layer 3)" in err, err


@pytest.mark.parametrize("way", ["semaphore", "split"])
def test_balance_with_device_layers(device_moe, moe_cpu, way):
    """--balance with device layers whose experts sit on both sides (--n-cpu-moe 1, a --tier-gb holding 9 of the
    other layers' 24 experts): the balancer (scheduler/balancer.py, the tier's rules) takes every cut layer's step
    of a decode row after the token, with its measured times; the resident ranks it hands to the CPU are computed
    there (the device skips them: the route it reads points them at an absent expert). Held at its floor, it hands
    nearly every resident rank over; the logits stay the CPU-only run's (f32 both sides) and every routed pair is
    counted once, on one side. Free, it runs on its own measurements: the greedy tokens the CPU-only run's, and
    resident ranks moved to the CPU."""

    m = moe_cpu.model
    env = dict(COLI_VK_LAYERS=-1, COLI_VK_CPU_MOE=1, COLI_VK_TIER_GB=tier_gb(m, 9), COLI_VK_CHAIN=WAYS[way])
    ref, _ = decode_rows(moe_cpu, IDS, 5)
    n = len(IDS) - 5
    dev = device_engine(device_moe, balance=True, **env)
    try:
        dl = dev.model.device_layers
        assert dl.bal is not None and dl.xroute is not None and dl.way == way
        bal = dl.bal
        bal.share = bal.floor
        steps = []
        bal.update = lambda t: (steps.append(t), bal.share)[1]     # held at the floor, the steps recorded
        got, _ = decode_rows(dev, IDS, 5)
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
        assert len(steps) == 4 * n and sum(t.resident_rows for t in steps) > 0
        assert dl.handed > 0 and dl.handed == sum(t.resident_rows - t.device_rows for t in steps)
        assert dl.cpu_rows + dl.dev_rows == n * 4 * dl.k
        assert dl.dev_rows == sum(t.device_rows for t in steps) > 0 and dl.cpu_rows > 0   # both sides computed
        # every segment's timestamps one token in stamp_every (the balancer reads its segments' own every token)
        assert dl.gpu_tokens == (-(-n // dl.stamp_every) if dev.device.timestamps else 0)
    finally:
        dev.close()
    cpu_ids = list(moe_cpu.generate(ids=IDS[:5], max_tokens=6, temp=0.0, stop_at_eos=False).ids)
    dev = device_engine(device_moe, balance=True, **env)
    try:
        dl = dev.model.device_layers
        r = dev.generate(ids=IDS[:5], max_tokens=6, temp=0.0, stop_at_eos=False)
        assert list(r.ids) == cpu_ids
        assert dl.bal.steps == 4 * 5 and dl.cpu_rows > 0
        assert dl.dev_rows > 0
        if dev.device.type_name == "cpu":   # Lavapipe's device is the CPU's cores, and slower: its own measurements
            assert dl.handed > 0 and dl.bal.share < 1.0     # moved resident ranks to the CPU (a GPU keeps them)
        assert dl.dev_rows + dl.cpu_rows == 5 * 4 * dl.k      # the decode rows' pairs (prompt rows apart)
    finally:
        dev.close()


def test_balance_cli(device_moe, capsys):
    """coli bench --gpu-layers 4 --tier-gb G --balance (experts on both sides): runs, the closing line gives both
    sides' routed pairs and the balancer's share; --cpu-moe --balance (no layer with experts on both sides): one
    line says there is nothing to balance, the run goes on."""
    from coli.cli import main

    e = device_engine(device_moe)
    m = e.model
    gb = tier_gb(m, 12, ctx=512)
    e.close()
    bench = ["bench", "-m", str(device_moe), "-p", "0", "-n", "3", "-r", "1", "--ctx", "512"]
    assert main([*bench, "--gpu-layers", "4", "--tier-gb", f"{gb:.6f}", "--balance"]) == 0
    err = capsys.readouterr().err
    assert "balance: device share" in err and "routed pairs of decode rows:" in err and "Traceback" not in err, err
    assert re.search(r"\d+ experts swapped in \(\d+ copied while a token ran, \d+ refused by the reuse gate\)", err), err
    assert main([*bench, "--cpu-moe", "--balance"]) == 0
    err = capsys.readouterr().err
    assert "--balance: no device layer holds part of its routed experts" in err, err


def test_balance_device_lost_mid_layer(device_moe, moe_cpu, monkeypatch):
    """--balance, one submit a token (two host values a cut layer: the resident ranks' route, then the rows): the
    device fails while the host waits for the second layer's route: the host signals the token's last value (8 for 4
    cut layers) after pointing the resident ranks it did not route at an absent expert (their segments run while the
    queue drains), the queue drains (closing does not hang), the layers go back to the CPU and the decode logits are
    the CPU's bits."""

    m = moe_cpu.model
    dev = device_engine(device_moe, balance=True, COLI_VK_LAYERS=-1, COLI_VK_CPU_MOE=1, COLI_VK_TIER_GB=tier_gb(m, 9),
                        COLI_VK_CHAIN="on")
    try:
        ref, _ = decode_rows(moe_cpu, IDS[:7], 4)
        dl = dev.model.device_layers
        assert dl.way == "semaphore" and dl.bal is not None and dl._V == 2
        dl.spin_s = 0.0
        calls = lose_device_on_call(monkeypatch, dl.K, "wait_value", 2)
        got, _ = decode_rows(dev, IDS[:7], 4)
        # the second route waited for: layer 1's (3) here; the clean-clone CI under -n 2 once saw a later cut layer's
        # (5): the balancer splits by measured times, so which layer waits first may move
        assert calls[0] == 1 and len(calls) == 2 and calls[1] in (3, 5, 7), calls
        assert dev.model.device_layers is None
        assert rel_err(got[:1], ref[:1]) < 1e-5         # the prompt's rows on the device
        assert np.array_equal(got[1:], ref[1:])          # then every layer of every row on the CPU: its bits
        assert dl._tl == 8
    finally:
        dev.close()


# the swap tests' MoE: 2 layers of 32 experts top-4 (half resident); its random routers, or (--skew 0.9) a hot quarter
SWAP_ARGS = ["--layers", "2", "--d", "128", "--heads", "4", "--experts", "32", "--top-k", "4", "--expert-ff", "64",
             "--vocab", "300", "--type", "Q8_0", "--seed", "7"]


@pytest.mark.parametrize("skew", [False, True])
def test_swaps_gated_by_measured_reuse(tmp_path_factory, skew):
    """--gpu-layers 2 with a --tier-gb that holds half of each layer's 32 experts (the warm start: the lowest ids),
    300 decode rows of random tokens, the in-layer swaps (scheduler/layer_residency.py: the tier's LFRU rule with its
    reuse gate, COLI_VK_TIER_REUSE) beside LFRU alone shown the same routings. On the file whose routers favour a
    random quarter of each layer (scripts/make_synthetic_moe.py --skew 0.9) that quarter, read from the router's
    bias column, is resident at the end: the hot set filled. On the file without --skew the gate refuses swaps LFRU
    alone makes and swaps less (its random routers are not uniform: their top quarter took a third of the routings,
    so some swaps do repay; exactly uniform routings: tests/moe/test_tier_policy.py). Both: the expert table follows
    the residency and the logits stay the CPU-only f32 run's; the skewed file's copies run while the next token does
    (COLI_VK_SWAP_ASYNC), the other's between tokens."""
    from gguf import GGUFReader

    from scheduler.layer_residency import LayerLFRU
    from tests.tiny_moe import build_tiny_moe

    path = build_tiny_moe(tmp_path_factory.mktemp("swap"), SWAP_ARGS + (["--skew", "0.9"] if skew else []),
                          f"swap-{'skew' if skew else 'plain'}.gguf")
    ids = [int(x) for x in np.random.default_rng(0).integers(0, 300, 301)]
    cpu = device_engine(path, ctx=512)
    try:
        ref, _ = decode_rows(cpu, ids, 1, cpu.model.new_cache(512, 512))
        gb = tier_gb(cpu.model, 32, ctx=512)
    finally:
        cpu.close()
    dev = device_engine(path, ctx=512, COLI_VK_LAYERS=2, COLI_VK_TIER_GB=gb, COLI_VK_SWAP_ASYNC=int(skew))
    try:
        dl = dev.model.device_layers
        assert dl.first == 0 and dl.on_token is not None
        assert [int(dl.resident[il].sum()) for il in (0, 1)] == [16, 16]
        alone = LayerLFRU({il: mk.copy() for il, mk in dl.resident.items()})      # LFRU without the gate
        hook = dl.on_token

        def both(d, routed):
            for il, a, b in alone.token(routed):
                alone.resident[il][a], alone.resident[il][b] = True, False
            hook(d, routed)

        dl.on_token = both
        got, _ = decode_rows(dev, ids, 1, dev.model.new_cache(512, 512))
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
        dl.swaps_land(wait=True)
        assert 0 < dl.swaps and dl.swaps_refused > 0 and dl.swaps_overlapped == (dl.swaps if skew else 0)
        if skew:
            r = GGUFReader(str(path))
            for il in (0, 1):
                col0 = next(t for t in r.tensors if t.name == f"blk.{il}.ffn_gate_inp.weight").data[:, 0]
                hot = np.argsort(col0)[-8:]          # the biased quarter
                assert dl.resident[il][hot].all(), (il, hot, np.flatnonzero(dl.resident[il]))
        else:
            assert dl.swaps < alone.swaps, (dl.swaps, alone.swaps)
        assert [int(dl.resident[il].sum()) for il in (0, 1)] == [16, 16]
        for il in (0, 1):
            assert (np.flatnonzero(dl.per[il]["tab_np"][:, 0]) == np.flatnonzero(dl.resident[il])).all()
    finally:
        dev.close()


def test_chain_setting():
    """COLI_VK_CHAIN, read once into the way a token runs (``chain_way``): auto is one submit a token (semaphore)
    wherever the device has timeline semaphores, else a submit a segment; on and event need the semaphores; event
    with --balance is the semaphore way (the balancer's route has a host value of its own); another value is one error
    naming the variable."""
    from types import SimpleNamespace

    from coli.base.errors import ColiError
    from coli.vulkan.layer_join import chain_way

    lava, gpu = SimpleNamespace(timeline=True, type_name="cpu"), SimpleNamespace(timeline=True, type_name="discrete")
    old = SimpleNamespace(timeline=False, type_name="integrated", name="old GPU")
    for v, want in ((None, "semaphore"), ("on", "semaphore"), ("OFF", "split"), ("event", "event")):
        env = {"COLI_VK_CHAIN": v} if v else {}
        assert (chain_way(lava, env), chain_way(gpu, env)) == (want, want), v
        assert chain_way(gpu, env, balance=True) == ("semaphore" if want == "event" else want)
        if v in ("on", "event"):
            with pytest.raises(ColiError, match=f"COLI_VK_CHAIN={v}: old GPU has no timeline"):
                chain_way(old, env)
        else:
            assert chain_way(old, env) == "split"
    with pytest.raises(ColiError, match=r"COLI_VK_CHAIN='yes': not one of its values \(auto, on, event or off"):
        chain_way(lava, {"COLI_VK_CHAIN": "yes"})
