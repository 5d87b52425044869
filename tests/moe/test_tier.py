"""The tier (scheduler/tier.py): experts per budget, heat decay, the warm start, LFRU, rate, eviction vs in-flight
batches, failed uploads, the balancer's hand-back in split(), turning off.

These tests exercise POLICY ONLY: the device is `RecordingDevice`, an in-test object that records the calls
the tier makes (upload/free/submit/join) and returns zeros; nothing here checks numerics of a real device
(tests/vulkan/test_tier_device.py does, on Lavapipe, where coli.vulkan provides open_device).
"""
import io
import threading
import time

import numpy as np
import pytest

from scheduler.balancer import Balancer
from scheduler.tier import Tier
from scheduler.tier_policy import TRIAL_TOKENS

EXPERT_BYTES = 3 * 4 * 8  # three [4, 8]-byte matrices


def arrays(tag=0):
    raw = np.full((4, 8), tag % 256, dtype=np.uint8)
    return tuple(("Q8_0", raw.copy(), (4, 32)) for _ in range(3))


class Batch:
    def __init__(self, n, d, release, device_ms=1.0, fail=False):
        self.n, self.d, self.release, self.device_ms, self.fail = n, d, release, device_ms, fail

    def join(self):
        self.release.wait(5)
        if self.fail:
            raise RuntimeError("device lost")
        return np.zeros((self.n, self.d), np.float32)


class RecordingDevice:
    """Records calls in order; upload fails from the `fail_from`-th upload on (0-based) when set."""

    def __init__(self, fail_from=None):
        self.calls, self.live, self.n, self.fail_from = [], set(), 0, fail_from
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.release.set()
        self.fail_join = False

    def upload_expert(self, g, u, d):
        with self.lock:
            k = self.n
            self.n += 1
            if self.fail_from is not None and k >= self.fail_from:
                self.calls.append(("upload-failed", k))
                raise MemoryError("VK_ERROR_OUT_OF_DEVICE_MEMORY")
            self.live.add(k)
            self.calls.append(("upload", k))
            return k

    def free_expert(self, h):
        with self.lock:
            self.live.remove(h)
            self.calls.append(("free", h))

    def submit_experts(self, x, rows, handles):
        self.calls.append(("submit", tuple(handles)))
        return Batch(len(rows), x.shape[1], self.release, fail=self.fail_join)


def make(cap=4, L=2, E=8, counts=None, env=None, bal=None, dev=None):
    dev = dev or RecordingDevice()
    log = io.StringIO()
    env = {"COLI_VK_TIER_REUSE": "0", **(env or {})}    # LFRU's own rules unless a test turns the reuse gate on
    t = Tier(dev, "m", L, E, EXPERT_BYTES, cap * EXPERT_BYTES, "test rule", counts=counts,
             balancer=bal or Balancer(enabled=False), env=env, log=log)
    return t, dev, log


# ---- budget ----------------------------------------------------------------------------------------------







def test_experts_per_budget_and_start_line():
    t, _, _ = make(cap=4)
    t2 = Tier(RecordingDevice(), "olmoe", 2, 8, 3 * 1024 * 1024, 10 * 1024 * 1024 + 5, "COLI_VK_TIER_GB=0.01",
              env={}, log=io.StringIO(), device_name="llvmpipe")
    assert t.capacity == 4 and t2.capacity == 3
    assert t2.start_line() == ("[VK] tier olmoe: on, llvmpipe, budget 0.01 GiB = 3 experts of 3.00 MiB, "
                               "COLI_VK_TIER_GB=0.01, shared queue, up to 16 promotions per token, balanced "
                               "against the CPU")
    # a budget below one expert (the rule's 0 on a small machine): said plainly, no "balanced" nor a device share
    t0 = Tier(RecordingDevice(), "olmoe", 2, 8, 3 * 1024 * 1024, 3 * 1024 * 1024 - 1, "shared RAM: ...", env={},
              log=io.StringIO(), device_name="llvmpipe")
    assert t0.capacity == 0 and t0.start_line().endswith(
        "budget 0.00 GiB = 0 experts of 3.00 MiB, shared RAM: ..., shared queue, up to 16 promotions per token, "
        "no expert fits: every routed expert runs on the CPU")
    line = t0.run_line(0, 0)
    assert "balance: none (no expert on the device)" in line and "device share" not in line
    for n, said in ((1, "1 decode token without"), (2, "2 decode tokens without")):   # it read "1 decode tokens"
        t2.gate.tokens_without = n
        assert f", {said} the device (the decode gate: no decision)" in t2.run_line(0, 0)
    t.close(), t2.close(), t0.close()


# ---- heat ------------------------------------------------------------------------------------------------



def test_heat_halves_stepwise_at_1024_boundaries():
    t, _, _ = make()
    t.begin_token()
    t.split(0, np.array([3]), np.array([1]))           # +1 in token 1
    for _ in range(1023):                              # tokens 2..1024
        t.begin_token()
    assert t.heat[0, 3] == 1.0                         # 1024 tokens begun, none halving yet
    t.begin_token()                                    # token 1025: 1024 completed -> halve once
    assert t.heat[0, 3] == 0.5
    t.begin_token(2047)                                # a 2047-token forward (tokens 1026..3072)
    assert t.heat[0, 3] == 0.5
    t.begin_token()                                    # 3072 completed: boundaries 2048 and 3072 crossed
    assert t.heat[0, 3] == 0.125
    t.close()


# ---- warm start ------------------------------------------------------------------------------------------



def test_warm_start_reads_in_parallel_and_uploads_the_plan():
    c = np.zeros((2, 8), np.int64)
    c[1, 5], c[0, 2] = 7, 3
    t, dev, log = make(cap=4, counts=c)
    threads = set()

    def read(l, e):
        threads.add(threading.current_thread().name)
        time.sleep(0.01)
        return arrays(l * 8 + e)

    ws = t.warm_start(read, threads=4)
    assert ws.n == 4 and ws.n_history == 2 and ws.failed == 0
    assert set(t.resident) == {(1, 5), (0, 2), (0, 0), (1, 0)}
    assert len(threads) > 1                                      # read on the pool
    assert log.getvalue().startswith("[VK] tier m: warm start, 2 experts from the history; 2 more to fill the room in ")
    assert log.getvalue().rstrip().endswith(" s")
    assert t.warm_uploads == 4 and t.uploads == 4
    t.close()
    assert dev.live == set()                                     # close frees them


def test_warm_start_failed_upload_shrinks_budget():
    c = np.zeros((2, 8), np.int64)
    c[0, :] = np.arange(8, 0, -1)
    t, dev, log = make(cap=6, counts=c, dev=RecordingDevice(fail_from=3))
    ws = t.warm_start(lambda l, e: arrays(e), threads=2)
    assert ws.n == 3 and ws.failed == 1 and t.capacity == 3 and t.failed == 1
    assert ("an upload failed (layer 0 expert 3: MemoryError: VK_ERROR_OUT_OF_DEVICE_MEMORY), budget now 3 experts"
            in log.getvalue())                                   # the expert and the reason, never silent
    t.close()


# ---- LFRU, rate, upload pipeline ------------------------------------------------------------------------

def fill_one(t, layer, e, heat):
    """Promote (layer, e) through note/settle (room available) and set its heat."""
    assert t.note(layer, e, lambda: arrays(e))
    t.settle()
    t.heat[layer, e] = heat


def test_promoted_expert_serves_from_the_next_step():
    t, dev, _ = make(cap=2, env={"COLI_VK_TIER_SYNC": "1"})
    t.begin_token()
    d, c = t.split(0, np.array([1, 2]), np.array([1, 1]))
    assert d.size == 0 and list(c) == [1, 2]
    assert t.note(0, 1, lambda: arrays(1))            # recorded; decided at the next settle()
    d, c = t.split(0, np.array([1]), np.array([1]))   # same step, before settle: still on the CPU
    assert d.size == 0
    t.settle()
    d, c = t.split(0, np.array([1, 2]), np.array([1, 1]))
    assert list(d) == [1] and list(c) == [2]
    t.close()


@pytest.mark.parametrize("cand, promoted", [(14.0, False), (np.nextafter(14.0, 15.0), True), (20.0, True)])
def test_lfru_margin_exact_boundary(cand, promoted):
    t, dev, _ = make(cap=2, env={"COLI_VK_TIER_SYNC": "1"})
    t.begin_token()
    fill_one(t, 0, 0, 8.0)                             # coldest: 1.25 * 8 + 4 = 14
    fill_one(t, 0, 1, 30.0)
    t.heat[1, 4] = cand
    assert t.promote(1, 4, lambda: arrays(4)) is promoted
    t.settle()
    assert ((1, 4) in t.resident) is promoted
    assert ((0, 0) in t.resident) is (not promoted)    # the coldest is the one evicted
    assert (0, 1) in t.resident
    assert t.evictions == int(promoted)
    t.close()


def test_rate_limit_16_promotions_per_token():
    t, dev, _ = make(cap=100, L=4, E=16, env={"COLI_VK_TIER_SYNC": "1", "COLI_VK_TIER_QUEUE_MAX": "1000"})
    t.begin_token()
    staged = sum(t.promote(0, e, lambda: arrays(e)) for e in range(16)) + \
        sum(t.promote(1, e, lambda: arrays(e)) for e in range(4))
    assert staged == 16 and t.skipped_rate == 4
    t.begin_token()
    assert sum(t.promote(1, e, lambda: arrays(e)) for e in range(16)) == 16
    t.begin_token(3)                                  # a 3-token forward gets 48
    assert sum(t.promote(l, e, lambda: arrays(e)) for l in (2, 3) for e in range(16)) == 32
    t.settle()
    assert len(t.resident) == 64
    t.close()


def test_eviction_waits_for_the_in_flight_batch():
    dev = RecordingDevice()
    t, dev, _ = make(cap=1, dev=dev)
    t.begin_token()
    fill_one(t, 0, 0, 1.0)
    t.settle()
    while (0, 0) not in t.resident:                   # async mode: wait for the uploader
        time.sleep(0.01)
        t.settle()
    dev.release.clear()                               # the device batch is "running"
    d, c = t.split(0, np.array([0, 5]), np.array([1, 1]))
    assert list(d) == [0]
    iss = t.issue(0, np.zeros((1, 4), np.float32), [0], d)
    t.heat[0, 5] = 100.0
    assert t.promote(0, 5, lambda: arrays(5))         # evicts (0, 0), which the batch reads
    assert (0, 0) not in t.resident
    time.sleep(0.2)
    assert ("free", 0) not in dev.calls and ("upload", 1) not in dev.calls   # waiting for the join
    dev.release.set()
    out = t.join(iss)
    assert out.shape == (1, 4)
    for _ in range(200):
        t.settle()
        if (0, 5) in t.resident:
            break
        time.sleep(0.01)
    assert (0, 5) in t.resident
    assert dev.calls.index(("free", 0)) < dev.calls.index(("upload", 1))
    t.close()


def test_failed_upload_shrinks_planned_residency():
    t, dev, log = make(cap=4, env={"COLI_VK_TIER_SYNC": "1"}, dev=RecordingDevice(fail_from=2))
    t.begin_token()
    for e in range(3):
        t.note(0, e, lambda: arrays(e))
    t.settle()
    assert t.capacity == 3 and t.failed == 1 and len(t.resident) == 2
    assert (0, 2) not in t.resident and (0, 2) not in t.pending
    # one line naming the expert and the reason (each distinct reason once)
    assert log.getvalue().count("failed (MemoryError: VK_ERROR_OUT_OF_DEVICE_MEMORY)") == 1
    assert "[VK] tier m: upload of layer 0 expert 2 failed (MemoryError: VK_ERROR_OUT_OF_DEVICE_MEMORY); " \
           "budget now 3 experts" in log.getvalue()
    t.note(0, 3, lambda: arrays(3))
    t.settle()
    assert t.failed == 2 and t.capacity == 2
    assert log.getvalue().count("failed (MemoryError: VK_ERROR_OUT_OF_DEVICE_MEMORY)") == 1
    t.close()


def test_split_hands_resident_ram_experts_to_the_cpu_at_the_share():
    bal = Balancer(enabled=True)
    t, dev, _ = make(cap=8, env={"COLI_VK_TIER_SYNC": "1"}, bal=bal)
    t.begin_token()
    for e in range(6):
        t.note(0, e, lambda: arrays(e))
    t.settle()
    bal.share = 0.5
    in_ram = lambda l, e: e in (1, 2, 3, 4)   # noqa: E731  0 and 5 only on the device
    d, c = t.split(0, np.arange(8), np.array([1, 1, 3, 1, 1, 2, 1, 1]), in_ram)
    # resident rows 1+1+3+1+1+2 = 9, device keeps round(4.5) = 5: experts 0 and 5 (3 rows) + expert 2 (3 rows)
    assert list(d) == [0, 2, 5] and list(c) == [1, 3, 4, 6, 7]
    assert t.handed_rows == 3 and t.device_pairs == 6 and t.routed_pairs == 11
    t.close()


def test_join_feeds_the_balancer_and_run_line():
    bal = Balancer(enabled=True)
    t, dev, _ = make(cap=8, env={"COLI_VK_TIER_SYNC": "1"}, bal=bal)
    t.begin_token()
    t.note(0, 0, lambda: arrays(0))
    t.settle()
    d, c = t.split(0, np.array([0, 1]), np.array([2, 1]))
    iss = t.issue(0, np.zeros((2, 4), np.float32), [0, 1], [0, 0])
    time.sleep(0.01)
    t.join(iss)
    assert bal.steps == 1 and bal.a_ms == pytest.approx(0.5) and bal.b_ms is not None and bal.b_ms >= 10.0
    line = t.run_line(7, 3)
    assert line.startswith("[VK] tier m run: device 2 of 3 routed experts (66.7%) | CPU RAM hits 7, disk loads 3 | "
                           "resident 1 (budget 8, 0.00 GiB of 0.00 GiB, n/a blocks, frag n/a) | uploads 1 (")
    assert "evictions 0, skipped 0 queue + 0 rate + 0 yield + 0 reuse, failed 0 | device 1.0 ms, CPU share" in line
    assert line.endswith("rows handed to the CPU")
    t.close()


def test_device_lost_in_join_turns_the_tier_off():
    t, dev, log = make(cap=4, env={"COLI_VK_TIER_SYNC": "1"})
    t.begin_token()
    t.note(0, 0, lambda: arrays(0))
    t.settle()
    d, _ = t.split(0, np.array([0]), np.array([1]))
    dev.fail_join = True
    iss = t.issue(0, np.zeros((1, 4), np.float32), [0], d)
    with pytest.raises(RuntimeError, match="device lost"):
        t.join(iss)
    assert not t.on and "[VK] tier m: off, the device failed a join (RuntimeError: device lost)" in log.getvalue()
    d, c = t.split(0, np.array([0, 1]), np.array([1, 1]))
    assert d.size == 0 and list(c) == [0, 1]
    assert t.note(0, 1, lambda: arrays(1)) is False


def test_split_without_in_ram_keeps_every_resident_expert_on_the_device():
    bal = Balancer(enabled=True)
    t, dev, _ = make(cap=8, env={"COLI_VK_TIER_SYNC": "1"}, bal=bal)
    t.begin_token()
    for e in range(3):
        t.note(0, e, lambda: arrays(e))
    t.settle()
    bal.share = 0.05
    d, c = t.split(0, np.arange(4), np.ones(4, np.int64))
    assert list(d) == [0, 1, 2] and list(c) == [3] and t.handed_rows == 0
    t.close()


def test_auto_tokens_and_explicit_begin_token_count_a_forward_once():
    t, dev, _ = make(cap=4, L=2, E=8)
    t.auto_tokens = True
    groups = {0: np.array([0]), 1: np.array([1])}
    x = np.zeros((5, 4), np.float32)
    t.issue_step(0, x, groups, None, 1)          # a 5-token prompt forward: auto
    t.issue_step(1, x, groups, None, 1)
    assert t.tokens == 5 and t.rate_left == 80
    t.begin_token()                              # the engine's decode step says so itself
    t.issue_step(0, x[:1], groups, None, 1)
    t.issue_step(1, x[:1], groups, None, 1)
    assert t.tokens == 6 and t.rate_left == 16
    t.issue_step(0, x[:1], groups, None, 1)      # a forward without the explicit call: auto again
    assert t.tokens == 7
    t.close()


def test_noted_candidates_are_decided_in_layer_expert_order():
    # room for 2: whatever order the CPU finished them in, the two lowest (layer, expert) are promoted
    for order in ([(1, 3), (0, 7), (0, 2)], [(0, 2), (1, 3), (0, 7)]):
        t, dev, _ = make(cap=2, env={"COLI_VK_TIER_SYNC": "1"})
        t.begin_token()
        for l, e in order:
            assert t.note(l, e, lambda e=e: arrays(e))
        t.settle()
        assert sorted(t.resident) == [(0, 2), (0, 7)]
        t.close()


# ---- admission by yield ------------------------------------------------------------------------------------

def _routed_run(env, skew, L, E, K, cap, tokens, seed=0):
    """A decode run of ``tokens`` tokens on a warm-started tier (the fill: each layer's lowest ids) under
    COLI_VK_TIER_SYNC=1, every expert the CPU computes offered: routing uniform over the E experts, or skewed (the
    highest quarter of ids takes 80 % of the routings). Returns the tier (closed), the evictions counted after each
    token, the hot quarter's resident experts at the end and the device's share of the last half's pairs."""
    rng = np.random.default_rng(seed)
    t, dev, _ = make(cap=cap, L=L, E=E, env={"COLI_VK_TIER_SYNC": "1", **env})
    t.warm_start(lambda l, e: arrays(e), threads=1)
    assert t.warm_uploads == cap and t.evictions == 0
    p = np.full(E, 1.0 / E)
    if skew:
        p[:] = 0.2 / (E - E // 4)
        p[E - E // 4:] = 0.8 / (E // 4)
    ev = []
    for tok in range(tokens):
        t.begin_token()
        if tok == tokens // 2:
            half = (t.device_pairs, t.routed_pairs)
        for l in range(L):
            t.settle()
            _, cpu = t.split(l, rng.choice(E, K, replace=False, p=p), np.ones(K, np.int64))
            for e in cpu:
                t.note(l, int(e), lambda e=e: arrays(int(e)))
        ev.append(t.evictions)
    hot = int(t.mask[:, E - E // 4:].sum())
    late = (t.device_pairs - half[0]) / (t.routed_pairs - half[1])
    t.close()
    return t, ev, hot, late


def test_uniform_routing_stops_uploading_after_the_first_rounds():
    """Uniform routing over 64 experts top-8, half of them resident: a newcomer is routed as often as the expert it
    evicts, so every round of trials fails. The count follows from the rule: the first round stages COLI_VK_TIER_RATE
    (16) trials, then rounds of 4 open 32 tokens after the last one was judged plus a wait doubling from 32 tokens:
    rounds at T, T+32+32, +32+64, +32+128, ... (T: the first round's last trial). Each of these rounds fills at its
    opening token, so 600 tokens give 16 + 3 x 4 = 28 evictions (uploads), against LFRU alone's 166."""
    t, ev, _, late = _routed_run({"COLI_VK_TIER_YIELD": "1"}, False, L=8, E=64, K=8, cap=256, tokens=600)
    a = t.admission
    assert a.rounds_paid == 0 and a.rounds_failed == 4       # the first and three later ones
    first = ev.index(16) + 1                     # tokens begun when the first round's 16th trial was staged
    assert max(ev[:first + 2 * TRIAL_TOKENS - 1]) == 16                 # nothing until the second round opens
    opens = [first + 64, first + 64 + 96, first + 64 + 96 + 160]
    for k, o in enumerate(opens):               # each later round: 4 trials at its opening token
        assert ev[o - 2] == 16 + 4 * k and ev[o - 1] == 16 + 4 * (k + 1)
    assert opens[-1] + 32 + 256 > 600 and ev[-1] == 28 == t.uploads - t.warm_uploads
    assert t.skipped_yield > 0 and f"evictions 28 (trial rounds: 0 paid, 4 not), skipped 0 queue + 0 rate + " \
        f"{t.skipped_yield} yield + 0 reuse" in t.run_line(0, 0)
    assert 0.45 < late < 0.55                    # half the experts resident serve half the pairs, as before
    old, ev_old, _, _ = _routed_run({"COLI_VK_TIER_YIELD": "0"}, False, L=8, E=64, K=8, cap=256, tokens=600)
    assert ev_old[-1] > 5 * 28 and old.skipped_yield == 0     # LFRU alone keeps swapping


def test_skewed_routing_fills_the_hot_set():
    """The highest quarter of each layer's 32 experts takes 80 % of the routings (top-4), the budget holds half of
    them and the warm start's fill took the lowest ids: the trials that bring the hot experts in pay (a hot newcomer
    is routed ~16x as often as a cold victim), so rounds double until the whole hot quarter is resident, and the
    device serves more than the hot share of the pairs (LFRU alone: 61 evictions, this rule 52)."""
    t, ev, hot, late = _routed_run({"COLI_VK_TIER_YIELD": "1"}, True, L=4, E=32, K=4, cap=64, tokens=1000)
    assert hot == 4 * 8 and t.admission.rounds_paid >= 1
    assert late > 0.8
    old, ev_old, _, _ = _routed_run({"COLI_VK_TIER_YIELD": "0"}, True, L=4, E=32, K=4, cap=64, tokens=1000)
    assert ev[-1] < ev_old[-1]                   # the cold-for-cold swaps that do not pay are skipped


# ---- the reuse gate ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reuse_gate_uniform_routing_stops_uploading_after_the_warm_start(seed):
    """Uniform routing over 64 experts top-8, half of them resident, 600 tokens: the spread of the measured routings
    is the sampling noise's, so the gate's shrinkage is 0 at the end and (but for the first tokens' noise) no swap
    is expected to repay an upload. LFRU alone swaps 166-172 times on the same routings."""
    env = {"COLI_VK_TIER_REUSE": "1"}
    t, ev, _, late = _routed_run(env, False, L=8, E=64, K=8, cap=256, tokens=600, seed=seed)
    assert t.uploads - t.warm_uploads == t.evictions == ev[-1] <= 3
    assert ev[100] == ev[-1]                     # none after the first 100 tokens
    assert t.reuse.B == 0.0 and t.skipped_reuse > 10_000
    assert f"skipped 0 queue + 0 rate + 0 yield + {t.skipped_reuse} reuse" in t.run_line(0, 0)
    assert 0.45 < late < 0.55                    # half the experts resident serve half the pairs either way
    old, ev_old, _, late_old = _routed_run({"COLI_VK_TIER_REUSE": "0"}, False, L=8, E=64, K=8, cap=256, tokens=600,
                                           seed=seed)
    assert ev_old[-1] > 150 and old.skipped_reuse == 0 and 0.45 < late_old < 0.55


@pytest.mark.parametrize("seed", [0, 1])
def test_reuse_gate_skewed_routing_fills_the_hot_set(seed):
    """The highest quarter of each layer's 32 experts takes 80 % of the routings (top-4), the budget holds half and
    the warm start took the lowest ids: the shrinkage nears 1 and every hot expert comes in, as with LFRU alone, while
    swaps of a cold expert for another cold one fail the pair's own noise bound (seed 0: 42 evictions, LFRU 61)."""
    t, ev, hot, late = _routed_run({"COLI_VK_TIER_REUSE": "1"}, True, L=4, E=32, K=4, cap=64, tokens=1000, seed=seed)
    assert hot == 4 * 8 and t.reuse.B > 0.9 and late > 0.8
    assert ev[-1] >= 4 * 8 == hot                # each hot expert evicted a cold one (the fill took only cold ones)
    old, ev_old, hot_old, late_old = _routed_run({"COLI_VK_TIER_REUSE": "0"}, True, L=4, E=32, K=4, cap=64,
                                                 tokens=1000, seed=seed)
    assert hot_old == hot and ev[-1] < ev_old[-1]     # LFRU alone: the same hot set, more cold-for-cold swaps
