"""Backend parity, in the style of llama.cpp's test-backend-ops: every (backend, GGUF type, op, activation mode)
against the NumPy reference.

* Backends: ``cpu`` (the Numba kernels, ``cpu_kernels.formats``) and ``vulkan`` (whatever device the loader
  finds; Lavapipe in CI). Types: every row of the backend's registry (``coli.types.table`` keys them).
* Ops: ``gemv`` (few activation rows: the CPU's per-row GEMV, the device's GEMV shader), ``gemm`` (many rows:
  the blocked CPU GEMM, the device's tiled GEMM), ``expert`` (a SwiGLU expert batch: several experts, rows
  routed top-2, one expert with enough rows for the GEMM, the rest on the GEMV; on the CPU through
  ``scheduler.step.MoEStep.expert_cpu``, on the device through ``Device.submit_experts``) and, on the device
  only, ``lmm`` (the device layers' prompt GEMM, ``shaders/lmm.comp`` through ``coli.vulkan.layers.Kernels``, at
  16, 64 and 512 rows: mode 0 dense, mode 1 the experts' gate and up with SwiGLU and mode 2 their down scaled by
  the route weight, over rows routed top-2 to 4 experts (one without rows) and grouped by expert, and modes 1
  and 2 in the shared expert's one-expert form, mode 1 with the experts' biases and the tanh GELU or gpt-oss's
  clamped SwiGLU, mode 2 with the down bias; f32 only; on the cooperative-matrix route, ``shaders/lmm_cm.comp``,
  against ``lmm_reference``'s model of its float16 operands).
* Activations: ``f32``, and ``int8`` (llama.cpp's Q8 activation blocks: per 32, d = amax/127, q = rint(x/d)) for
  the quantized formats on both backends (the device rounds on the host or in shaders/act_q8.comp); the
  reference then multiplies the rounded activations (an exact NumPy model).
* Reference: ``coli.types.table`` ``reference`` (``gguf.quants.dequantize``), products in float64.
* Test weights: one generator, ``coli.types.table.random_blocks`` (``gguf.quants.quantize`` where gguf can
  quantize the type, coli's port of ggml's quantizer for NVFP4, random valid blocks with finite f16 scales
  elsewhere).
* One tolerance per (op, act) (``TOL``): max |got - want| / max |want|.

* Prompt attention (``attn``, the device only, no weight format): the device layers' causal attention of a prompt
  chunk over the KV cache (``shaders/attn_pre.comp``, or ``attn_pre_cm.comp`` on the cooperative-matrix route;
  ``Kernels.attn_kernel``) in the cases of ``ATTN_CASES`` (GQA, a chunk after cached positions, rows not a multiple
  of the workgroup's, a window, sinks, head dimensions 64 .. 256) against a float64 softmax attention.

``python -m scripts.backend_ops`` runs the same cases and prints the coverage table of docs/formats.md.

Quick start for a new op: name it in ``OPS`` (and in ``BACKEND_OPS`` for the backends that have it; ``OP_ACTS``
when it has fewer activation modes), give it a ``TOL`` entry per activation mode and its ``ROWS``, a method on
``Backend`` that runs it on the backend and counts the work, and a branch of ``run_case`` that builds weights with
``weight`` (the shared generator), runs it, asserts the work count grew and returns the largest ``err`` against
the float64 reference.
"""
from __future__ import annotations

import types
import zlib

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES

from coli.types import table as TT
from cpu_kernels import formats as F
from coli.vulkan import shaders as S
from tests.vk_util import numpy_expert, requires_vulkan

OPS = ("gemv", "gemm", "expert", "lmm")
#: The ops each backend implements (``lmm``: the device layers' prompt GEMM, a device kernel only).
BACKEND_OPS = {"cpu": ("gemv", "gemm", "expert"), "vulkan": OPS}
#: The activation modes each backend implements, and ops with fewer (``lmm`` multiplies f32 activations).
ACTS = {"cpu": ("f32", "int8"), "vulkan": ("f32", "int8")}
OP_ACTS = {"lmm": ("f32",)}
#: max |got - want| / max |want| per (op, act). int8 expert: the SwiGLU output is rounded to int8 again before
#: down, from f32 values on the backend and float64 in the model, so codes at a rounding tie may flip: the check
#: first subtracts the most those can move each output (``expert_reference``'s slack).
TOL = {("gemv", "f32"): 2e-5, ("gemm", "f32"): 2e-5, ("expert", "f32"): 2e-5,
       ("gemv", "int8"): 2e-5, ("gemm", "int8"): 2e-5, ("expert", "int8"): 2e-5, ("lmm", "f32"): 2e-5}
#: ``lmm`` on the cooperative-matrix route (shaders/lmm_cm.comp), against ``lmm_reference``'s model of that route:
#: weights and activations rounded to float16 (nearest even, as NumPy), products summed in float64; what is left is
#: the device's float32 sums. (Against unrounded operands the route's error is 2e-4 .. 6e-4 of the largest output,
#: except where gpt-oss's clamp bounds the outputs far below the products: case "1o" of the K-quants' random blocks,
#: gates up to |g| 330 against the clamp 7, 5e-3 (Q4_K) and 2e-2 (Q6_K), the H100's figures and the model's.)
TOL_LMM_F16 = 4e-3


#: ``attn``: the float32 kernel (attn_pre.comp) against float64, and the cooperative-matrix one (attn_pre_cm.comp):
#: q, K, V and the softmax weights rounded to float16 (a relative 2^-11 each; a NumPy model of that rounding gives
#: at most 1.5e-3 of the largest output over ATTN_CASES).
TOL_ATTN, TOL_ATTN_F16 = 2e-5, 6e-3
#: (nq, nkv, hd, pos0, R, window, sinks): the chunk's rows at positions pos0 .. pos0 + R - 1 over a cache of CTX_ATTN
ATTN_CASES = ((4, 2, 128, 0, 16, 0, False), (4, 2, 128, 37, 100, 0, False), (2, 1, 64, 200, 130, 0, True),
              (2, 2, 128, 5, 70, 48, False), (2, 1, 80, 3, 33, 0, False), (2, 2, 256, 9, 40, 0, False),
              (2, 1, 128, 60, 64, 20, True), (6, 2, 64, 11, 45, 0, False), (8, 2, 128, 30, 50, 16, True))
CTX_ATTN = 400
#: keys a part when a case runs with its keys split over workgroups (shaders/attn_split.glsl; a multiple of both
#: kernels' key tiles), and the workgroups of that split (3: a workgroup takes parts z, z + 3, ..)
ATTN_CHK, ATTN_SPLIT = 32, 3


def attn_id(case) -> str:
    nq, nkv, hd, pos0, R, W, sk = case
    return f"q{nq}kv{nkv}-hd{hd}-pos{pos0}-R{R}" + (f"-win{W}" if W else "") + ("-sinks" if sk else "")


def tolerance(be, op: str, act: str) -> float:
    """The error bound of one case on backend ``be``: ``TOL``, or ``TOL_LMM_F16`` for ``lmm`` on a device whose
    prompt GEMM takes the float16 route (``Backend.route``)."""
    return TOL_LMM_F16 if op == "lmm" and be.route() == "coopmat" else TOL[(op, act)]


#: Activation rows per op: CPU GEMV up to F.GEMV_MAX_T rows (f32; the VNNI int8 GEMV goes further), the device
#: GEMV below 16 rows (COLI_VK_TIER_GEMM_ROWS); GEMM rows above both backends' GEMV limits.
ROWS = {"gemv": (1, min(3, F.GEMV_MAX_T)), "gemm": (max(F.GEMV_I8_MAX_T, F.GEMV_MAX_T, 16) + 1, 37),
        "lmm": (16, 64, 512)}
O_ODD = 37   # output rows: not a multiple of the CPU's 16-row chunks nor of the device's 64-row tiles



def load_backends():
    """Import both backends' registries (neither compiles nor needs a Vulkan loader) so the table's ``backends``
    column is full; the table's rows."""
    import coli.vulkan.shaders  # noqa: F401
    import cpu_kernels.formats  # noqa: F401
    return TT.TYPES

def registry(backend: str) -> list[str]:
    """The GGUF types a backend's registry implements."""
    return list(F.FORMATS) if backend == "cpu" else list(S.FORMATS)


def acts(backend: str, type_name: str, op: str = "gemv") -> tuple[str, ...]:
    """Activation modes that change the arithmetic for this type and op (F32/F16/BF16 weights ignore act
    everywhere; ``OP_ACTS`` limits an op's modes)."""
    if TT.get(type_name).block_size == 1:
        return ("f32",)
    return tuple(a for a in ACTS[backend] if a in OP_ACTS.get(op, ACTS[backend]))


def inner(type_name: str, k: int = 0) -> int:
    """An odd number of blocks, at least 32 weights: 3 (+k) blocks of 64- and 256-weight types, 5 (+k) units of
    32; F32/F16/BF16 (rows of any width) 7 more, a partial last unit whose rows do not start on a 16-byte boundary."""
    bs = TT.get(type_name).block_size
    return (3 + k) * bs if bs >= 64 else (5 + k) * 32 + (7 if bs == 1 else 0)


def cases():
    out = []
    for backend in TT.BACKENDS:
        for t in registry(backend):
            for op in BACKEND_OPS[backend]:
                for act in acts(backend, t, op):
                    marks = [requires_vulkan] if backend == "vulkan" else []
                    out.append(pytest.param(backend, t, op, act, marks=marks, id=f"{backend}-{t}-{op}-{act}"))
    return out


def _seed(*parts) -> int:
    return zlib.crc32("/".join(parts).encode())


def weight(type_name: str, O: int, I: int, rng, scale: float = 1.0):
    """(raw uint8 [O, row_bytes], reference float64 [O, I]) of the shared generator."""
    raw = TT.random_blocks(type_name, O, I, rng, scale)
    return raw, TT.get(type_name).reference(raw, (O, I)).astype(np.float64)


def act_model(x: np.ndarray, act: str) -> np.ndarray:
    """The activations the kernels multiply, float64: x itself (f32), or its int8 rounding per 32 (exact model of
    ``cpu_kernels.formats.quantize_act_int8``: d = amax/127 in f32, q = rint(x * (1/d)), ties to even; a block
    whose d is not a normal f32 is zeros)."""
    x = np.asarray(x, np.float32)
    if act == "f32":
        return x.astype(np.float64)
    T, I = x.shape
    xb = x.reshape(T, I // 32, 32)
    d = (np.abs(xb).max(axis=-1) / np.float32(127.0)).astype(np.float32)
    d = np.where(d >= np.finfo(np.float32).tiny, d, np.float32(0.0))   # no normal scale: a zero block
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * idv[:, :, None])
    return (q * d[:, :, None].astype(np.float64)).reshape(T, I)


def err(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(float(np.abs(want).max()), 1e-30))


def _uploader(K):
    """``(buf, bufs)``: ``buf(a, readback=False)`` makes a device buffer of the kernels ``K`` holding a copy of ``a``;
    ``bufs`` lists every buffer it made (the caller frees them)."""
    bufs = []

    def buf(a, readback=False):
        a = np.ascontiguousarray(a)
        b = K.buffer(a.nbytes, readback=readback)
        K.upload(b, a)
        bufs.append(b)
        return b

    return buf, bufs


class Backend:
    """matmul and expert batch of one backend behind one interface; ``work()`` counts what the backend ran
    (CPU: kernel calls through this object; device: dispatches) so a test asserts the backend did the work."""

    def __init__(self, name: str, dev=None):
        self.name, self.dev = name, dev
        self.calls = 0
        self._K = None     # the device layers' coli.vulkan.layers.Kernels, made on the first lmm

    def route(self) -> str:
        """The device's prompt GEMM route (``coli.vulkan.layers.Kernels.route``); "f32" on the CPU."""
        if self.dev is None:
            return "f32"
        from coli.vulkan.layers import Kernels

        if self._K is None:
            self._K = Kernels(self.dev)
        return self._K.route

    def lmm(self, type_name, dense, xd, experts, x, xh, ids, wts, biases):
        """The device layers' prompt GEMM (``shaders/lmm.comp``) on the device only, its three modes in one
        command buffer. dense (raw, (O, I)) and xd f32 [R, I]: mode 0, y [R, O] = xd W^T. experts: per expert the
        raw bytes of gate, up [Fd, D] and down [D, Fd]; x f32 [R, D]; ids int [R, k] (distinct in a row), wts f32
        [R, k]: pair p = r * k + j (row r's j-th expert): mode 1, h [R * k, Fd] = silu(x[r] Wg^T) * (x[r] Wu^T);
        mode 2 from its own input xh f32 [R * k, Fd], yk [R * k, D] = wts[r, j] (xh[p] Wd^T). Then the shared
        expert's form (u6 = 1: one expert, every row its own pair; expert 0's weights, route weight wts[r, 0]): hs
        [R, Fd] as h of row r, ys [R, D] = wts[r, 0] (xh[r] Wd^T). Then, with ``biases`` (bg, bu f32 [E, Fd], bd f32
        [E, D]: each expert's gate, up and down biases): hg as h with the tanh GELU and the biases, ho as h with
        gpt-oss's clamped SwiGLU (limit 7) and the biases, ykb as yk with the down bias before the route weight.
        -> (y, h, yk, hs, ys, hg, ho, ykb) f32; the eight dispatches count in the device's ``dispatches`` and
        ``layer_dispatches``."""
        from coli.vulkan.layers import Dispatch, Kernels

        if self._K is None:
            self._K = Kernels(self.dev)
        K, dev = self._K, self.dev
        (raw, (O, I)), (R, k), E = dense, ids.shape, len(experts)
        D, Fd = x.shape[1], xh.shape[1]
        placed = []
        buf, bufs = _uploader(K)

        try:
            tw = dev._place(type_name, raw, (O, I))
            placed.append(tw)
            table = np.zeros((E, 3), np.uint64)          # gate, up, down addresses per expert
            for e, mats in enumerate(experts):
                for c, (m, shape) in enumerate(zip(mats, ((Fd, D), (Fd, D), (D, Fd)))):
                    placed.append(dev._place(type_name, m, shape))
                    table[e, c] = placed[-1].addr
            flat = ids.reshape(-1).astype(np.int64)
            pairs = np.argsort(flat, kind="stable").astype(np.uint32)        # grouped by expert (moe_sort.comp's job)
            off = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=E))]).astype(np.uint32)
            route = np.concatenate([ids.astype(np.uint32), wts.astype(np.float32).view(np.uint32)], axis=1)
            route1 = np.stack([np.zeros(R, np.uint32), wts[:, 0].astype(np.float32).view(np.uint32)], axis=1)
            xdb, xb, xhb, tb, rb, pb, ob, r1b = (buf(a) for a in (xd, x, xh, table, route, pairs, off, route1))
            # NaN: an output lmm skips fails the finite check
            yb, hb, ykb, hsb, ysb, hgb, hob, ykbb = (buf(np.full(n, np.nan, np.float32), True) for n in (
                (R, O), (R * k, Fd), (R * k, D), (R, Fd), (R, D), (R * k, Fd), (R * k, Fd), (R * k, D)))
            bgb, bub, bdb = (buf(b) for b in biases)
            BM, gr = 64, -(-R // K.tile)                 # lmm.comp's tile: 64 outputs x K.tile rows
            ops = [Dispatch("lmm", (-(-O // BM), gr), [tw.addr, xdb.addr, yb.addr, yb.addr], [O, I, 0, R, 0],
                            type_name=type_name, wait=False),
                   Dispatch("lmm", (-(-Fd // BM), gr, E), [tb.addr, xb.addr, hb.addr, rb.addr, pb.addr, ob.addr],
                            [Fd, D, 0, R, 0, k], type_name=type_name, mode=1, wait=False),
                   Dispatch("lmm", (-(-D // BM), gr, E), [tb.addr, xhb.addr, ykb.addr, rb.addr, pb.addr, ob.addr],
                            [D, Fd, 0, R, 0, k], type_name=type_name, mode=2, wait=False),
                   Dispatch("lmm", (-(-Fd // BM), gr, 1), [tb.addr, xb.addr, hsb.addr, r1b.addr, pb.addr, ob.addr],
                            [Fd, D, 0, R, 0, 1, 1], type_name=type_name, mode=1, wait=False),
                   Dispatch("lmm", (-(-D // BM), gr, 1), [tb.addr, xhb.addr, ysb.addr, r1b.addr, pb.addr, ob.addr],
                            [D, Fd, 0, R, 0, 1, 1], type_name=type_name, mode=2, wait=False),
                   # the other gated activations with the experts' biases (gpt-oss, Gemma's GeGLU): mode 1 with the
                   # tanh GELU, mode 1 with gpt-oss's clamped SwiGLU (limit 7), mode 2 with the down bias
                   Dispatch("lmm", (-(-Fd // BM), gr, E), [tb.addr, xb.addr, hgb.addr, rb.addr, pb.addr, ob.addr,
                                                      bgb.addr, bub.addr],
                            [Fd, D, 0, R, 0, k, 0, 1, 1, 0], type_name=type_name, mode=1, wait=False),
                   Dispatch("lmm", (-(-Fd // BM), gr, E), [tb.addr, xb.addr, hob.addr, rb.addr, pb.addr, ob.addr,
                                                      bgb.addr, bub.addr],
                            [Fd, D, 0, R, 0, k, 0, 2, 1, int(np.float32(7.0).view(np.uint32))], type_name=type_name,
                            mode=1, wait=False),
                   Dispatch("lmm", (-(-D // BM), gr, E), [tb.addr, xhb.addr, ykbb.addr, rb.addr, pb.addr, ob.addr,
                                                     bdb.addr],
                            [D, Fd, 0, R, 0, k, 0, 0, 1], type_name=type_name, mode=2, wait=False)]
            rec = K.record(ops)
            try:
                K.submit(rec)
            finally:
                K.free(rec)
            return tuple(b.f32(n * m).reshape(n, m).copy() for b, (n, m) in
                         ((yb, (R, O)), (hb, (R * k, Fd)), (ykb, (R * k, D)), (hsb, (R, Fd)), (ysb, (R, D)),
                          (hgb, (R * k, Fd)), (hob, (R * k, Fd)), (ykbb, (R * k, D))))
        finally:
            for b in bufs:
                K.drop(b)
            for t in placed:
                dev._drop(t)

    def attn_kernel(self, hd: int) -> str:
        """The device's prompt attention kernel for head dimension ``hd`` (``Kernels.attn_kernel``)."""
        self.route()
        return self._K.attn_kernel(hd)

    def attn(self, q, K, V, pos0: int, scale: float, window: int = 0, sinks=None, split: int = 1):
        """The device layers' prompt attention (``Kernels.attn_kernel``'s kernel) of q f32 [R, nq, hd] at positions
        pos0 .. pos0 + R - 1 over the cache K, V f32 [nkv, ctx, hd]; window 0: none; sinks f32 [nq] or None;
        ``split`` > 1: the keys split over that many workgroups in parts of ``ATTN_CHK`` and joined (attn_pre.comp's
        join pass) -> f32 [R, nq, hd]; the dispatches count in the device's ``layer_dispatches``."""
        from coli.vulkan.layers import Dispatch, f32_bits

        self.route()
        Kk = self._K
        R, nq, hd = q.shape
        nkv, ctx = K.shape[:2]
        kern, groups, mode = Kk.attn_dispatch(nq, nkv, hd, R)
        buf, bufs = _uploader(Kk)

        try:
            bqb, bk, bv = buf(q), buf(K), buf(V)
            bp = buf(np.array([pos0, 0, 0, 0], np.uint32))
            bo = buf(np.full(q.shape, np.nan, np.float32), True)     # NaN: a row the kernel skips fails
            bs = buf(np.zeros(nq, np.float32) if sinks is None else np.asarray(sinks, np.float32))
            bparts = buf(np.zeros(split * R * nq * (hd + 2), np.float32))
            aa = [bqb.addr, bk.addr, bv.addr, bp.addr, bo.addr, bs.addr, bparts.addr]
            aw = [nq, nkv, hd, ctx, f32_bits(scale), R, window, int(sinks is not None), hd, split, ATTN_CHK]
            ops = [Dispatch(kern, (*groups, split), aa, aw, mode=mode, wait=False)]
            if split > 1:
                ops.append(Dispatch("attn_pre", (R,), aa, aw + [1], mode=(mode & 0xFFFF) | 1 << 16))
            rec = Kk.record(ops)
            try:
                Kk.submit(rec)
            finally:
                Kk.free(rec)
            return bo.f32(q.size).reshape(q.shape).copy()
        finally:
            for b in bufs:
                Kk.drop(b)

    def work(self) -> int:
        return self.dev.dispatches if self.dev is not None else self.calls

    def matmul(self, type_name, raw, shape, x, act):
        if self.dev is not None:
            return self.dev.matmul(type_name, raw, shape, x, act=act)
        self.calls += 1
        return F.matmul(F.prepare(type_name, raw, shape), x, act=act)

    def experts(self, specs, x, rows, eids, act):
        """specs: per expert ((type, raw, shape) x 3: gate, up, down); pair p = (rows[p], eids[p]) -> f32 [P, D]."""
        if self.dev is not None:
            hs = [self.dev.upload_expert(*s) for s in specs]
            try:
                return self.dev.submit_experts(x, rows, [hs[e] for e in eids], act=act).join()
            finally:
                for h in hs:
                    self.dev.free_expert(h)
        from scheduler.step import MoEStep

        step = MoEStep(None, act=act)
        out = np.empty((len(rows), x.shape[1]), np.float32)
        for e, s in enumerate(specs):
            w = types.SimpleNamespace(**{k: F.prepare(*s[i]) for i, k in enumerate(("gate", "up", "down"))})
            sel = np.flatnonzero(eids == e)
            if sel.size:
                self.calls += 1
                out[sel] = step.expert_cpu(w, x[rows[sel]])
        return out


def expert_reference(x, w, act):
    """SwiGLU expert in float64 on the activations the backend multiplies (int8: x and the SwiGLU output rounded):
    (want float64 [R, D], slack float64 [R, D]). The SwiGLU output reaches the second rounding as f32 from the
    backend and float64 here, so a code within 1e-3 of a rounding tie may go either way: ``slack`` is the most
    those codes can move each output (one step d of their block times |W_down|); zero for f32."""
    if act == "f32":
        return numpy_expert(x, w), 0.0
    wg, wu, wd = w
    xa = act_model(x, act)
    g, u = xa @ wg.T, xa @ wu.T
    h = (g / (1.0 + np.exp(-g)) * u).astype(np.float32)
    R, Fd = h.shape
    hb = h.reshape(R, Fd // 32, 32)
    d = (np.abs(hb).max(axis=-1) / np.float32(127.0)).astype(np.float32)
    d = np.where(d >= np.finfo(np.float32).tiny, d, np.float32(0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(d[..., None] != 0, hb.astype(np.float64) / d[..., None], 0.0)
    tie = np.abs(np.abs(t - np.floor(t)) - 0.5) < 1e-3
    step = (tie * d[..., None]).reshape(R, Fd)
    return act_model(h, act) @ wd.T, step @ np.abs(wd).T


def lmm_shapes(type_name: str) -> tuple[int, int, int, int]:
    """(O, I) of the dense mode (69 outputs: a partial second 64-output tile; ``inner``'s odd number of blocks) and
    (D, Fd) of the experts (each a multiple of the block: gate/up [Fd, D], down [D, Fd]; small, for Lavapipe; D 99
    for F32/F16/BF16: gate/up rows of any width, down's outputs as many; Fd, down's width, a multiple of 32 as the
    device layers pad it)."""
    bs = TT.get(type_name).block_size
    D, Fd = (256, 256) if bs == 256 else (128, 256) if bs == 128 else (128, 192) if bs == 64 else \
        (96, 160) if bs == 32 else (99, 160)
    return O_ODD + 32, inner(type_name), D, Fd


def f16_model(a) -> np.ndarray:
    """float64 of ``a`` rounded to float16, nearest even (NumPy's cast): an operand of the cooperative-matrix route,
    which rounds the decoded weights and the activation rows to float16 in shared memory (the H100 rounds the same
    way: its errors on unrounded operands are this model's, format by format)."""
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float64)


def lmm_reference(ws, W, xd, x, xh, ids, wts, biases, rnd=None) -> dict:
    """float64 references of ``lmm_errors``' eight outputs, {case: array}: products of the weights (float64 [O, I]
    W and per expert (gate, up, down)) and the activations after ``rnd`` (None: as they are; ``f16_model``: the
    cooperative-matrix route's operands), then the biases, activations and route weights in float64."""
    q = rnd if rnd is not None else (lambda a: np.asarray(a, np.float64))
    bg, bu, bd = biases
    k = ids.shape[1]
    wq = [tuple(q(m) for m in mats) for mats in ws]
    xq, xhq = q(x), q(xh)
    n = len(ids.reshape(-1))
    out = {c: np.empty((n, wq[0][0].shape[0])) for c in (1, "1g", "1o")}
    out[2], out["2b"] = np.empty((n, wq[0][2].shape[0])), np.empty((n, wq[0][2].shape[0]))
    for p, e in enumerate(ids.reshape(-1)):
        g, u = wq[e][0] @ xq[p // k], wq[e][1] @ xq[p // k]
        with np.errstate(over="ignore"):
            out[1][p] = g / (1.0 + np.exp(-g)) * u
            gb, ub = g + bg[e], u + bu[e]
            out["1g"][p] = 0.5 * gb * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gb + 0.044715 * gb ** 3))) * ub
            gc, uc = np.minimum(gb, 7.0), np.clip(ub, -7.0, 7.0)     # gpt-oss: gate min(g, 7), up clamped +-7
            out["1o"][p] = gc / (1.0 + np.exp(-1.702 * gc)) * (uc + 1.0)
        dn = wq[e][2] @ xhq[p]
        out[2][p] = np.float64(wts.reshape(-1)[p]) * dn
        out["2b"][p] = np.float64(wts.reshape(-1)[p]) * (dn + bd[e])
    with np.errstate(over="ignore"):
        g, u = xq @ wq[0][0].T, xq @ wq[0][1].T
        out["1s"] = g / (1.0 + np.exp(-g)) * u
    out["2s"] = wts[:, :1].astype(np.float64) * (xhq[:len(x)] @ wq[0][2].T)
    out[0] = q(xd) @ q(W).T
    return out


def lmm_errors(be: Backend, type_name: str, R: int, rng) -> dict:
    """One ``lmm`` run of R rows: {case: (err, exact)} for case 0 (dense), 1 (gate/up + SwiGLU), 2 (down x route
    weight), "1s", "2s" (modes 1 and 2 in the shared expert's one-expert form), "1g" / "1o" (mode 1 with the
    experts' biases and the tanh GELU / gpt-oss's clamped SwiGLU) and "2b" (mode 2 with the down bias): ``err``
    against the route's reference (``lmm_reference`` of float16-rounded operands on the cooperative-matrix route, of
    the operands as they are otherwise), ``exact`` against the operands as they are."""
    O, I, D, Fd = lmm_shapes(type_name)
    E, k = 4, 2          # expert 3 gets no rows: its tiles return at once
    raw, W = weight(type_name, O, I, rng)
    specs, ws = [], []
    for _ in range(E):
        g, wg = weight(type_name, Fd, D, rng, 0.3)
        u, wu = weight(type_name, Fd, D, rng, 0.3)
        dn, wd = weight(type_name, D, Fd, rng, 0.3)
        specs.append((g, u, dn))
        ws.append((wg, wu, wd))
    ids = np.stack([rng.choice(3, k, replace=False, p=(0.6, 0.3, 0.1)) for _ in range(R)])
    wts = rng.uniform(0.05, 1.0, (R, k)).astype(np.float32)
    xd = rng.standard_normal((R, I)).astype(np.float32)
    x = rng.standard_normal((R, D)).astype(np.float32)
    xh = rng.standard_normal((R * k, Fd)).astype(np.float32)
    bg, bu = (rng.uniform(-0.5, 0.5, (E, Fd)).astype(np.float32) for _ in range(2))
    bd = rng.uniform(-0.5, 0.5, (E, D)).astype(np.float32)
    w0 = be.dev.layer_dispatches
    y, h, yk, hs, ys, hg, ho, ykb = be.lmm(type_name, (raw, (O, I)), xd, specs, x, xh, ids, wts, (bg, bu, bd))
    assert be.dev.layer_dispatches == w0 + 8, f"{be.name} did not run the eight lmm dispatches"
    got = {0: y, 1: h, 2: yk, "1s": hs, "2s": ys, "1g": hg, "1o": ho, "2b": ykb}
    for a in got.values():
        assert a.dtype == np.float32 and np.isfinite(a).all()
    args = (ws, W, xd, x, xh, ids, wts, (bg, bu, bd))
    ref = exact = lmm_reference(*args)
    if be.route() == "coopmat":     # a width that is not a multiple of 32 takes lmm.comp's f32 products there too
        cm = lmm_reference(*args, rnd=f16_model)
        width = {c: Fd if str(c).startswith("2") else I if c == 0 else D for c in exact}
        ref = {c: cm[c] if width[c] % 32 == 0 else exact[c] for c in exact}
    return {c: (err(a, ref[c]), err(a, exact[c])) for c, a in got.items()}


def attn_reference(q, K, V, pos0: int, scale: float, window: int = 0, sinks=None) -> np.ndarray:
    """float64 causal softmax attention (coli/models/blocks.py attend; gpt-oss's sink: one more logit a head in the
    max and the denominator): row r at position p = pos0 + r sees keys max(0, p - window + 1) .. p (window 0: all),
    q head h the KV head h // (nq / nkv) -> float64 [R, nq, hdv] (V's width)."""
    R, nq, hd = q.shape
    nkv = K.shape[0]
    out = np.empty((R, nq, V.shape[-1]), np.float64)
    for r in range(R):
        p = pos0 + r
        lo = max(0, p - window + 1) if window else 0
        for h in range(nq):
            kvh = h // (nq // nkv)
            s = scale * (K[kvh, lo:p + 1].astype(np.float64) @ q[r, h].astype(np.float64))
            mx = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            e = np.exp(s - mx)
            den = e.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - mx))
            out[r, h] = (e / den) @ V[kvh, lo:p + 1].astype(np.float64)
    return out


def attn_inputs(case, rng):
    """(q [R, nq, hd], K, V [nkv, CTX_ATTN, hd], scale, window, sinks or None) of one ``ATTN_CASES`` entry: K and V
    past the chunk's last position are 1e30 and NaN (a kernel that reads them fails)."""
    nq, nkv, hd, pos0, R, W, sk = case
    q = rng.standard_normal((R, nq, hd)).astype(np.float32)
    K = rng.standard_normal((nkv, CTX_ATTN, hd)).astype(np.float32)
    V = rng.standard_normal((nkv, CTX_ATTN, hd)).astype(np.float32)
    q[R // 2] *= 4.0                                   # a row with sharp scores: exp's range
    K[:, pos0 + R:], V[:, pos0 + R:] = 1e30, np.nan
    sinks = rng.uniform(-1.0, 3.0, nq).astype(np.float32) if sk else None
    return q, K, V, 1.0 / np.sqrt(hd), W, sinks


def attn_tolerance(be, hd: int) -> float:
    """``TOL_ATTN_F16`` where the device's kernel for ``hd`` is the cooperative-matrix one, else ``TOL_ATTN``."""
    return TOL_ATTN_F16 if be.attn_kernel(hd) == "attn_pre_cm" else TOL_ATTN


def attn_error(be, case, split: int = 1) -> float:
    """One ``ATTN_CASES`` case on the device (``split``: as ``Backend.attn``'s): max |got - want| / max |want|
    against ``attn_reference``."""
    rng = np.random.default_rng(_seed("attn", attn_id(case)))
    q, K, V, scale, W, sinks = attn_inputs(case, rng)
    w0 = be.dev.layer_dispatches
    got = be.attn(q, K, V, case[3], scale, W, sinks, split)
    assert be.dev.layer_dispatches == w0 + 1 + (split > 1), f"{be.name} did not run the attention dispatches"
    assert got.dtype == np.float32 and np.isfinite(got).all()
    return err(got, attn_reference(q, K, V, case[3], scale, W, sinks))


def run_case(be: Backend, type_name: str, op: str, act: str) -> float:
    """Run one (backend, type, op, act) case; returns the largest error over its shapes and row counts."""
    rng = np.random.default_rng(_seed(be.name, type_name, op, act))
    worst = 0.0
    if op == "lmm":
        for R in ROWS["lmm"]:
            worst = max(worst, *(e for e, _ in lmm_errors(be, type_name, R, rng).values()))
        return worst
    if op in ("gemv", "gemm"):
        for k in (0, 1):
            O, I = O_ODD + 32 * k, inner(type_name, k)
            raw, W = weight(type_name, O, I, rng)
            for T in ROWS[op]:
                x = rng.standard_normal((T, I)).astype(np.float32)
                if act == "int8":
                    x[0, :32] = 0.0   # an all-zero activation block: d = 0
                    x[-1, 32:64] = np.float32(1e-39)   # a subnormal block: no normal scale, zeros too
                w0 = be.work()
                y = be.matmul(type_name, raw, (O, I), x, act)
                assert be.work() > w0, f"{be.name} did no work"
                assert y.shape == (T, O) and y.dtype == np.float32 and np.isfinite(y).all()
                worst = max(worst, err(y, act_model(x, act) @ W.T))
        return worst
    # expert batch: E experts, R rows top-2; expert 0 gets >= 18 rows (its groups take the GEMM)
    bs = TT.get(type_name).block_size
    D, Fd = (256, 512) if bs >= 128 else (192, 320) if bs == 64 else (96, 160)
    E, R, K = 3, 20, 2
    specs, ws = [], []
    for _ in range(E):
        g, wg = weight(type_name, Fd, D, rng, 0.3)
        u, wu = weight(type_name, Fd, D, rng, 0.3)
        dn, wd = weight(type_name, D, Fd, rng, 0.3)
        specs.append(((type_name, g, (Fd, D)), (type_name, u, (Fd, D)), (type_name, dn, (D, Fd))))
        ws.append((wg, wu, wd))
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(R)])
    ids[:18, 0] = 0
    ids[:18, 1] = np.where(ids[:18, 1] == 0, 1, ids[:18, 1])
    x = rng.standard_normal((R, D)).astype(np.float32)
    if act == "int8":
        x[1, 32:64] = np.float32(1e-39)   # a subnormal block: no normal scale, zeros
    rows, eids = np.repeat(np.arange(R), K), ids.reshape(-1)
    w0 = be.work()
    y = be.experts(specs, x, rows, eids, act)
    assert be.work() > w0, f"{be.name} did no work"
    assert y.shape == (R * K, D) and np.isfinite(y).all()
    with np.errstate(over="ignore"):   # exp(-g) of a large negative gate: silu -> 0, as it should
        refs = [expert_reference(x[r:r + 1], ws[e], act) for r, e in zip(rows, eids)]
    want = np.concatenate([w for w, _ in refs])
    slack = np.concatenate([np.broadcast_to(s, w.shape) for w, s in refs])
    return float(np.maximum(np.abs(y.astype(np.float64) - want) - slack, 0.0).max()
                 / max(float(np.abs(want).max()), 1e-30))


@pytest.fixture(scope="module")
def backends():
    made = {"cpu": Backend("cpu")}
    yield made
    if "vulkan" in made:
        made["vulkan"].dev.close()


def _backend(backends, name):
    if name not in backends:
        from coli.vulkan import open_device

        d = open_device("backend-ops", budget=1 << 28, quiet=True)
        if d is None:
            pytest.fail("libvulkan.so.1 is present but no device opened")
        backends[name] = Backend(name, d)
    return backends[name]


@pytest.mark.parametrize("backend,type_name,op,act", cases())
def test_op_matches_reference(backends, backend, type_name, op, act):
    be = _backend(backends, backend)
    e, tol = run_case(be, type_name, op, act), tolerance(be, op, act)
    assert e < tol, f"{backend} {type_name} {op} act={act}: error {e:.3g} > {tol:g}"


@requires_vulkan
@pytest.mark.parametrize("split", [1, ATTN_SPLIT], ids=["whole", "split"])
@pytest.mark.parametrize("case", ATTN_CASES, ids=[attn_id(c) for c in ATTN_CASES])
def test_prompt_attention_matches_reference(backends, case, split):
    be = _backend(backends, "vulkan")
    e, tol = attn_error(be, case, split), attn_tolerance(be, case[2])
    assert e < tol, f"{be.attn_kernel(case[2])} {attn_id(case)} split {split}: error {e:.3g} > {tol:g}"


@requires_vulkan
def test_prompt_attention_gqa_workgroups_change_no_bit(backends):
    """attn_pre.comp serving the q heads of a KV head in one workgroup (G of them: 2, 3 with rows of the block unused,
    4) gives every row the same bits as one q head a workgroup, at each query-rows setting."""
    be = _backend(backends, "vulkan")
    be.route()
    K = be._K
    route = K.attn_route
    seen = set()
    try:
        K.attn_route = "f32"
        for case in [c for c in ATTN_CASES if c[0] > c[1]]:
            q, Kc, Vc, scale, W, sinks = attn_inputs(case, np.random.default_rng(_seed("gqa", attn_id(case))))
            for bq in (8, 16, 32):
                out = {}
                for gqa in (False, True):
                    K.attn_bq, K.attn_gqa = bq, gqa
                    out[gqa] = be.attn(q, Kc, Vc, case[3], scale, W, sinks)
                seen.add(K.attn_group(case[0], case[1], case[2]))
                assert np.array_equal(out[False], out[True]), (attn_id(case), bq)
    finally:
        K.attn_route, K.attn_bq, K.attn_gqa = route, 8, True
    assert seen == {2, 3, 4}


# ----------------------------------------------------------------------------------------------- the table
def test_every_backend_has_every_row():
    """A type one backend implements and another lacks fails here, unless the table marks it CPU only."""
    load_backends()
    assert TT.gaps() == [], ("backends lack rows (implement them, or mark the type CPU only in "
                             f"coli.types.table.CPU_ONLY with the reason): {TT.gaps()}")
    for b in TT.BACKENDS:
        assert set(registry(b)) == {n for n, t in TT.TYPES.items() if b in t.backends}


def test_gaps_flags_a_missing_row_unless_cpu_only():
    rows = {n: TT.TensorType(n, t.qtype, t.block_size, t.type_size, t.reference, t.quantizable, t.scale_offsets,
                             t.shader, None, {"cpu": "x"}) for n, t in list(TT.TYPES.items())[:2]}
    first, second = list(rows)
    rows[first].backends["vulkan"] = "y"
    assert TT.gaps(rows) == [(second, "vulkan")]
    rows[second].cpu_only = "a reason"
    assert TT.gaps(rows) == []
    rows[second].backends["vulkan"] = "y"              # a CPU-only mark the device has outgrown is flagged
    assert TT.gaps(rows) == [(second, "cpu_only")]
    rows[second].cpu_only = None
    rows[first].backends = {"vulkan": "y"}             # the device without the CPU is never excused
    assert TT.gaps(rows) == [(first, "cpu")]


def test_rows_agree_with_gguf_and_each_other():
    load_backends()
    for n, t in TT.TYPES.items():
        if t.qtype is None:  # coli's own type: no GGUF geometry to agree with
            assert t.own and t.random is not None, n
            continue
        assert (t.block_size, t.type_size) == GGML_QUANT_SIZES[t.qtype]
        if t.backends:
            assert t.reference is not None, f"{n}: a backend implements it but there is no NumPy reference"
    for n, f in F.FORMATS.items():
        assert (f.block_size, f.type_size, f.reference) == (TT.get(n).block_size, TT.get(n).type_size,
                                                            TT.get(n).reference)
        assert f.int8 == (f.block_size > 1), n
        if f.int8 and f.gemv_i8 is None:
            from cpu_kernels import vnni
            assert f.no_i8 or not vnni.HAVE_VNNI, f"{n}: int8 format without a VNNI GEMV and no reason"
    assert S.FORMATS == {n: TT.get(n).shader for n in S.DEVICE_TYPES}


def test_random_blocks_are_finite_and_varied():
    rng = np.random.default_rng(0)
    for n in load_backends():
        t = TT.TYPES[n]
        if not t.backends:
            continue
        raw = TT.random_blocks(n, 3, inner(n), rng)
        assert raw.dtype == np.uint8 and raw.shape == (3, t.row_bytes(inner(n)))
        w = t.reference(raw, (3, inner(n)))
        assert np.isfinite(w).all() and np.unique(w).size > 8, n


def test_unknown_type_is_one_clear_error():
    from coli.base.errors import ColiError

    with pytest.raises(ColiError, match="Q9_9"):
        TT.get("Q9_9")
    with pytest.raises(ColiError, match="Q4_K.*256"):
        TT.get("Q4_K").row_bytes(100)
