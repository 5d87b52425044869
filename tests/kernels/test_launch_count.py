"""scripts/bench/prompt_phases.py's launch counter (``count_launches``): the module globals holding a parallel
kernel are counters while its block runs and the kernels again after it, and a compiled function naming such a
global can compile meanwhile (a cold cache: Numba types the counter as its kernel)."""
from __future__ import annotations

import importlib
import sys

import numpy as np

from conftest import ROOT

PROBE = '''
from numba import njit, prange


@njit(parallel=True)
def par(a):
    for i in prange(a.shape[0]):
        a[i] += 1.0


@njit
def caller(a):
    par(a)
    return a.sum()
'''


def test_count_launches_puts_the_kernels_back_and_callers_compile(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "bench"))
    (tmp_path / "launch_probe_r30.py").write_text(PROBE)
    mod = importlib.import_module("launch_probe_r30")
    phases = importlib.import_module("prompt_phases")
    try:
        par, n, a = mod.par, [0], np.zeros(4)
        with phases.count_launches(n, prefixes=("launch_probe_r30",)) as wrapped:
            assert wrapped == 1 and mod.par is not par
            mod.par(a)                      # a launch from Python: counted
            assert mod.caller(a) == 8.0     # compiles now, naming the counter; its call of par is compiled code
            assert n[0] == 1
        assert mod.par is par               # put back
        mod.par(a)
        assert n[0] == 1 and a.sum() == 12.0
    finally:
        sys.modules.pop("launch_probe_r30", None)
