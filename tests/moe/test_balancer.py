"""The balancer (scheduler/balancer.py): convergence to the equal-finish share, floor, ceiling, hand-back
order, determinism, --no-balance. Pure policy on a deterministic model of steps (no device)."""
import numpy as np
import pytest

from scheduler.balancer import Balancer, StepTimes, simulate


def test_converges_to_equal_finish_share_slow_igpu_then_fast_dgpu():
    # 32 pairs a step, 24 resident; iGPU 0.9 ms/row vs CPU 0.3 -> device keeps 32*0.3/1.2 = 8 rows = 1/3
    r = simulate([(0.9, 0.3), (0.03, 0.3)], steps_per_phase=60, noise=0.0, cpu_fixed_ms=0.0, dev_fixed_ms=0.0)
    s = r["share"]
    assert r["target"][0] == pytest.approx(1 / 3)
    assert np.all(np.abs(s[12:60] - 1 / 3) < 0.02)         # within 12 steps of the start
    assert r["target"][60] == 1.0
    assert np.all(s[60 + 15:] > 0.99)                      # back to the ceiling within 15 steps of the switch
    assert s.max() <= 1.0
    # the balanced split's step time is within 10% of the best split's once converged
    assert np.all(r["step_ms"][20:60] <= 1.1 * r["best_ms"][20:60])


def test_never_below_floor_and_takes_rows_back():
    b = Balancer(floor=0.05)
    for _ in range(50):                                    # device 100x slower: target far below the floor
        b.update(StepTimes(device_ms=100.0, device_rows=1, cpu_ms=1.0, cpu_rows=31, waited_ms=99.0,
                           resident_rows=24))
        assert b.share >= 0.05
    assert b.share == pytest.approx(0.05, abs=1e-3)
    assert b.device_rows(24) == 1                          # round(0.05 * 24) = 1
    assert b.device_rows(4) == 0                           # round(0.2) = 0
    # a 4-row step at the floor: the device keeps 1 row once every `period` calls
    b.period = 16
    kept = [int(b.keep(np.ones(4, np.int64), np.ones(4, bool)).sum()) for _ in range(32)]
    assert kept == ([0] * 15 + [1]) * 2
    # each update whose target sits at the floor doubles the period, up to 1024; a higher target resets it
    for _ in range(10):
        b.update(StepTimes(device_ms=100.0, device_rows=1, cpu_ms=1.0, cpu_rows=31, waited_ms=99.0,
                           resident_rows=24))
    assert b.period == 1024
    for _ in range(40):                                    # then the device is fast: all rows back
        b.update(StepTimes(device_ms=0.1, device_rows=2, cpu_ms=30.0, cpu_rows=30, waited_ms=0.0,
                           resident_rows=24))
    assert b.share == pytest.approx(1.0, abs=1e-3)
    assert b.period == 16                                  # the target left the floor: back to 16


def test_probe_lowers_share_while_cpu_cost_unknown():
    b = Balancer()
    b.update(StepTimes(10.0, 8, 0.0, 0, 9.0, 8))           # all rows on the device, join waited 90%
    assert b.share == pytest.approx(0.9)
    b.update(StepTimes(10.0, 8, 0.0, 0, 0.5, 8))           # waited 5% < 10%: no change
    assert b.share == pytest.approx(0.9)


def test_no_balance_keeps_share_one():
    r = simulate([(0.9, 0.3)], steps_per_phase=30, enabled=False)
    assert np.all(r["share"] == 1.0)
    b = Balancer(enabled=False)
    assert b.keep(np.array([1, 2]), np.array([True, True])).all()


def test_deterministic():
    a = simulate([(0.9, 0.3), (0.03, 0.3)], steps_per_phase=40, seed=3)
    b = simulate([(0.9, 0.3), (0.03, 0.3)], steps_per_phase=40, seed=3)
    np.testing.assert_array_equal(a["share"], b["share"])


def test_keep_order_most_rows_first_ties_by_position():
    b = Balancer()
    b.share = 0.4
    rows = np.array([1, 2, 2, 1, 4])
    mov = np.array([True, True, True, True, False])
    # 10 rows, device keeps round(4) = 4: the non-movable 4 already -> every movable one goes to the CPU
    assert list(b.keep(rows, mov)) == [False, False, False, False, True]
    b.share = 0.7                                          # 7 rows: 4 + expert 1 (2 rows) + expert 2 (2 rows)
    assert list(b.keep(rows, mov)) == [False, True, True, False, True]


def test_cold_cpu_measurement_is_replaced_by_the_first_warm_one():
    b = Balancer()
    b.update(StepTimes(10.0, 4, 40.0, 4, 0.0, 8, cpu_cold=2))    # disk reads: 10 ms/row
    assert b.b_ms == pytest.approx(10.0)
    b.update(StepTimes(10.0, 4, 80.0, 4, 0.0, 8, cpu_cold=1))    # still cold: averaged in
    assert b.b_ms == pytest.approx(10.0 + 0.3 * (20.0 - 10.0))
    b.update(StepTimes(10.0, 4, 2.0, 4, 0.0, 8))                 # the first warm step replaces it
    assert b.b_ms == pytest.approx(0.5)
    b.update(StepTimes(10.0, 4, 400.0, 4, 0.0, 8, cpu_cold=3))   # a later cold step does not count
    assert b.b_ms == pytest.approx(0.5)
    b.update(StepTimes(10.0, 4, 4.0, 4, 0.0, 8))                 # warm ones average as usual
    assert b.b_ms == pytest.approx(0.5 + 0.3 * (1.0 - 0.5))


def test_a_cold_cpu_measurement_does_not_keep_the_cpu_from_rows():
    """A first CPU cost measured with disk reads (50 ms a row) is no measurement of RAM-held rows: while the join
    keeps waiting on the device (40 ms a step, less than that cold cost), the share probes down as before any
    measurement, the CPU gets movable rows again (``keep``), and its first warm step replaces the cold cost."""
    b = Balancer()
    b.update(StepTimes(40.0, 4, 50.0, 1, 40.0, 4, cpu_cold=1))   # a disk read: 50 ms for one row
    for _ in range(3):                                          # the device alone, the join waiting 40 ms
        b.update(StepTimes(40.0, 4, 0.0, 0, 40.0, 4))
    assert b.cpu_room and b.share == pytest.approx(1.0 - 4 * b.probe)
    keep = b.keep(np.array([1, 1, 1, 1]), np.array([True, True, True, True]))
    assert not keep.all()                                       # rows handed to the CPU
    b.update(StepTimes(30.0, 3, 1.0, 1, 30.0, 4))               # the CPU's row, from RAM: 1 ms
    assert b.b_ms == pytest.approx(1.0)


def test_target_under_the_floor_leaves_only_measurement_rows():
    b = Balancer(floor=0.05)
    for _ in range(30):
        b.update(StepTimes(100.0, 1, 1.0, 63, 99.0, 64))          # the device 6000x slower per row
    assert b.share == pytest.approx(0.05, abs=1e-6) and b.target == 0.05
    # a 64-row step: round(0.05 * 64) = 3 rows at the floor, but the device loses there too: none,
    # except one measurement row every `period` steps
    kept = [int(b.keep(np.ones(64, np.int64), np.ones(64, bool)).sum()) for _ in range(b.period)]
    assert kept == [0] * (b.period - 1) + [1]


def test_never_lowers_when_one_cpu_row_costs_more_than_the_device_step():
    """A discrete GPU: 8 pairs in 0.23 ms (mostly fixed latency), a CPU row 0.3 ms. The equal-finish model
    asks for ~0.9 of the rows on the device, but any row handed to the CPU makes the step longer."""
    from scheduler.balancer import Balancer, StepTimes

    b = Balancer(enabled=True)
    for i in range(64):
        if i % 2:   # a step where the CPU also had a non-resident expert
            b.update(StepTimes(device_ms=0.23, device_rows=7, cpu_ms=0.3, cpu_rows=1, waited_ms=0.0, resident_rows=7))
        else:       # every pair resident: the CPU had nothing to do and the join waited for the device
            b.update(StepTimes(device_ms=0.23, device_rows=8, cpu_ms=0.0, cpu_rows=0, waited_ms=0.2, resident_rows=8))
    assert b.share > 0.99 and b.device_rows(8) == 8   # (the first step's probe, before any CPU row, heals)


def test_never_lowers_when_the_device_finished_first():
    """A per-row model can ask for a lower share (the device's per-row cost is mostly a fixed batch latency),
    but when the step's device time is below the CPU's, the CPU is the longer side: the share must not drop."""
    from scheduler.balancer import Balancer, StepTimes

    b = Balancer(enabled=True)
    for _ in range(50):
        # 6 device rows in 0.9 ms (a = 0.15 ms/row), 10 CPU rows in 1.0 ms (b = 0.1 ms/row), 8 resident: the
        # model's equal-finish target is 0.8, yet the device finished before the CPU and the join did not wait
        b.update(StepTimes(device_ms=0.9, device_rows=6, cpu_ms=1.0, cpu_rows=10, waited_ms=0.0, resident_rows=8))
    assert b.target is not None and b.target < 1.0
    assert b.share == 1.0


def _latency_device_run(enabled: bool, steps: int = 1024, seed: int = 3):
    """A simulated discrete GPU whose batch is mostly fixed latency (the H200 decode: 8 pairs a step, about
    half resident; a batch is 0.25 ms of submit/fence latency that its timestamps do not show + 0.01 ms a
    row; a join that finds the batch done still costs 0.015 ms). The CPU: 0.1 ms a row + 0.08 ms fixed.
    Every resident expert is movable. Returns per step: handed rows, the CPU's time without hand-back, the
    device's wall time with every resident row, and the step time."""
    rng = np.random.default_rng(seed)
    bal = Balancer(enabled=enabled)
    out = {k: [] for k in ("handed", "cpu_base", "dev_wall_all", "step")}
    for i in range(steps):
        k = 8 if i == 0 else int(rng.binomial(8, 0.5))      # resident pairs (the first step: all, a probe)
        if k == 0:
            continue
        keep = bal.keep(np.ones(k, np.int64), np.ones(k, bool))
        d = int(keep.sum())
        c = 8 - d
        cpu = 0.08 + 0.1 * c
        wall = 0.25 + 0.01 * d
        waited = max(0.0, wall - cpu) + 0.015
        out["handed"].append(k - d)
        out["cpu_base"].append(0.08 + 0.1 * (8 - k))
        out["dev_wall_all"].append(0.25 + 0.01 * k)
        out["step"].append(max(cpu, wall) + 0.015)
        bal.update(StepTimes(0.01 * d, d, cpu, c, waited, k))
    return {key: np.asarray(v) for key, v in out.items()}, bal


def test_never_hands_rows_to_a_cpu_that_is_the_longer_side_fixed_latency_device():
    """H200 (docs/balancer.md): the balanced run handed rows to a CPU that was already the longer side and
    lost 5-6 % to the tier. With a device whose batch is mostly fixed latency: no row goes to the CPU in a
    step where the CPU, without it, already took longer than the device; and the balanced run is never
    slower than the tier alone (share fixed at 1) on the same steps."""
    on, bal = _latency_device_run(True)
    off, _ = _latency_device_run(False)
    cpu_longer = on["cpu_base"] >= on["dev_wall_all"]
    assert cpu_longer.sum() > 500                          # most steps: the CPU is the longer side
    assert int(on["handed"][cpu_longer].sum()) == 0
    assert on["step"].sum() <= off["step"].sum() * 1.001


def _gate_run(gate, on_ms, off_ms, n, drop_every=0):
    """Feed ``n`` decode tokens whose time depends on the side the gate chose; returns the sides in order."""
    from itertools import count
    sides, k = [], count()
    for _ in range(n):
        side = gate.use_device
        sides.append(side)
        i = next(k)
        ms = on_ms(i) if side else off_ms(i)
        gate.token(None if drop_every and i % drop_every == 0 else ms)
    return sides


def test_decode_gate_leaves_the_device_when_tokens_without_it_are_faster():
    from scheduler.balancer import DecodeGate
    g = DecodeGate(window=4, hold=8, max_hold=32, margin=0.03)
    sides = _gate_run(g, lambda i: 26.0, lambda i: 17.0, 8 + 8 + 8 + 16 + 8 + 32 + 1)
    # measuring: alternate from the device, 4 samples a side; then the faster side (without) for `hold`
    assert sides[:8] == [True, False] * 4
    assert sides[8:16] == [False] * 8
    assert g.decisions[0] == (False, 26.0, 17.0)
    # the hold's end measures again, the losing side first; the same decision doubles the hold (8 -> 16 -> 32)
    assert sides[16:24] == [True, False] * 4 and sides[24:40] == [False] * 16
    assert sides[40:48] == [True, False] * 4 and sides[48:80] == [False] * 32
    assert [d[0] for d in g.decisions] == [False, False, False]
    assert g.hold == 32 and g.tokens_without == sides[:-1].count(False)


def test_decode_gate_keeps_the_device_within_the_margin_and_comes_back():
    from scheduler.balancer import DecodeGate
    g = DecodeGate(window=4, hold=8, margin=0.03)
    sides = _gate_run(g, lambda i: 10.0, lambda i: 9.8, 16)      # 2 % faster without: within the margin
    assert g.decisions == [(True, 10.0, 9.8)] and sides[8:16] == [True] * 8
    g = DecodeGate(window=4, hold=8, margin=0.03)
    # without the device faster first, then the device 2x faster (e.g. the CPU got busy): the next measurement
    # takes the device back, and the hold starts again at 8
    sides = _gate_run(g, lambda i: 20.0 if i < 16 else 5.0, lambda i: 10.0, 16 + 8 + 8)
    assert [d[0] for d in g.decisions] == [False, True] and sides[24:32] == [True] * 8 and g.hold == 8


def test_decode_gate_drops_samples_and_a_measurement_without_them_ends_on_the_device():
    from scheduler.balancer import DecodeGate
    g = DecodeGate(window=4, hold=8)
    # every third sample dropped: the measurement takes longer, the decision is the same
    sides = _gate_run(g, lambda i: 20.0, lambda i: 10.0, 40, drop_every=3)
    assert g.decisions and g.decisions[0] == (False, 20.0, 10.0)
    g = DecodeGate(window=4, hold=8)
    # every sample dropped (each token read experts from disk): 4 x window tokens measured, then the device
    # for `hold` tokens without a decision, then measuring again; not an endless alternation
    sides = _gate_run(g, lambda i: 20.0, lambda i: 10.0, 16 + 8 + 16 + 1, drop_every=1)
    assert g.decisions == [] and sides[:16] == [True, False] * 8
    assert sides[16:24] == [True] * 8 and sides[24:40] == [True, False] * 8
    g = DecodeGate(window=4, hold=8)
    # the side without the device never gets a sample: the device after 4 x window tokens, not that side alone
    sides = _gate_run(g, lambda i: 20.0, lambda i: None, 16 + 8)
    assert g.decisions == [] and sides[16:24] == [True] * 8 and sides[:16].count(False) == 12
    g = DecodeGate(enabled=False)
    assert _gate_run(g, lambda i: 20.0, lambda i: 1.0, 50) == [True] * 50 and g.tokens_without == 0
    with pytest.raises(ValueError):
        DecodeGate(window=0)
