"""Whole decoder layers on the device: the kernels' host side (docs/vulkan.md "Device layers").

:class:`Kernels` makes the pipelines of the whole-layer kernels (``shaders/lmv.comp``, ``lmoe.comp``,
``rmsnorm.comp``, ``topk.comp``, ``rope_kv.comp``, ``attn_dec.comp``; their headers give each kernel's push
constants), buffers with device addresses, and records a list of dispatches into one command buffer that can
be submitted again and again: every address and size is a push constant fixed at recording, and what changes
from token to token (the position) is read by the kernels from a params buffer. Every kernel shares one
pipeline layout: 8 addresses and 16 words of push constants (``shaders/layer_common.glsl``) and set 0 with the
i-quant grid table at binding 6 (``shaders/iq_common.glsl``).

Imported only with a device open (it imports the ``vulkan`` binding through ``coli.vulkan.binding``).
"""
from __future__ import annotations

import struct
import sys
import time
from dataclasses import dataclass

import numpy as np

from .binding import (
    _ACC_HOST_READ,
    _ACC_SHADER_READ,
    _ACC_SHADER_WRITE,
    _ACC_XFER_WRITE,
    _MEM_DEVICE_LOCAL,
    _MEM_HOST_CACHED,
    _MEM_HOST_COHERENT,
    _MEM_HOST_VISIBLE,
    _NOT_READY,
    _PSTAGE_BOTTOM,
    _PSTAGE_COMPUTE,
    _PSTAGE_HOST,
    _PSTAGE_TOP,
    _PSTAGE_TRANSFER,
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
from .memory import _Buf
from .pipelines import push_constant_layout, storage_set_layout
from .errors import DeviceLost, VulkanError
from .host_join import HostJoin
from .layer_plan import ATTN_PARTS_ROWS, attn_parts_rows

PC_ADDRS, PC_WORDS = 8, 16
_PC_BYTES = 8 * PC_ADDRS + 4 * PC_WORDS
_ACC_XFER_READ = 0x800
_ACC_HOST_WRITE = 0x4000

#: the format kernels (compiled per GGUF type) and the others
FORMAT_KERNELS = ("lmv", "lmoe", "lmm")
#: kernels that read or write the K/V cache: specialization constants 6 and 7 give its K and V types
#: (shaders/kv_types.glsl), from a Dispatch's ``mode`` (``layer_plan.kv_mode``)
KV_KERNELS = ("rope_kv", "attn_dec", "attn_pre", "attn_pre_cm")

PLAIN_KERNELS = ("rmsnorm", "topk", "rope_kv", "attn_dec", "heat", "attn_pre", "moe_sort", "moe_sum", "attn_comb",
                 "attn_pre_cm", "mla", "deltanet", "dn_chunk")


def f32_bits(x: float) -> int:
    """The bits of ``x`` as an f32, for a push-constant word."""
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


@dataclass
class Dispatch:
    """One dispatch: ``kernel`` (``type_name`` for a format kernel, ``mode`` its MODE), workgroup counts, up to 8
    addresses and 16 words of push constants; ``wait``: a compute barrier before it (it reads what an earlier
    dispatch wrote)."""

    kernel: str
    groups: tuple
    addrs: list
    words: list
    type_name: str | None = None
    mode: int = 0
    wait: bool = True
    rows: int = 0       # a format kernel's output rows a workgroup (ROWS); 0: the kernels' ``rows``


@dataclass
class Copy:
    """A buffer copy recorded in the command buffer: ``regions`` [(src offset, dst offset, bytes)]; ``wait``:
    a barrier before it (compute writes -> transfer reads)."""

    src: object
    dst: object
    regions: list
    wait: bool = True


class Buffer(_Buf):
    """A storage buffer with its device address ``addr``; ``view`` (uint8) when it is host-visible. ``f32()`` /
    ``u32()``: typed views of it."""

    def f32(self, n: int | None = None) -> np.ndarray:
        return self.view.view(np.float32)[:n]

    def u32(self, n: int | None = None) -> np.ndarray:
        return self.view.view(np.uint32)[:n]


@dataclass
class HostWait:
    """The ops after it wait until the host sets ``event`` (:meth:`Kernels.host_event`; ``vkCmdWaitEvents`` from the
    host stage, legal for an event the host sets after the submit): what the host wrote before it set the event is
    visible to them. A decode token with experts on the CPU in one command buffer (layer_join.py ``_run_event``)."""

    event: object


@dataclass
class Recorded:
    """A recorded command buffer (``arr``: ``VkCommandBuffer[1]``), the dispatches it holds and, where the device has
    timestamps, the query pool of its first and last timestamp (``Kernels.gpu_ms``)."""

    arr: object
    dispatches: int
    qpool: object = None
    fence: object = None     # ``VkFence[1]`` of :meth:`Kernels.start`'s submits
    n_stamps: int = 2        # timestamps in qpool (``each``: one before the first op and one after every op)
    waits: int = 0           # HostWaits with a timestamp before and after each (:meth:`Kernels.gpu_waits_ms`)


def prompt_route(dev, env=None) -> str:
    """The prompt GEMM's route on ``dev``: "coopmat" (shaders/lmm_cm.comp: 64-row tiles, float16 products) where
    ``COLI_VK_PROMPT_ROUTE`` (of ``env``, the settings) is auto or coopmat and the device has cooperative matrices
    (``dev.coopmat``), else "f32" (shaders/lmm.comp). Another value is the settings' error (the variable's choices)."""
    from coli.base.settings import get

    route = get("COLI_VK_PROMPT_ROUTE", env)
    return "coopmat" if route != "f32" and getattr(dev, "coopmat", False) else "f32"


class Kernels(HostJoin):
    """Pipelines of the whole-layer kernels on a ``coli.vulkan.device.Device``, buffers, recording, submits.

    Workgroup sizes: the format kernels use the device's GEMV workgroup (``dev.gemv_wg``, ``rows`` output rows
    a workgroup: ``COLI_VK_LAYER_ROWS`` of ``env``, the settings); the others 256 (``wg``). Errors: ``VulkanError`` from Vulkan calls,
    ``DeviceLost`` from a failed submit or wait."""

    def __init__(self, dev, wg: int = 256, env=None):
        self.dev = dev
        self.wg = int(wg)
        self._events = []       # host_event's, destroyed at close
        # output rows a format kernel's workgroup owns: 16 (spare subgroups split the units), so a 2048-row matrix
        # gives 128 workgroups (COLI_VK_LAYER_ROWS; 4 measured 4-10 % slower in decode on the H100)
        from coli.base.settings import get

        self.rows = int(get("COLI_VK_LAYER_ROWS", env))
        #: the decode router's rows a workgroup (lmv.comp, F32): few experts each, so that its read of the whole
        #: router (512 KiB for OLMoE) spreads over many workgroups (COLI_VK_ROUTER_ROWS)
        self.router_rows = int(get("COLI_VK_ROUTER_ROWS", env))
        # rows of a prompt GEMM tile (lmm.comp): 32 or 64 (COLI_VK_PROMPT_TILE; the settings refuse another)
        self.tile = int(get("COLI_VK_PROMPT_TILE", env))
        #: the prompt GEMM's route (:func:`prompt_route`)
        self.route = prompt_route(dev, env)
        if self.route == "coopmat":
            self.tile = 64
        #: lmm_cm.comp's PIPE per MODE: the experts' gate/up (mode 1: both halves of the workgroup decode) take two
        #: buffers of 32 inputs; dense and down (mode 0, 2) one buffer of 64, where every invocation decodes (H100:
        #: mode 1 27.3 -> 15.8 ms a 512-row chunk with 2, mode 2 9.5 -> 11.0 ms: docs/vulkan.md "Prompt routes")
        self.cm_pipe = {0: 0, 1: 2, 2: 0}
        #: query rows of an attn_pre.comp workgroup (8, 16 or 32; at most 16 when the head dimension exceeds 128:
        #: shared memory): :meth:`attn_pre` gives the grid's
        self.attn_bq = 8
        #: the prompt attention serves the q heads of one KV head in one workgroup (GQA: each K/V tile read once for
        #: them; the same sums as one head a workgroup): :meth:`attn_group`
        self.attn_gqa = True
        #: the prompt attention's route: "coopmat" (attn_pre_cm.comp, float16 products, 64 rows a workgroup) with
        #: the GEMM's coopmat route, else "f32" (attn_pre.comp); :meth:`attn_kernel` gives a head dimension's kernel
        self.attn_route = "coopmat" if self.route == "coopmat" and ("attn_pre_cm", None) in dev._modules else "f32"
        #: keys an attn_dec.comp workgroup takes in decode (its split over positions, joined by each head's last part); a
        #: context of at most this many keys keeps one workgroup a head and no join
        self.attn_chunk = int(get("COLI_VK_ATTN_CHUNK", env))
        #: decode attention at short contexts (flash-decoding): a head's keys split in even parts so that the heads'
        #: parts make about this many workgroups (an H100 has 132 SMs; one head a workgroup left 16 of them busy at
        #: OLMoE's 16 heads), none under attn_min_keys keys (coli/vulkan/layer_decode.py ``attn_np``); none on a CPU
        #: device (Lavapipe: a workgroup more is serial work more, 46 ms a layer at 32 parts against 1 ms at 2)
        self.attn_wgs = 0 if getattr(dev, "type_name", "") == "cpu" else 128
        self.attn_min_keys = 16
        #: the prompt attention's keys split over workgroups (shaders/attn_split.glsl): parts of attn_pre_chunk keys
        #: (a multiple of both kernels' key tiles), COLI_VK_PROMPT_ATTN_SPLIT workgroups a row block (None:
        #: :meth:`attn_split`'s rule)
        self.attn_pre_chunk = 256
        self.attn_pre_split = get("COLI_VK_PROMPT_ATTN_SPLIT", env)
        self._pipes: dict = {}
        self.fence = None       # VkFence[1] of submit()
        self._bufs: list = []
        d = dev._dev
        self._dsl = storage_set_layout(d, [6])
        self.layout = push_constant_layout(d, self._dsl, _PC_BYTES)
        dsl = ffi.new("VkDescriptorSetLayout[1]", [self._dsl])
        # one descriptor set: the grid table at binding 6 (from the device's pool)
        sets = ffi.new("VkDescriptorSet[1]")
        dai = _s("VkDescriptorSetAllocateInfo")
        dai.sType = vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO
        dai.descriptorPool = dev._desc_pool
        dai.descriptorSetCount = 1
        dai.pSetLayouts = dsl
        _chk(lib.vkAllocateDescriptorSets(d, dai, sets), "vkAllocateDescriptorSets")
        self._set = sets
        info = _s("VkDescriptorBufferInfo")
        info.buffer = dev._iq_grids.buffer
        info.offset = 0
        info.range = (1 << 64) - 1
        w = _s("VkWriteDescriptorSet")
        w.sType = vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET
        w.dstSet = sets[0]
        w.dstBinding = 6
        w.descriptorCount = 1
        w.descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
        w.pBufferInfo = info
        lib.vkUpdateDescriptorSets(d, 1, w, 0, ffi.NULL)
        self._pc = ffi.new(f"uint8_t[{_PC_BYTES}]")
        dev._layer_kernels = self    # Device.close destroys what this made (close())

    # -- pipelines --------------------------------------------------------------------------------------
    def pipeline(self, kernel: str, type_name: str | None = None, mode: int = 0, plain: bool = False, rows: int = 0):
        """The pipeline of ``kernel`` (``type_name`` for a format kernel, ``mode`` its MODE), made on first use;
        ``plain``: lmm.comp even on the coopmat route (an F32/F16/BF16 matrix whose width is not a multiple of 32:
        lmm_cm.comp steps 32 inputs a unit with vec4 loads; lmm.comp reads such a row's last unit one float at a
        time), with the route's 64-row tile so the grid is the same; ``rows``: a format kernel's output rows a
        workgroup (0: :attr:`rows`)."""
        plain = plain and kernel == "lmm" and self.route == "coopmat"
        rows = rows or self.rows
        key = (kernel, type_name, mode, (self.tile, self.cm_pipe[mode], plain) if kernel == "lmm" else
               self.attn_bq if kernel == "attn_pre" else rows)
        p = self._pipes.get(key)
        if p is not None:
            return p
        dev = self.dev
        coop = kernel == "lmm" and self.route == "coopmat" and not plain
        fmt = kernel in FORMAT_KERNELS
        module = dev._modules.get(("lmm_cm" if coop else kernel, type_name if fmt else None))
        if module is None:
            raise VulkanError(f"no shader module {kernel} for {type_name}" if fmt else f"no shader module {kernel}")
        if coop:                 # 128 invocations of the device's subgroup size: MODE and the 16-output blocks each
            vals, ids, pin = [mode, 4 * dev.subgroup_size // 128, self.cm_pipe[mode]], [2, 4, 5], 128
        elif kernel == "lmm":      # 4 x the tile's rows, no subgroup operations: the workgroup, MODE and the tile
            vals, ids, pin = [4 * self.tile, mode, self.tile], [0, 2, 3], None
        elif kernel == "attn_pre":   # a fixed workgroup of 128 without subgroup operations; mode: MAXD | G << 16
            maxd, g = mode & 0xFFFF, max(1, (mode >> 16) & 0xFF)
            vals, ids, pin = [0, self.attn_bq if maxd == 128 else min(self.attn_bq, 16), maxd, g], [2, 3, 4, 5], None
        elif kernel == "attn_pre_cm":   # 128 invocations of the device's subgroup size: 16-row blocks each, G
            vals, ids, pin = [4 * dev.subgroup_size // 128, max(1, (mode >> 16) & 0xFF)], [4, 5], 128
        else:
            vals = [dev.gemv_wg, rows, mode] if fmt else [self.wg]
            ids, pin = list(range(len(vals))), vals[0]
        if kernel in KV_KERNELS:   # the K/V cache's types (shaders/kv_types.glsl): mode's bits 24-27 K's, 28-31 V's
            vals, ids = vals + [(mode >> 24) & 15, (mode >> 28) & 15], ids + [6, 7]
        pipe = dev.compute_pipeline(module, self.layout, vals, ids, pin, f"{kernel}_{type_name}" if fmt else kernel)
        self._pipes[key] = pipe
        return pipe

    def attn_kernel(self, hd: int, hdv: int | None = None, q8: bool = False) -> str:
        """The prompt attention's kernel for head dimension ``hd`` (V's ``hdv``, None: the same): "attn_pre_cm" on the
        coopmat route (``attn_route``) when ``hd`` is a multiple of 16 up to 128 and V's width is K's, else
        "attn_pre"; "attn_pre" for a q8_0 K or V cache (``q8``: attn_pre_cm has not run on q8_0 rows)."""
        return "attn_pre_cm" if (self.attn_route == "coopmat" and hd % 16 == 0 and hd <= 128
                                 and hdv in (None, hd) and not q8) else "attn_pre"

    def attn_group(self, nq: int, nkv: int, hd: int, hdv: int | None = None, q8: bool = False) -> int:
        """G of the prompt attention (attn_pre.comp, attn_pre_cm.comp): the q heads of one KV head a workgroup serves,
        the largest divisor of nq / nkv up to its query rows (``attn_pre``'s BQ); 1 with ``attn_gqa`` off."""
        if not self.attn_gqa:
            return 1
        gs, bq = nq // nkv, self.attn_pre(hd, hdv, q8)[1]
        return max(g for g in range(1, min(gs, bq) + 1) if gs % g == 0)

    def attn_dispatch(self, nq: int, nkv: int, hd: int, R: int, hdv: int | None = None,
                      q8: bool = False) -> tuple[str, tuple, int]:
        """(kernel, workgroup counts, Dispatch ``mode``) of the prompt attention of R rows: :meth:`attn_kernel`'s,
        (nq / G, ceil(R / (BQ // G))) with BQ of :meth:`attn_pre` (64 for attn_pre_cm.comp), mode MAXD | G << 16."""
        kern, (maxd, bq) = self.attn_kernel(hd, hdv, q8), self.attn_pre(hd, hdv, q8)
        g = self.attn_group(nq, nkv, hd, hdv, q8)
        return kern, (nq // g, -(-R // (bq // g))), maxd | (g << 16)

    def attn_split(self, kern: str, groups: tuple, R: int) -> int:
        """NS, the workgroups a row block's keys are split over (the prompt attention's grid z; 1: no split) for
        :meth:`attn_dispatch`'s kernel ``kern`` and ``groups`` of R rows: ``attn_pre_split`` when set, else enough for the grid to make 4 x ``attn_wgs`` workgroups (H100: 132 SMs, several workgroups
        resident each; at 512 rows from position 1,536 one of OLMoE's [16 x 8] grids spent 444 us a layer, 21 % of
        the chunk), at most 8 and at most 2,048 / R (the parts' scratch: :func:`coli.vulkan.layer_plan.prompt_bytes`);
        1 on a CPU device (``attn_wgs`` 0)."""
        if self.attn_pre_split is not None:
            return int(self.attn_pre_split)
        base = groups[0] * groups[1]
        return max(1, min(8, ATTN_PARTS_ROWS // max(int(R), 1), -(-4 * self.attn_wgs // base)))

    def attn_parts_rows(self, R: int) -> int:
        """Rows x parts of the split's scratch (:meth:`attn_split`) that chunks of up to R rows can write
        (:func:`coli.vulkan.layer_plan.attn_parts_rows`, which the plan counts): 0 where none splits (a CPU device,
        or ``attn_pre_split`` 1)."""
        if self.attn_pre_split is None and not self.attn_wgs:
            return 0
        return attn_parts_rows(R, self.attn_pre_split)

    def attn_pre(self, hd: int, hdv: int | None = None, q8: bool = False) -> tuple[int, int]:
        """(MAXD, BQ) of :meth:`attn_kernel`'s kernel for head dimension ``hd`` (<= 256): the Dispatch's ``mode``
        and the query rows of a workgroup (the grid's y is ceil(R / BQ)); attn_pre_cm.comp: (128, 64)."""
        if self.attn_kernel(hd, hdv, q8) == "attn_pre_cm":
            return 128, 64
        maxd = 128 if hd <= 128 else 256
        return maxd, self.attn_bq if maxd == 128 else min(self.attn_bq, 16)

    # -- buffers ----------------------------------------------------------------------------------------
    def buffer(self, nbytes: int, host: bool = True, readback: bool = False) -> Buffer:
        """A buffer of ``nbytes`` (rounded up to 256) with a device address: host-visible and mapped
        (``view``) when ``host`` (device-local memory preferred; host-cached memory when ``readback``: the host
        reads it, and a read from device memory through the PCIe BAR costs milliseconds for 100 KiB), else
        device-local (filled by :meth:`upload` or by kernels)."""
        size = max(256, -(-int(nbytes) // 256) * 256)
        usage = _USAGE_STORAGE | _USAGE_ADDRESS | _USAGE_XFER_SRC | _USAGE_XFER_DST
        if host:
            b = Buffer(self.dev, size, usage, _MEM_HOST_VISIBLE | _MEM_HOST_COHERENT,
                       _MEM_HOST_CACHED if readback else _MEM_DEVICE_LOCAL, address=True)
        else:
            b = Buffer(self.dev, size, usage, _MEM_DEVICE_LOCAL, 0, address=True)
        self._bufs.append(b)
        return b

    def drop(self, b: Buffer) -> None:
        """Destroy a buffer made by :meth:`buffer` (not while a submit that uses it runs)."""
        b.destroy()
        if b in self._bufs:
            self._bufs.remove(b)

    def upload(self, dst: Buffer, data: np.ndarray) -> None:
        """Copy ``data``'s bytes to the start of ``dst``: directly when it is mapped, else through the device's
        staging buffer (synchronous)."""
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if dst.view is not None:
            dst.view[:flat.size] = flat
            return
        self.dev._staged_copy(flat, dst.buffer)

    def upload_many(self, pairs) -> None:
        """:meth:`upload` of each ``(dst, data)`` in ``pairs``, ``data`` an array or None for zeros over the whole of
        ``dst``: the mapped ones copied (zeroed) directly, the others through the staging buffer in one submit
        (the zeros recorded as fills: nothing staged)."""
        staged = []
        for dst, data in pairs:
            flat = None if data is None else np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            if dst.view is not None:
                if flat is None:
                    dst.view[:] = 0
                else:
                    dst.view[:flat.size] = flat
            else:
                staged.append((flat, dst.buffer, dst.size if flat is None else flat.size))
        if staged:
            self.dev._staged_copies(staged)

    # -- recording and submits --------------------------------------------------------------------------
    def record(self, ops: list, timestamps: bool = False, each: bool = False, lead: bool = False, after=None,
               resets: tuple = ()):
        """A :class:`Recorded` command buffer holding ``ops`` (:class:`Dispatch` / :class:`Copy`) in
        order, a memory barrier before each op whose ``wait`` is set, and one at the end that makes the writes
        visible to the host. It may be submitted any number of times (:meth:`submit`). ``timestamps``: a timestamp
        before the first op and after the last (:meth:`gpu_ms`), where the device has them; ``each``: one after
        every op too (:meth:`op_ms`: a profile of the ops, for benchmarks); with ``timestamps`` alone a
        :class:`HostWait` gets one before it and one after it (:meth:`gpu_waits_ms`: the device's time less its waits
        for the host); ``lead``: the first dispatch waits
        too (on what earlier submits wrote: a program cut into several command buffers); ``after``: an event of
        :meth:`host_event` the first op waits for, with what the host wrote before it set it (``vkCmdWaitEvents`` from
        the host stage: the spec's way to make host writes made after a submit visible to it; a pipeline barrier's
        host stage covers only writes made before the submit); ``resets``: events reset by the device at the end."""
        dev = self.dev
        cai = _s("VkCommandBufferAllocateInfo")
        cai.sType = vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO
        cai.commandPool = dev._cmd_pool
        cai.level = vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY
        cai.commandBufferCount = 1
        arr = ffi.new("VkCommandBuffer[1]")
        _chk(lib.vkAllocateCommandBuffers(dev._dev, cai, arr), "vkAllocateCommandBuffers")
        cb = arr[0]
        n_dispatch = 0
        bi = _s("VkCommandBufferBeginInfo")
        bi.sType = vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO
        _chk(lib.vkBeginCommandBuffer(cb, bi), "vkBeginCommandBuffer")
        qpool = None
        waits = sum(isinstance(op, HostWait) for op in ops) if timestamps and not each and dev.timestamps else 0
        n_stamps = len(ops) + 1 if each else 2 + 2 * waits
        if (timestamps or each) and dev.timestamps:
            qpool = timestamp_pool(dev._dev, n_stamps)
            lib.vkCmdResetQueryPool(cb, qpool, 0, n_stamps)
            lib.vkCmdWriteTimestamp(cb, _PSTAGE_TOP, qpool, 0)
        mb = _s("VkMemoryBarrier")
        mb.sType = vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER
        # whatever the host wrote before the submit is visible to it (the submit's own guarantee); the barriers
        # order the dispatches' writes and reads
        lib.vkCmdBindDescriptorSets(cb, vk.VK_PIPELINE_BIND_POINT_COMPUTE, self.layout, 0, 1, self._set, 0,
                                    ffi.NULL)
        bound = None
        pc = self._pc
        last = None
        nw = 0      # the HostWaits stamped so far
        if lead:     # a later segment of one submit: it follows a semaphore wait, and the host may have written
            # (yk rows, the balancer's route) since the submit, which the submit's own guarantee does not cover
            mb.srcAccessMask = _ACC_SHADER_WRITE | _ACC_XFER_WRITE | _ACC_HOST_WRITE
            mb.dstAccessMask = _ACC_SHADER_READ | _ACC_SHADER_WRITE | _ACC_XFER_READ | _ACC_XFER_WRITE
            lib.vkCmdPipelineBarrier(cb, _PSTAGE_COMPUTE | _PSTAGE_TRANSFER | _PSTAGE_HOST,
                                     _PSTAGE_COMPUTE | _PSTAGE_TRANSFER, 0, 1, mb, 0, ffi.NULL, 0, ffi.NULL)
        if after is not None:
            mb.srcAccessMask = _ACC_HOST_WRITE
            mb.dstAccessMask = _ACC_SHADER_READ | _ACC_SHADER_WRITE | _ACC_XFER_READ | _ACC_XFER_WRITE
            lib.vkCmdWaitEvents(cb, 1, after, _PSTAGE_HOST, _PSTAGE_COMPUTE | _PSTAGE_TRANSFER, 1, mb, 0, ffi.NULL,
                                0, ffi.NULL)
        for n_op, op in enumerate(ops):
            if isinstance(op, HostWait):
                # the host's writes only (the device's own are ordered by the next op's barrier)
                mb.srcAccessMask = _ACC_HOST_WRITE
                mb.dstAccessMask = _ACC_SHADER_READ | _ACC_SHADER_WRITE | _ACC_XFER_READ | _ACC_XFER_WRITE
                if waits:   # the ops before it done ... the wait over (an in-order front end: Lavapipe, NVIDIA)
                    lib.vkCmdWriteTimestamp(cb, _PSTAGE_BOTTOM, qpool, 1 + 2 * nw)
                lib.vkCmdWaitEvents(cb, 1, op.event, _PSTAGE_HOST, _PSTAGE_COMPUTE | _PSTAGE_TRANSFER, 1, mb, 0,
                                    ffi.NULL, 0, ffi.NULL)
                if waits:
                    lib.vkCmdWriteTimestamp(cb, _PSTAGE_BOTTOM, qpool, 2 + 2 * nw)
                    nw += 1
                if each and qpool is not None:
                    lib.vkCmdWriteTimestamp(cb, _PSTAGE_BOTTOM, qpool, n_op + 1)
                continue
            if isinstance(op, Copy):
                if op.wait:
                    # the host too: a flag copied after rows the host polls for mid-submit (layer_join.py) must
                    # not be seen before them
                    mb.srcAccessMask = _ACC_SHADER_WRITE | _ACC_XFER_WRITE
                    mb.dstAccessMask = _ACC_XFER_READ | _ACC_HOST_READ
                    lib.vkCmdPipelineBarrier(cb, _PSTAGE_COMPUTE | _PSTAGE_TRANSFER, _PSTAGE_TRANSFER | _PSTAGE_HOST,
                                             0, 1, mb,
                                             0, ffi.NULL, 0, ffi.NULL)
                regs = ffi.new("VkBufferCopy[]", len(op.regions))
                for j, (so, do, n) in enumerate(op.regions):
                    regs[j].srcOffset, regs[j].dstOffset, regs[j].size = so, do, n
                lib.vkCmdCopyBuffer(cb, op.src.buffer, op.dst.buffer, len(op.regions), regs)
                last = "copy"
                if each and qpool is not None:
                    lib.vkCmdWriteTimestamp(cb, _PSTAGE_BOTTOM, qpool, n_op + 1)
                continue
            if op.wait and last is not None:
                mb.srcAccessMask = _ACC_SHADER_WRITE | _ACC_XFER_WRITE
                mb.dstAccessMask = _ACC_SHADER_READ | _ACC_SHADER_WRITE
                lib.vkCmdPipelineBarrier(cb, _PSTAGE_COMPUTE | _PSTAGE_TRANSFER, _PSTAGE_COMPUTE, 0, 1, mb, 0,
                                         ffi.NULL, 0, ffi.NULL)
            pipe = self.pipeline(op.kernel, op.type_name, op.mode, op.kernel == "lmm" and op.words[1] % 32 != 0,
                                 op.rows)
            if pipe != bound:
                lib.vkCmdBindPipeline(cb, vk.VK_PIPELINE_BIND_POINT_COMPUTE, pipe)
                bound = pipe
            if len(op.addrs) > PC_ADDRS or len(op.words) > PC_WORDS:
                raise ValueError(f"{op.kernel}: at most {PC_ADDRS} addresses and {PC_WORDS} words")
            a = list(op.addrs) + [0] * (PC_ADDRS - len(op.addrs))
            w = [int(x) & 0xFFFFFFFF for x in op.words] + [0] * (PC_WORDS - len(op.words))
            ffi.memmove(pc, struct.pack(f"<{PC_ADDRS}Q{PC_WORDS}I", *a, *w), _PC_BYTES)
            lib.vkCmdPushConstants(cb, self.layout, _STAGE_COMPUTE, 0, _PC_BYTES, pc)
            gx, gy, gz = (tuple(op.groups) + (1, 1))[:3]
            lib.vkCmdDispatch(cb, int(gx), int(gy), int(gz))
            n_dispatch += 1
            last = "dispatch"
            if each and qpool is not None:
                lib.vkCmdWriteTimestamp(cb, _PSTAGE_BOTTOM, qpool, n_op + 1)
        mb.srcAccessMask, mb.dstAccessMask = _ACC_SHADER_WRITE | _ACC_XFER_WRITE, _ACC_HOST_READ
        lib.vkCmdPipelineBarrier(cb, _PSTAGE_COMPUTE | _PSTAGE_TRANSFER, _PSTAGE_HOST, 0, 1, mb, 0, ffi.NULL, 0,
                                 ffi.NULL)
        for ev in resets:    # after the barrier: every op above (and the waits before them) done
            lib.vkCmdResetEvent(cb, ev[0], _PSTAGE_COMPUTE | _PSTAGE_TRANSFER)
        if qpool is not None and not each:
            lib.vkCmdWriteTimestamp(cb, _PSTAGE_BOTTOM, qpool, n_stamps - 1)
        _chk(lib.vkEndCommandBuffer(cb), "vkEndCommandBuffer")
        return Recorded(arr, n_dispatch, qpool, n_stamps=n_stamps, waits=waits)

    def gpu_ms(self, rec: Recorded) -> float | None:
        """Milliseconds between the first and the last timestamp of ``rec``'s last run (after its wait), or None
        without timestamps."""
        if rec.qpool is None:
            return None
        if rec.n_stamps > 2:
            g = self.dev.timestamp_ms(rec.qpool, rec.n_stamps)
            return None if g is None else sum(g)
        return self.dev.timestamp_ms(rec.qpool)

    def gpu_waits_ms(self, rec: Recorded) -> tuple | None:
        """``(device ms, ms waiting for the host)`` of ``rec``'s last run: its first to last timestamp less the gaps
        around its :class:`HostWait` ops (from the end of the ops before one to the end of the wait), and those gaps;
        None without timestamps."""
        if rec.qpool is None or rec.n_stamps <= 2:
            g = self.gpu_ms(rec)
            return None if g is None else (g, 0.0)
        g = self.dev.timestamp_ms(rec.qpool, rec.n_stamps)
        if g is None:
            return None
        wait = sum(g[1 + 2 * i] for i in range(rec.waits))
        return sum(g) - wait, wait

    def op_ms(self, rec: Recorded) -> list | None:
        """Milliseconds of each op of ``rec``'s last run (recorded with ``each``), or None without timestamps."""
        if rec.qpool is None or rec.n_stamps <= 2 or rec.waits:
            return None
        return self.dev.timestamp_ms(rec.qpool, rec.n_stamps)

    def free(self, rec: Recorded) -> None:
        """Free a command buffer made by :meth:`record` and its query pool (not while it runs)."""
        if self.dev._dev is not None and rec.arr is not None:
            lib.vkFreeCommandBuffers(self.dev._dev, self.dev._cmd_pool, 1, rec.arr)
            rec.arr = None
        if self.dev._dev is not None and rec.qpool is not None:
            lib.vkDestroyQueryPool(self.dev._dev, rec.qpool, ffi.NULL)
            rec.qpool = None
        if self.dev._dev is not None and rec.fence is not None:
            lib.vkDestroyFence(self.dev._dev, rec.fence[0], ffi.NULL)
            rec.fence = None

    def _fence(self, holder) -> object:
        """``holder``'s ``VkFence[1]`` (``fence`` attribute), made unsignalled on first use."""
        if holder.fence is None:
            holder.fence = new_fence(self.dev._dev)
        return holder.fence

    def _queue_submit(self, rec: Recorded, queue, fence) -> None:
        sub = _s("VkSubmitInfo")
        sub.sType = vk.VK_STRUCTURE_TYPE_SUBMIT_INFO
        sub.commandBufferCount = 1
        sub.pCommandBuffers = rec.arr
        r = lib.vkQueueSubmit(queue, 1, sub, fence[0])
        if r != 0:
            self.dev._mark_lost(f"vkQueueSubmit returned {r}")
            raise DeviceLost(f"vkQueueSubmit returned {r}")

    def running(self, rec: Recorded) -> bool:
        """Whether ``rec``'s last :meth:`start` still runs (False before the first); DeviceLost on a fence error."""
        if rec.fence is None:
            return False
        r = lib.vkGetFenceStatus(self.dev._dev, rec.fence[0])
        if r == _NOT_READY:
            return True
        if r != 0:
            self.dev._mark_lost(f"vkGetFenceStatus returned {r}")
            raise DeviceLost(f"vkGetFenceStatus returned {r}")
        return False

    def start(self, rec: Recorded, queue=None) -> bool:
        """Submit ``rec`` without waiting, on ``queue`` (default: the device's queue); False, submitting
        nothing, while its previous :meth:`start` still runs (:meth:`running`). Not counted in the device's
        dispatches (the clock holder's heats are no work). ``VulkanError`` / ``DeviceLost`` when a call fails."""
        if self.running(rec):
            return False
        new = rec.fence is None
        f = self._fence(rec)
        if not new:
            _chk(lib.vkResetFences(self.dev._dev, 1, f), "vkResetFences")
        self._queue_submit(rec, self.dev._queue if queue is None else queue, f)
        return True

    def wait(self, rec: Recorded) -> bool:
        """Wait for ``rec``'s last :meth:`start` (the device's timeout); False when the wait failed."""
        if rec.fence is None:
            return True
        return lib.vkWaitForFences(self.dev._dev, 1, rec.fence, 1, self.dev._timeout_ns) == 0

    def submit(self, rec: Recorded, spin_s: float = 0.0) -> bool:
        """Submit a recorded command buffer and wait for it (the device's timeout): with ``spin_s`` > 0 polling
        its fence (``vkGetFenceStatus``) for up to that many seconds first, then blocking in ``vkWaitForFences``
        (a thread woken from the blocking wait starts later: docs/vulkan.md "Fence wait"). True when the poll saw
        the fence signalled. DeviceLost when the submit or the wait fails."""
        dev = self.dev
        f = self._fence(self)
        _chk(lib.vkResetFences(dev._dev, 1, f), "vkResetFences")
        self._queue_submit(rec, dev._queue, f)
        dev.dispatches += rec.dispatches
        dev.layer_dispatches += rec.dispatches
        if spin_s > 0:
            d, f0, st, clock = dev._dev, f[0], lib.vkGetFenceStatus, time.perf_counter
            end = clock() + spin_s
            r = st(d, f0)
            while r == _NOT_READY and clock() < end:
                r = st(d, f0)
            if r == 0:
                return True
            if r != _NOT_READY:
                dev._mark_lost(f"vkGetFenceStatus returned {r}")
                raise DeviceLost(f"vkGetFenceStatus returned {r}")
        r = lib.vkWaitForFences(dev._dev, 1, f, 1, dev._timeout_ns)
        if r != 0:
            why = "fence wait timed out" if r == _TIMEOUT else f"vkWaitForFences returned {r}"
            dev._mark_lost(why)
            raise DeviceLost(why)
        return False

    def close(self) -> None:
        """Destroy the pipelines, the buffers made here, the layout and the fence (the device's close calls it)."""
        d = self.dev._dev
        if d is None:
            return
        for sem in getattr(self, "_tl", None) or []:
            if sem is not None:
                lib.vkDestroySemaphore(d, sem[0], ffi.NULL)
        self._tl = self._siginfo = self._waitinfo = None
        for ev in self._events:
            lib.vkDestroyEvent(d, ev[0], ffi.NULL)
        self._events = []
        for p in self._pipes.values():
            lib.vkDestroyPipeline(d, p, ffi.NULL)
        self._pipes = {}
        for b in self._bufs:
            b.destroy()
        self._bufs = []
        if self.fence is not None:
            lib.vkDestroyFence(d, self.fence[0], ffi.NULL)
            self.fence = None
        if self.layout is not None:
            lib.vkDestroyPipelineLayout(d, self.layout, ffi.NULL)
            lib.vkDestroyDescriptorSetLayout(d, self._dsl, ffi.NULL)
            self.layout = None


#: the clock holder's longest spin, in rounds of one flag read (shaders/heat.comp): it ends there when nothing
#: stops it (docs/vulkan.md "Clocks": 44 ms on the H200)
HEAT_ROUNDS = 1 << 18


def clock_queue(dev, env=None):
    """The queue of a :class:`ClockHolder` (docs/vulkan.md "Clocks"): the device's second queue on a discrete GPU
    with ``COLI_VK_HOLD_CLOCK`` on (the settings), else None (an integrated GPU would take the CPU's power; a
    device with one queue would run it in turn with the work)."""
    from coli.base.settings import get

    if get("COLI_VK_HOLD_CLOCK", env) and getattr(dev, "type_name", "") == "discrete":
        return getattr(dev, "_queue2", None)
    return None


class ClockHolder:
    """Keeps a discrete GPU busy between the engine's submits, so it does not lower its clock while the CPU
    works (docs/vulkan.md "Clocks"): one workgroup of ``shaders/heat.comp`` on ``queue`` (a second queue: it runs
    beside the work) that spins until a command buffer holding :meth:`stop_op` runs, or ``rounds`` rounds.

    :meth:`start` after a token's device work (or at a decode token's start); :meth:`stop_op`, the first op of
    the next token's command buffer, ends the spin. ``runs``: heats submitted; ``seen``: of the ended ones, those
    a stop_op ended; ``skips``: :meth:`start` calls that found the last heat still running. :meth:`concurrent`
    checks that the device runs the two queues at once (made by :meth:`for_device`). Errors: ``VulkanError`` /
    ``DeviceLost`` from the Vulkan calls."""

    def __init__(self, K: Kernels, queue, rounds: int | None = None):
        self.K, self.queue = K, queue
        # u32 words: [0] the flag (the token number the last stop_op copied), [1] the token number the next heat
        # waits for, [2:4] heat.comp's out (rounds spun; 2 while it spins, then 1 when a stop_op ended it, 0 at the cap)
        self.words = K.buffer(16, host=True)
        self.words.u32(4)[:] = 0
        a = self.words.addr
        self.rec = K.record([Dispatch("heat", (1,), [a, a + 4, a + 8], [HEAT_ROUNDS if rounds is None else rounds],
                                      wait=False)])
        self.tick = 0
        self.runs = self.seen = self.skips = 0

    @classmethod
    def for_device(cls, dev, K: Kernels | None = None, env=None) -> "ClockHolder | None":
        """A holder for ``dev`` where :func:`clock_queue` gives a queue and :meth:`concurrent` holds, else None;
        ``K``: the :class:`Kernels` to use (made when None)."""
        q = clock_queue(dev, env)
        if q is None:
            return None
        h = cls(K if K is not None else Kernels(dev, env=env), q)
        try:
            ok = h.concurrent()
        except BaseException:
            h.close()
            raise
        if not ok:
            h.close()
            print(f"[VK] {getattr(dev, 'name', 'device')}: no clock holder (the device ran the probe's stop op only "
                  f"after the heat: its queues take turns)", file=sys.stderr)
            return None
        return h

    def concurrent(self) -> bool:
        """Whether a heat and the work's queue run at once: a heat on this queue, then (once it spins, or after
        0.1 s) a command buffer holding only :meth:`stop_op` on the device's queue, which must end it. On a device
        that runs its queues in turn the stop op waits for the heat's cap: the heat ends unseen (False)."""
        K, w = self.K, self.words.u32(4)
        self.tick = 1
        w[:] = [0, 1, 0, 7]
        if not K.start(self.rec, self.queue):
            return False
        t_end = time.perf_counter() + 0.1
        while int(w[3]) == 7 and time.perf_counter() < t_end:
            time.sleep(0)
        stop = K.record([self.stop_op()])
        try:
            K.submit(stop)
        finally:
            K.free(stop)
        if not K.wait(self.rec):
            raise DeviceLost("the clock holder's probe: fence wait failed")
        return int(w[3]) == 1

    def stop_op(self) -> Copy:
        """The op that ends a running heat: the token number into the flag (first in a recorded command buffer)."""
        return Copy(self.words, self.words, [(4, 0, 4)], wait=False)

    def start(self) -> None:
        """Submit a heat that waits for the next :meth:`stop_op` (nothing while the last one still runs)."""
        if self.K.running(self.rec):
            self.skips += 1
            return
        w = self.words.u32(4)
        if self.rec.fence is not None:
            self.seen += int(w[3]) == 1        # the last heat's end: 1 when a stop_op ended it
        w[2:4] = 0
        self.tick = self.tick % 0x7FFFFFFF + 1
        w[1] = self.tick
        self.K.start(self.rec, self.queue)
        self.runs += 1

    def close(self) -> None:
        """Stop a running heat (the flag at its top) and free the command buffer once it has ended (after a failed
        wait: once the device is idle)."""
        if self.rec is None:
            return
        dev = self.K.dev
        if dev._dev is not None:
            if self.words.view is not None:
                self.words.u32(1)[0] = 0xFFFFFFFF
            if not self.K.wait(self.rec):
                lib.vkDeviceWaitIdle(dev._dev)
        self.K.free(self.rec)
        self.rec = None

    def line(self) -> str:
        """``the clock holder ran N times (S ended by the next token, K still busy)``."""
        return f"the clock holder ran {self.runs} times ({self.seen} ended by the next token, {self.skips} still busy)"
