"""Batches and submits: per-batch frames (scratch buffers, descriptor sets, command buffers, a fence, a timestamp
pool), the batch plan and its group table, the recorded command buffer of an expert step or a plain matmul, the
submit, and ``Batch.join`` (fence wait, results, device time) (docs/vulkan.md "Host overhead", "Fence wait").

An expert step is ONE command buffer: per format signature, gate+up+SwiGLU (GEMV for groups of
< ``COLI_VK_TIER_GEMM_ROWS`` rows, tiled GEMM from there), a barrier, then down; timestamps around it;
submitted with a fence and not waited for. ``Batch.join`` waits.
"""
from __future__ import annotations

import struct
import time

import numpy as np

from .binding import (
    _ACC_HOST_READ,
    _ACC_SHADER_READ,
    _ACC_SHADER_WRITE,
    _MEM_DEVICE_LOCAL,
    _NOT_READY,
    _PSTAGE_BOTTOM,
    _PSTAGE_COMPUTE,
    _PSTAGE_HOST,
    _PSTAGE_TOP,
    _STAGE_COMPUTE,
    _TIMEOUT,
    _USAGE_ADDRESS,
    _USAGE_STORAGE,
    _USAGE_XFER_DST,
    _USAGE_XFER_SRC,
    _chk,
    _s,
    ffi,
    lib,
    new_fence,
    timestamp_pool,
    vk,
)
from .errors import DeviceLost, VulkanError
from .memory import _Buf
from .pipelines import _PC_WORDS

MAXR = 4           # rows a GEMV group holds (shaders/gemv.comp): larger GEMV groups go in chunks
GEMM_BM, GEMM_BN = 64, 32
# pc.act_flags bits (shaders/common.glsl expert_act)
_ACT_CLAMP, _ACT_OAI, _ACT_BIAS = 1, 2, 4


def _addr6(h) -> tuple:
    """The group-table words of an expert: gate, up, down device addresses as (lo, hi) pairs."""
    return tuple(v for t in (h.gate, h.up, h.down) for v in (t.addr & 0xFFFFFFFF, t.addr >> 32))


def _addr6_of(h) -> tuple:
    """``h.addr6`` (kept by an uploaded expert) or :func:`_addr6` of a handle without it (a plain matmul's)."""
    a = getattr(h, "addr6", None)
    return a if a is not None else _addr6(h)



class _Frame:
    """Per in-flight batch: scratch buffers, two descriptor sets, a command buffer, a fence, a query pool."""

    def __init__(self, dev: BatchMixin):
        self.dev = dev
        d = dev._dev
        self.bufs: dict[str, _Buf | None] = {"x": None, "tab": None, "h": None, "y": None}
        cai = _s("VkCommandBufferAllocateInfo")
        cai.sType = vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO
        cai.commandPool = dev._cmd_pool
        cai.level = vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY
        cai.commandBufferCount = 1
        pc = ffi.new("VkCommandBuffer[1]")
        _chk(lib.vkAllocateCommandBuffers(d, cai, pc), "vkAllocateCommandBuffers")
        self.cmd = pc[0]
        self.cmd_arr = pc
        pf = new_fence(d)
        self.fence_arr = pf
        self.fence = pf[0]
        self.qpool = timestamp_pool(d) if dev.timestamps else None
        sets = ffi.new("VkDescriptorSet[2]")
        dai = _s("VkDescriptorSetAllocateInfo")
        dai.sType = vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO
        dai.descriptorPool = dev._desc_pool
        dai.descriptorSetCount = 2
        layouts = ffi.new("VkDescriptorSetLayout[2]", [dev._dsl, dev._dsl])
        dai.pSetLayouts = layouts
        _chk(lib.vkAllocateDescriptorSets(d, dai, sets), "vkAllocateDescriptorSets")
        self.sets = sets  # [0]: expert op (h = SwiGLU scratch); [1]: plain matmul (h bindings -> x buffer)
        # command buffers recorded for a batch plan (Device._record_submit's key), submitted again while the
        # frame's buffers stay (a grown buffer rewrites the descriptor sets they were recorded with)
        self.recorded: dict = {}
        self.ds_expert = ffi.new("VkDescriptorSet[1]", [sets[0]])
        self.ds_plain = ffi.new("VkDescriptorSet[1]", [sets[1]])
        self.pc = ffi.new("uint32_t[%d]" % _PC_WORDS)

    def ensure(self, need: dict[str, int]) -> None:
        """Grow scratch buffers to at least ``need[name]`` bytes (the frame is idle); rewrite descriptors."""
        dev = self.dev
        changed = False
        for name, n in need.items():
            b = self.bufs[name]
            if b is not None and b.size >= n:
                continue
            size = max(4096, 1 << (max(n, 1) - 1).bit_length())
            if b is not None:
                b.destroy()
                self.bufs[name] = None
            req, pref = dev._scratch_types[name]
            self.bufs[name] = _Buf(dev, size, _USAGE_STORAGE, req, pref)
            changed = True
        if changed:
            self.drop_recorded()
        if changed and all(self.bufs[k] is not None for k in self.bufs):
            self._write_sets()

    def new_cmd(self, key):
        """A command buffer for the plan ``key`` (the frame is idle): allocated from the device's pool; past 32
        plans the frame's recorded buffers are all freed first."""
        if len(self.recorded) >= 32:
            self.drop_recorded()
        cai = _s("VkCommandBufferAllocateInfo")
        cai.sType = vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO
        cai.commandPool = self.dev._cmd_pool
        cai.level = vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY
        cai.commandBufferCount = 1
        arr = ffi.new("VkCommandBuffer[1]")
        _chk(lib.vkAllocateCommandBuffers(self.dev._dev, cai, arr), "vkAllocateCommandBuffers")
        return arr

    def drop_recorded(self):
        for arr, _ in self.recorded.values():
            lib.vkFreeCommandBuffers(self.dev._dev, self.dev._cmd_pool, 1, arr)
        self.recorded.clear()

    def _write_sets(self):
        b = self.bufs
        binds = [("x", "x", "tab", "h", "h", "y"), ("x", "x", "tab", "x", "x", "y")]
        infos = ffi.new("VkDescriptorBufferInfo[14]")
        writes = ffi.new("VkWriteDescriptorSet[14]")
        for si in range(2):
            for j, name in enumerate(binds[si] + ("iq",)):
                k = si * 7 + j
                infos[k].buffer = self.dev._iq_grids.buffer if name == "iq" else b[name].buffer
                infos[k].offset = 0
                infos[k].range = (1 << 64) - 1  # VK_WHOLE_SIZE
                w = writes[k]
                w.sType = vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET
                w.dstSet = self.sets[si]
                w.dstBinding = j
                w.descriptorCount = 1
                w.descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
                w.pBufferInfo = infos + k
        lib.vkUpdateDescriptorSets(self.dev._dev, 14, writes, 0, ffi.NULL)

    def destroy(self):
        d = self.dev._dev
        for b in self.bufs.values():
            if b is not None:
                b.destroy()
        if self.qpool is not None:
            lib.vkDestroyQueryPool(d, self.qpool, ffi.NULL)
        lib.vkDestroyFence(d, self.fence, ffi.NULL)


class Batch:
    """One submitted step. ``join()`` waits and returns f32 [P, D]; ``device_ms`` is set by the join."""

    def __init__(self, dev: BatchMixin, frame: _Frame | None, P: int, D: int, lost: str | None = None):
        self.dev, self.frame, self.P, self.D = dev, frame, P, D
        self._lost = lost
        self._result: np.ndarray | None = None
        self.device_ms: float | None = None
        self.submitted_at = time.perf_counter()

    def done(self) -> bool:
        """True when the device has finished (or the batch failed); never blocks."""
        if self._result is not None or self._lost or self.frame is None:
            return True
        return lib.vkGetFenceStatus(self.dev._dev, self.frame.fence) != _NOT_READY

    def _wait(self):
        if self._lost:
            raise DeviceLost(self._lost)
        if self.frame is None:
            return
        spin = self.dev.spin_s
        if spin > 0:     # poll first (COLI_VK_SPIN_US: docs/vulkan.md "Fence wait"), then block
            d, f, st, clock = self.dev._dev, self.frame.fence, lib.vkGetFenceStatus, time.perf_counter
            end = clock() + spin
            r = st(d, f)
            while r == _NOT_READY and clock() < end:
                r = st(d, f)
            if r == 0:
                return
            if r < 0:
                self._fail(f"vkGetFenceStatus returned {r}")
        r = lib.vkWaitForFences(self.dev._dev, 1, self.frame.fence_arr, 1, self.dev._timeout_ns)
        if r == _TIMEOUT:
            self._fail("fence wait timed out")
        elif r != 0:
            self._fail(f"vkWaitForFences returned {r}")

    def _fail(self, why: str):
        self._lost = why
        self.dev._mark_lost(why)
        raise DeviceLost(why)

    def join(self) -> np.ndarray:
        """Wait for the batch; f32 [P, D], each pair's unweighted expert output (or the matmul's y).

        Raises DeviceLost when the device failed (the caller recomputes these pairs on the CPU).
        """
        if self._result is not None:
            return self._result
        if self.frame is not None and self.dev._dev is None:
            raise VulkanError("the device was closed before this batch was joined")
        self._wait()
        if self.frame is None:
            self._result = np.zeros((self.P, self.D), np.float32)
            return self._result
        f = self.frame
        n = self.P * self.D
        self._result = f.bufs["y"].view[:n * 4].view(np.float32).reshape(self.P, self.D).copy()
        if f.qpool is not None:
            self.device_ms = self.dev.timestamp_ms(f.qpool)
        self.dev._release(f)
        self.frame = None
        return self._result


class BatchMixin:
    """The batches of ``device.Device``: frames from a pool of 64, the plan of a batch (kept per formats and sizes),
    its group table, the command buffer recorded for it (kept per frame and plan), the submit and its fence,
    timestamps, a device loss. Needs the opened device, its pipelines (``_pipeline``, ``_layout``) and its
    counters (``Device.__init__``) from the other parts."""

    def _make_command_pool(self):
        """The command pool of the queue family (buffers reset one by one): frames, staging and the device layers
        allocate from it."""
        d = self._dev
        cpci = _s("VkCommandPoolCreateInfo")
        cpci.sType = vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO
        cpci.flags = vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT
        cpci.queueFamilyIndex = self.queue_family
        pc = ffi.new("VkCommandPool*")
        _chk(lib.vkCreateCommandPool(d, cpci, ffi.NULL, pc), "vkCreateCommandPool")
        self._cmd_pool = pc[0]

    # -- frames and faults -------------------------------------------------------------------------
    def _check_alive(self):
        if self.lost:
            raise DeviceLost(self.lost)
        if not self._objs_ok:
            raise VulkanError("device is closed")

    def _mark_lost(self, why: str):
        if not self.lost:
            self.lost = why

    def _frame(self) -> _Frame:
        if self._frames_free:
            return self._frames_free.pop()
        if len(self._frames_all) >= 64:
            raise VulkanError("more than 64 batches in flight")
        f = _Frame(self)
        self._frames_all.append(f)
        return f

    def _release(self, f: _Frame):
        self._frames_free.append(f)

    # -- the plan, the table, the command buffer, the submit ------------------------------------------
    def _plan(self, groups, D, F, Din, P, plain, i8):
        """The static part of a batch: ``(G, row_group, gsgc, work, dispatch_plan, nitems)`` — the group table's
        rows (one per GEMM group; GEMV groups cut into chunks of <= MAXR rows), for each the index of its group in
        ``groups`` and its (first sorted pair, pairs), the work lists of every (pass, signature, kernel) as
        uint32 words, and per pass ``(mode, O, I, [(kernel, type_name, first item, items)])``."""
        sig_ids: dict = {}
        row_group, gs, gc = [], [], []
        gv_of: list = []       # per signature: GEMV group rows
        gm_of: list = []       # per signature: GEMM group rows
        for gi, (h, s, c) in enumerate(groups):
            si = sig_ids.setdefault(h.sig, len(sig_ids))
            if si == len(gv_of):
                gv_of.append([])
                gm_of.append([])
            if self.gemm_rows > 0 and c >= self.gemm_rows:
                gm_of[si].append(len(row_group))
                row_group.append(gi); gs.append(s); gc.append(c)
            else:
                for k in range(0, c, MAXR):
                    gv_of[si].append(len(row_group))
                    row_group.append(gi); gs.append(s + k); gc.append(min(MAXR, c - k))
        G = len(row_group)
        passes = [(0, D, F)] if plain else [(1, F, D if Din is None else Din), (0, D, F)]   # (mode, O, I)
        work_parts = []
        dispatch_plan = []
        nitems = 0
        for mode, O, I in passes:
            plan = []
            for sig, si in sig_ids.items():
                tname = sig[0] if mode == 1 else sig[1]
                gv, gm = gv_of[si], gm_of[si]
                if gv:
                    o0 = np.arange(0, O, self.gemv_rows, dtype=np.uint32)
                    w = np.zeros((len(gv) * o0.size, 4), np.uint32)
                    w[:, 0] = np.repeat(np.asarray(gv, np.uint32), o0.size)
                    w[:, 1] = np.tile(o0, len(gv))
                    work_parts.append(w)
                    plan.append((self.i8_kernel if i8 else "gemv", tname, nitems, w.shape[0]))
                    nitems += w.shape[0]
                if gm:
                    gma = np.asarray(gm, np.int64)
                    oo = np.arange(0, O, GEMM_BM, dtype=np.int64)
                    ntn = (np.asarray(gc, np.int64)[gma] + GEMM_BN - 1) // GEMM_BN   # row tiles of each group
                    per = oo.size * ntn
                    j = np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)
                    nt = np.repeat(ntn, per)
                    w = np.zeros((j.size, 4), np.uint32)
                    w[:, 0] = np.repeat(gma, per)
                    w[:, 1] = oo[j // nt]
                    w[:, 2] = (j % nt) * GEMM_BN
                    work_parts.append(w)
                    plan.append(("gemm", tname, nitems, w.shape[0]))
                    nitems += w.shape[0]
            dispatch_plan.append((mode, O, I, plan))
        work = np.concatenate([w.reshape(-1) for w in work_parts]) if work_parts else np.zeros(0, np.uint32)
        gsgc = np.array([gs, gc], np.uint32).T.copy()
        return G, row_group, gsgc, work, dispatch_plan, nitems

    def _record_submit(self, *, x, D, F, P, rows_sorted, out_sorted, groups, clamp, plain, round_h=(),
                       i8=False, Din=None, act_kind=0, bias_gu=None) -> Batch:
        # D: y's columns (down's rows); F: h's columns (gate/up rows, padded); Din: x's columns (gate/up
        # inner size, padded; default D)
        # round_h: (first sorted pair, pairs) ranges whose input rows of the last pass (h; the plain matmul's
        # x, bound as h) the act_q8 kernel rounds per 32 before that pass (act "int8"); i8: the GEMV groups
        # run gemv_i8dot / gemv_i8emu on packed int8 rows (x packed by the caller, h by act_q8's mode 1)
        # the batch's plan (group table layout, work lists, dispatches) depends on the groups' formats and sizes,
        # not on which experts they are: kept per key, and its command buffer per frame (recorded once, submitted
        # again with new tables: docs/vulkan.md "Host overhead")
        key = (plain, D, F, Din, P, clamp, act_kind, bias_gu is not None, i8, tuple(round_h),
               tuple((h.sig, c) for h, _, c in groups))
        bp = self._plans.get(key) if self.reuse else None
        if bp is None:
            bp = self._plan(groups, D, F, Din, P, plain, i8)
            if self.reuse:
                if len(self._plans) >= 256:
                    self._plans.clear()
                self._plans[key] = bp
        tab, offs, flags = self._step_table(bp, groups, P, rows_sorted, out_sorted, clamp, act_kind, bias_gu)

        if self._fault_at and self.submits + 1 == self._fault_at:
            self.submits += 1
            why = f"COLI_VK_FAULT={self._fault_at}: device lost at submit {self.submits}"
            self._mark_lost(why)
            return Batch(self, None, P, D, lost=why)

        f = self._frame()
        try:
            xin = x          # (plain: its rows are the h-binding input, set 1)
            need = {"x": xin.nbytes, "tab": tab.nbytes, "h": (P * F * 4) if not plain else 4, "y": P * D * 4}
            f.ensure(need)     # a grown buffer drops the frame's recorded command buffers (new descriptors)
            f.bufs["x"].view[:xin.nbytes] = xin.reshape(-1).view(np.uint8)
            f.bufs["tab"].view[:tab.nbytes] = tab.view(np.uint8)
            rec = f.recorded.get(key) if self.reuse else None
            if rec is None:
                cmd_arr = f.new_cmd(key) if self.reuse else f.cmd_arr
                ndisp = self._record(cmd_arr[0], f, bp[4], plain=plain, round_h=round_h, i8=i8, clamp=clamp,
                                     offs=offs, flags=flags)
                self.recordings += 1
                if self.reuse:
                    f.recorded[key] = (cmd_arr, ndisp)
            else:
                cmd_arr, ndisp = rec
            sub = _s("VkSubmitInfo")
            sub.sType = vk.VK_STRUCTURE_TYPE_SUBMIT_INFO
            sub.commandBufferCount = 1
            sub.pCommandBuffers = cmd_arr
            _chk(lib.vkResetFences(self._dev, 1, f.fence_arr), "vkResetFences")
            self.submits += 1
            r = lib.vkQueueSubmit(self._queue, 1, sub, f.fence)
            if r != 0:
                why = f"vkQueueSubmit returned {r}"
                self._mark_lost(why)
                self._release(f)
                return Batch(self, None, P, D, lost=why)
        except BaseException:
            self._release(f)
            raise
        self.dispatches += ndisp
        self.matmuls += len(groups) * (1 if plain else 3)
        b = Batch(self, f, P, D)
        for h, _, _ in groups:
            h.last_batch = b
        return b

    @staticmethod
    def _step_table(bp, groups, P, rows_sorted, out_sorted, clamp, act_kind, bias_gu):
        """The step table of a batch of plan ``bp`` (:meth:`_plan`): per group row its expert's 6 address words
        and (first sorted pair, pairs), the sorted pairs' rows and output slots, the work lists, and with
        ``bias_gu`` each group row's gate/up bias row. ``(tab uint32 [...], (grp_off, row_off, out_off, work_off,
        bias_off) in words, pc.act_flags)``."""
        G, row_group, gsgc, work, dispatch_plan, nitems = bp
        gt = np.empty((G, 8), np.uint32)
        gt[:, :6] = [_addr6_of(groups[g][0]) for g in row_group]
        gt[:, 6:] = gsgc
        flags = (_ACT_CLAMP if clamp is not None else 0) | (_ACT_OAI if act_kind == 2 else 0)
        bias_rows = None
        if bias_gu is not None:   # per group row: the bias row of its first pair (one expert per group)
            bias_rows = bias_gu[np.asarray(out_sorted, np.int64)[gsgc[:, 0].astype(np.int64)]]
            flags |= _ACT_BIAS
        grp_off = 0
        row_off = G * 8
        out_off = row_off + P
        work_off = out_off + P
        parts = [gt.reshape(-1), np.asarray(rows_sorted, np.uint32), np.asarray(out_sorted, np.uint32), work]
        bias_off = work_off + 4 * nitems
        if bias_rows is not None:
            parts.append(bias_rows.reshape(-1).view(np.uint32))
        return np.concatenate(parts), (grp_off, row_off, out_off, work_off, bias_off), flags

    def _record(self, cb, f: _Frame, dispatch_plan, *, plain, round_h, i8, clamp, offs, flags) -> int:
        """Record a batch's command buffer ``cb`` on frame ``f``: timestamps around it, per pass of
        ``dispatch_plan`` (:meth:`_plan`) a barrier after the first, the act_q8 rounding of ``round_h`` before the
        last, one dispatch per (kernel, format) work list, then a barrier to the host. Returns the dispatches."""
        grp_off, row_off, out_off, work_off, bias_off = offs
        bi = _s("VkCommandBufferBeginInfo")
        bi.sType = vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO
        bi.flags = 0 if self.reuse else vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT
        _chk(lib.vkResetCommandBuffer(cb, 0), "vkResetCommandBuffer")
        _chk(lib.vkBeginCommandBuffer(cb, bi), "vkBeginCommandBuffer")
        if f.qpool is not None:
            lib.vkCmdResetQueryPool(cb, f.qpool, 0, 2)
            lib.vkCmdWriteTimestamp(cb, _PSTAGE_TOP, f.qpool, 0)
        lib.vkCmdBindDescriptorSets(cb, vk.VK_PIPELINE_BIND_POINT_COMPUTE, self._layout, 0, 1,
                                    f.ds_plain if plain else f.ds_expert, 0, ffi.NULL)
        mb = _s("VkMemoryBarrier")
        mb.sType = vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER
        pc = f.pc
        cl = struct.unpack("<I", struct.pack("<f", float(clamp) if clamp is not None else 0.0))[0]
        ndisp = 0
        last = len(dispatch_plan) - 1
        for pi, (mode, O, I, plan) in enumerate(dispatch_plan):
            # The dispatches of one pass touch disjoint rows of h (pass 1) or y (pass 2), so they need
            # no barrier between them. Khronos' synchronization validation still reports hazards
            # between them, because each shader statically names both passes' bindings (the mode is
            # a specialization constant): false positives, checked by hand. Between the passes h is
            # written, then read.
            if pi > 0:
                mb.srcAccessMask = _ACC_SHADER_WRITE
                mb.dstAccessMask = _ACC_SHADER_READ | _ACC_SHADER_WRITE
                lib.vkCmdPipelineBarrier(cb, _PSTAGE_COMPUTE, _PSTAGE_COMPUTE, 0, 1, mb, 0, ffi.NULL, 0, ffi.NULL)
            if pi == last and round_h:
                # the int8 activations: round the pass's input rows in place, then a barrier
                lib.vkCmdBindPipeline(cb, vk.VK_PIPELINE_BIND_POINT_COMPUTE, self._pipeline("act_q8", None, 1 if i8 else 0))
                for s0, c in round_h:
                    nb = c * I // 32
                    pc[0:_PC_WORDS] = [O, I, s0 * I // 32, 0, 0, 0, nb, 0, 0, 0]
                    lib.vkCmdPushConstants(cb, self._layout, _STAGE_COMPUTE, 0, 4 * _PC_WORDS, pc)
                    ng = (nb + 63) // 64
                    lib.vkCmdDispatch(cb, min(ng, 65535), (ng + 65534) // 65535, 1)
                    ndisp += 1
                mb.srcAccessMask = _ACC_SHADER_WRITE
                mb.dstAccessMask = _ACC_SHADER_READ | _ACC_SHADER_WRITE
                lib.vkCmdPipelineBarrier(cb, _PSTAGE_COMPUTE, _PSTAGE_COMPUTE, 0, 1, mb, 0, ffi.NULL, 0, ffi.NULL)
            for kernel, tname, woff, nw in plan:
                lib.vkCmdBindPipeline(cb, vk.VK_PIPELINE_BIND_POINT_COMPUTE, self._pipeline(kernel, tname, mode))
                pc[0:_PC_WORDS] = [O, I, grp_off, row_off, out_off, work_off + 4 * woff, nw, flags, cl,
                                   bias_off]
                lib.vkCmdPushConstants(cb, self._layout, _STAGE_COMPUTE, 0, 4 * _PC_WORDS, pc)
                gx = min(nw, 65535)
                gy = (nw + 65534) // 65535
                lib.vkCmdDispatch(cb, gx, gy, 1)
                ndisp += 1
        mb.srcAccessMask, mb.dstAccessMask = _ACC_SHADER_WRITE, _ACC_HOST_READ
        lib.vkCmdPipelineBarrier(cb, _PSTAGE_COMPUTE, _PSTAGE_HOST, 0, 1, mb, 0, ffi.NULL, 0, ffi.NULL)
        if f.qpool is not None:
            lib.vkCmdWriteTimestamp(cb, _PSTAGE_BOTTOM, f.qpool, 1)
        _chk(lib.vkEndCommandBuffer(cb), "vkEndCommandBuffer")
        return ndisp

    def timestamp_ms(self, qpool, n: int = 2):
        """Milliseconds between the two timestamps of ``qpool`` (:func:`timestamp_pool`) after their command buffer
        ran, or None when the results are not there; with ``n`` > 2 timestamps, the list of the ``n - 1`` gaps."""
        data = ffi.new(f"uint64_t[{n}]")
        if lib.vkGetQueryPoolResults(self._dev, qpool, 0, n, 8 * n, data, 8, vk.VK_QUERY_RESULT_64_BIT) != 0:
            return None
        mask = (1 << self.timestamp_bits) - 1 if self.timestamp_bits < 64 else (1 << 64) - 1
        gaps = [((int(data[i + 1]) - int(data[i])) & mask) * self.timestamp_period / 1e6 for i in range(n - 1)]
        return gaps[0] if n == 2 else gaps

    def measure_copy(self, nbytes: int = 1 << 30, reps: int = 5) -> dict:
        """Device-to-device copy bandwidth, bytes copied per second in GB/s, best of ``reps`` by timestamps.

        ``{"shader": <copy.comp, 16-byte loads>, "transfer": <vkCmdCopyBuffer on this queue>}``. Each byte
        is read once and written once: the DRAM traffic is twice these figures. A benchmark reference for
        scripts/bench/kernels.py --op gpu; needs timestamps.
        """
        self._check_alive()
        if not self.timestamps:
            raise VulkanError("device has no timestamps")
        nbytes = nbytes // 16 * 16
        usage = _USAGE_XFER_SRC | _USAGE_XFER_DST | _USAGE_STORAGE | _USAGE_ADDRESS
        src = _Buf(self, nbytes, usage, _MEM_DEVICE_LOCAL, 0, address=True)
        dst = _Buf(self, nbytes, usage, _MEM_DEVICE_LOCAL, 0, address=True)
        f = self._frame()
        out = {}
        try:
            region = _s("VkBufferCopy")
            region.size = nbytes
            bi = _s("VkCommandBufferBeginInfo")
            bi.sType = vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO
            sub = _s("VkSubmitInfo")
            sub.sType = vk.VK_STRUCTURE_TYPE_SUBMIT_INFO
            sub.commandBufferCount = 1
            sub.pCommandBuffers = f.cmd_arr
            data = ffi.new("uint64_t[2]")
            pc = ffi.new("uint8_t[20]")
            pc[0:20] = struct.pack("<QQI", src.addr, dst.addr, nbytes // 16)
            pipe = self._copy_pipeline()
            for kind in ("shader", "transfer"):
                best = float("inf")
                for _ in range(reps + 1):
                    _chk(lib.vkResetCommandBuffer(f.cmd, 0), "vkResetCommandBuffer")
                    _chk(lib.vkBeginCommandBuffer(f.cmd, bi), "vkBeginCommandBuffer")
                    lib.vkCmdResetQueryPool(f.cmd, f.qpool, 0, 2)
                    lib.vkCmdWriteTimestamp(f.cmd, _PSTAGE_TOP, f.qpool, 0)
                    if kind == "shader":
                        lib.vkCmdBindPipeline(f.cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipe)
                        lib.vkCmdPushConstants(f.cmd, self._copy_layout, _STAGE_COMPUTE, 0, 20, pc)
                        lib.vkCmdDispatch(f.cmd, min(65535, max(1, nbytes // 16 // 256 // 4)), 1, 1)
                    else:
                        lib.vkCmdCopyBuffer(f.cmd, src.buffer, dst.buffer, 1, region)
                    lib.vkCmdWriteTimestamp(f.cmd, _PSTAGE_BOTTOM, f.qpool, 1)
                    _chk(lib.vkEndCommandBuffer(f.cmd), "vkEndCommandBuffer")
                    _chk(lib.vkResetFences(self._dev, 1, f.fence_arr), "vkResetFences")
                    _chk(lib.vkQueueSubmit(self._queue, 1, sub, f.fence), "vkQueueSubmit")
                    _chk(lib.vkWaitForFences(self._dev, 1, f.fence_arr, 1, 60 * 10**9), "vkWaitForFences")
                    _chk(lib.vkGetQueryPoolResults(self._dev, f.qpool, 0, 2, 16, data, 8, vk.VK_QUERY_RESULT_64_BIT),
                         "vkGetQueryPoolResults")
                    best = min(best, (int(data[1]) - int(data[0])) * self.timestamp_period * 1e-9)
                out[kind] = nbytes / best / 1e9
            return out
        finally:
            self._release(f)
            src.destroy()
            dst.destroy()
