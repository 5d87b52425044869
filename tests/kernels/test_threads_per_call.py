"""Numba's thread count is per calling thread: every public Engine call runs on the engine's own count,
from the main thread or a worker thread, and a second engine does not change the first one's count."""
from __future__ import annotations

import threading

import numba
import numpy as np
import pytest

IDS = [1, 504, 3575, 282, 4649, 314]


def _spy(eng):
    """Record ``numba.get_num_threads()`` at each forward of ``eng``'s model (inside the public call)."""
    seen = []
    orig = type(eng.model).forward

    def forward(*a, **kw):
        seen.append(numba.get_num_threads())
        return orig(eng.model, *a, **kw)

    eng.model.forward = forward
    return seen


def _in_thread(fn):
    box = {}

    def run():
        try:
            box["out"] = fn()
            box["count_after"] = numba.get_num_threads()
        except BaseException as e:  # pragma: no cover - re-raised below
            box["err"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=300)
    assert not t.is_alive()
    if "err" in box:
        raise box["err"]
    return box


@pytest.fixture(scope="module")
def two_engines(model_path):
    from coli.engine import Engine

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs a Numba pool of 2 threads or more")
    path = model_path("smollm2")
    a = Engine(path, threads=1, save_usage=False)
    b = Engine(path, threads=2, save_usage=False)  # constructed after a: must not change a's count
    yield a, b
    a.close()
    b.close()


def test_second_engine_does_not_change_the_first(two_engines):
    a, b = two_engines
    before = numba.get_num_threads()
    seen_a, seen_b = _spy(a), _spy(b)
    try:
        la = a.logits(IDS)
        lb = b.logits(IDS)
        la2 = a.logits(IDS)
    finally:
        del a.model.forward, b.model.forward
    assert seen_a and set(seen_a) == {1}
    assert seen_b and set(seen_b) == {2}
    assert numba.get_num_threads() == before  # the caller's count comes back
    np.testing.assert_array_equal(la, la2)
    # 1 and 2 threads split the same rows over threads: same results up to float summation order
    np.testing.assert_allclose(la, lb, rtol=1e-4, atol=1e-3)


def test_call_from_worker_thread_runs_on_engine_threads(two_engines):
    a, b = two_engines
    seen_a = _spy(a)
    try:
        main = a.logits(IDS)
        n_main = len(seen_a)
        box = _in_thread(lambda: a.logits(IDS))
        nll_box = _in_thread(lambda: a.nll(IDS))
        gen_box = _in_thread(lambda: a.generate(ids=IDS, max_tokens=3).ids)
    finally:
        del a.model.forward
    assert len(seen_a) > n_main
    assert set(seen_a) == {1}  # a worker thread starts at NUMBA_NUM_THREADS, the engine asked for 1
    # the worker's own count is left as it was (a new thread's default)
    assert box["count_after"] == numba.config.NUMBA_NUM_THREADS
    np.testing.assert_array_equal(box["out"], main)
    assert nll_box["out"] == a.nll(IDS)
    assert gen_box["out"] == a.generate(ids=IDS, max_tokens=3).ids
