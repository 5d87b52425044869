"""The tier inside the lead's MoE step (scheduler/step.py's issue_step/join_step calls), on the OLMoE oracle
fixture's experts.

The device here is `NumpyDevice`, an in-test reference that computes each pair's expert with
`gguf.quants.dequantize` weights in float64 (the formula of docs/contracts.md: down(silu(gate x) * up x)):
these tests check the SCHEDULER's plumbing (split, batch rows, outputs written back in rank order,
evictions, balancer hand-back, device loss), not Vulkan; tests/vulkan/test_tier_device.py runs the same on Lavapipe.
"""
import io
import time
from concurrent.futures import Future

import numpy as np
import pytest

from conftest import FIXTURES

formats = pytest.importorskip("cpu_kernels.formats")
step_mod = pytest.importorskip("scheduler.step")
ram_mod = pytest.importorskip("scheduler.ram_cache")

from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from coli.gguf_file import open_gguf  # noqa: E402
from scheduler.balancer import Balancer  # noqa: E402
from scheduler.tier import Tier  # noqa: E402

FIX = FIXTURES / "oracles" / "olmoe.gguf"


class NumpyBatch:
    def __init__(self, out, ms, fail):
        self.out, self.device_ms, self.fail = out, ms, fail

    def join(self):
        if self.fail:
            raise RuntimeError("VK_ERROR_DEVICE_LOST (injected)")
        return self.out


class NumpyDevice:
    def __init__(self, fault_at=None):
        self.live, self.n, self.joins, self.fault_at, self.submits = {}, 0, 0, fault_at, 0

    def upload_expert(self, *mats):
        ws = [dequantize(raw, GGMLQuantizationType[t]).reshape(shape).astype(np.float64) for t, raw, shape in mats]
        h = self.n
        self.n += 1
        self.live[h] = ws
        return h

    def free_expert(self, h):
        del self.live[h]

    def submit_experts(self, x, rows, handles):
        t = time.perf_counter()
        out = np.empty((len(rows), x.shape[1]), np.float32)
        for p, (r, h) in enumerate(zip(rows, handles)):
            g, u, d = self.live[h]
            xr = x[r].astype(np.float64)
            a, b = g @ xr, u @ xr
            out[p] = (d @ (a / (1 + np.exp(-a)) * b)).astype(np.float32)
        self.submits += 1
        fail = self.fault_at is not None and self.submits >= self.fault_at
        return NumpyBatch(out, (time.perf_counter() - t) * 1e3, fail)


def setup(slots=8):
    g = open_gguf(FIX)
    layers = {}
    for n, t in g.tensors.items():
        if n.endswith("ffn_gate_exps.weight"):
            l = int(n.split(".")[1])
            layers[l] = (t, g.tensors[f"blk.{l}.ffn_up_exps.weight"], g.tensors[f"blk.{l}.ffn_down_exps.weight"])
    src = ram_mod.ExpertSource(FIX, layers)
    return src, sorted(layers)


def run_steps(tier_kw=None, steps=6, slots=8, seed=0, env=None, fault_at=None, shift=False, warm=False):
    src, layers = setup()
    cache = ram_mod.RAMCache(src, slots, io_threads=2)
    loads = []
    cache.on_read = lambda l, e, t0, t1: loads.append((l, e))
    st = step_mod.MoEStep(cache, act="f32")
    dev = None
    log = io.StringIO()
    if tier_kw is not None:
        dev = NumpyDevice(fault_at)
        per = max(src.expert_nbytes(l) for l in layers)
        st.tier = Tier(dev, "olmoe", max(layers) + 1, 8, per, tier_kw["cap"] * per, "test", env=env or {},
                       balancer=tier_kw.get("bal", Balancer(enabled=False)), log=log, moe_layers=layers,
                       auto_tokens=True, ram=cache)
        if warm:
            st.tier.warm_start(src.read_raw, threads=2)
    rng = np.random.default_rng(seed)
    D = src.layers[layers[0]][0].shape[2]
    ys, per_step = [], []
    for s in range(steps):
        for l in layers:
            R = 3
            x = rng.standard_normal((R, D)).astype(np.float32)
            pool = 8 if not shift else (np.array([0, 1, 2]) if s < steps // 4 else np.array([5, 6, 7]))
            ids = np.stack([rng.choice(pool, 2, replace=False) for _ in range(R)])
            w = rng.random((R, 2)).astype(np.float32)
            c0, d0 = st.stats.cpu_pairs, st.stats.device_pairs
            ys.append(st.run(l, x, ids, w))
            per_step.append((st.stats.cpu_pairs - c0, st.stats.device_pairs - d0))
    if st.tier is not None:
        st.tier.close()
    cache.close()
    st.loads = loads
    return ys, per_step, st, log.getvalue()


@pytest.fixture(scope="module")
def cpu_ref():
    return run_steps(None)[0]


def close(ys, ref):
    for a, b in zip(ys, ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(1.0, float(np.abs(b).max())))


def test_tier_sync_matches_cpu_and_both_sides_share_a_step(cpu_ref):
    ys, per, st, log = run_steps({"cap": 6}, env={"COLI_VK_TIER_SYNC": "1"})
    close(ys, cpu_ref)
    assert st.tier.device_pairs > 0 and any(c > 0 and d > 0 for c, d in per)   # both sides in one step
    assert "[VK] tier olmoe run: device " in log


def test_tiny_budget_evicts_and_still_matches():
    # the routing moves from experts {0,1,2} to {5,6,7} after a quarter: the newcomers' heat passes 1.25x + 4
    ref = run_steps(None, steps=24, shift=True)[0]
    ys, per, st, log = run_steps({"cap": 2}, steps=24, shift=True, env={"COLI_VK_TIER_SYNC": "1"})
    close(ys, ref)
    assert st.tier.evictions >= 2 and st.tier.device_pairs > 0
    assert all(0 <= e <= 2 or 5 <= e <= 7 for (_, e) in st.tier.resident)


def test_experts_leaving_the_device_are_read_back_into_ram():
    """The warm start fills the device straight from the file; when the routing moves on, the evicted experts
    (not in RAM, room in the RAM pool) are read into the RAM cache in the background at eviction: every one of them
    is read from the file once, and the CPU's numbers are unchanged."""
    ref = run_steps(None, steps=24, shift=True)[0]
    ys, per, st, log = run_steps({"cap": 4}, steps=24, shift=True, env={"COLI_VK_TIER_SYNC": "1"}, warm=True)
    close(ys, ref)
    assert st.tier.evictions >= 2 and st.tier.prefetched >= 1
    assert len(st.loads) == len(set(st.loads))   # no expert read twice: the read-back is the one the CPU uses


def test_balancer_hands_rows_back_and_matches(cpu_ref):
    bal = Balancer(enabled=True)
    bal.share = 0.05
    bal.b_ms, bal.a_ms = 1e-3, 1e3            # the "device" is far slower: the share stays at its floor
    ys, per, st, log = run_steps({"cap": 16, "bal": bal}, env={"COLI_VK_TIER_SYNC": "1"})
    close(ys, cpu_ref)
    assert st.tier.handed_rows > 0


def test_device_lost_mid_run_finishes_on_the_cpu(cpu_ref):
    ys, per, st, log = run_steps({"cap": 16}, env={"COLI_VK_TIER_SYNC": "1"}, fault_at=3)
    close(ys, cpu_ref)
    assert not st.tier.on and "[VK] tier olmoe: off, the device failed a join" in log


def _row_run(fast: bool, cap: int, slots: int, bal=None, steps=24, seed=3, gate=None):
    """Decode rows (R = 1) through an int8 step with the tier (``NumpyDevice``, synchronous residency): the decode
    row path (``MoEStep._tier_row``) when ``fast``, else the general step. Returns outputs, counters, residency."""
    src, layers = setup()
    cache = ram_mod.RAMCache(src, slots, io_threads=2)
    st = step_mod.MoEStep(cache, act="int8")
    if not fast:
        st.router_region_ok = lambda: False
    dev = NumpyDevice()
    per = max(src.expert_nbytes(l) for l in layers)
    st.tier = Tier(dev, "olmoe", max(layers) + 1, 8, per, cap * per, "test",
                   env={"COLI_VK_TIER_SYNC": "1", "COLI_VK_DECODE_GATE": "0"},   # the split alone: no timing
                   balancer=bal if bal is not None else Balancer(enabled=False), log=io.StringIO(),
                   moe_layers=layers, auto_tokens=True, ram=cache)
    if gate is not None:
        st.tier.gate = gate
        gate.dev = dev
    rng = np.random.default_rng(seed)
    D = src.layers[layers[0]][0].shape[2]
    ys = []
    for s in range(steps):
        pool = np.array([0, 1, 2, 3]) if s < steps // 4 else np.array([4, 5, 6, 7])   # the routing moves on
        for l in layers:
            x = rng.standard_normal((1, D)).astype(np.float32)
            ids = rng.choice(pool, 2, replace=False).reshape(1, 2)
            w = rng.random((1, 2)).astype(np.float32)
            ys.append(st.run(l, x, ids, w))
    t = st.tier
    s_ = st.stats
    # (the RAM cache's hits and LRU order are left out: an expert read back in the background at its eviction
    # lands when the I/O pool finishes it, on either path)
    counts = (s_.steps, s_.pairs, s_.cpu_pairs, s_.device_pairs, t.routed_pairs, t.device_pairs, t.evictions,
              t.uploads, t.handed_rows, t.batches, sorted(t.resident), dev.submits)
    heat = t.heat.copy()
    t.close()
    cache.close()
    return ys, counts, heat


@pytest.mark.skipif(not step_mod._decode.available("int8", ()), reason="the decode row path runs the int8 VNNI kernels")
@pytest.mark.parametrize("cap,slots,balanced", [(3, 8, False), (16, 8, False), (3, 2, False), (16, 8, True)])
def test_decode_row_path_matches_the_general_step(cap, slots, balanced):
    """A decode row with the tier on takes ``MoEStep._tier_row`` (``Tier.issue_row``, the CPU's experts in one
    compiled call): bit for bit the general step's outputs, the same counters, heat, residency and evictions,
    with experts on both sides, evictions (cap 3), disk reads inside steps (2 RAM slots) and a
    balancer that hands rows to the CPU (the general split)."""
    def bal():
        if not balanced:
            return None
        b = Balancer(enabled=True)
        b.share = 0.05
        b.b_ms, b.a_ms = 1e-3, 1e3
        return b
    ys_f, c_f, h_f = _row_run(True, cap, slots, bal())
    ys_g, c_g, h_g = _row_run(False, cap, slots, bal())
    for a, b in zip(ys_f, ys_g):
        np.testing.assert_array_equal(a, b)
    assert c_f == c_g
    np.testing.assert_array_equal(h_f, h_g)
    assert c_f[3] > 0 and c_f[2] > 0            # both sides computed pairs
    if cap == 3:
        assert c_f[6] > 0                       # evictions
    if balanced:
        assert c_f[8] > 0                       # rows handed to the CPU


class _OffGate:
    """A decode gate (scheduler.balancer.DecodeGate's API) that keeps the device for the first ``on_tokens`` decode
    tokens, then says: every token without the device. ``submits_at_off``: the device's submits then (``dev``)."""
    enabled = True

    def __init__(self, on_tokens: int = 0, dev=None):
        self.decisions, self.tokens_without = [(False, 1.0, 0.5)], 0
        self.on_left, self.dev = on_tokens, dev
        self.submits_at_off = None if on_tokens > 0 else 0
        self.use_device = on_tokens > 0

    def token(self, ms):
        if not self.use_device:
            self.tokens_without += 1
        self.on_left -= 1
        self.use_device = self.on_left > 0
        if not self.use_device and self.submits_at_off is None:
            self.submits_at_off = self.dev.submits
        return self.use_device


@pytest.mark.skipif(not step_mod._decode.available("int8", ()), reason="the decode row path runs the int8 VNNI kernels")
@pytest.mark.parametrize("fast", [True, False])
def test_decode_gate_off_leaves_the_device_only_what_the_cpu_lacks(fast):
    """Decode tokens the gate runs without the device (``Tier._dev_off``) after 3 with it (their promotions make
    experts resident), on the decode row path and the general split: with every expert in RAM no batch is
    submitted after the switch, no expert is promoted, and the outputs are the CPU-only run's bit for bit; with 2
    RAM slots the device still computes the resident experts the CPU lacks."""
    ys_cpu, c_cpu, _ = _row_run(fast, 0, 8, Balancer(enabled=True))
    assert c_cpu[3] == 0 and c_cpu[-1] == 0                 # the reference: no expert resident, no batch
    n_on = 3 * len(setup()[1])                              # the outputs of the 3 tokens with the device
    g = _OffGate(3)
    ys, c, _ = _row_run(fast, 16, 8, Balancer(enabled=True), gate=g)
    assert len(c[10]) > 0 and c[8] > 0                      # resident experts, rows handed to the CPU
    assert c[-1] == g.submits_at_off > 0 and g.tokens_without == 24 - 3 - 1
    for a, b in zip(ys[n_on:], ys_cpu[n_on:]):
        np.testing.assert_array_equal(a, b)
    g2 = _OffGate(3)
    ys2, c2, _ = _row_run(fast, 16, 2, Balancer(enabled=True), gate=g2)
    assert c2[-1] > g2.submits_at_off and c2[8] > 0         # the device took the experts the CPU did not hold
    for a, b in zip(ys2[n_on:], ys_cpu[n_on:]):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-2 * max(1.0, float(np.abs(b).max())))


def test_no_promotion_in_a_decode_token_without_the_device():
    """A token the gate runs without the device offers the tier no candidate (``Tier.note`` is False); a token with
    the device does."""
    src, layers = setup()
    t = Tier(NumpyDevice(), "m", max(layers) + 1, 8, 1024, 8192, "test", env={"COLI_VK_TIER_SYNC": "1"},
             balancer=Balancer(enabled=True), log=io.StringIO(), moe_layers=layers, auto_tokens=True,
             ram=ram_mod.RAMCache(src, 8, io_threads=1))
    t.gate = _OffGate()
    t.begin_token()
    assert not t.note(layers[0], 1, lambda: None) and not t._candidates
    t.gate = _OffGate(5)
    t.begin_token()
    assert t.note(layers[0], 1, lambda: None)
    t.close()
    t.ram.close()


@pytest.mark.parametrize("balanced", [True, False])
def test_balanced_tier_reads_the_device_only_experts_into_ram(balanced):
    """A balanced tier (gate off: ``COLI_VK_DECODE_GATE=0``) reads the warm start's experts into the RAM pool's
    room from its first forward, a prompt's too (``rate`` reads a token, a prompt counting 4 at most), so the
    balancer can hand them to the CPU; ``--no-balance`` (no balancer) reads none."""
    src, layers = setup()
    cache = ram_mod.RAMCache(src, 8, io_threads=2)
    per = max(src.expert_nbytes(l) for l in layers)
    t = Tier(NumpyDevice(), "olmoe", max(layers) + 1, 8, per, 16 * per, "test",
             env={"COLI_VK_TIER_SYNC": "1", "COLI_VK_DECODE_GATE": "0", "COLI_VK_TIER_RATE": "2"},
             balancer=Balancer(enabled=balanced), log=io.StringIO(), moe_layers=layers, auto_tokens=True, ram=cache)
    t.warm_start(src.read_raw, threads=2)
    t.settle()
    assert len(t.resident) == 16 and t.prefetched == 0
    t.begin_token(30)                        # a prompt's forward: 2 x 4 reads
    assert t.prefetched == (8 if balanced else 0)
    t.begin_token(1)                         # a decode token: 2 more
    assert t.prefetched == (10 if balanced else 0)
    for f in list(cache.inflight.values()):
        f.result(timeout=30)
    t.close()
    cache.close()


def test_decode_gate_off_reads_the_device_only_experts_into_ram():
    """The warm start uploads experts straight from the file, so the CPU cannot take them; tokens without the
    device (measured or decided) read them into the RAM cache's free slots (``Tier._back_to_ram``, ``rate`` a
    token), after which no decode step needs a batch. The gate gets no sample of a token that still needed one
    or that started reads (every other expert is in RAM from the start: no disk read drops them), and a sample
    of each token after."""
    src, layers = setup()
    cache = ram_mod.RAMCache(src, 8, io_threads=2)
    st = step_mod.MoEStep(cache, act="int8")
    dev = NumpyDevice()
    per = max(src.expert_nbytes(l) for l in layers)
    t = st.tier = Tier(dev, "olmoe", max(layers) + 1, 8, per, 16 * per, "test", env={"COLI_VK_TIER_SYNC": "1"},
                       balancer=Balancer(enabled=True), log=io.StringIO(), moe_layers=layers, auto_tokens=True,
                       ram=cache)
    t.warm_start(src.read_raw, threads=2)
    t.settle()
    assert t.resident and not any(cache.in_ram(l, e) for l, e in t.resident)
    for l in layers:                         # the experts the device does not hold: in RAM before the decode
        for e in range(8):
            if (l, e) not in t.resident:
                cache.put(l, e, cache.fetch(l, e).result())
    t.gate = _OffGate()
    samples = []
    t.gate.token = lambda ms, f=t.gate.token: (samples.append(ms), f(ms))[1]
    rng = np.random.default_rng(5)
    D = src.layers[layers[0]][0].shape[2]

    def token():
        for l in layers:
            x = rng.standard_normal((1, D)).astype(np.float32)
            st.run(l, x, rng.choice(8, 2, replace=False).reshape(1, 2), rng.random((1, 2)).astype(np.float32))
    t.rate = 2                               # reads started a token (the promotion rate)
    token()                                  # a token without the device: 2 reads started
    assert t.prefetched == 2 < len(t.resident) and dev.submits > 0
    token()
    assert t.prefetched == 4 and samples == [None]
    while t._ram_todo:
        token()
    assert t.prefetched == len(t.resident)
    token()                                  # gives the sample of the loop's last token, which started reads
    assert samples and all(ms is None for ms in samples)   # no token that started reads gave a sample
    for f in list(cache.inflight.values()):
        f.result(timeout=30)
    n, k = dev.submits, len(samples)
    for _ in range(4):
        token()
    assert dev.submits == n                  # every resident expert movable: no batch
    assert all(ms is not None and ms > 0 for ms in samples[k + 1:]) and len(samples) == k + 4
    assert any(cache.in_ram(l, e) for l, e in t.resident)     # the CPU took the reads it needed
    t.close()
    cache.close()


def test_decode_gate_is_on_with_the_balancer_only():
    """The gate is on in a balanced tier with a RAM cache (``COLI_VK_DECODE_GATE=0`` turns it off), never under
    --no-balance."""
    src, layers = setup()
    cache = ram_mod.RAMCache(src, 8, io_threads=1)

    def gate(env, enabled, ram=cache):
        t = Tier(NumpyDevice(), "m", max(layers) + 1, 8, 1024, 4096, "test", env=env,
                 balancer=Balancer(enabled=enabled), log=io.StringIO(), ram=ram)
        on = t.gate.enabled
        t.close()
        return on
    assert gate({}, True) and gate({"COLI_VK_DECODE_GATE": "1"}, True)
    assert not gate({"COLI_VK_DECODE_GATE": "0"}, True) and not gate({}, False)
    assert not gate({}, True, ram=None)          # no RAM cache: no CPU copies to run a token on
    cache.close()


def test_the_gate_takes_no_sample_while_the_background_reads_run():
    """A decode token that starts reads of the device-only experts, or begins while some still run, gives the
    decode gate no sample (they share the CPU's memory bandwidth); the first token after they landed does."""

    class RAM:                    # the RAM cache's surface that Tier._back_to_ram uses
        def __init__(self):
            self.lru, self.inflight = {}, {}

        def in_ram(self, l, e):
            return False

        def room(self, l):
            return len(self.inflight) < 4

        def fetch(self, l, e):
            self.inflight[(l, e)] = Future()

    ram = RAM()
    t = Tier(NumpyDevice(), "m", 2, 8, 1024, 8 * 1024, "test", balancer=Balancer(enabled=True), log=io.StringIO(),
             ram=ram)
    assert t.gate.enabled
    samples = []
    t.gate.token = lambda ms, f=t.gate.token: (samples.append(ms), f(ms))[1]
    t.resident[(0, 1)] = object()
    t._ram_todo = [(0, 1)]

    def token():
        t.begin_token(1)
        t._tok_last = t._tok_t0 + 2_000_000          # the token's last step 2 ms after its start

    token()                       # starts the read
    token()                       # the read still runs
    ram.inflight[(0, 1)].set_result(None)    # it landed (the cache keeps it in inflight until a step takes it)
    token()
    token()
    assert t.prefetched == 1
    assert samples[0] is None and samples[1] is None and samples[2] == pytest.approx(2.0)
    t.close(free=False)           # the resident "expert" is a stand-in, not the device's
