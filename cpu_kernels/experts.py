"""Grouped matmuls: many weight matrices of any format in ONE parallel launch (the compiled token path).

A decode step multiplies a few activation rows by many small matrices (q/k/v, gate/up, the CPU experts of a MoE
step); one Numba parallel launch per matrix costs ~10 us of fork/join each and leaves threads idle at the ends of
every launch (docs/cpu_kernels.md, "grouped kernels"). These kernels take a *table* of weights and run every
(weight, block of 16 output rows) work item of the batch in one ``prange``:

* ``mm_grouped``: weight ``e`` multiplies the activation rows ``src[p]`` for the slots ``p`` in
  ``pstart[e]:pstart[e+1]`` and writes ``out[dst[p], off[e] + o]``. q/k/v of a layer are three weights reading
  the same rows into one [T, Oq+Ok+Ov] buffer; a MoE step's down matrices are one weight per expert, each
  reading its own rows of the activation and writing its pairs' rows of ``pair_out`` (invariant 1: where a pair
  landed is fixed by its pair id, never by the order the work ran in).
* ``ffn_gate_up``: gate and up weights of each expert (or of a dense FFN) in one work item per output-row block,
  the activation function fused: ``a[p, o] = act(gate_o . x, up_o . x)`` (SwiGLU with an optional clamp, or
  Gemma's tanh-GELU), so gate and up are never written out.

Both kernels read the weight row ``o`` once per block of slots: rows routed to the same expert share its weight
reads (the row stays in L1 across the slots), which makes a prompt chunk a GEMM over the weight block.

Weights are passed as a descriptor table, int64 [n, 13] (``desc``): format code, O, I, five array addresses and
their row lengths (``Weight.desc``: the packed arrays of ``formats.prepare``, which stay alive as long as the
``Weight`` does; the callers hold their Weights during the call). Numba has no templates and a typed list of
differently typed arrays would cost a Python-side build per step; a table of addresses is built once per
weight at load and stacked per step with one NumPy fancy index.

Activation modes (``mode``): ``I8`` (the layer input quantized ONCE per row with ``quantize_rows`` — llama.cpp's
Q8 activation blocks, ``formats._quantize_act_i8`` — then VNNI integer dots through ``cpu_kernels.vnni``'s
``row_*`` intrinsics; the same arithmetic as ``formats.matmul(act="int8")``'s GEMVs), ``F32`` (the weight row
decoded to f32 once per block of slots, then f32 dots with the f32 activations). F32/F16/BF16 weights always run
the f32 dot. Where the CPU lacks VNNI the callers pass the rounded activations in F32 mode (the same numbers up to
f32 rounding, as ``formats.matmul``).
"""
from __future__ import annotations

import itertools
import math

import numba
import numba.core.cgutils
import numba.core.errors
import numpy as np
from llvmlite import binding as _llvm
from llvmlite import ir as _llir
from numba import njit, prange, types
from numba.extending import intrinsic

from . import formats as _F
# the grouped kernels' format codes live with the registry (formats.Weight.desc builds the descriptors)
from .formats import (  # noqa: F401  (re-exported: experts.FORMAT_CODE, ...)
    DESC_LEN, FORMAT_CODE, TILE_CODE, FC_F32, FC_FP8, FC_G16, FC_LUT, FC_Q2_K,
    FC_Q3_K, FC_Q4_0, FC_Q4_1, FC_Q4_K, FC_Q5_0, FC_Q5_1, FC_Q5_K, FC_Q6_K, FC_Q8,
    FC_T2_K, FC_T3_K, FC_T4_0, FC_T4_1, FC_T4_K, FC_T5_0, FC_T5_1, FC_T5_K,
    FC_T6_K, FC_T8, FC_TI1M, FC_TI1S, FC_TI2, FC_TI2S, FC_TI2X, FC_TI3, FC_TI3S,
    FC_TMX, FC_TNL, FC_TNV, FC_TXS, weight_desc)
from . import fp8 as _fp8
from . import gemm_i8 as _G
from . import iquants as _iq
from . import lowbit as _lb
from . import tiles as _tiles
from .iquants import row_g16
from .tiles import (decode_row, tile4_iq4_nl, tile4_iq4_xs, tile4_mxfp4, tile4_q2_k, tile4_q3_k, tile4_q4_0,
                    tile4_q4_1, tile4_q4_k, tile4_q5_0, tile4_q6_k, tile4_q8_0, tile_iq4_nl, tile_iq4_xs, tile_mxfp4,
                    tile4_q5_1, tile4_q5_k, tile_q2_k, tile_q3_k, tile_q4_0, tile_q4_1, tile_q4_k, tile_q5_0,
                    tile_q5_1, tile_q5_k, tile_q6_k, tile_q8_0, tile_iq2_xxs, tile_iq3_xxs, tile4_iq2_xxs,
                    tile4_iq3_xxs, tile_iq3_s, tile4_iq3_s, tile_iq2_xs, tile4_iq2_xs, tile_iq2_s,
                    tile4_iq2_s, tile_iq1_s, tile4_iq1_s, tile_iq1_m, tile4_iq1_m, tile_nvfp4, tile4_nvfp4,
                    tile4u_q8_0, widen_t16_q5_0, wsum_q8_0)
from .vnni import (HAVE_VNNI, _act_sums16, row_lut, row_pair, row_q2_k, row_q3_k, row_q4_k, row_q5_0, row_q5_k,
                   row_q6_k, row_q8, widen_lut, widen_q5_0)

_PJIT = dict(parallel=True, nogil=True, cache=True, fastmath=True)
_JIT = dict(nogil=True, cache=True, fastmath=True)
_RB = 16
#: 16-row blocks a one-row gate/up run reads of each matrix before the other (``_gate_up_run``)
_RUN = 16

I8 = 0
F32 = 1
ACT_SWIGLU = 0
ACT_GEGLU = 1
#: gpt-oss's clamped SwiGLU: ``(clamp(u, -L, L) + 1) * g' * sigmoid(ALPHA_OAI * g')`` with ``g' = min(g, L)``
#: (transformers ``models/gpt_oss/modeling_gpt_oss.py`` ``GptOssExperts._apply_gate``; ggml ``swiglu_oai``)
ACT_SWIGLU_OAI = 2
#: the sigmoid's gain in ACT_SWIGLU_OAI (HF ``swiglu_alpha``; llama.cpp hard-codes it for gpt-oss)
ALPHA_OAI = 1.702

_F0 = np.float32(0.0)
_F8 = np.float32(8.0)


def supports(w) -> bool:
    """True when the grouped kernels can run weight ``w`` (its format has a code)."""
    return w.name in FORMAT_CODE


def expert_desc(w):
    """int64 [3, 13]: the descriptors of an expert's gate, up and down (``w.gate``/``w.up``/``w.down``
    Weights), stacked once and kept on ``w`` (``_desc3``); None when a format has no code."""
    d = getattr(w, "_desc3", False)
    if d is False:
        ok = supports(w.gate) and supports(w.up) and supports(w.down)
        d = np.stack([w.gate.desc, w.up.desc, w.down.desc]) if ok else None
        w._desc3 = d
    return d


# ----------------------------------------------------------------------------------------------- pointers
def _ptr_of(nbty):
    @intrinsic
    def ptr(typingctx, addr):
        sig = types.CPointer(nbty)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.CPointer(nbty)))

        return sig, codegen

    return ptr


_pi8 = _ptr_of(types.int8)
_pu8 = _ptr_of(types.uint8)
_pf32 = _ptr_of(types.float32)
_pu32 = _ptr_of(types.uint32)

_F32C2 = types.Array(types.float32, 2, "C")
_I64C1 = types.Array(types.int64, 1, "C")


def _stack_array(context, builder, aryty, shape):
    """A C-contiguous array of ``shape`` on the stack of the function being built (alloca in its entry block,
    no NRT allocation, no meminfo): scratch that lives until that function returns."""
    elt = context.get_data_type(aryty.dtype)
    n = 1
    for v in shape:
        n *= v
    buf = numba.core.cgutils.alloca_once(builder, elt, size=n)
    isz = context.get_abi_sizeof(elt)
    ip = lambda v: context.get_constant(types.intp, v)  # noqa: E731
    strides, acc = [], isz
    for v in reversed(shape):
        strides.insert(0, ip(acc))
        acc *= v
    ary = context.make_array(aryty)(context, builder)
    context.populate_array(ary, data=buf, shape=[ip(v) for v in shape], strides=strides, itemsize=ip(isz),
                           meminfo=None)
    return ary


@intrinsic
def _stack_gu(typingctx):
    """f32 [2, _RB] on the stack: a one-row work item's gate and up outputs. ``np.empty`` there was an NRT
    allocation and free per 16-row work item (~0.1-0.3 us each, thousands a decode token)."""
    def codegen(context, builder, sig, args):
        return _stack_array(context, builder, _F32C2, (2, _RB))._getvalue()

    return _F32C2(), codegen


@intrinsic
def _stack_gu_run(typingctx):
    """f32 [2, _RUN * _RB] on the stack: a one-row gate/up run's gate and up outputs (``_gate_up_run``)."""
    def codegen(context, builder, sig, args):
        return _stack_array(context, builder, _F32C2, (2, _RUN * _RB))._getvalue()

    return _F32C2(), codegen


@intrinsic
def _f32_bits(typingctx, v):
    """The float32 whose bits are the low 32 bits of integer ``v`` (a bit cast)."""
    if not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        i = context.cast(builder, args[0], sig.args[0], types.int32)
        return builder.bitcast(i, _llir.FloatType())

    return types.float32(v), codegen


@intrinsic
def _stack_index(typingctx, v):
    """int64 [1] on the stack holding ``v``."""
    def codegen(context, builder, sig, args):
        ary = _stack_array(context, builder, _I64C1, (1,))
        builder.store(context.cast(builder, args[0], sig.args[0], types.int64), ary.data)
        return ary._getvalue()

    return _I64C1(v), codegen


@njit(inline="always", **_JIT)
def _r_i8(ds, k, o):
    n = ds[8 + k]
    return numba.carray(_pi8(ds[3 + k] + o * n), (n,))


@njit(inline="always", **_JIT)
def _r_u8(ds, k, o):
    n = ds[8 + k]
    return numba.carray(_pu8(ds[3 + k] + o * n), (n,))


@njit(inline="always", **_JIT)
def _r_u32(ds, k, o):
    n = ds[8 + k]
    return numba.carray(_pu32(ds[3 + k] + o * n * 4), (n,))


@njit(inline="always", **_JIT)
def _r_f32(ds, k, o):
    n = ds[8 + k]
    return numba.carray(_pf32(ds[3 + k] + o * n * 4), (n,))


# row o of packed array k as a [1, n] array: the lowbit/fp8 decoders index (array, row)
@njit(inline="always", **_JIT)
def _r2_u8(ds, k, o):
    n = ds[8 + k]
    return numba.carray(_pu8(ds[3 + k] + o * n), (1, n))


@njit(inline="always", **_JIT)
def _r2_i8(ds, k, o):
    n = ds[8 + k]
    return numba.carray(_pi8(ds[3 + k] + o * n), (1, n))


@njit(inline="always", **_JIT)
def _r2_f32(ds, k, o):
    n = ds[8 + k]
    return numba.carray(_pf32(ds[3 + k] + o * n * 4), (1, n))


@njit(inline="always", **_JIT)
def _lowbit_dec(ds, o, buf):
    """Row o of a FC_Q5_1 / FC_Q2_K / FC_Q3_K / FC_G16 / FC_FP8 weight decoded to f32 by its own module's
    decoder (cpu_kernels.lowbit ``_dec_*``, iquants ``_dec_g16``, fp8 ``_dec``)."""
    fc = ds[0]
    if fc == FC_Q5_1:
        _lb._dec_q5_1(_r2_i8(ds, 0, o), _r2_f32(ds, 1, o), _r2_f32(ds, 2, o), 0, buf)
    elif fc == FC_Q2_K:
        _lb._dec_q2_k(_r2_u8(ds, 0, o), _r2_u8(ds, 1, o), _r2_u8(ds, 2, o), _r2_f32(ds, 3, o), _r2_f32(ds, 4, o),
                      0, buf)
    elif fc == FC_Q3_K:
        _lb._dec_q3_k(_r2_u8(ds, 0, o), _r2_u8(ds, 1, o), _r2_i8(ds, 2, o), _r2_f32(ds, 3, o), 0, buf)
    elif fc == FC_G16:
        _iq._dec_g16(_r2_i8(ds, 0, o), _r2_f32(ds, 1, o), 0, buf)
    else:
        _fp8._dec(_r2_u8(ds, 0, o), _r2_f32(ds, 1, o), 0, buf)


# ----------------------------------------------------------------------------------------------- row dots
@njit(inline="always", **_JIT)
def _tile(fc, rec, xq, xd, xm, out, off):
    """out[off:off+16] = the 16 rows of t16 tile ``rec`` (format code fc) . one int8 activation row."""
    if fc == FC_T4_1:
        tile_q4_1(rec, xq, xd, xm, out, off)
    elif fc == FC_T8:
        tile_q8_0(rec, xq, xd, xm, out, off)
    elif fc == FC_T5_0:
        tile_q5_0(rec, xq, xd, xm, out, off)
    elif fc == FC_T4_K:
        tile_q4_k(rec, xq, xd, xm, out, off)
    elif fc == FC_T6_K:
        tile_q6_k(rec, xq, xd, xm, out, off)
    elif fc == FC_TMX:
        tile_mxfp4(rec, xq, xd, xm, out, off)
    elif fc == FC_TNL:
        tile_iq4_nl(rec, xq, xd, xm, out, off)
    elif fc == FC_TXS:
        tile_iq4_xs(rec, xq, xd, xm, out, off)
    elif fc == FC_T2_K:
        tile_q2_k(rec, xq, xd, xm, out, off)
    elif fc == FC_T3_K:
        tile_q3_k(rec, xq, xd, xm, out, off)
    elif fc == FC_T5_1:
        tile_q5_1(rec, xq, xd, xm, out, off)
    elif fc == FC_T5_K:
        tile_q5_k(rec, xq, xd, xm, out, off)
    elif fc == FC_TI2:
        tile_iq2_xxs(rec, xq, xd, xm, out, off)
    elif fc == FC_TI3:
        tile_iq3_xxs(rec, xq, xd, xm, out, off)
    elif fc == FC_TI3S:
        tile_iq3_s(rec, xq, xd, xm, out, off)
    elif fc == FC_TI2X:
        tile_iq2_xs(rec, xq, xd, xm, out, off)
    elif fc == FC_TI2S:
        tile_iq2_s(rec, xq, xd, xm, out, off)
    elif fc == FC_TI1S:
        tile_iq1_s(rec, xq, xd, xm, out, off)
    elif fc == FC_TI1M:
        tile_iq1_m(rec, xq, xd, xm, out, off)
    elif fc == FC_TNV:
        tile_nvfp4(rec, xq, xd, xm, out, off)
    else:
        tile_q4_0(rec, xq, xd, xm, out, off)


@njit(inline="always", **_JIT)
def _tile4(fc, rec, xq, xd, xm, rows, out, orows, off):
    """out[orows[i], off:off+16] = tile ``rec`` . row rows[i] of xq for i < n, n = 2, 3 or 4 rows (``tiles.tile4_*``)."""
    if fc == FC_T4_1:
        tile4_q4_1(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_T8:
        tile4_q8_0(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_T5_0:
        tile4_q5_0(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_T4_K:
        tile4_q4_k(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_T6_K:
        tile4_q6_k(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_TMX:
        tile4_mxfp4(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_TNL:
        tile4_iq4_nl(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_TXS:
        tile4_iq4_xs(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_T2_K:
        tile4_q2_k(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_T3_K:
        tile4_q3_k(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_T5_1:
        tile4_q5_1(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_T5_K:
        tile4_q5_k(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_TI2:
        tile4_iq2_xxs(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_TI3:
        tile4_iq3_xxs(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_TI3S:
        tile4_iq3_s(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_TI2X:
        tile4_iq2_xs(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_TI2S:
        tile4_iq2_s(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_TI1S:
        tile4_iq1_s(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_TI1M:
        tile4_iq1_m(rec, xq, xd, xm, rows, out, orows, off)
    elif fc == FC_TNV:
        tile4_nvfp4(rec, xq, xd, xm, rows, out, orows, off)
    else:
        tile4_q4_0(rec, xq, xd, xm, rows, out, orows, off)


#: a 0 offset or pair index for ``_block_i8`` as an int64 (a literal 0 is typed Literal[int]: another compile)
_I0 = np.int64(0)


@njit(inline="always", **_JIT)
def _i8_tiles(ds, fc, c0, c1, p0, p1, src, dst, oe, xq, xd, xm, out):
    """``_block_i8`` of the t16 tiles (``TILE_CODE``): c0 is a tile's first row (16-row work items)."""
    rec = _r_u8(ds, 0, c0 // 16)
    p = p0
    while p + 4 <= p1:  # 4 rows share each weight load; the same per-row arithmetic as one row alone
        _tile4(fc, rec, xq, xd, xm, src[p:p + 4], out, dst[p:p + 4], oe + c0)
        p += 4
    if p1 - p >= 2:  # 2 or 3 left (a decode step's 2-3 sequences, an expert 2-3 rows chose): they share it too
        _tile4(fc, rec, xq, xd, xm, src[p:p1], out, dst[p:p1], oe + c0)
    elif p1 > p:
        r = src[p]
        _tile(fc, rec, xq[r], xd[r], xm[r], out[dst[p]], oe + c0)


@njit(inline="always", **_JIT)
def _i8_dots(ds, fc, c0, c1, p0, p1, src, dst, oe, xq, xd, xm, out):
    """``_block_i8`` of the layouts whose VNNI row dot is the output: Q8_0's int8 codes (FC_Q8), Q5_0, the 4-bit
    table codes, Q6_K and the G = 16 layout."""
    if fc == FC_Q8:
        for o in range(c0, c1):
            q = _r_i8(ds, 0, o)
            d = _r_f32(ds, 1, o)
            for p in range(p0, p1):
                r = src[p]
                out[dst[p], oe + o] = row_q8(q, d, xq[r], xd[r])
    elif fc == FC_Q5_0:
        for o in range(c0, c1):
            qs = _r_u8(ds, 0, o)
            qh = _r_u32(ds, 1, o)
            d = _r_f32(ds, 2, o)
            for p in range(p0, p1):
                r = src[p]
                out[dst[p], oe + o] = row_q5_0(qs, qh, d, xq[r], xd[r])
    elif fc == FC_LUT:
        kv = _r_i8(ds, 2, 0)
        for o in range(c0, c1):
            qs = _r_u8(ds, 0, o)
            d = _r_f32(ds, 1, o)
            for p in range(p0, p1):
                r = src[p]
                out[dst[p], oe + o] = row_lut(qs, d, kv, xq[r], xd[r])
    elif fc == FC_Q6_K:
        for o in range(c0, c1):
            q = _r_i8(ds, 0, o)
            sc = _r_i8(ds, 1, o)
            d = _r_f32(ds, 2, o)
            for p in range(p0, p1):
                r = src[p]
                out[dst[p], oe + o] = row_q6_k(q, sc, d, xq[r], xd[r])
    elif fc == FC_G16:
        for o in range(c0, c1):
            q = _r_i8(ds, 0, o)
            s = _r_f32(ds, 1, o)
            for p in range(p0, p1):
                r = src[p]
                out[dst[p], oe + o] = row_g16(q, s, xq[r], xd[r])


@njit(inline="always", **_JIT)
def _i8_with_mins(ds, fc, c0, c1, p0, p1, src, dst, oe, xq, xd, xm, out):
    """``_block_i8`` of Q4_0, Q4_1 and Q5_1: the row dot plus the offset or minimum through the activations'
    block sums."""
    if fc == FC_Q4_0 or fc == FC_Q4_1:
        for o in range(c0, c1):
            qs = _r_u8(ds, 0, o)
            d = _r_f32(ds, 1, o)
            m = _r_f32(ds, 2 if fc == FC_Q4_1 else 1, o)
            for p in range(p0, p1):
                r = src[p]
                s = row_pair(qs, d, xq[r], xd[r])
                corr = _F0
                if fc == FC_Q4_1:
                    for b in range(d.shape[0]):
                        corr += m[b] * xm[r, b]
                    out[dst[p], oe + o] = s + corr
                else:
                    for b in range(d.shape[0]):
                        corr += d[b] * xm[r, b]
                    out[dst[p], oe + o] = s - _F8 * corr
    elif fc == FC_Q5_1:   # vnni.gemv_i8_q5_1's arithmetic: the Q8 dot plus the minimum through block sums
        for o in range(c0, c1):
            q = _r_i8(ds, 0, o)
            d = _r_f32(ds, 1, o)
            m = _r_f32(ds, 2, o)
            for p in range(p0, p1):
                r = src[p]
                s = row_q8(q, d, xq[r], xd[r])
                corr = _F0
                for b in range(d.shape[0]):
                    corr += m[b] * xm[r, b]
                out[dst[p], oe + o] = s + corr


@njit(inline="always", **_JIT)
def _i8_q4_q5_k(ds, fc, c0, c1, p0, p1, src, dst, oe, xq, xd, xm, out):
    """``_block_i8`` of Q4_K and Q5_K: the row dot minus the mins through the block sums."""
    for o in range(c0, c1):
        qs = _r_u8(ds, 0, o)
        sc = _r_u8(ds, 1, o)
        mn = _r_u8(ds, 2, o)
        d = _r_f32(ds, 3, o)
        dm = _r_f32(ds, 4, o)
        for p in range(p0, p1):
            r = src[p]
            if fc == FC_Q4_K:
                s = row_q4_k(qs, sc, d, xq[r], xd[r])
            else:
                s = row_q5_k(qs, sc, d, xq[r], xd[r])
            mins = _F0
            for b in range(d.shape[0]):
                mb = _F0
                for k in range(8):
                    mb += np.float32(mn[b * 8 + k]) * xm[r, b * 8 + k]
                mins += dm[b] * mb
            out[dst[p], oe + o] = s - mins


@njit(inline="always", **_JIT)
def _i8_q2_q3_k(ds, fc, c0, c1, p0, p1, src, dst, oe, xq, xd, xm, out):
    """``_block_i8`` of Q2_K and Q3_K, ``vnni.gemv_i8_q2_k`` / ``_q3_k``'s arithmetic: the mins (Q3_K: the -4)
    through the activations' 16-sums."""
    I = ds[2]
    xs = np.empty((p1 - p0, I // 16), np.float32)
    for p in range(p0, p1):
        xs[p - p0] = _act_sums16(xq[src[p]], xd[src[p]])
    for o in range(c0, c1):
        if fc == FC_Q2_K:
            qs = _r_u8(ds, 0, o)
            sc = _r_u8(ds, 1, o)
            mn = _r_u8(ds, 2, o)
            d = _r_f32(ds, 3, o)
            dm = _r_f32(ds, 4, o)
            for p in range(p0, p1):
                r = src[p]
                s = row_q2_k(qs, sc, d, xq[r], xd[r])
                mins = _F0
                for b in range(d.shape[0]):
                    mb = _F0
                    for k in range(16):
                        mb += np.float32(mn[b * 16 + k]) * xs[p - p0, b * 16 + k]
                    mins += dm[b] * mb
                out[dst[p], oe + o] = s - mins
        else:
            qs = _r_u8(ds, 0, o)
            hm = _r_u8(ds, 1, o)
            sc3 = _r_i8(ds, 2, o)
            d = _r_f32(ds, 3, o)
            for p in range(p0, p1):
                r = src[p]
                s = row_q3_k(qs, hm, sc3, d, xq[r], xd[r])
                corr = _F0
                for b in range(d.shape[0]):
                    cb = _F0
                    for k in range(16):
                        cb += np.float32(sc3[b * 16 + k]) * xs[p - p0, b * 16 + k]
                    corr += d[b] * cb
                out[dst[p], oe + o] = s - np.float32(4.0) * corr


@njit(inline="always", **_JIT)
def _i8_fp8(ds, fc, c0, c1, p0, p1, src, dst, oe, xq, xd, xm, out):
    """``_block_i8`` of FP8_E4M3_B128 (FC_FP8): E4M3 codes are not integers, so the decoded row times the
    rounded activations (q * d in f32)."""
    I = ds[2]
    buf = np.empty(I, np.float32)
    for o in range(c0, c1):
        _lowbit_dec(ds, o, buf)
        for p in range(p0, p1):
            r = src[p]
            acc = _F0
            for b in range(I // 32):
                db = xd[r, b]
                for j in range(32):
                    acc += buf[b * 32 + j] * (np.float32(xq[r, b * 32 + j]) * db)
            out[dst[p], oe + o] = acc


@njit(**_JIT)
def _block_i8(ds, c0, c1, p0, p1, src, dst, oe, xq, xd, xm, out):
    """out[dst[p], oe + o] = W[o] . row src[p] for o in c0:c1, p in p0:p1 (int8 activations): the format
    branch taken once per work item, so each inner loop is one format's code (one inlined ``_i8_*`` per layout
    family)."""
    fc = ds[0]
    if fc >= FC_T4_0:
        _i8_tiles(ds, fc, c0, c1, p0, p1, src, dst, oe, xq, xd, xm, out)
    elif fc == FC_Q8 or fc == FC_Q5_0 or fc == FC_LUT or fc == FC_Q6_K or fc == FC_G16:
        _i8_dots(ds, fc, c0, c1, p0, p1, src, dst, oe, xq, xd, xm, out)
    elif fc == FC_Q4_0 or fc == FC_Q4_1 or fc == FC_Q5_1:
        _i8_with_mins(ds, fc, c0, c1, p0, p1, src, dst, oe, xq, xd, xm, out)
    elif fc == FC_Q4_K or fc == FC_Q5_K:
        _i8_q4_q5_k(ds, fc, c0, c1, p0, p1, src, dst, oe, xq, xd, xm, out)
    elif fc == FC_Q2_K or fc == FC_Q3_K:
        _i8_q2_q3_k(ds, fc, c0, c1, p0, p1, src, dst, oe, xq, xd, xm, out)
    else:
        _i8_fp8(ds, fc, c0, c1, p0, p1, src, dst, oe, xq, xd, xm, out)


# ``_block_i8`` behind a C symbol. Every compiled function that calls an @njit function links a copy of the
# callee's LLVM module into its own and optimizes the whole again (numba.core.codegen ``finalize``): ``_block_i8``
# (two 20-way chains of t16 tile intrinsics) cost each of its ~10 callers about half its own compile again (a
# trivial caller took 54 % of the callee's time). Compiled once as a ``cfunc`` (cached) and registered with LLVM's
# symbol table at import, it is a plain external call in its callers, resolved when their (cached) code loads
# (docs/cpu_kernels.md, "Compile time").
_CP = types.CPointer
_BLOCK_SYM = "coli_experts_block_i8"


@numba.cfunc(types.void(_CP(types.int64), types.int64, types.int64, types.int64, types.int64, types.int64,
                        _CP(types.int64), types.int64, _CP(types.int64), types.int64, types.int64,
                        _CP(types.int8), types.int64, types.int64, _CP(types.float32), types.int64, types.int64,
                        _CP(types.float32), types.int64, types.int64, _CP(types.float32), types.int64, types.int64),
             nopython=True, cache=True)
def _block_i8_c(dsp, nds, c0, c1, p0, p1, srcp, nsrc, dstp, ndst, oe, xqp, xqr, xqc, xdp, xdr, xdc, xmp, xmr, xmc,
                outp, outr, outc):
    _block_i8(numba.carray(dsp, (nds,)), c0, c1, p0, p1, numba.carray(srcp, (nsrc,)), numba.carray(dstp, (ndst,)),
              oe, numba.carray(xqp, (xqr, xqc)), numba.carray(xdp, (xdr, xdc)), numba.carray(xmp, (xmr, xmc)),
              numba.carray(outp, (outr, outc)))


_llvm.add_symbol(_BLOCK_SYM, _block_i8_c.address)
#: (argument name, dtype, ndim) of ``block_i8``'s arrays: C-contiguous, as the C symbol rebuilds them
_BLOCK_ARRAYS = {0: ("ds", types.int64, 1), 5: ("src", types.int64, 1), 6: ("dst", types.int64, 1),
                 8: ("xq", types.int8, 2), 9: ("xd", types.float32, 2), 10: ("xm", types.float32, 2),
                 11: ("out", types.float32, 2)}


@intrinsic
def block_i8(typingctx, ds, c0, c1, p0, p1, src, dst, oe, xq, xd, xm, out):
    """``_block_i8(ds, c0, c1, p0, p1, src, dst, oe, xq, xd, xm, out)`` through its C symbol (same arguments:
    ds int64 [13], src/dst int64 [n], xq int8 [R, I], xd/xm f32 [R, I/32], out f32 [*, *], all C-contiguous;
    the integers as int64). A typing error names an argument of another dtype, rank or layout."""
    args = (ds, c0, c1, p0, p1, src, dst, oe, xq, xd, xm, out)
    for i, (name, dt, nd) in _BLOCK_ARRAYS.items():
        a = args[i]
        if not (isinstance(a, types.Array) and a.dtype == dt and a.ndim == nd and a.layout == "C"):
            raise numba.core.errors.TypingError(f"block_i8: {name} must be a C-contiguous {dt} array of {nd} "
                                                f"dimension(s), got {a}")
    for i in (1, 2, 3, 4, 7):
        if not isinstance(args[i], types.Integer):
            raise numba.core.errors.TypingError(f"block_i8: argument {i} must be an integer, got {args[i]}")

    def codegen(context, builder, sig, llargs):
        vals = []
        for i, (ty, v) in enumerate(zip(sig.args, llargs)):
            if i in _BLOCK_ARRAYS:
                a = context.make_array(ty)(context, builder, v)
                vals.append(a.data)
                vals.extend(builder.extract_value(a.shape, k) for k in range(ty.ndim))
            else:
                vals.append(context.cast(builder, v, ty, types.int64))
        fnty = _llir.FunctionType(_llir.VoidType(), [v.type for v in vals])
        builder.call(numba.core.cgutils.get_or_insert_function(builder.module, fnty, _BLOCK_SYM), vals)
        return context.get_dummy_value()

    return types.void(*args), codegen


@njit(inline="always", **_JIT)
def _row_ok(fc):
    """True for the format codes ``_row_i8`` computes (the others take ``_block_i8`` with one row)."""
    return (fc == FC_Q8 or fc == FC_Q5_0 or fc == FC_LUT or fc == FC_Q4_0 or fc == FC_Q4_1 or fc == FC_Q4_K or fc == FC_Q5_K
            or fc == FC_Q6_K)


@njit(inline="always", **_JIT)
def _row_i8(ds, o, r, xq, xd, xm):
    """W[o] . row r of the int8 activations (``_block_i8``'s arithmetic for one (row, row) pair)."""
    fc = ds[0]
    if fc == FC_Q8:
        return row_q8(_r_i8(ds, 0, o), _r_f32(ds, 1, o), xq[r], xd[r])
    if fc == FC_Q5_0:
        return row_q5_0(_r_u8(ds, 0, o), _r_u32(ds, 1, o), _r_f32(ds, 2, o), xq[r], xd[r])
    if fc == FC_LUT:
        return row_lut(_r_u8(ds, 0, o), _r_f32(ds, 1, o), _r_i8(ds, 2, 0), xq[r], xd[r])
    if fc == FC_Q4_0 or fc == FC_Q4_1:
        qs = _r_u8(ds, 0, o)
        d = _r_f32(ds, 1, o)
        m = _r_f32(ds, 2 if fc == FC_Q4_1 else 1, o)
        s = row_pair(qs, d, xq[r], xd[r])
        corr = _F0
        if fc == FC_Q4_1:
            for b in range(d.shape[0]):
                corr += m[b] * xm[r, b]
            return s + corr
        for b in range(d.shape[0]):
            corr += d[b] * xm[r, b]
        return s - _F8 * corr
    if fc == FC_Q4_K or fc == FC_Q5_K:
        qs = _r_u8(ds, 0, o)
        sc = _r_u8(ds, 1, o)
        mn = _r_u8(ds, 2, o)
        d = _r_f32(ds, 3, o)
        dm = _r_f32(ds, 4, o)
        if fc == FC_Q4_K:
            s = row_q4_k(qs, sc, d, xq[r], xd[r])
        else:
            s = row_q5_k(qs, sc, d, xq[r], xd[r])
        mins = _F0
        for b in range(d.shape[0]):
            mb = _F0
            for k in range(8):
                mb += np.float32(mn[b * 8 + k]) * xm[r, b * 8 + k]
            mins += dm[b] * mb
        return s - mins
    if fc == FC_Q6_K:
        return row_q6_k(_r_i8(ds, 0, o), _r_i8(ds, 1, o), _r_f32(ds, 2, o), xq[r], xd[r])
    return np.float32(np.nan)  # a format code without a branch here: loud, never a silent zero


@njit(**_JIT)
def _decode_row(ds, o, buf):
    """Weight row ``o`` decoded to f32 into ``buf`` [I] (ggml's dequantize_row_* in the packed layouts of
    ``formats``; the same formulas as ``formats._dec_*``)."""
    fc = ds[0]
    I = ds[2]
    if fc == FC_F32:
        w = _r_f32(ds, 0, o)
        for i in range(I):
            buf[i] = w[i]
    elif fc == FC_Q8:
        q = _r_i8(ds, 0, o)
        d = _r_f32(ds, 1, o)
        for b in range(I // 32):
            db = d[b]
            for j in range(32):
                buf[b * 32 + j] = db * np.float32(q[b * 32 + j])
    elif fc >= FC_T4_0:
        decode_row(_r_u8(ds, 0, o // 16), fc - FC_T4_0, o % 16, I, buf)
    elif fc == FC_Q5_0 or fc == FC_LUT:   # formats._dec_q5_0 / _dec_lut: the row widened to int8, then d * q
        q = np.empty(I, np.int8)
        if fc == FC_Q5_0:
            widen_q5_0(_r_u8(ds, 0, o), _r_u32(ds, 1, o), q)
            d = _r_f32(ds, 2, o)
        else:
            widen_lut(_r_u8(ds, 0, o), _r_i8(ds, 2, 0), q)
            d = _r_f32(ds, 1, o)
        for b in range(I // 32):
            db = d[b]
            for j in range(32):
                buf[b * 32 + j] = db * np.float32(q[b * 32 + j])
    elif fc == FC_Q4_0 or fc == FC_Q4_1:
        qs = _r_u8(ds, 0, o)
        d = _r_f32(ds, 1, o)
        for b in range(I // 32):
            db = d[b]
            mb = _r_f32(ds, 2, o)[b] if fc == FC_Q4_1 else -_F8 * db
            p = b >> 1
            if b & 1:
                for j in range(32):
                    buf[b * 32 + j] = db * np.float32(qs[p * 32 + j] >> 4) + mb
            else:
                for j in range(32):
                    buf[b * 32 + j] = db * np.float32(qs[p * 32 + j] & 15) + mb
    elif fc == FC_Q4_K:
        qs = _r_u8(ds, 0, o)
        sc = _r_u8(ds, 1, o)
        mn = _r_u8(ds, 2, o)
        d = _r_f32(ds, 3, o)
        dm = _r_f32(ds, 4, o)
        for b in range(I // 256):
            for k in range(4):
                s = b * 8 + 2 * k
                s0 = d[b] * np.float32(sc[s])
                s1 = d[b] * np.float32(sc[s + 1])
                m0 = dm[b] * np.float32(mn[s])
                m1 = dm[b] * np.float32(mn[s + 1])
                q0 = b * 128 + k * 32
                x0 = b * 256 + k * 64
                for j in range(32):
                    buf[x0 + j] = s0 * np.float32(qs[q0 + j] & 15) - m0
                for j in range(32):
                    buf[x0 + 32 + j] = s1 * np.float32(qs[q0 + j] >> 4) - m1
    elif fc == FC_Q5_K:
        q = _r_u8(ds, 0, o)
        sc = _r_u8(ds, 1, o)
        mn = _r_u8(ds, 2, o)
        d = _r_f32(ds, 3, o)
        dm = _r_f32(ds, 4, o)
        for s in range(I // 32):
            b = s >> 3
            s0 = d[b] * np.float32(sc[s])
            m0 = dm[b] * np.float32(mn[s])
            for j in range(32):
                buf[s * 32 + j] = s0 * np.float32(q[s * 32 + j]) - m0
    elif fc == FC_Q6_K:
        q = _r_i8(ds, 0, o)
        sc = _r_i8(ds, 1, o)
        d = _r_f32(ds, 2, o)
        for u in range(I // 16):
            s = d[u >> 4] * np.float32(sc[u])
            for j in range(16):
                buf[u * 16 + j] = s * np.float32(q[u * 16 + j])
    else:
        _lowbit_dec(ds, o, buf)


@njit(inline="always", **_JIT)
def _dot_f32(buf, x):
    s = _F0
    for i in range(x.shape[0]):  # fastmath: LLVM vectorizes the reduction
        s += buf[i] * x[i]
    return s


# fastmath off and no division check in these: the same IEEE operations in every caller, whether a loop of them is
# vectorised (``_act_run``) or not, so every kernel's activation has the same bits
_ACT_JIT = dict(nogil=True, cache=True, fastmath=False, error_model="numpy")


@njit(inline="always", **_ACT_JIT)
def _exp_f32(x):
    """exp(x) for float32 x in [-87, 88] without a library call, so a loop of it vectorises: Cephes ``expf``
    (x = n ln 2 + r, ln 2 in two parts; a degree-7 polynomial for e^r; 2^n from its exponent bits), within 2 ulp
    of exp (tests/kernels/test_experts.py)."""
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - n * np.float32(0.693359375)
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = p * (r * r) + r + np.float32(1.0)
    return y * _f32_bits((np.int32(n) + np.int32(127)) << np.int32(23))


@njit(inline="always", **_ACT_JIT)
def _silu_mul(g, u):
    """silu(g) * u = g / (1 + exp(-g)) * u in float32; 0 * u below g = -80 (silu(g) < 1e-33 there)."""
    z = max(min(-g, np.float32(80.0)), np.float32(-87.0))
    s = g / (np.float32(1.0) + _exp_f32(z)) * u
    return s if g >= np.float32(-80.0) else _F0 * u


@njit(**_ACT_JIT)
def _act(g, u, kind, limit):
    if kind == ACT_SWIGLU_OAI:
        if limit > 0.0:
            g = min(g, limit)
            u = min(max(u, -limit), limit)
        z = np.float32(ALPHA_OAI) * g
        if z < np.float32(-80.0):  # exp(-z) would overflow f32 (fastmath assumes no inf): the gate is ~0 here
            return _F0 * u
        return g / (np.float32(1.0) + math.exp(-z)) * (u + np.float32(1.0))
    if kind == ACT_GEGLU:
        # HF gelu_pytorch_tanh 0.5 g (1 + tanh(z)), z = sqrt(2/pi) (g + 0.044715 g^3), in f32 as g sigmoid(2z)
        # (1 + tanh(z) = 2 / (1 + exp(-2z))); sigmoid(2z) rounds to 1 above g = 10, and below g = -10 the value is
        # under 1e-36 (exp(-2z) would overflow f32 there, and g^3 for huge |g|)
        if g > np.float32(10.0):
            return g * u
        if g < np.float32(-10.0):
            return _F0 * u
        # t = 2z = 2 sqrt(2/pi) g + 2 sqrt(2/pi) 0.044715 g^3
        t = g * (np.float32(1.5957691216057308) + np.float32(0.07135481627260025) * (g * g))
        return g / (np.float32(1.0) + math.exp(-t)) * u
    if limit > 0.0:
        g = min(g, limit)
        u = min(max(u, -limit), limit)
    return _silu_mul(g, u)


@njit(**_ACT_JIT)
def _act_run(gu, n, kind, limit, out):
    """out[o] = act(gu[0, o], gu[1, o]) for o < n (gu f32 [2, >= n], out f32 [>= n]): ``_act``'s bits, the plain
    SwiGLU as one vectorised loop (scalar ``exp`` calls were half of gate/up's extra time, docs/cpu_kernels.md)."""
    if kind == ACT_SWIGLU and not limit > 0.0:
        for o in range(n):
            out[o] = _silu_mul(gu[0, o], gu[1, o])
    else:
        for o in range(n):
            out[o] = _act(gu[0, o], gu[1, o], kind, limit)


# ----------------------------------------------------------------------------------------------- kernels
@njit(inline="always", **_JIT)
def _mm_item(desc, nch, pstart, src, dst, off, mode, xq, xd, xm, x, out, it):
    """Work item ``it`` of :func:`mm_grouped` (weight e's 16-row block ``it - nch[e]``; ``nch`` int64 [n + 1]
    the cumulative block counts): the whole body of its ``prange``, also run by the persistent decode blocks."""
    e = 0
    while nch[e + 1] <= it:
        e += 1
    ds = desc[e]
    O = ds[1]
    c0 = (it - nch[e]) * _RB
    p0 = pstart[e]
    p1 = pstart[e + 1]
    oe = off[e]
    if mode == I8 and ds[0] != FC_F32:
        block_i8(ds, c0, min(O, c0 + _RB), p0, p1, src, dst, oe, xq, xd, xm, out)
    else:
        buf = np.empty(ds[2], np.float32)
        for o in range(c0, min(O, c0 + _RB)):
            _decode_row(ds, o, buf)
            for p in range(p0, p1):
                out[dst[p], oe + o] = _dot_f32(buf, x[src[p]])


@njit(inline="always", **_JIT)
def block_counts(desc, nch):
    """nch[0] = 0, nch[e + 1] = nch[e] + the 16-row blocks of weight e (desc int64 [n, 13]); returns nch[n]."""
    n = desc.shape[0]
    nch[0] = 0
    for e in range(n):
        nch[e + 1] = nch[e] + (desc[e, 1] + _RB - 1) // _RB
    return nch[n]


@njit(**_PJIT)
def mm_grouped(desc, pstart, src, dst, off, mode, xq, xd, xm, x, out):
    """out[dst[p], off[e] + o] = W_e[o] . row src[p], for every weight e (desc int64 [n, 13]), its slots
    p in pstart[e]:pstart[e+1] and o < O_e. Int8 mode reads xq int8 [R, I], xd/xm f32 [R, I/32]; F32 mode
    (and F32 weights) x f32 [R, I]. out f32 [*, *]. One parallel launch over (weight, 16-row block)."""
    nch = np.empty(desc.shape[0] + 1, np.int64)
    for it in prange(block_counts(desc, nch)):
        _mm_item(desc, nch, pstart, src, dst, off, mode, xq, xd, xm, x, out, it)


@njit(inline="always", **_JIT)
def _gate_up_item(gdesc, udesc, pstart, src, mode, xq, xd, xm, x, kind, limit, a, nc, it):
    """Work item ``it`` of :func:`ffn_gate_up` (expert ``it // nc``, its 16-row block ``it % nc``; ``nc`` the
    blocks per expert): the whole body of its ``prange``, also run by the persistent decode blocks."""
    F = gdesc[0, 1]
    e = it // nc
    c0 = (it % nc) * _RB
    gd = gdesc[e]
    ud = udesc[e]
    p0 = pstart[e]
    p1 = pstart[e + 1]
    if mode == I8 and p1 - p0 == 1 and _row_ok(gd[0]) and _row_ok(ud[0]):
        # one row (a decode step's expert): no scratch arrays, gate and up of a row back to back
        r = src[p0]
        for o in range(c0, min(F, c0 + _RB)):
            a[p0, o] = _act(_row_i8(gd, o, r, xq, xd, xm), _row_i8(ud, o, r, xq, xd, xm), kind, limit)
    elif mode == I8 and p1 - p0 == 1 and gd[0] != FC_F32 and ud[0] != FC_F32:
        # one row of tiles (a decode row's dense FFN or expert): the branch below with its scratch on the stack
        c1 = min(F, c0 + _RB)
        gu = _stack_gu()
        i0 = _stack_index(0)
        i1 = _stack_index(1)
        block_i8(gd, c0, c1, _I0, 1, src[p0:p1], i0, -c0, xq, xd, xm, gu)
        block_i8(ud, c0, c1, _I0, 1, src[p0:p1], i1, -c0, xq, xd, xm, gu)
        for o in range(c0, c1):
            a[p0, o] = _act(gu[0, o - c0], gu[1, o - c0], kind, limit)
    elif mode == I8 and gd[0] != FC_F32 and ud[0] != FC_F32:
        c1 = min(F, c0 + _RB)
        n = p1 - p0
        loc = np.arange(n)
        gs = np.empty((n, _RB), np.float32)
        us = np.empty((n, _RB), np.float32)
        block_i8(gd, c0, c1, _I0, n, src[p0:p1], loc, -c0, xq, xd, xm, gs)
        block_i8(ud, c0, c1, _I0, n, src[p0:p1], loc, -c0, xq, xd, xm, us)
        for p in range(n):
            for o in range(c0, c1):
                a[p0 + p, o] = _act(gs[p, o - c0], us[p, o - c0], kind, limit)
    else:
        gb = np.empty(gd[2], np.float32)
        ub = np.empty(ud[2], np.float32)
        for o in range(c0, min(F, c0 + _RB)):
            _decode_row(gd, o, gb)
            _decode_row(ud, o, ub)
            for p in range(p0, p1):
                xr = x[src[p]]
                a[p, o] = _act(_dot_f32(gb, xr), _dot_f32(ub, xr), kind, limit)


@njit(inline="always", **_JIT)
def _gate_up_run(gdesc, udesc, pstart, src, mode, xq, xd, xm, x, kind, limit, a, nc, i0, i1):
    """Work items i0:i1 of :func:`ffn_gate_up` (``_gate_up_item``'s numbering), split at experts into runs of at
    most ``_RUN`` blocks. An expert with one int8 row runs its gate rows of the run, then its up rows, then the
    activation over all of them (``_act_run``); the others item by item. The bits of ``_gate_up_item`` either way:
    switching matrices every 16-row block (9.8 KB of Q8_0) and scalar activations cost gate/up 15-20 % of the rate
    of plain GEMVs (docs/cpu_kernels.md)."""
    F = gdesc[0, 1]
    while i0 < i1:
        e = i0 // nc
        j = min(i1, (e + 1) * nc, i0 + _RUN)
        p0 = pstart[e]
        gd = gdesc[e]
        ud = udesc[e]
        if mode == I8 and pstart[e + 1] - p0 == 1 and j - i0 > 1 and gd[0] != FC_F32 and ud[0] != FC_F32:
            r0 = (i0 - e * nc) * _RB
            r1 = min(F, (j - e * nc) * _RB)
            gu = _stack_gu_run()
            if _row_ok(gd[0]) and _row_ok(ud[0]):
                r = src[p0]
                for o in range(r0, r1):
                    gu[0, o - r0] = _row_i8(gd, o, r, xq, xd, xm)
                for o in range(r0, r1):
                    gu[1, o - r0] = _row_i8(ud, o, r, xq, xd, xm)
            else:
                s0 = _stack_index(0)
                s1 = _stack_index(1)
                for c0 in range(r0, r1, _RB):
                    block_i8(gd, c0, min(r1, c0 + _RB), _I0, 1, src[p0:p0 + 1], s0, -r0, xq, xd, xm, gu)
                for c0 in range(r0, r1, _RB):
                    block_i8(ud, c0, min(r1, c0 + _RB), _I0, 1, src[p0:p0 + 1], s1, -r0, xq, xd, xm, gu)
            _act_run(gu, r1 - r0, kind, limit, a[p0, r0:r1])
        else:
            for it in range(i0, j):
                _gate_up_item(gdesc, udesc, pstart, src, mode, xq, xd, xm, x, kind, limit, a, nc, it)
        i0 = j


@njit(**_PJIT)
def ffn_gate_up(gdesc, udesc, pstart, src, mode, xq, xd, xm, x, kind, limit, a):
    """a[p, o] = act(G_e[o] . row src[p], U_e[o] . row src[p]) for every expert e (gate/up descriptors
    int64 [n, 13], same shapes), its slots p in pstart[e]:pstart[e+1], o < F. ``kind``: ACT_SWIGLU
    (silu(g) * u, clamped when ``limit`` > 0 as formats' swiglu) or ACT_GEGLU. a f32 [P, F]. One parallel
    launch over runs of up to ``_RUN`` 16-row blocks of an expert (``_gate_up_run``), at least 64 runs (4 for
    each of 16 threads) where there are as many blocks."""
    F = gdesc[0, 1]
    nc = (F + _RB - 1) // _RB
    k = max(1, min(_RUN, gdesc.shape[0] * nc // 64))
    nr = (nc + k - 1) // k
    for it in prange(gdesc.shape[0] * nr):
        i0 = (it // nr) * nc + (it % nr) * k
        _gate_up_run(gdesc, udesc, pstart, src, mode, xq, xd, xm, x, kind, limit, a, nc, i0,
                     min(i0 + k, (it // nr + 1) * nc))


@njit(inline="always", **_JIT)
def _tiled_ok(ds, n):
    """True when weight ``ds`` times ``n`` slot rows runs the 4 x 4 int8 tiles (``gemm_i8``): the Q8_0 kernel
    layout or the G = 16 one (``gemm_i8.tiles``), at least 4 rows each side, an even number of 32-blocks per row."""
    fc = ds[0]
    return ((fc == FC_Q8 or fc == FC_G16 or fc == FC_Q5_0 or fc == FC_LUT) and n >= _G.NR and ds[1] >= _G.MR
            and (ds[2] // 32) % 2 == 0)


@njit(inline="always", **_JIT)
def _w_tiles(ds, c0, c1):
    """Rows c0:c1 of weight ``ds`` as the tiles read them: (int8 codes, qs0, f32 scales [O, I/32] (or [O, I/16]
    for G = 16)), codes row o at [o - qs0]. The Q8_0 and G = 16 layouts as stored (qs0 = 0); compact Q5_0 and
    the 4-bit table formats widened into a scratch of the 16 rows (qs0 = c0)."""
    O = ds[1]
    fc = ds[0]
    if fc == FC_Q5_0 or fc == FC_LUT:
        q = np.empty((_RB, ds[2]), np.int8)
        for o in range(c0, c1):
            if fc == FC_Q5_0:
                widen_q5_0(_r_u8(ds, 0, o), _r_u32(ds, 1, o), q[o - c0])
            else:
                widen_lut(_r_u8(ds, 0, o), _r_i8(ds, 2, 0), q[o - c0])
        return q, c0, numba.carray(_pf32(ds[5 if fc == FC_Q5_0 else 4]), (O, ds[10 if fc == FC_Q5_0 else 9]))
    return numba.carray(_pi8(ds[3]), (O, ds[8])), 0, numba.carray(_pf32(ds[4]), (O, ds[9]))


#: formats whose prompt GEMM reads the activation codes + 128 (``Act.u8``): the Q8_0 and Q5_0 t16 tiles
#: (``tile4u_q8_0``) and the row layouts of ``gemm_i8``'s tiles (``_tiled_ok``)
U8_CODES = (FC_T8, FC_T5_0, FC_Q8, FC_G16, FC_Q5_0, FC_LUT)


_REC8 = _tiles.RECORD["Q8_0"]   # bytes of a Q8_0 t16 record (Q5_0's widened tile)


@njit(inline="always", **_JIT)
def _tu(fc):
    """True for the t16 formats whose prompt rows run ``tile4u_q8_0`` (``_tu_rows``): Q8_0, Q5_0."""
    return fc == FC_T8 or fc == FC_T5_0


@njit(inline="always", **_JIT)
def _tu_rows(ds, c0, p0, p1, src, dst, oe, xq, xd, xm, xu, out):
    """out[dst[p], oe + c0 + i] = row c0 + i (i < 16) of the Q8_0 or Q5_0 t16 weight ``ds`` . activation row
    src[p], p in p0:p1: the tile's 128 x code sums made once (``wsum_q8_0``; Q5_0: its records widened to a Q8_0
    tile's with them, ``widen_t16_q5_0``), then 4 rows at a time through ``tile4u_q8_0`` (xu: the codes + 128), the
    last 1-3 through the one-row tile. Bit-identical to ``_i8_tiles``."""
    rec = _r_u8(ds, 0, c0 // 16)
    nb = ds[2] // 32
    ws = np.empty(nb * 16, np.int32)
    if ds[0] == FC_T5_0:
        w8 = np.empty(nb * _REC8, np.uint8)
        widen_t16_q5_0(rec, w8, ws)
    else:
        w8 = rec
        wsum_q8_0(rec, ws)
    p = p0
    while p + 4 <= p1:
        tile4u_q8_0(w8, xu, xd, src[p:p + 4], out, dst[p:p + 4], oe + c0, ws)
        p += 4
    for q in range(p, p1):
        r = src[q]
        if ds[0] == FC_T5_0:
            tile_q5_0(rec, xq[r], xd[r], xm[r], out[dst[q]], oe + c0)
        else:
            tile_q8_0(rec, xq[r], xd[r], xm[r], out[dst[q]], oe + c0)


@njit(**_JIT)
def work_items(nblk, pstart, rb):
    """The (expert, 16-row weight block, block of at most ``rb`` routed rows) work items of a prompt chunk's
    expert GEMM: int64 [n_items, 4] rows (e, c0, p0, p1), expert by expert, for each weight block its row blocks
    in turn (a thread taking consecutive items keeps the weight block in cache). nblk int64 [n]: the 16-row
    blocks of expert e's weight; pstart int64 [n + 1]: its slots (rows) pstart[e]:pstart[e + 1]; rb > 0."""
    n = nblk.shape[0]
    cnt = 0
    for e in range(n):
        cnt += nblk[e] * max(1, (pstart[e + 1] - pstart[e] + rb - 1) // rb)
    items = np.empty((cnt, 4), np.int64)
    k = 0
    for e in range(n):
        for c in range(nblk[e]):
            p = pstart[e]
            while True:
                q = min(pstart[e + 1], p + rb)
                items[k, 0] = e
                items[k, 1] = c * _RB
                items[k, 2] = p
                items[k, 3] = q
                k += 1
                p = q
                if p >= pstart[e + 1]:
                    break
    return items


@njit(**_PJIT)
def mm_grouped_gemm(desc, pstart, items, src, dst, off, xq, xd, xm, xu, out):
    """``mm_grouped`` in I8 mode for prompt chunks: slot p reads row src[p] of xq/xd/xm and of xu = xq + 128 as
    uint8 (which may be empty [0, *] when no weight reads it: ``U8_CODES``): Q8_0 and Q5_0 t16 weights run
    ``tile4u_q8_0``; weights of the Q8_0 row layout with at least 4 slots the 4 x 4 int8 tiles of ``gemm_i8`` (the
    16-row weight block stays in L1 across the slot tiles; they read slot p as row p: src must be 0, 1, ... where a
    weight takes them); the others the row kernels. out[dst[p], off[e] + o]; one parallel launch over the
    ``work_items`` (e, c0, p0, p1)."""
    ident = src
    hu = xu.shape[0] > 0
    for it in prange(items.shape[0]):
        e = items[it, 0]
        c0 = items[it, 1]
        p0 = items[it, 2]
        p1 = items[it, 3]
        ds = desc[e]
        c1 = min(ds[1], c0 + _RB)
        if hu and _tu(ds[0]):
            _tu_rows(ds, c0, p0, p1, ident, dst, off[e], xq, xd, xm, xu, out)
        elif hu and _tiled_ok(ds, pstart[e + 1] - pstart[e]) and c1 - c0 >= _G.MR:
            # (a row block of fewer than 4 rows: its tile starts up to 3 rows back in the expert's, as its last)
            wq, qs0, wd = _w_tiles(ds, c0, c1)
            _G.tiles(wq, wd, c0, c1, xu, xd, p0, p1, out, dst, off[e], ds[0] == FC_G16, qs0)
        else:
            block_i8(ds, c0, c1, p0, p1, ident, dst, off[e], xq, xd, xm, out)


@njit(**_PJIT)
def ffn_gate_up_gemm(gdesc, udesc, pstart, items, src, xq, xd, xm, xu, kind, limit, gb, ub, a):
    """``ffn_gate_up`` in I8 mode for prompt chunks: slot p reads activation row src[p] of xq/xd/xm and xu (the
    codes + 128, or empty [0, *] when no weight reads it: ``U8_CODES``). Q8_0 and Q5_0 t16 experts run
    ``tile4u_q8_0``, other t16 formats their ``tile4``, Q8_0-row-layout experts with at least 4 slots the int8
    tiles of ``gemm_i8`` (they read slot rows in order: the caller gathers the rows and passes src = 0, 1, ...),
    the others the row kernels; each work item (``work_items``: e, c0, p0, p1) then applies the activation to its
    own block. The row layouts' tiles write gate and up into gb/ub f32 [P, F] (may be [0, 0] when no expert takes
    them), the others into a scratch of the item's. a f32 [P, F]."""
    F = gdesc[0, 1]
    P = a.shape[0]
    ident = np.arange(P)
    hu = xu.shape[0] > 0
    for it in prange(items.shape[0]):
        e = items[it, 0]
        c0 = items[it, 1]
        p0 = items[it, 2]
        p1 = items[it, 3]
        c1 = min(F, c0 + _RB)
        gd = gdesc[e]
        ud = udesc[e]
        ne = pstart[e + 1] - pstart[e]
        if hu and _tiled_ok(gd, ne) and _tiled_ok(ud, ne) and c1 - c0 >= _G.MR:
            gq, gs0, gw = _w_tiles(gd, c0, c1)
            _G.tiles(gq, gw, c0, c1, xu, xd, p0, p1, gb, ident, 0, gd[0] == FC_G16, gs0)
            uq, us0, uw = _w_tiles(ud, c0, c1)
            _G.tiles(uq, uw, c0, c1, xu, xd, p0, p1, ub, ident, 0, ud[0] == FC_G16, us0)
        elif ne == 1 and _row_ok(gd[0]) and _row_ok(ud[0]):  # ffn_gate_up's one-row code: an expert's bits never depend on the launch
            r = src[p0]
            for o in range(c0, c1):
                a[p0, o] = _act(_row_i8(gd, o, r, xq, xd, xm), _row_i8(ud, o, r, xq, xd, xm), kind, limit)
            continue
        else:   # t16 and the row kernels: the item's gate and up outputs in a scratch of its own (in cache)
            n = p1 - p0
            loc = np.arange(n)
            sp = src[p0:p1]
            gs = np.empty((n, _RB), np.float32)
            us = np.empty((n, _RB), np.float32)
            if hu and _tu(gd[0]):
                _tu_rows(gd, c0, _I0, n, sp, loc, -c0, xq, xd, xm, xu, gs)
            else:
                block_i8(gd, c0, c1, _I0, n, sp, loc, -c0, xq, xd, xm, gs)
            if hu and _tu(ud[0]):
                _tu_rows(ud, c0, _I0, n, sp, loc, -c0, xq, xd, xm, xu, us)
            else:
                block_i8(ud, c0, c1, _I0, n, sp, loc, -c0, xq, xd, xm, us)
            for p in range(n):
                for o in range(c0, c1):
                    a[p0 + p, o] = _act(gs[p, o - c0], us[p, o - c0], kind, limit)
            continue
        for p in range(p0, p1):
            for o in range(c0, c1):
                a[p, o] = _act(gb[p, o], ub[p, o], kind, limit)


# fastmath=False spelled out: the decode regions (fastmath) call it, and Numba compiles a function that does not set
# it with the flags of its first caller (a NaN row then raised ZeroDivisionError when a region compiled it first)
@njit(nogil=True, cache=True, fastmath=False)
def _rms_norm_q8(h, w, eps, out, xq, xd, xm):
    """RMSNorm (norms._rms_norm's arithmetic: the sum in float64) and the int8 quantization of its output
    (formats._quantize_act_i8's arithmetic) in one serial pass per row: h f32 [T, D] -> out f32 [T, D], xq int8
    [T, D], xd/xm f32 [T, D/32]. No fastmath: the codes are bit-equal to the two separate kernels."""
    T, D = h.shape
    for r in range(T):
        s = 0.0
        for i in range(D):
            v = np.float64(h[r, i])
            s += v * v
        inv = 1.0 / math.sqrt(s / D + eps)
        for i in range(D):
            out[r, i] = np.float32(h[r, i] * inv) * w[i]
    _F._quantize_act_i8(out, xq, xd, xm)


@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _quantize_rows_par(x, xq, xd, xm):
    """``formats._quantize_act_i8`` with the rows in parallel (the same per-row arithmetic, bit for bit)."""
    for t in prange(x.shape[0]):
        _F._quantize_act_i8(x[t:t + 1], xq[t:t + 1], xd[t:t + 1], xm[t:t + 1])


#: activation values from which ``quantize_rows`` runs its rows in parallel (a prompt chunk's hidden activations:
#: serial, they were ~10 % of a demo-MoE prompt chunk on 2 cores)
QUANTIZE_PAR_MIN = 1 << 16


def quantize_rows(x: np.ndarray):
    """x f32 [R, I] -> (xq int8 [R, I], xd f32 [R, I/32], xm f32 [R, I/32]) (``formats._quantize_act_i8``; rows in
    parallel from QUANTIZE_PAR_MIN values)."""
    R, I = x.shape
    xq = np.empty((R, I), np.int8)
    xd = np.empty((R, I // 32), np.float32)
    xm = np.empty_like(xd)
    (_quantize_rows_par if R > 1 and R * I >= QUANTIZE_PAR_MIN else _F._quantize_act_i8)(x, xq, xd, xm)
    return xq, xd, xm


_EMPTY_Q = (np.zeros((1, 32), np.int8), np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32))
_EMPTY_X = np.zeros((1, 32), np.float32)
_EMPTY_P = np.zeros((0, 0), np.int8)
_EMPTY_PS = np.zeros((0, 0), np.float32)


class Act:
    """One activation batch ready for the grouped kernels: ``mode`` I8 (codes quantized once) or F32.

    ``x`` f32 [R, I]; ``act`` "int8" | "f32". With "int8" on a CPU without VNNI the rows are rounded as
    llama.cpp's Q8 blocks and run in F32 mode (``formats.matmul``'s fallback)."""

    __slots__ = ("mode", "xq", "xd", "xm", "x", "xu")

    def __init__(self, x: np.ndarray, act: str, u8: bool = False):
        """``u8``: in I8 mode also make the codes + 128 (``u8``) in the quantization's parallel pass
        (``gemm_i8.prep_act``: the same codes, bit for bit)."""
        self.xu = None
        if act == "int8" and HAVE_VNNI:
            self.mode = I8
            self.x = x  # F32 weights read the f32 rows
            if u8 and x.shape[0] > 1:
                R, I = x.shape
                self.xq = np.empty((R, I), np.int8)
                self.xd = np.empty((R, I // 32), np.float32)
                self.xm = np.empty((R, I // 32), np.float32)
                self.xu = np.empty((R, I), np.uint8)
                _G.prep_act(x, self.xq, self.xd, self.xm, self.xu, _EMPTY_P, _EMPTY_PS, True, False)
            else:
                self.xq, self.xd, self.xm = quantize_rows(x)
            return
        else:
            if act == "int8":
                xr = np.empty_like(x)
                _F._round_act_int8(x, xr)
                x = xr
            self.mode = F32
            self.xq, self.xd, self.xm = _EMPTY_Q
            self.x = x

    def u8(self) -> np.ndarray:
        """uint8 [R, I]: the I8 codes + 128 (``xq ^ 0x80``, what ``tile4u_q8_0`` and ``gemm_i8``'s tiles read),
        made on first use and kept."""
        if self.xu is None:
            self.xu = _G.act_u8(self.xq)
        return self.xu

    @staticmethod
    def rms_norm(h: np.ndarray, w: np.ndarray, eps: float, act: str):
        """(x, Act of x) with x = RMSNorm(h) * w (``norms.rms_norm``'s arithmetic), the norm and the int8
        quantization in one serial kernel (a decode row: no parallel launch, one dispatch)."""
        if not (act == "int8" and HAVE_VNNI):
            from .norms import rms_norm

            x = rms_norm(h, w, eps)
            return x, Act(x, act)
        T, D = h.shape
        a = Act.__new__(Act)
        a.mode = I8
        a.xu = None
        a.x = np.empty((T, D), np.float32)
        a.xq = np.empty((T, D), np.int8)
        a.xd = np.empty((T, D // 32), np.float32)
        a.xm = np.empty((T, D // 32), np.float32)
        _rms_norm_q8(h, w, eps, a.x, a.xq, a.xd, a.xm)
        return a.x, a


_SLOTS: dict = {}


def _slots(n_w: int, T: int):
    """(pstart, rows) for ``n_w`` weights that each read rows 0..T-1 (cached: built once per shape)."""
    key = (n_w, T)
    r = _SLOTS.get(key)
    if r is None:
        pstart = np.arange(n_w + 1, dtype=np.int64) * T  # (T = 0: all zero; arange's step may not be 0)
        r = _SLOTS[key] = (pstart, np.tile(np.arange(T, dtype=np.int64), n_w))
    return r


class Group:
    """Weights with the same input size run as one grouped matmul (q/k/v of a layer); the descriptor table and
    the output offsets are built once. Holds the Weights (their arrays back the descriptors)."""

    def __init__(self, weights):
        self.weights = list(weights)
        self.desc = np.stack([w.desc for w in self.weights])
        self.off = np.zeros(len(self.weights), np.int64)
        self.off[1:] = np.cumsum(self.desc[:-1, 1])
        self.O = int(self.desc[:, 1].sum())
        # every weight t16: prompt rows can take the experts' GEMM kernel (``mm_grouped_gemm``), whose row-layout
        # tiles would read slots as rows; u8: whether it reads the codes + 128
        self.tiled = bool((self.desc[:, 0] >= FC_T4_0).all())
        self.u8 = _reads_u8(self.desc)

    def __call__(self, act: Act, out: np.ndarray | None = None) -> np.ndarray:
        """f32 [T, sum O]: the weights' outputs side by side (``out[:, off[i]:off[i] + O_i]``). Int8 rows of t16
        weights, at least GEMM_MIN_ROWS of them: ``mm_grouped_gemm`` (Q8_0 and Q5_0 through ``tile4u_q8_0``,
        work items of up to GEMM_ROW_BLOCK rows, dynamic chunks; the same bits as ``mm_grouped``)."""
        T = act.x.shape[0]
        if out is None:
            out = np.empty((T, self.O), np.float32)
        pstart, t = _slots(len(self.weights), T)
        if act.mode == I8 and self.tiled and T >= GEMM_MIN_ROWS:
            items = _items(self.desc, pstart)
            with numba.parallel_chunksize(dynamic_chunk(len(items))):
                mm_grouped_gemm(self.desc, pstart, items, t, t, self.off, act.xq, act.xd, act.xm,
                                act.u8() if self.u8 else _EMPTY_U, out)
            return out
        mm_grouped(self.desc, pstart, t, t, self.off, act.mode, act.xq, act.xd, act.xm, act.x, out)
        return out


def matmul_many(weights, act: Act, out: np.ndarray | None = None) -> np.ndarray:
    """Every weight of ``weights`` (same I) times all rows of ``act`` in one launch: f32 [T, sum O] with the
    weights' outputs side by side (q/k/v: ``out[:, :Oq]``, ``out[:, Oq:Oq+Ok]``, ...)."""
    return Group(weights)(act, out)


class FFN:
    """A gated FFN ``down(act(gate x, up x))`` (SwiGLU or tanh-GELU) in two launches; tables built once."""

    def __init__(self, gate, up, down, kind: int, limit: float, act_mode: str):
        self.weights = (gate, up, down)
        self.gd = gate.desc.reshape(1, -1)
        self.ud = up.desc.reshape(1, -1)
        self.dd = down.desc.reshape(1, -1)
        self.F = gate.shape[0]
        self.D = down.shape[0]
        self.kind = kind
        self.limit = np.float32(limit)
        self.act_mode = act_mode
        self.tiled = all(w.desc[0] >= FC_T4_0 for w in self.weights)   # (see ``Group.tiled``)

    def __call__(self, act: Act, act_mode: str | None = None) -> np.ndarray:
        """``act``: the input rows (T of them); ``act_mode``: "int8" | "f32" for the hidden activation (default:
        the one given at construction). Returns f32 [T, D]. Int8 rows of t16 weights, at least GEMM_MIN_ROWS of
        them: the experts' GEMM kernels (``_experts_gemm`` with one expert; the same bits)."""
        T = act.x.shape[0]
        pstart, t = _slots(1, T)
        if act.mode == I8 and self.tiled and T >= GEMM_MIN_ROWS:
            a = np.empty((T, self.F), np.float32)
            y = np.empty((T, self.D), np.float32)
            _experts_gemm(self.gd, self.ud, self.dd, pstart, t, t, act, a, y, self.kind, self.limit,
                          act_mode or self.act_mode)
            return y
        a = np.empty((T, self.F), np.float32)
        ffn_gate_up(self.gd, self.ud, pstart, t, act.mode, act.xq, act.xd, act.xm, act.x, self.kind, self.limit, a)
        aa = Act(a, act_mode or self.act_mode)
        y = np.empty((T, self.D), np.float32)
        mm_grouped(self.dd, pstart, t, t, _ZERO1, aa.mode, aa.xq, aa.xd, aa.xm, aa.x, y)
        return y


def ffn(gate, up, down, act: Act, kind: int, limit: float, act_mode: str) -> np.ndarray:
    """A dense FFN ``down(act(gate x, up x))`` on all rows of ``act`` in two launches (f32 [T, D])."""
    return FFN(gate, up, down, kind, limit, act_mode)(act)


_ZERO1 = np.zeros(1, np.int64)


def experts(ws, groups, act: Act, pair_out: np.ndarray, kind: int, limit: float, act_mode: str) -> None:
    """The CPU experts of a MoE step in two launches (gate+up+activation for all, then all down rows).

    ``ws``: objects with ``.gate``, ``.up``, ``.down`` Weights (the RAM cache's ExpertWeights), any formats with a
    code; ``groups``: per expert, in the same order, ``(rows, pairs)`` int arrays: the rows of ``act`` it reads and
    the pair ids (r*K + k) it writes; ``act``: the step's input rows (quantized once); ``pair_out`` f32 [R*K, D]:
    row ``pairs[i]`` receives the expert's output for ``rows[i]``. ``kind``/``limit``: the activation (ACT_SWIGLU
    with its clamp, 0 = none); ``act_mode``: "int8" | "f32" for the hidden activation."""
    n = len(ws)
    sizes = [len(g[0]) for g in groups]
    pstart = np.array([0, *itertools.accumulate(sizes)], np.int64)
    if n == 1:
        src = np.asarray(groups[0][0], np.int64)
        dst = np.asarray(groups[0][1], np.int64)
        d3 = expert_desc(ws[0])[:, None]
    else:
        src = np.concatenate([g[0] for g in groups]).astype(np.int64, copy=False)
        dst = np.concatenate([g[1] for g in groups]).astype(np.int64, copy=False)
        d3 = np.stack([expert_desc(w) for w in ws], axis=1)  # [3, n, 13]: gate, up, down tables
    gd, ud, dd = d3[0], d3[1], d3[2]
    P = int(pstart[-1])
    a = np.empty((P, int(gd[0, 1])), np.float32)
    if act.mode == I8 and max(sizes) >= GEMM_MIN_ROWS and not (d3[:, :, 0] == FC_F32).any():
        # (float experts have no int8 codes: they keep ffn_gate_up's decode path on the f32 rows)
        _experts_gemm(gd, ud, dd, pstart, src, dst, act, a, pair_out, kind, limit, act_mode)
        return
    ffn_gate_up(gd, ud, pstart, src, act.mode, act.xq, act.xd, act.xm, act.x, kind, np.float32(limit), a)
    aa = Act(a, act_mode)
    slots = np.arange(P, dtype=np.int64)
    mm_grouped(dd, pstart, slots, dst, np.zeros(n, np.int64), aa.mode, aa.xq, aa.xd, aa.xm, aa.x, pair_out)


#: An expert with at least this many rows in a step runs the blocked int8 GEMM tiles (``gemm_i8``) when the step
#: is in I8 mode (prompt chunks; a decode step's experts have one row each and keep the row kernels).
GEMM_MIN_ROWS = _G.NR


#: work chunks per thread of a prompt chunk's expert kernels (``dynamic_chunk``)
CHUNKS_PER_THREAD = 16


def dynamic_chunk(items: int) -> int:
    """Iterations per chunk for a ``prange`` over ``items`` work items of unequal cost (an expert's 16-row blocks
    cost its routed rows): about ``CHUNKS_PER_THREAD`` chunks a thread, which the threading layer hands out as
    threads finish (``numba.parallel_chunksize``; without it Numba splits the range into one equal share per
    thread, and a prompt's routing left the busiest of 16 threads 1.3-1.6x the mean: docs/cpu_kernels.md
    "Prompt experts: dynamic chunks"). The items' results do not depend on the thread that runs them."""
    return max(1, items // (CHUNKS_PER_THREAD * numba.get_num_threads()))


#: routed rows per work item of a prompt chunk's expert GEMM (``work_items``): an expert with more rows is split
#: into blocks of this many as well as into 16-row weight blocks, so a chunk routed to few experts still has work
#: for every thread, and one busy expert is not one long item (a multiple of 4: ``tile4``'s rows)
GEMM_ROW_BLOCK = 64

_EMPTY_U = np.zeros((0, 64), np.uint8)
_EMPTY_F = np.zeros((0, 0), np.float32)


def _reads_u8(*descs) -> bool:
    """True when a weight of these descriptor tables reads the activation codes + 128 (``U8_CODES``)."""
    return any(bool(np.isin(d[:, 0], U8_CODES).any()) for d in descs)


def _items(desc, pstart):
    nblk = (desc[:, 1] + _RB - 1) // _RB
    return work_items(nblk, pstart, np.int64(GEMM_ROW_BLOCK))


def _experts_gemm(gd, ud, dd, pstart, src, dst, act, a, pair_out, kind, limit, act_mode):
    """``experts`` for prompt chunks in I8 mode: ``ffn_gate_up_gemm`` and ``mm_grouped_gemm`` over the
    ``work_items`` (expert, 16-row weight block, up to GEMM_ROW_BLOCK rows), in chunks handed out dynamically
    (``dynamic_chunk``). t16 experts read the step's rows in place (``src``); the row layouts' tiles read them
    gathered into slot order. The codes + 128 (``Act.u8``) are made only where a weight reads them: once per
    step's rows for gate/up, in the hidden activations' quantization pass for down."""
    if ((gd[:, 0] >= FC_T4_0) & (ud[:, 0] >= FC_T4_0)).all():
        xq, xd, xm, s = act.xq, act.xd, act.xm, src
        xu = act.u8() if _reads_u8(gd, ud) else _EMPTY_U
    else:
        xq, xd, xm = act.xq[src], act.xd[src], act.xm[src]
        xu = _G.act_u8(xq) if _reads_u8(gd, ud) else _EMPTY_U
        s = np.arange(len(src), dtype=np.int64)
    gb = ub = _EMPTY_F   # (the row layouts' tiles write gate and up there)
    if xu.shape[0] and not ((gd[:, 0] >= FC_T4_0) & (ud[:, 0] >= FC_T4_0)).all():
        gb = np.empty_like(a)
        ub = np.empty_like(a)
    items = _items(gd, pstart)
    with numba.parallel_chunksize(dynamic_chunk(len(items))):
        ffn_gate_up_gemm(gd, ud, pstart, items, s, xq, xd, xm, xu, kind, np.float32(limit), gb, ub, a)
    aa = Act(a, act_mode, u8=_reads_u8(dd))
    off = np.zeros(len(dd), np.int64)
    if aa.mode == I8:
        items = _items(dd, pstart)
        with numba.parallel_chunksize(dynamic_chunk(len(items))):
            mm_grouped_gemm(dd, pstart, items, np.arange(a.shape[0], dtype=np.int64), dst, off, aa.xq, aa.xd,
                            aa.xm, aa.u8() if _reads_u8(dd) else _EMPTY_U, pair_out)
    else:
        slots = np.arange(a.shape[0], dtype=np.int64)
        with numba.parallel_chunksize(dynamic_chunk(len(dd) * ((int(dd[0, 1]) + _RB - 1) // _RB))):
            mm_grouped(dd, pstart, slots, dst, off, aa.mode, aa.xq, aa.xd, aa.xm, aa.x, pair_out)


# ----------------------------------------------------------------------------------------------- rank-order sum
@njit(inline="always", nogil=True, cache=True)
def _combine_row(po, w, y, r):
    K, D = po.shape[1], po.shape[2]
    w0 = w[r, 0]
    for d in range(D):
        y[r, d] = po[r, 0, d] * w0
    for k in range(1, K):
        wk = w[r, k]
        for d in range(D):
            y[r, d] = y[r, d] + po[r, k, d] * wk


@njit(nogil=True, cache=True, fastmath=False)   # the decode regions call it: flags spelled out (_rms_norm_q8)
def combine_rows(po, w, y):
    """The MoE step's rank-order sum (invariant 1): y[r] = po[r, 0] * w[r, 0] + po[r, 1] * w[r, 1] + ... left to
    right, f32 (no fastmath: no FMA contraction, the same roundings as the NumPy expression). po f32 [R, K, D],
    w f32 [R, K], y f32 [R, D]."""
    for r in range(po.shape[0]):
        _combine_row(po, w, y, r)


@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def combine_rows_par(po, w, y):
    """``combine_rows`` with the rows in parallel (the same per-row arithmetic)."""
    for r in prange(po.shape[0]):
        _combine_row(po, w, y, r)


# ----------------------------------------------------------------------------------------------- biased experts
class ExpertFFN:
    """How one MoE layer's experts compute, beyond the default SwiGLU: the activation ``kind`` (ACT_*), its
    clamp ``limit`` (0 = none) and optional per-expert biases (gpt-oss: ``ffn_{gate,up,down}_exps.bias``,
    f32 [E, F], [E, F], [E, D]; added to ``gate x``, ``up x`` before the activation and to ``down a`` after it,
    as transformers' ``GptOssExperts.forward``). ``None`` biases are zero. Raises ValueError on a shape
    mismatch between the three."""

    __slots__ = ("kind", "limit", "gate_bias", "up_bias", "down_bias")

    def __init__(self, kind: int = ACT_SWIGLU, limit: float = 0.0, gate_bias=None, up_bias=None, down_bias=None):
        self.kind = int(kind)
        self.limit = float(limit)
        bs = [None if b is None else np.ascontiguousarray(b, dtype=np.float32) for b in (gate_bias, up_bias, down_bias)]
        if any(b is not None for b in bs):
            if any(b is None or b.ndim != 2 for b in bs):
                raise ValueError("ExpertFFN: gate, up and down biases come together, each f32 [E, n]")
            if bs[0].shape != bs[1].shape or bs[0].shape[0] != bs[2].shape[0]:
                raise ValueError(f"ExpertFFN: bias shapes {[list(b.shape) for b in bs]} do not match "
                                 "(gate [E, F], up [E, F], down [E, D])")
        self.gate_bias, self.up_bias, self.down_bias = bs

    @property
    def has_bias(self) -> bool:
        return self.gate_bias is not None

    def act_np(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        """The activation on f32 [N, F] gate/up outputs (biases already added), the kernels' arithmetic."""
        out = np.empty_like(g)
        _act_rows(g, u, self.kind, np.float32(self.limit), out)
        return out


@njit(**_JIT)
def _act_rows(g, u, kind, limit, out):
    for p in range(g.shape[0]):
        for o in range(g.shape[1]):
            out[p, o] = _act(g[p, o], u[p, o], kind, limit)


@njit(**_JIT)
def _bias_act(gu, F, pexp, gb, ub, kind, limit, a):
    """a[p, o] = act(gu[p, o] + gb[pexp[p], o], gu[p, F + o] + ub[pexp[p], o]): serial (decode-sized)."""
    for p in range(a.shape[0]):
        e = pexp[p]
        for o in range(F):
            a[p, o] = _act(gu[p, o] + gb[e, o], gu[p, F + o] + ub[e, o], kind, limit)


@njit(**_PJIT)
def _bias_act_par(gu, F, pexp, gb, ub, kind, limit, a):
    for p in prange(a.shape[0]):
        e = pexp[p]
        for o in range(F):
            a[p, o] = _act(gu[p, o] + gb[e, o], gu[p, F + o] + ub[e, o], kind, limit)


#: slots x F up to which the bias + activation pass runs serially (a parallel launch costs ~10 us)
SERIAL_ACT = 1 << 14


def experts_ffn(ws, eids, groups, act: Act, pair_out: np.ndarray, ffn: ExpertFFN, act_mode: str) -> None:
    """``experts`` for a layer with an ``ExpertFFN``: its activation kind and clamp, and its biases when it has
    them (``eids``: the expert id of each entry of ``ws``, indexing the bias rows). Without biases this is
    ``experts`` (two launches). With biases: gate and up of every expert in one grouped launch (f32 [P, 2F]),
    bias + activation in one pass, the down rows in one launch, then the down bias added to each pair's row
    (the same order of operations as transformers' ``GptOssExperts``: ``(a @ down) + b``)."""
    if not ffn.has_bias:
        experts(ws, groups, act, pair_out, ffn.kind, ffn.limit, act_mode)
        return
    n = len(ws)
    sizes = np.array([len(g[0]) for g in groups], np.int64)
    pstart = np.zeros(n + 1, np.int64)
    np.cumsum(sizes, out=pstart[1:])
    P = int(pstart[-1])
    src = np.concatenate([g[0] for g in groups]).astype(np.int64, copy=False)
    dst = np.concatenate([g[1] for g in groups]).astype(np.int64, copy=False)
    pexp = np.repeat(np.asarray(eids, np.int64), sizes)
    F = int(ws[0].gate.shape[0])
    # gate e (table row e) and up e (row n + e) read the same rows; slot p of up e is P + p, writing row p
    gud = np.concatenate([np.stack([w.gate.desc for w in ws]), np.stack([w.up.desc for w in ws])])
    gps = np.concatenate([pstart[:-1], P + pstart])
    slots = np.arange(P, dtype=np.int64)
    gu = np.empty((P, 2 * F), np.float32)
    off = np.repeat(np.array([0, F], np.int64), n)
    mm_grouped(gud, gps, np.concatenate([src, src]), np.concatenate([slots, slots]), off, act.mode,
               act.xq, act.xd, act.xm, act.x, gu)
    a = np.empty((P, F), np.float32)
    (_bias_act if P * F <= SERIAL_ACT else _bias_act_par)(gu, F, pexp, ffn.gate_bias, ffn.up_bias, ffn.kind,
                                                          np.float32(ffn.limit), a)
    aa = Act(a, act_mode)
    dd = np.stack([w.down.desc for w in ws])
    mm_grouped(dd, pstart, slots, dst, np.zeros(n, np.int64), aa.mode, aa.xq, aa.xd, aa.xm, aa.x, pair_out)
    pair_out[dst] += ffn.down_bias[pexp]
