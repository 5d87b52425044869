"""The tier's pure policy (scheduler/tier_policy.py): the budget rule, history heat, the heat's halving, the
warm-start plan, the LFRU eviction choice, the admission by yield. Exact values from the rules in docs/tier.md."""
import numpy as np
import pytest

from coli.base.errors import ColiError
from scheduler.tier_policy import (TRIAL_MIN, TRIAL_TOKENS, Admission, GiB, DeviceMemory, budget_bytes,
                                   halvings_due, history_heat, lfru_victim, warm_plan)


def test_budget_discrete_memory_budget_and_heap():
    b, w = budget_bytes(DeviceMemory("d", "discrete", 16 * GiB, 8 * GiB), 0, 0, env={})
    assert b == 7 * GiB and "discrete" in w and "8.00 GiB free" in w and "1 GiB reserve" in w
    b, w = budget_bytes({"kind": "discrete_gpu", "heap_bytes": 16 * GiB}, 0, 0, env={})
    assert b == 15 * GiB and "no VK_EXT_memory_budget" in w
    b, _ = budget_bytes(DeviceMemory("d", "discrete", 16 * GiB, 8 * GiB), 0, 0,
                        env={"COLI_VK_TIER_RESERVE_GB": "2"})
    assert b == 6 * GiB
    b, _ = budget_bytes(DeviceMemory("d", "discrete", 16 * GiB, GiB // 2), 0, 0, env={})
    assert b == 0


@pytest.mark.parametrize("kind", ["integrated", "cpu", "virtual"])
def test_budget_shared_ram_quarter_rule(kind):
    # (32 - 4 - 2) / 4 - 2 = 4.5 GiB
    b, w = budget_bytes(DeviceMemory("i", kind, 64 * GiB), 4 * GiB, 2 * GiB, env={}, available=32 * GiB)
    assert b == int(4.5 * GiB) and w.startswith("shared RAM: a quarter")
    # never below 0: (10 - 1 - 1) / 4 - 2 = 0
    b, _ = budget_bytes(DeviceMemory("i", kind, 64 * GiB), GiB, GiB, env={}, available=10 * GiB)
    assert b == 0
    b, _ = budget_bytes(DeviceMemory("i", kind, 64 * GiB), 8 * GiB, 8 * GiB, env={}, available=10 * GiB)
    assert b == 0


def test_budget_override_and_bad_values():
    b, w = budget_bytes(DeviceMemory("d", "discrete", 16 * GiB, 8 * GiB), 0, 0, env={"COLI_VK_TIER_GB": "1.5"})
    assert b == int(1.5 * GiB) and w == "COLI_VK_TIER_GB=1.5"
    b, _ = budget_bytes(DeviceMemory("i", "integrated", 64 * GiB), 0, 0, env={"COLI_VK_TIER_GB": "0.25"},
                        available=1 * GiB)
    assert b == GiB // 4
    b, w = budget_bytes(DeviceMemory("d", "discrete", 2 * GiB), 0, 0, env={"COLI_VK_TIER_GB": "5"})
    assert b == 2 * GiB and "capped" in w
    with pytest.raises(ColiError, match="COLI_VK_TIER_GB"):
        budget_bytes(DeviceMemory("d", "discrete", 2 * GiB), 0, 0, env={"COLI_VK_TIER_GB": "lots"})
    with pytest.raises(ColiError, match="COLI_VK_TIER_GB"):
        budget_bytes(DeviceMemory("d", "discrete", 2 * GiB), 0, 0, env={"COLI_VK_TIER_GB": "-1"})


def test_history_heat_seeds_32_and_proportion():
    h = history_heat(np.array([[10, 5, 0, 1], [0, 0, 0, 0], [2, 8, 8, 4]]))
    np.testing.assert_array_equal(h, [[32, 16, 0, 3.2], [0, 0, 0, 0], [8, 32, 32, 16]])


def test_warm_plan_order_and_fill():
    c = np.array([[5, 0, 9, 0, 0],
                  [9, 0, 0, 1, 0],
                  [0, 0, 0, 0, 0]])
    plan, nh = warm_plan(c, 100)
    # history hottest first, ties by layer then expert; then unnamed one per layer in turn, lowest id first
    assert plan[:4] == [(0, 2), (1, 0), (0, 0), (1, 3)] and nh == 4
    assert plan[4:10] == [(0, 1), (1, 1), (2, 0), (0, 3), (1, 2), (2, 1)]
    assert len(plan) == 15 and len(set(plan)) == 15
    plan, nh = warm_plan(c, 3)
    assert plan == [(0, 2), (1, 0), (0, 0)] and nh == 3
    plan, nh = warm_plan(c, 6, fill=False)
    assert plan == [(0, 2), (1, 0), (0, 0), (1, 3)]


def test_halvings_due_counts_1024_token_boundaries():
    assert halvings_due(1023, 0) == 0 and halvings_due(1024, 0) == 1
    assert halvings_due(3072, 1) == 2 and halvings_due(3072, 3) == 0 and halvings_due(5000, 0) == 4


def test_lfru_victim_exact_margin_and_ties():
    heat = np.zeros((2, 4))
    mask = np.zeros((2, 4), bool)
    assert lfru_victim(heat, mask, (0, 0)) is None                 # nothing resident
    mask[0, 1] = mask[1, 2] = mask[1, 3] = True
    heat[0, 1], heat[1, 2], heat[1, 3] = 8.0, 4.0, 4.0             # coldest 4.0, twice: lowest (layer, expert)
    heat[0, 0] = 1.25 * 4.0 + 4.0                                  # exactly 1.25x + 4: not enough
    assert lfru_victim(heat, mask, (0, 0)) is None
    heat[0, 0] = np.nextafter(9.0, np.inf)                         # the next float above: evicts (1, 2)
    assert lfru_victim(heat, mask, (0, 0)) == (1, 2)


# ---- admission by yield ----------------------------------------------------------------------------------

def _round(a, tok, routings, n, new_layer=0):
    """Stage ``n`` trials at token ``tok``: newcomer (new_layer, i) evicts (1, i)."""
    for i in range(n):
        assert a.allows(tok)
        a.staged(tok, (new_layer, i), (1, i), routings)


@pytest.mark.parametrize("gain, paid", [(4, True), (3, False)])
def test_admission_round_pays_at_exactly_the_payback(gain, paid):
    r = np.zeros((2, 16), np.int64)
    a = Admission(first=4, payback=4.0, cap=64)
    _round(a, 10, r, 4)
    assert not a.allows(10)                              # the round is full: no fifth trial
    r[0, :4] += 10 + gain                                # each newcomer routed `gain` more times than its victim
    r[1, :4] += 10
    assert a.judge(10 + TRIAL_TOKENS - 1, r) is None     # the last trial's 32 tokens have not passed
    assert a.judge(10 + TRIAL_TOKENS, r) is paid
    assert a.last_gain == gain
    if paid:                                             # twice the trials, at once
        assert a.size == 8 and a.allows(10 + TRIAL_TOKENS)
    else:                                                # TRIAL_MIN trials, 32 tokens later
        assert a.size == TRIAL_MIN and not a.allows(10 + 2 * TRIAL_TOKENS - 1) and a.allows(10 + 2 * TRIAL_TOKENS)


def test_admission_backs_off_doubling_to_the_heat_half_life():
    r = np.zeros((2, 16), np.int64)
    a = Admission(first=16, payback=4.0)
    tok, waits = 0, []
    for k in range(8):
        while not a.allows(tok):
            tok += 1
        _round(a, tok, r, a.size)                        # every round fills at its first token; nobody routed
        assert a.judge(tok + TRIAL_TOKENS, r) is False
        tok += TRIAL_TOKENS
        waits.append(a.open_at - tok)
        assert a.size == TRIAL_MIN
    assert waits == [32, 64, 128, 256, 512, 1024, 1024, 1024] and a.rounds_failed == 8


def test_admission_round_closes_after_its_window_unfilled():
    r = np.zeros((2, 16), np.int64)
    a = Admission(first=16, payback=4.0)
    _round(a, 5, r, 3)
    assert a.allows(5 + TRIAL_TOKENS - 1) and not a.allows(5 + TRIAL_TOKENS)   # stages for 32 tokens at most
    assert a.judge(5 + TRIAL_TOKENS, r) is False and a.rounds_failed == 1


def test_layer_lfru_rule():
    """scheduler/layer_residency.py: a non-resident expert routed 5 times (heat 5 > 1.25 x 0 + 4) replaces the coldest
    resident (lowest id among equals), 4 times is not enough; a layer wholly resident or wholly on the CPU never
    swaps; the history seeds the heat."""
    from scheduler.layer_residency import LayerLFRU

    res = {0: np.array([True, True, False, False]), 1: np.array([True] * 4), 2: np.array([False] * 4)}
    p = LayerLFRU(res)
    assert p.layers == [0]
    tok = {0: np.array([2, 0]), 1: np.array([1, 2]), 2: np.array([3, 1])}
    for _ in range(4):
        assert p.token(tok) == []
    assert p.token(tok) == [(0, 2, 1)]           # expert 2 at 5, expert 0 at 5, expert 1 at 0: 1 goes
    counts = np.zeros((3, 4), np.int64)
    counts[0] = [0, 100, 10, 0]                  # history: expert 1 hot (32), expert 2 at 3.2
    q = LayerLFRU({0: np.array([True, True, False, False])}, counts)
    assert q.token({0: np.array([2, 3])}) == [(0, 2, 0)]   # 3.2 + 1 = 4.2 > 1.25 x 0 + 4: the coldest, 0, goes
    assert q.heat[0][2] == 4.2 and q.heat[0][1] == 32.0
    # ties: of two routed non-resident experts at equal heat the lowest id comes in, of two equally cold residents
    # the lowest id goes; the caller's dict follows the swaps it writes through it (row views of the policy's arrays)
    res = {5: np.array([True, True, False, False, False]), 7: np.array([False, True, True, False, False])}
    p = LayerLFRU(res)
    tok = {5: np.array([4, 3]), 7: np.array([4, 3])}
    for _ in range(4):
        assert p.token(tok) == []
    assert p.token(tok) == [(5, 3, 0)]           # one swap a token: the first layer's
    res[5][3], res[5][0] = True, False
    assert p.resident[5][3] and not p.resident[5][0]
    assert p.token(tok) == [(5, 4, 1)]           # 4 at 6 > 1.25 x 0 + 4; layer 7's turn after
    res[5][4], res[5][1] = True, False
    assert p.token(tok) == [(7, 3, 1)] and p.swaps == 3


def _layer_swaps(skew: bool, gate: bool, seed: int, L=4, E=32, K=4, tokens=1000):
    """LayerLFRU over ``tokens`` routed decode tokens (each layer's lowest half resident): routing uniform over the E
    experts, or the highest quarter of ids taking 80 % of it. Returns the policy and the hot quarter's resident
    count."""
    from scheduler.layer_residency import LayerLFRU
    from scheduler.tier_policy import ReuseGate

    rng = np.random.default_rng(seed)
    res = {il: np.arange(E) < E // 2 for il in range(L)}
    p = LayerLFRU(res, reuse=ReuseGate(4.0) if gate else None)
    pr = np.full(E, 1.0 / E)
    if skew:
        pr[:] = 0.2 / (E - E // 4)
        pr[E - E // 4:] = 0.8 / (E // 4)
    for _ in range(tokens):
        for il, a, b in p.token({il: rng.choice(E, K, replace=False, p=pr) for il in range(L)}):
            assert res[il][b] and not res[il][a]
            res[il][a], res[il][b] = True, False
    return p, sum(int(res[il][E - E // 4:].sum()) for il in range(L))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layer_swaps_stop_under_uniform_routing_and_fill_the_hot_set(seed):
    """scheduler/layer_residency.py with the tier's reuse gate (COLI_VK_TIER_REUSE): 4 layers of 32 experts top-4,
    half resident, 1000 tokens. Uniform routing: the measured spread is the sampling noise's, the shrinkage ends at
    0 and no swap is made (LFRU alone: more than 30, one a token at most). The highest quarter taking 80 %: every hot
    expert comes in (each evicting a cold one: at least 32 swaps) and the gate refuses cold-for-cold swaps LFRU alone
    makes."""
    p, _ = _layer_swaps(False, True, seed)
    assert p.swaps == 0 and p.skipped_reuse > 1000 and p.reuse.B == 0.0
    old, _ = _layer_swaps(False, False, seed)
    assert old.swaps > 30 and old.skipped_reuse == 0
    p, hot = _layer_swaps(True, True, seed)
    assert hot == 4 * 8 and 32 <= p.swaps and p.skipped_reuse > 0 and p.reuse.B > 0.9
    old, hot_old = _layer_swaps(True, False, seed)
    assert hot_old == hot and p.swaps < old.swaps


# ---- the reuse gate ------------------------------------------------------------------------------------------

def test_reuse_gate_shrinkage_and_gain():
    """scheduler/tier_policy.py ReuseGate: B = sigma^2 / (sigma^2 + N) with N = m (1 - m / S1) S2 / S1 and sigma^2 =
    T - N (1 + 2 sqrt(2 / n)); the gain (B-shrunk difference less 2 B sqrt((r_c + r_v) S2 / S1)) / S1 x 1024
    against the payback; equal counts and the
    first token (every spread is the noise's) give B = 0; halving scales S1 by 1/2 and S2 by 1/4."""
    from scheduler.tier_policy import ReuseGate

    g = ReuseGate(payback=4.0)
    r = np.array([[0.0, 0.0, 10.0, 10.0], [5.0, 5.0, 5.0, 5.0]])
    assert g.refresh(r, [0, 1]) == 0.0 and g.gain(0, 10.0, 0, 0.0) == 0.0      # no token yet: nothing measured
    g.tokens(10)
    assert g.refresh(r[1:], [0]) == 0.0                 # every expert routed alike: no spread, no gain
    assert g.gain(0, 5.0, 0, 5.0) == 0.0 and not g.pays(0, 5.0, 0, 5.0)
    B = g.refresh(r[:1], [0])
    N = 5 * (1 - 5 / 10) * 10 / 10
    sig = 25.0 - N * (1 + 2.0 * np.sqrt(2 / 4))
    assert B == pytest.approx(sig / (sig + N), rel=1e-12)
    d = B * 10 - 2.0 * B * np.sqrt(10 * 10 / 10)       # less 2 standard errors of the pair's counts
    assert g.gain(0, 10.0, 0, 0.0) == pytest.approx(d / 10 * 1024, rel=1e-12) and g.pays(0, 10.0, 0, 0.0)
    assert g.gain(0, 0.0, 0, 10.0) < 0 and not g.pays(0, 0.0, 0, 10.0)
    g.halve(1)
    assert (g.s1, g.s2) == (5.0, 2.5)
    one = ReuseGate()
    one.tokens(1)                                       # one token: each expert 0 or 1, K of E set
    assert one.refresh(np.array([[1.0, 0.0, 0.0, 1.0]]), [0]) == 0.0
