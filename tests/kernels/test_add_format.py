"""The "Adding a format" checklist of docs/formats.md, run: a copy of Q8_0 under a new name, entered only through
the registries the checklist names (the tensor-type table, ``formats.add_rows``, ``formats.FORMAT_CODE``,
``gemm_i8.GEMMS``), runs every CPU path (GEMV, GEMM, int8 GEMV and GEMM, the grouped kernels) with Q8_0's
numbers bit for bit and within the harness's tolerance of the reference, and leaves no gap in the table.

A path that picked its kernel by the format's name instead of by these registries would send the copy elsewhere
(or raise): then the checklist no longer lists every step a new format needs."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from coli.types import table as TT
from cpu_kernels import experts as E
from cpu_kernels import formats as F
from cpu_kernels import gemm_i8 as G

NAME = "Q8_0_COPY"


@pytest.fixture
def copy_of_q8_0(monkeypatch):
    """The checklist's steps for a new type made of Q8_0's pieces; every registry restored afterwards."""
    monkeypatch.setattr(TT, "TYPES", dict(TT.TYPES))
    monkeypatch.setattr(F, "FORMATS", dict(F.FORMATS))
    q8 = TT.get("Q8_0")
    # 1. coli/types/table.py: the row (a type of coli's own: no GGUF id), CPU only (no device decoder)
    TT.TYPES[NAME] = dataclasses.replace(q8, name=NAME, qtype=None, shader=NAME.lower(), backends={},
                                         cpu_only="a test copy of Q8_0", own="a test copy of Q8_0",
                                         random=lambda O, I, rng, scale=1.0: TT.random_blocks("Q8_0", O, I, rng,
                                                                                             scale))
    # 2. the family module's rows, through formats.add_rows (its kernels: Q8_0's)
    f = F.FORMATS["Q8_0"]
    F.add_rows([F._row(NAME, 32, 34, f.pack, f.gemv, f.gemm, NAME.lower(), True, f.gemv_i8)])
    # 3. cpu_kernels/formats.py: the grouped kernels' layout code
    monkeypatch.setitem(F.FORMAT_CODE, NAME, F.FORMAT_CODE["Q8_0"])
    # 4. (optional) cpu_kernels/gemm_i8.py: the int8 GEMM of prompt chunks
    monkeypatch.setitem(G.GEMMS, NAME, G.GEMMS["Q8_0"])
    return NAME


@pytest.mark.parametrize("act", ["f32", "int8"])
def test_a_copy_added_by_the_checklist_runs_every_cpu_path(copy_of_q8_0, act):
    O, I = 48, 320
    raw = TT.random_blocks(copy_of_q8_0, O, I, np.random.default_rng(3))
    want = TT.get(copy_of_q8_0).reference(raw, (O, I)).astype(np.float64)
    wc = F.prepare(copy_of_q8_0, raw, (O, I), tiles=False)
    w8 = F.prepare("Q8_0", raw, (O, I), tiles=False)
    assert wc.name == copy_of_q8_0 and E.supports(wc)
    rng = np.random.default_rng(4)
    for T in (1, 3, 17, 40):   # the GEMV, the GEMV per row, the GEMM (int8: VNNI GEMV up to 12, the int8 GEMM)
        x = rng.standard_normal((T, I)).astype(np.float32)
        got = F.matmul(wc, x, act)
        assert np.array_equal(got, F.matmul(w8, x, act)), (T, act)
        grouped = E.Group([wc])(E.Act(x, act))
        assert np.array_equal(grouped, E.Group([w8])(E.Act(x, act))), (T, act)
        xr = x
        if act == "int8":   # the reference multiplies the activations as the kernels round them
            xr = np.empty_like(x)
            F._round_act_int8(x, xr)
        ref = xr.astype(np.float64) @ want.T
        err = float(np.abs(got - ref).max()) / float(np.abs(ref).max())
        assert err < 2e-5, (T, act, err)
    assert TT.get(copy_of_q8_0).backends["cpu"] == TT.get("Q8_0").backends["cpu"]
    assert not [g for g in TT.gaps() if g[0] == copy_of_q8_0]
