"""The placement gate of ``--gpu-layers -1`` (coli/vulkan/placement.py; docs/vulkan.md "Whole layers or experts
apart"): its probabilities against exact combinatorics, the resident set's invariants on constructed histories, the
cost fit against runs made from known costs, and (Lavapipe) the chosen placement's logits equal to the CPU-only run's."""
from __future__ import annotations

import json

from math import comb

import numpy as np
import pytest

from coli.vulkan import placement as P
from scheduler.tier_policy import warm_plan
from tests.vk_util import requires_vulkan

#: the costs the issue measured on an H100 (ms): a join 0.37, a CPU pair 0.085; the layers' own made up around them
H100 = P.Costs(w=0.15, a=0.45, c=1.6, jc=0.05, p=0.085, runs=5)


@pytest.mark.parametrize("E,k,m", [(64, 8, 32), (64, 8, 60), (8, 2, 5), (8, 2, 1), (16, 4, 16)])
def test_all_resident_is_exact_for_uniform_routing(E, k, m):
    """Uniform counts: P(all k routed resident) = C(m, k) / C(E, k); the CPU's pairs k (E - m) / E."""
    counts = np.full(E, 100)
    r = np.zeros(E, bool)
    r[:m] = True
    assert P.all_resident(counts, r, k) == pytest.approx(comb(m, k) / comb(E, k), rel=1e-12, abs=1e-15)
    assert P.cpu_pairs(counts, r, k) == pytest.approx(k * (E - m) / E, rel=1e-12)


def test_a_history_within_the_resident_set_expects_no_join():
    """A layer whose history names at most as many distinct experts as are resident (the hottest chosen): no token is
    expected to need the CPU (its join's call and pairs) in that layer, by the gate's own prediction too."""
    E, k = 64, 8
    counts = np.zeros((2, E), np.int64)
    rng = np.random.default_rng(0)
    hot = rng.choice(E, 20, replace=False)
    counts[0, hot] = rng.integers(1, 500, 20)
    counts[1] = 10                        # uniform
    assert P.choose_resident(counts, [0], 20, k, H100)[0] == sorted(int(e) for e in hot)
    res = P.choose_resident(counts, [0, 1], 20, k, H100)
    assert sum(map(len, res.values())) == 20 and set(res[0]) <= set(hot.tolist())
    res = {0: sorted(int(e) for e in hot), 1: []}
    assert P.all_resident(counts[0], P.hottest_mask(counts[0], 20), k) == 1.0
    assert P.cpu_pairs(counts[0], P.hottest_mask(counts[0], 20), k) == 0.0
    arm = P.predict_experts(H100, counts, 2, 0, {0, 1}, res, k, E)
    assert arm.joins == pytest.approx(1.0) and arm.pairs == pytest.approx(k)      # layer 1's alone


def test_uniform_routing_with_half_resident_fills_whole_layers_and_takes_whole_layers():
    """16 layers x 64 experts, top-8, uniform history, room for half the experts: the resident set is 8 layers whole
    and none of the others' (a spread of 32 a layer keeps every layer's join and CPU call), so arm (b) differs from
    arm (a) only in its 8 other layers: a join, a call and 8 CPU pairs each against a CPU layer each; the gate takes
    the cheaper by the costs."""
    n, E, k = 16, 64, 8
    counts = np.full((n, E), 37, np.int64)
    res = P.choose_resident(counts, list(range(n)), n * E // 2, k, H100)
    sizes = sorted(len(v) for v in res.values())
    assert sizes == [0] * 8 + [E] * 8
    d = P.decide(H100, counts, n, set(range(n)), k, E, first_layers=8, first_apart=0, cap=n * E // 2, spread=warm_plan)
    a, b = d.arms
    assert a.ms == pytest.approx(H100.w * 8 + H100.c * 8)
    assert b.ms == pytest.approx(H100.w * 8 + 8 * (H100.a + H100.jc + H100.p * k))
    assert d.arm.name == ("experts" if b.ms < a.ms else "layers")
    # a CPU layer dearer than a join and its pairs: experts apart
    dear = P.Costs(w=0.15, a=0.45, c=3.0, jc=0.05, p=0.085, runs=5)
    assert P.decide(dear, counts, n, set(range(n)), k, E, 8, 0, n * E // 2, warm_plan).arm.name == "experts"
    cheap = P.Costs(w=0.15, a=0.45, c=0.5, jc=0.05, p=0.085, runs=5)
    assert P.decide(cheap, counts, n, set(range(n)), k, E, 8, 0, n * E // 2, warm_plan).arm.name == "layers"


def test_without_measured_costs_the_gate_keeps_whole_layers():
    counts = np.full((4, 8), 5, np.int64)
    d = P.decide(P.Costs(note="none"), counts, 4, {0, 1, 2, 3}, 2, 8, 3, 0, 9, warm_plan)
    assert d.arm.name == "layers" and "not measured" in d.why
    assert sum(len(v) for v in d.arms[1].resident.values()) == 9      # the warm start's spread, for the line
    assert P.decide(P.Costs(), counts, 4, {0, 1, 2, 3}, 2, 8, 3, 0, 9, warm_plan, force="experts").arm.name == "experts"


def _runs(placements, w, a, x, c, jc, p, h, h2, way="semaphore"):
    """Runs made from known costs: each placement (whole, cut, xcut, cpu, the CPU calls' pairs of a token) 10 tokens,
    the calls' times t = jc + p n exactly, the device layers' and the rest's times by the model."""
    runs = []
    for whole, cut, xcut, cpu, ns in placements:
        T = 10
        calls = [n for n in ns for _ in range(T)]      # each token: the listed layers' calls
        call_s = sum(1e-3 * (jc + p * n) for n in calls)
        dl = h + w * whole + a * cut + x * xcut + 1e3 * call_s / T
        runs.append(P.Run(whole, cut, cpu, T, dl, h2 + c * cpu, len(calls), sum(calls), call_s,
                          float(sum(n * n for n in calls)), sum(n * 1e-3 * (jc + p * n) for n in calls),
                          xcut=xcut, way=way if cut else ""))
    return runs


def test_fit_recovers_the_costs_runs_were_made_from():
    """Runs made from known costs give those costs back, intercepts included: the resident experts' segment ``x``
    apart from the join ``a`` where cut layers with and without resident experts were run (``--cpu-moe`` beside
    ``--tier-gb``), else inside it (``a + x``, ``x`` None); the cut runs of another way (``COLI_VK_CHAIN``) are not
    used for this one's, and are fitted alone for theirs."""
    cost = dict(w=0.2, a=0.5, x=0.19, c=1.5, jc=0.04, p=0.09, h=0.7, h2=0.3)
    places = [(8, 0, 0, 8, []), (4, 0, 0, 12, []), (0, 16, 16, 0, [8, 7, 6, 8, 5, 8]), (0, 16, 0, 0, [3, 4, 1]),
              (7, 9, 1, 0, [8, 8, 7])]
    runs = _runs(places, **cost)
    events = _runs(places[:3], **dict(cost, a=0.3), way="event")
    for got, used in ((P.fit(runs), 5), (P.fit(runs + events, "semaphore"), 7)):     # the events' whole-layer runs too
        for name, v in cost.items():
            assert getattr(got, name) == pytest.approx(v, rel=1e-9, abs=1e-12), name
        assert got.note == "" and got.runs == used
    got = P.fit(runs[:3])        # every cut layer with resident experts: their segment inside the join
    assert got.x is None and got.a == pytest.approx(cost["a"] + cost["x"], rel=1e-9) and got.note == ""
    assert P.fit(runs + events, "event").a == pytest.approx(0.3 + cost["x"], rel=1e-9)
    assert P.fit(_runs(places, **dict(cost, x=-0.1))).x is None      # a negative segment cost: left inside a
    assert P.fit(runs[:1]).a is None and "experts apart" in P.fit(runs[:1]).note


def test_a_layer_with_resident_experts_pays_their_segment():
    """The prediction of arm (b) adds ``x`` once for each cut layer holding some of its experts, none for a layer
    with all (no cut) or none of them; the resident set's greedy sees the same cost (a layer's first resident experts
    cost ``x`` before they save anything)."""
    n, E, k = 3, 8, 2
    counts = np.full((n, E), 9, np.int64)
    c = P.Costs(w=0.2, a=0.5, x=0.19, c=1.5, jc=0.04, p=0.09)
    res = {0: list(range(E)), 1: [0, 1, 2], 2: []}
    arm = P.predict_experts(c, counts, n, 0, set(range(n)), res, k, E)
    no_x = P.predict_experts(P.Costs(**dict(c.__dict__, x=None)), counts, n, 0, set(range(n)), res, k, E)
    assert arm.cut == 2 and arm.ms - no_x.ms == pytest.approx(c.x, rel=1e-12)
    lc = P.layer_costs(c, counts[0], k)
    assert lc[1] - P.layer_costs(P.Costs(**dict(c.__dict__, x=None)), counts[0], k)[1] == pytest.approx(c.x)
    assert lc[E] == c.w and lc[0] == pytest.approx(c.a + c.jc + c.p * k)


@requires_vulkan
@pytest.mark.parametrize("arm", ["layers", "experts"])
def test_the_gates_placements_give_the_cpu_logits(device_moe, moe_cpu, arm):
    """--gpu-layers -1 with a --tier-gb that holds every layer without its experts and 9 experts (not every layer
    whole): the gate's arm (``COLI_VK_PLACEMENT``) places whole layers (the last that fit, none joined) or every
    layer with 9 experts resident; either gives the CPU-only run's logits, the decode tokens are timed for the
    measured runs and the experts arm's CPU calls counted; the decision says both arms."""
    from coli.runtime import gate_line
    from tests.vk_util import IDS, decode_rows, device_engine, rel_err, tier_gb

    m = moe_cpu.model
    dev = device_engine(device_moe, COLI_VK_LAYERS=-1, COLI_VK_TIER_GB=tier_gb(m, 9), COLI_VK_PLACEMENT=arm)
    try:
        dl = dev.model.device_layers
        assert dl is not None and dev.placement is not None and dev.placement.arm.name == arm
        if arm == "layers":
            assert dl.first > 0 and dl.resident == {}
        else:
            assert dl.first == 0
            assert sum(int(r.sum()) for r in dl.resident.values()) + 8 * (4 - len(dl.resident)) == 9
        line = gate_line(dev.placement)
        assert line.startswith(f"placement: {arm} (") and "COLI_VK_PLACEMENT" in line
        ref, _ = decode_rows(moe_cpu, IDS, 5)
        got, _ = decode_rows(dev, IDS, 5)
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
        assert dl.tok_times.tokens == len(IDS) - 5 - 1      # the first after the prompt is not a decode token's gap
        assert (dl.calls.n > 0) == (arm == "experts") and 0 <= dl.calls.pairs <= dl.cpu_rows
    finally:
        dev.close()


def test_runs_are_kept_per_device_and_shape_and_read_back(tmp_path):
    """``Runs`` keeps the last KEEP runs in its folder (``COLI_VK_PLACEMENT_RUNS``), read back by the next run; a
    file that is not one (not JSON, another shape, a run with a field of the wrong type or no token) is started
    again; "off" keeps nothing."""
    from coli.base import settings

    env = settings.overlay(None, COLI_VK_PLACEMENT_RUNS=str(tmp_path / "runs"))
    r = P.Runs("dev-L4", env)
    for i in range(P.Runs.KEEP + 3):
        r.add(P.Run(2, 0, 2, 10, 5.0 + i, 1.0))
    back = P.Runs("dev-L4", env).runs
    assert len(back) == P.Runs.KEEP and back[-1].dl_ms == 5.0 + P.Runs.KEEP + 2 and back[0].dl_ms == 8.0
    assert P.Runs("other-L4", env).runs == []
    good = dict(whole=2, cut=0, cpu=2, tokens=10, dl_ms=5.0, rest_ms=1.0)
    cut = dict(good, cut=2, xcut=1, way="event")

    def doc(*runs, version=P.VERSION):
        return json.dumps({"version": version, "runs": list(runs)})
    # not JSON, JSON of another shape, a run a field of the wrong type, no token (fit divides by it), not finite,
    # version 1 (no xcut, no way), a cut run without its way or another way, a way without a cut, xcut over cut
    for text in ["not json", "[]", "null", '{"runs": {"a": 1}}', doc(dict(good, whole="2")),
                 doc(dict(good, tokens=0)), doc(dict(good, dl_ms=float("nan"))),
                 doc(dict(good, cpu=True)), doc(good, dict(good, cut=-1)), doc(good, version=1),
                 doc(dict(cut, way="")), doc(dict(cut, way="on")), doc(dict(good, way="event")), doc(dict(cut, xcut=3))]:
        (tmp_path / "runs" / "dev-L4.json").write_text(text)
        r = P.Runs("dev-L4", env)
        assert r.runs == [] and r.costs().runs == 0, text
    (tmp_path / "runs" / "dev-L4.json").write_text(doc(good, dict(good, dl_ms=7), cut))
    assert [(x.dl_ms, x.way) for x in P.Runs("dev-L4", env).runs] == [(5.0, ""), (7, ""), (5.0, "event")]
    off = P.Runs("dev-L4", settings.overlay(None, COLI_VK_PLACEMENT_RUNS="off"))
    off.add(P.Run(2, 0, 2, 10, 5.0, 1.0))
    assert off.path is None and sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["dev-L4.json"]
