"""Work claiming for a persistent parallel region (docs/cpu_kernels.md, "One launch per layer").

A compiled decode block runs its phases (norm, the q/k/v GEMV, RoPE, attention, ...) inside ONE ``prange`` over
the threads instead of one parallel launch per phase. Threads do not own fixed shares: each phase has a counter
pair in an int64 array ``ctr`` (``ctr[STRIDE p]`` claimed work items, ``ctr[STRIDE p + STRIDE / 2]`` finished
ones, on cache lines of their own: ``counters(n_phases)``). A thread claims runs of items (``chunk``) with an
atomic add until they run out, then waits until every item of the phase is finished before it goes on. A thread waits only for items that a running thread has claimed, so the region cannot deadlock whatever the
threading layer does with the ``prange`` iterations (TBB may run two of them one after the other on one thread:
the first then does all the work and the second finds it done). The wait spins with ``pause`` for ``SPIN``
rounds, then yields the core (``sched_yield``) so a thread that shares its core with the one it waits for lets it
run (a spinning pool collapses on a shared core: docs/cpu_kernels.md "Threading").

Memory order: the add is sequentially consistent and the wait's load an acquire, so what a thread wrote before it
finished an item is visible to every thread that saw the item finished (C++ ``std::atomic`` semantics, which
LLVM's ``atomicrmw``/``load atomic`` implement).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

#: ``pause`` rounds of a wait before it starts yielding the core (~50-150 cycles each)
SPIN = 4096
#: int64 slots per phase in ``ctr``: the claimed and the finished counter 64 bytes apart (no shared cache line)
STRIDE = 16


def counters(n_phases: int) -> np.ndarray:
    """The zeroed counter array of a region of ``n_phases`` phases: int64 [STRIDE * n_phases]."""
    return np.zeros(STRIDE * n_phases, np.int64)


def _slot(context, builder, aryty, ary, idx):
    a = context.make_array(aryty)(context, builder, ary)
    return cgutils.get_item_pointer(context, builder, aryty, a, [idx])


@intrinsic
def atomic_add(typingctx, arr, idx, val):
    """``old = arr[idx]; arr[idx] += val`` atomically (seq_cst) on an int64 1-D array; returns ``old``."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1):
        return None
    sig = types.int64(arr, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        ptr = _slot(context, builder, signature.args[0], args[0], args[1])
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")

    return sig, codegen


@intrinsic
def atomic_load(typingctx, arr, idx):
    """``arr[idx]`` read with acquire order (int64 1-D array)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1):
        return None
    sig = types.int64(arr, types.intp)

    def codegen(context, builder, signature, args):
        ptr = _slot(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def pause(typingctx):
    """The x86 ``pause`` instruction (a spin-wait hint)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                            "llvm.x86.sse2.pause")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def sched_yield(typingctx):
    """libc ``sched_yield()``: give the core to another runnable thread."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@njit(inline="always", nogil=True, cache=True)
def claim(ctr, ph, k):
    """The first of the next ``k`` work items of phase ``ph`` (0, k, 2k, ...; at or past the phase's count when
    none is left)."""
    return atomic_add(ctr, STRIDE * ph, k)


@njit(inline="always", nogil=True, cache=True)
def finish(ctr, ph, k):
    """Mark ``k`` claimed items of phase ``ph`` done (after their results are written)."""
    atomic_add(ctr, STRIDE * ph + STRIDE // 2, k)


@njit(inline="always", nogil=True, cache=True)
def chunk(n, nt):
    """Items per claim for ``n`` items on ``nt`` threads: about four claims per thread (few atomic adds on a
    shared cache line, still balanced when a thread arrives late)."""
    return max(1, n // (4 * nt))


@njit(inline="always", nogil=True, cache=True)
def wait(ctr, ph, n):
    """Return when all ``n`` items of phase ``ph`` are finished (spin, then yield: module docstring)."""
    k = 0
    while atomic_load(ctr, STRIDE * ph + STRIDE // 2) < n:
        if k < SPIN:
            pause()
            k += 1
        else:
            sched_yield()


@njit(inline="always", nogil=True, cache=True)
def serial(ctr, ph):
    """True for the one thread that runs the single item of phase ``ph`` (it calls ``finish(ctr, ph, 1)``)."""
    return atomic_add(ctr, STRIDE * ph, 1) == 0


@njit(inline="always", nogil=True, cache=True)
def reset(ctr):
    """Zero the counters before the region starts (serial, outside the ``prange``)."""
    for i in range(ctr.shape[0]):
        ctr[i] = 0
