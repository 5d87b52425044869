"""The tier's pure policy (scheduler/tier_policy.py): the budget rule, history heat, the heat's halving, the
warm-start plan, the LFRU eviction choice. Exact values from the rules in docs/tier.md."""
import numpy as np
import pytest

from coli.base.errors import ColiError
from scheduler.tier_policy import (GiB, DeviceMemory, budget_bytes, halvings_due, history_heat, lfru_victim,
                                   warm_plan)


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
