"""Coverage table of the backend-parity harness (tests/kernels/test_backend_ops.py): every (backend, type, op, act) case
run against the NumPy reference, printed as a Markdown table (docs/formats.md).

usage: python -m scripts.backend_ops [--types Q4_K,Q2_K] [--ops lmm,attn] [--no-vulkan] [--lmm-cases]

A cell is the case's max error relative to the largest |value| (``ok`` when under the harness tolerance,
``FAIL`` when over), ``-`` where the backend's registry lacks the type (the table gives the CPU-only reason
underneath), ``f32`` where the type has only f32 arithmetic (float weights ignore act). ``attn`` (the device's prompt
attention, no weight format) prints its own table after it: each case of the harness's ``ATTN_CASES``, the kernel
the device's route takes for its head dimension and its error. ``--lmm-cases`` prints, after the table, each ``lmm``
case of each type and row count on the device: its error against the route's reference (``lmm_errors``: float16
operands on the cooperative-matrix route) and, after the slash, against the unrounded operands. Exit 1 on any FAIL.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cpu_kernels  # noqa: E402,F401  (threading layer before numba)
import numpy as np  # noqa: E402
from coli.types import table as TT  # noqa: E402
from tests.kernels import test_backend_ops as H  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="", help="comma-separated GGUF types (default: every implemented one)")
    ap.add_argument("--ops", default="", help=f"comma-separated ops of {', '.join(H.OPS)}, attn (default: all)")
    ap.add_argument("--no-vulkan", action="store_true", help="CPU only")
    ap.add_argument("--lmm-cases", action="store_true", help="each lmm case's error on the device, by row count")
    a = ap.parse_args(argv)
    import coli.vulkan.shaders  # noqa: F401  (the backends' registries fill the table's backends column)
    import cpu_kernels.formats  # noqa: F401
    names = [n for n, t in TT.TYPES.items() if t.backends]
    if a.types:
        names = [n for n in names if n in a.types.split(",")]
    backends = {"cpu": H.Backend("cpu")}
    if not a.no_vulkan:
        from coli.vulkan import open_device

        d = open_device("backend-ops", budget=1 << 28, quiet=True)
        if d is not None:
            backends["vulkan"] = H.Backend("vulkan", d)
            print(f"vulkan: {d.name}, prompt GEMM route {backends['vulkan'].route()}", file=sys.stderr)
    cols = [(b, op, act) for b in TT.BACKENDS for op in H.BACKEND_OPS[b] for act in ("f32", "int8")
            if act in H.ACTS[b] and act in H.OP_ACTS.get(op, H.ACTS[b]) and (not a.ops or op in a.ops.split(","))]
    failed = 0
    if cols:
        print("| type | block | bytes | test weights | " + " | ".join(f"{b} {op} {act}" for b, op, act in cols) + " |")
        print("|---|---|---|---|" + "---|" * len(cols))
    for n in names if cols else ():
        t = TT.TYPES[n]
        cells = []
        for b, op, act in cols:
            if b not in t.backends:
                cells.append("-")
            elif b not in backends:
                cells.append("no device")
            elif act not in H.acts(b, n, op):
                cells.append("f32")
            else:
                e = H.run_case(backends[b], n, op, act)
                ok = e < H.tolerance(backends[b], op, act)
                failed += not ok
                cells.append(f"{'ok' if ok else 'FAIL'} {e:.0e}")
            print(f"  {n} {b} {op} {act}: {cells[-1]}", file=sys.stderr, flush=True)
        gen = ("gguf quantize" if t.quantizable else "coli quantize" if t.random is not None and t.own is None
               else "random blocks")
        print(f"| {n} | {t.block_size} | {t.type_size} | {gen} | " + " | ".join(cells) + " |", flush=True)
    if "vulkan" in backends and a.lmm_cases:
        be = backends["vulkan"]
        cases = None
        for n in names:
            if "vulkan" not in TT.TYPES[n].backends:
                continue
            rng = np.random.default_rng(H._seed(be.name, n, "lmm", "f32"))    # run_case's draws
            for R in H.ROWS["lmm"]:
                errs = H.lmm_errors(be, n, R, rng)
                if cases is None:
                    cases = list(errs)
                    print(f"\n| lmm ({be.route()} route): type | rows | " + " | ".join(map(str, cases)) + " |")
                    print("|---|---|" + "---|" * len(cases))
                print(f"| {n} | {R} | " + " | ".join(f"{e:.1e} / {x:.1e}" for e, x in errs.values()) + " |", flush=True)
    if "vulkan" in backends and (not a.ops or "attn" in a.ops.split(",")):
        be = backends["vulkan"]
        print("\n| attention case (nq, nkv, head dim, first position, rows, window, sinks) | kernel | keys split | "
              "error |")
        print("|---|---|---|---|")
        for case in H.ATTN_CASES:
            for split in (1, H.ATTN_SPLIT):     # whole, and the keys split over workgroups (parts of ATTN_CHK)
                e, tol = H.attn_error(be, case, split), H.attn_tolerance(be, case[2])
                failed += e >= tol
                print(f"| {H.attn_id(case)} | {be.attn_kernel(case[2])} | {split if split > 1 else '-'} | "
                      f"{'ok' if e < tol else 'FAIL'} {e:.0e} |", flush=True)
        print(f"attention tolerances: attn_pre {H.TOL_ATTN:g}, attn_pre_cm {H.TOL_ATTN_F16:g}")
    only = [f"{n}: {t.cpu_only}" for n, t in TT.TYPES.items() if t.cpu_only]
    print("\nTolerances (max |got - want| / max |want|): " +
          ", ".join(f"{op} {act} {tol:g}" for (op, act), tol in H.TOL.items()) +
          f"; lmm on the cooperative-matrix route {H.TOL_LMM_F16:g} against its float16 model")
    if only:
        print("CPU only: " + "; ".join(only))
    if "vulkan" in backends:
        backends["vulkan"].dev.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
