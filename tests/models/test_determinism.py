"""Run-to-run determinism (DESIGN.md invariant 1: a result does not depend on where or when an expert ran): the
same file and ids give bit-identical logits whatever the Numba thread count, the RAM expert cache's size (hits
against cold reads) and the order and grouping in which expert reads land; an expert's arithmetic does not depend
on the other experts of its CPU batch."""
from __future__ import annotations

import time
import types

import numpy as np
import pytest

from coli.types import table as TT
from cpu_kernels import experts as X
from cpu_kernels import formats as F
from conftest import FIXTURES

ORACLES = FIXTURES / "oracles"


def _expert(t, rng, D=256, Fd=512):
    mk = lambda O, I: F.prepare(t, TT.random_blocks(t, O, I, rng, 0.3), (O, I))  # noqa: E731
    return types.SimpleNamespace(gate=mk(Fd, D), up=mk(Fd, D), down=mk(D, Fd))


@pytest.mark.parametrize("act", ["int8", "f32"])
@pytest.mark.parametrize("R", [3, 40])
def test_expert_result_does_not_depend_on_its_batch(act, R, monkeypatch):
    """MoEStep._compute_many with an expert in a format without a grouped-kernel code (IQ2_XS) beside grouped
    ones (Q4_K, Q8_0): the pairs are bit-identical whether the experts' reads landed in one batch, one by one,
    or in another order (before, one such expert sent the whole batch down the per-expert path, whose sums
    differ from the grouped kernels' by f32 rounding)."""
    from scheduler.step import MoEStep

    # every registry row has a grouped-kernel code now: take IQ2_XS's away for this test (supports() reads the
    # table at call time), so one expert takes the per-expert path
    monkeypatch.delitem(X.FORMAT_CODE, "IQ2_XS")
    rng = np.random.default_rng(R)
    ws = {0: _expert("Q4_K", rng), 1: _expert("IQ2_XS", rng), 2: _expert("Q8_0", rng)}
    assert [X.supports(w.gate) for w in ws.values()] == [True, False, True]
    K, D = 2, 256
    x = rng.standard_normal((R, D)).astype(np.float32)
    flat = np.stack([rng.permutation(3)[:K] for _ in range(R)]).reshape(-1)
    groups = {e: np.flatnonzero(flat == e) for e in range(3)}
    st = MoEStep(None, act=act)
    xa = X.Act(x, act)
    outs = []
    for batches in ([[0, 1, 2]], [[0], [1], [2]], [[2, 0], [1]], [[1, 2], [0]]):
        po = np.full((R * K, D), np.nan, np.float32)
        for b in batches:
            st._compute_many(0, [(e, ws[e]) for e in b], xa, groups, K, po)
        assert np.isfinite(po).all()
        outs.append(po)
    for po in outs[1:]:
        assert np.array_equal(po, outs[0])


def _slow_reads(monkeypatch, seed):
    """Every expert read sleeps 0-3 ms (seeded): reads land in another order and other batches."""
    from scheduler import ram_cache

    rng = np.random.default_rng(seed)
    real = ram_cache.RAMCache._read

    def slow(self, layer, e, *early):
        time.sleep(float(rng.uniform(0, 0.003)))
        return real(self, layer, e, *early)

    monkeypatch.setattr(ram_cache.RAMCache, "_read", slow)


@pytest.mark.parametrize("name", ["olmoe", "qwen3next"])
def test_logits_do_not_depend_on_threads_cache_or_read_timing(monkeypatch, tmp_path, name):
    """The oracle fixture's prompt (two prefill steps) and 4 greedy decode steps: bit-identical logits from
    engines with 1 and 2 Numba threads, every expert in RAM or 2 slots per layer (cold reads every step) and
    reads slowed at random (other landing orders)."""
    from coli.engine import Engine

    ids = [int(i) for i in np.load(ORACLES / f"{name}.npz")["ids"]]
    runs = []
    for i, kw in enumerate([dict(threads=2), dict(threads=1, expert_cache=2), dict(threads=2, expert_cache=2)]):
        if i == 2:
            _slow_reads(monkeypatch, i)
        with Engine(ORACLES / f"{name}.gguf", save_usage=False, usage=str(tmp_path / f"{i}.coli_usage"),
                    quiet=True, **kw) as eng:
            lg = eng.logits(ids)
            steps = []
            f = eng.model.forward

            def rec(chunk, cache, all_logits=False):
                out = f(chunk, cache, all_logits=all_logits)
                steps.append(np.array(out[-1], copy=True))
                return out

            eng.model.forward = rec
            gen = eng.generate(ids=ids, max_tokens=4, temp=0.0, stop_at_eos=False).ids
            runs.append((lg, np.stack(steps), gen))
    for i, (lg, steps, gen) in enumerate(runs[1:], 1):
        rows = np.flatnonzero((lg != runs[0][0]).any(axis=1))
        assert not len(rows), (f"run {i} differs from run 0 at {len(rows)} of {len(lg)} prompt positions, "
                               f"the first {rows[:8]}, by up to {np.abs(lg - runs[0][0]).max():.3g}")
        assert np.array_equal(steps, runs[0][1]) and gen == runs[0][2]
