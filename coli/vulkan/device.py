"""The Vulkan device: opening, memory, pipelines, the expert batch and the plain matmul.

Imported only when a device is asked for (``coli.vulkan.open_device``): importing it imports the
``vulkan`` binding, which dlopens ``libvulkan.so.1`` and raises OSError where there is none.
Calls go through the binding's raw cffi layer (``vk.ffi`` / ``vk.lib``): the wrappers cost 2-8 us a call,
raise exceptions for success codes and return the wrong value for vkGetBufferDeviceAddress
(stack-notes section 3 and pitfalls 3-7).

Design (docs/vulkan.md):
- Weights stay in their GGUF block bytes; each tensor is a VkBuffer bound at an offset inside a
  256 MiB device-memory block (``alloc.BlockAllocator``), and shaders read it through its buffer
  device address, so one dispatch covers every expert of a step.
- ``submit_experts`` records ONE command buffer per step: per format signature, gate+up+SwiGLU
  (GEMV for groups of < ``COLI_VK_TIER_GEMM_ROWS`` rows, tiled GEMM from there), a barrier, then
  down; timestamps around it; submitted with a fence and not waited for. ``Batch.join`` waits.
- Not thread-safe: one thread (the scheduler's) drives a Device.
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
    _Q_COMPUTE,
    _Q_GRAPHICS,
    _STAGE_COMPUTE,
    _TIMEOUT,
    _TYPE_CPU,
    _USAGE_ADDRESS,
    _USAGE_STORAGE,
    _USAGE_XFER_DST,
    _USAGE_XFER_SRC,
    GiB,
    MiB,
    _chk,
    _env_float,
    _env_int,
    _s,
    ffi,
    lib,
    new_fence,
    timestamp_pool,
    vk,
)
from .errors import BudgetExceeded, DeviceLost, VulkanError
from .memory import MemoryMixin, _Buf, _ceil32, row_bytes
from .pipelines import _PC_WORDS, PipelineMixin

_TYPE_NAMES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
_TYPE_RANK = {2: 0, 1: 1, 3: 2, 4: 3, 0: 4}       # discrete > integrated > virtual > CPU

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


def _int8_format(type_name: str) -> bool:
    """Whether the CPU multiplies this weight format with int8 activations in its int8 mode (its format
    registry's ``int8`` flag: every quantized format; F32/F16/BF16 always take f32)."""
    from cpu_kernels.formats import FORMATS as CPU_FORMATS
    f = CPU_FORMATS.get(type_name)
    return bool(f is not None and f.int8)


def _pack_rows_int8(x: np.ndarray) -> np.ndarray:
    """x f32 [R, D] as gemv_i8.glsl's packed int8 rows (f32 [R, D] of raw words): per block of 32, words 0-7
    the codes of the CPU's ``quantize_act_int8`` (element 4k in the low byte of word k), word 8 its f32 d."""
    from cpu_kernels.formats import quantize_act_int8
    q, d = quantize_act_int8(x)
    R, D = x.shape
    p = np.zeros((R, D // 32, 32), np.uint32)
    p[:, :, :8] = np.ascontiguousarray(q).view(np.uint32).reshape(R, D // 32, 8)
    p[:, :, 8] = d.view(np.uint32)
    return p.view(np.float32).reshape(R, D)


def _round_rows_int8(x: np.ndarray) -> np.ndarray:
    """x f32 [R, D] rounded per 32 with the CPU's ``quantize_act_int8``: ``q * d`` in f32 (the values the
    CPU's int8 path multiplies; bit for bit its ``_round_act_int8``)."""
    from cpu_kernels.formats import quantize_act_int8
    q, d = quantize_act_int8(x)
    R, D = x.shape
    return (q.astype(np.float32).reshape(R, D // 32, 32) * d[:, :, None]).reshape(R, D)


class ExpertHandle:
    """A resident expert: its gate, up and down tensors on the device (from ``Device.upload_expert``)."""
    __slots__ = ("id", "gate", "up", "down", "D", "F", "Dp", "Fp", "sig", "nbytes", "last_batch", "freed",
                 "addr6", "uploaded")

    def __repr__(self):
        return f"<expert {self.id}: {self.gate.type_name}/{self.down.type_name} D={self.D} F={self.F}>"


class _Frame:
    """Per in-flight batch: scratch buffers, two descriptor sets, a command buffer, a fence, a query pool."""

    def __init__(self, dev: "Device"):
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

    def __init__(self, dev: "Device", frame: _Frame | None, P: int, D: int, lost: str | None = None):
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


class Device(MemoryMixin, PipelineMixin):
    """A Vulkan device holding experts. Open it with ``coli.vulkan.open_device``.

    Public figures: ``name``, ``type_name`` ("discrete"/"integrated"/"cpu"...), ``subgroup_size``,
    ``subgroup_pinned``, ``queue_family``, ``dedicated_compute_queue``, ``heaps`` (list of
    (bytes, device_local)), ``budget_free`` (VK_EXT_memory_budget's free bytes of the weights' heap, or
    None), ``budget_bytes`` (uploads past it raise BudgetExceeded; set from the caller's ``budget``),
    ``budget_rule``, ``staging``; counters ``dispatches``
    (compute dispatches submitted), ``matmuls`` (weight-matrix products submitted: 3 per expert group
    of a batch, 1 per plain matmul), ``submits``.
    """

    def __init__(self, label: str, *, budget=None, block_bytes: int = 256 * MiB, staging: bool | None = None,
                 device_index: int | None = None, index_name: str | None = None):
        self.label = label
        self._index_name = index_name     # what set device_index, for its error (default COLI_VK_DEV=N)
        self._dev = None
        self._objs_ok = False
        self.dispatches = 0
        self.layer_dispatches = 0     # of them, the device layers' (coli/vulkan/layers.py)
        self.matmuls = 0
        self.submits = 0
        self.lost: str | None = None
        # activation numerics of the expert batch: "f32", or "int8" (the CPU's int8 activations: rows rounded
        # per 32 as cpu_kernels.formats.quantize_act_int8 before every product with a quantized weight; the
        # engine sets it to its cpu_act, so both sides of a placement multiply the same numbers)
        self.act = "f32"
        # int8 activations with Q8_0 experts in GEMV groups: integer dot products (COLI_VK_I8=0: the f32 GEMV
        # on rounded activations instead; same numbers, another summation)
        self.i8 = _env_int("COLI_VK_I8", 1) != 0
        self._fault_at = _env_int("COLI_VK_FAULT", 0)
        self.gemm_rows = _env_int("COLI_VK_TIER_GEMM_ROWS", 16)
        # a batch's plan and its command buffer kept and submitted again for the next batch of the same formats
        # and sizes (COLI_VK_REUSE=0: built and recorded for every batch); ``recordings`` counts the recordings
        self.reuse = _env_int("COLI_VK_REUSE", 1) != 0
        self._plans: dict = {}
        self.recordings = 0
        self._timeout_ns = int(_env_float("COLI_VK_TIMEOUT_S", 60.0) * 1e9)
        self._frames_free: list[_Frame] = []
        self._frames_all: list[_Frame] = []
        self._pipes: dict = {}
        self._modules: dict = {}
        self._next_handle = 1
        self._handles: dict[int, ExpertHandle] = {}
        try:
            self._open(budget, block_bytes, staging, device_index)
        except BaseException:
            self.close()
            raise

    # -- opening -----------------------------------------------------------------------------------
    def _open(self, budget, block_bytes, staging, device_index):
        spv = self._read_spirv()            # shaders first: a missing .spv is a reason not to open

        app_name = ffi.new("char[]", b"coli")
        app = _s("VkApplicationInfo")
        app.sType = vk.VK_STRUCTURE_TYPE_APPLICATION_INFO
        app.pApplicationName = app_name
        app.pEngineName = app_name
        app.apiVersion = (1 << 22) | (3 << 12)      # 1.3 where the device has it (1.2 is what we need)
        ici = _s("VkInstanceCreateInfo")
        ici.sType = vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO
        ici.pApplicationInfo = app
        pi = ffi.new("VkInstance*")
        _chk(lib.vkCreateInstance(ici, ffi.NULL, pi), "vkCreateInstance")
        self._inst = pi[0]

        n = ffi.new("uint32_t*")
        _chk(lib.vkEnumeratePhysicalDevices(self._inst, n, ffi.NULL), "vkEnumeratePhysicalDevices")
        if n[0] == 0:
            raise VulkanError("no Vulkan device")
        pds = ffi.new("VkPhysicalDevice[]", n[0])
        _chk(lib.vkEnumeratePhysicalDevices(self._inst, n, pds), "vkEnumeratePhysicalDevices")
        cands = []
        for i in range(n[0]):
            pr = _s("VkPhysicalDeviceProperties")
            lib.vkGetPhysicalDeviceProperties(pds[i], pr)
            cands.append((i, pds[i], pr.deviceType, ffi.string(pr.deviceName).decode(errors="replace")))
        idx = device_index if device_index is not None else _env_int("COLI_VK_DEV", -1)
        listed = ", ".join(f"{c[0]}: {c[3]}" for c in cands)
        if idx >= 0:
            if idx >= len(cands):
                raise VulkanError(f"{self._index_name or f'COLI_VK_DEV={idx}'}: no device {idx} (the Vulkan "
                                  f"device{'s are' if len(cands) > 1 else ' is'} {listed})")
            chosen = cands[idx]
        else:
            # a software rasterizer (Mesa's llvmpipe, type CPU) is slower than coli's own CPU kernels: never
            # picked for speed, only when named (an index) or allowed (COLI_VK_SOFTWARE=1, the tests' backend)
            pick = [c for c in cands if c[2] != _TYPE_CPU or _env_int("COLI_VK_SOFTWARE", 0)]
            if not pick:
                raise VulkanError(f"no GPU: the only Vulkan device{'s are' if len(cands) > 1 else ' is'} {listed}, "
                                  f"a software rasterizer (slower than coli's CPU kernels); name it to use it "
                                  f"anyway (--device vulkan:{cands[0][0]}, COLI_VK_DEV={cands[0][0]} or "
                                  f"COLI_VK_SOFTWARE=1)")
            chosen = min(pick, key=lambda c: (_TYPE_RANK.get(c[2], 9), c[0]))
        self.device_index, self._pd, dtype, self.name = chosen
        self.type_name = _TYPE_NAMES.get(dtype, "other")
        # a batch's join may poll its fence this long before it blocks in vkWaitForFences (a thread that slept
        # in the wait runs the next layer's Python ~2x slower); off by default: on the H200 it shortened the
        # fence wait but not the token (docs/vulkan.md "Fence wait")
        self.spin_s = _env_int("COLI_VK_SPIN_US", 0) / 1e6
        pd = self._pd

        # properties: subgroup, subgroup size control, limits
        props2 = _s("VkPhysicalDeviceProperties2")
        sgp = _s("VkPhysicalDeviceSubgroupProperties")
        sgc = _s("VkPhysicalDeviceSubgroupSizeControlProperties")
        props2.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2
        sgp.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES
        sgc.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_PROPERTIES
        exts = self._device_extensions()
        pr = _s("VkPhysicalDeviceProperties")
        lib.vkGetPhysicalDeviceProperties(pd, pr)
        api = pr.apiVersion
        v13 = (1 << 22) | (3 << 12)
        have_sgc = api >= v13 or "VK_EXT_subgroup_size_control" in exts
        props2.pNext = sgp
        if have_sgc:
            sgp.pNext = sgc
        lib.vkGetPhysicalDeviceProperties2(pd, props2)
        lim = props2.properties.limits
        self.api_version = f"{api >> 22}.{(api >> 12) & 0x3ff}.{api & 0xfff}"
        self.subgroup_size = int(sgp.subgroupSize)
        if not (sgp.supportedStages & _STAGE_COMPUTE) or not (sgp.supportedOperations & 0x8):
            raise VulkanError("no subgroup arithmetic in compute shaders")
        self.timestamp_period = float(lim.timestampPeriod)

        # features we need
        f2 = _s("VkPhysicalDeviceFeatures2")
        f11 = _s("VkPhysicalDeviceVulkan11Features")
        f12 = _s("VkPhysicalDeviceVulkan12Features")
        fsc = _s("VkPhysicalDeviceSubgroupSizeControlFeatures")
        f2.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2
        f11.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES
        f12.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES
        fsc.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_FEATURES
        f2.pNext = f11
        f11.pNext = f12
        if have_sgc:
            f12.pNext = fsc
        # VK_KHR_shader_integer_dot_product (core in 1.3): the int8-activation GEMV's OpSDot
        fdp = _s("VkPhysicalDeviceShaderIntegerDotProductFeatures")
        fdp.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_INTEGER_DOT_PRODUCT_FEATURES
        have_dp = api >= v13 or "VK_KHR_shader_integer_dot_product" in exts
        if have_dp:
            (fsc if have_sgc else f12).pNext = fdp
        # VK_KHR_cooperative_matrix: the prompt GEMM's float16 route (shaders/lmm_cm.comp)
        fcm = _s("VkPhysicalDeviceCooperativeMatrixFeaturesKHR")
        fcm.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR
        have_cm = "VK_KHR_cooperative_matrix" in exts
        if have_cm:
            fcm.pNext = f2.pNext
            f2.pNext = fcm
        lib.vkGetPhysicalDeviceFeatures2(pd, f2)
        #: True when lmm_cm.comp can run: 16 x 16 x 16 float16 products with float32 sums on a subgroup of 32 or 64
        #: (the workgroup of 128 holds 4 or 2 of them), float16 arithmetic and 31 KiB of shared memory
        self.coopmat = bool(have_cm and fcm.cooperativeMatrix and f12.shaderFloat16
                            and self.subgroup_size in (32, 64) and lim.maxComputeSharedMemorySize >= 32768
                            and self._coopmat_f16_16())
        #: True when the device's integer dot product (shaderIntegerDotProduct) is on: the int8 GEMV uses it
        self.int_dot = bool(have_dp and fdp.shaderIntegerDotProduct) and _env_int("COLI_VK_INT_DOT", 1) != 0
        self.i8_kernel = "gemv_i8dot" if self.int_dot else "gemv_i8emu"
        missing = [nm for nm, ok in (("shaderInt64", f2.features.shaderInt64),
                                     ("storageBuffer16BitAccess", f11.storageBuffer16BitAccess),
                                     ("storageBuffer8BitAccess", f12.storageBuffer8BitAccess),
                                     ("bufferDeviceAddress", f12.bufferDeviceAddress)) if not ok]
        if missing:
            raise VulkanError(f"device {self.name} lacks {', '.join(missing)}")
        #: True when timeline semaphores are on: device layers with experts on the CPU submit a token once
        #: (coli/vulkan/device_layers.py, docs/vulkan.md "Experts on the CPU")
        self.timeline = bool(f12.timelineSemaphore)
        sg_stages = sgc.requiredSubgroupSizeStages if have_sgc else 0
        self.subgroup_pinned = bool(have_sgc and fsc.subgroupSizeControl and (sg_stages & _STAGE_COMPUTE)
                                    and sgc.minSubgroupSize <= self.subgroup_size <= sgc.maxSubgroupSize)
        full_sg = bool(have_sgc and fsc.computeFullSubgroups)
        # lmm_cm.comp's blocks per subgroup follow the subgroup size: it must be the one the shader gets
        self.coopmat = self.coopmat and (self.subgroup_pinned or self.subgroup_size == 32)

        # queues: a compute family without graphics first (async compute), else any compute family
        qn = ffi.new("uint32_t*")
        lib.vkGetPhysicalDeviceQueueFamilyProperties(pd, qn, ffi.NULL)
        qf = ffi.new("VkQueueFamilyProperties[]", qn[0])
        lib.vkGetPhysicalDeviceQueueFamilyProperties(pd, qn, qf)
        self.queue_families = [(i, int(qf[i].queueFlags), int(qf[i].queueCount)) for i in range(qn[0])]
        comp = [i for i in range(qn[0]) if qf[i].queueFlags & _Q_COMPUTE]
        if not comp:
            raise VulkanError("no compute queue")
        own = [i for i in comp if not qf[i].queueFlags & _Q_GRAPHICS]
        self.queue_family = own[0] if own else comp[0]
        self.dedicated_compute_queue = bool(own)
        self.timestamp_bits = int(qf[self.queue_family].timestampValidBits)
        self.timestamps = self.timestamp_bits > 0 and self.timestamp_period > 0

        # device
        # a second queue of the family where it has one, at the lowest priority: the clock
        # holder of the device layers and the tier (coli/vulkan/layers.py, docs/vulkan.md "Clocks")
        nq = min(2, int(qf[self.queue_family].queueCount))
        prio = ffi.new("float[2]", [1.0, 0.0])
        qci = _s("VkDeviceQueueCreateInfo")
        qci.sType = vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO
        qci.queueFamilyIndex = self.queue_family
        qci.queueCount = nq
        qci.pQueuePriorities = prio
        e11 = _s("VkPhysicalDeviceVulkan11Features")
        e12 = _s("VkPhysicalDeviceVulkan12Features")
        esc = _s("VkPhysicalDeviceSubgroupSizeControlFeatures")
        ef2 = _s("VkPhysicalDeviceFeatures2")
        ef2.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2
        e11.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES
        e12.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES
        esc.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_FEATURES
        ef2.features.shaderInt64 = 1
        e11.storageBuffer16BitAccess = 1
        e12.storageBuffer8BitAccess = 1
        e12.bufferDeviceAddress = 1
        e12.timelineSemaphore = 1 if self.timeline else 0
        ef2.pNext = e11
        e11.pNext = e12
        if self.subgroup_pinned:
            esc.subgroupSizeControl = 1
            esc.computeFullSubgroups = 1 if full_sg else 0
            e12.pNext = esc
        edp = _s("VkPhysicalDeviceShaderIntegerDotProductFeatures")
        edp.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_INTEGER_DOT_PRODUCT_FEATURES
        if self.int_dot:
            edp.shaderIntegerDotProduct = 1
            (esc if self.subgroup_pinned else e12).pNext = edp
        ecm = _s("VkPhysicalDeviceCooperativeMatrixFeaturesKHR")
        ecm.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR
        if self.coopmat:
            ecm.cooperativeMatrix = 1
            e12.shaderFloat16 = 1
            ecm.pNext = ef2.pNext
            ef2.pNext = ecm
        want_ext = []
        if self.coopmat:
            want_ext.append("VK_KHR_cooperative_matrix")
        if self.int_dot and api < v13:
            want_ext.append("VK_KHR_shader_integer_dot_product")
        if self.subgroup_pinned and api < v13:
            want_ext.append("VK_EXT_subgroup_size_control")
        self.memory_budget_ext = "VK_EXT_memory_budget" in exts
        if self.memory_budget_ext:
            want_ext.append("VK_EXT_memory_budget")
        self._choose_zero_copy(exts)
        if self.zero_copy:
            want_ext.append("VK_EXT_external_memory_host")
        ext_c = [ffi.new("char[]", e.encode()) for e in want_ext]
        ext_arr = ffi.new("char*[]", ext_c) if ext_c else ffi.NULL
        dci = _s("VkDeviceCreateInfo")
        dci.sType = vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO
        dci.pNext = ef2
        dci.queueCreateInfoCount = 1
        dci.pQueueCreateInfos = qci
        dci.enabledExtensionCount = len(ext_c)
        dci.ppEnabledExtensionNames = ext_arr
        pdv = ffi.new("VkDevice*")
        _chk(lib.vkCreateDevice(pd, dci, ffi.NULL, pdv), "vkCreateDevice")
        self._dev = pdv[0]
        pq = ffi.new("VkQueue*")
        lib.vkGetDeviceQueue(self._dev, self.queue_family, 0, pq)
        self._queue = pq[0]
        self._queue2 = None
        if nq > 1:
            lib.vkGetDeviceQueue(self._dev, self.queue_family, 1, pq)
            self._queue2 = pq[0]
        self._full_sg = full_sg and self.subgroup_pinned
        self._init_host_import()
        heap_free = self._read_memory_types()
        self._choose_weight_memory(staging, block_bytes)
        self._set_budget(budget, heap_free)

        self._make_layouts()
        self._make_command_pool()
        self._load_kernels(spv)
        # the staging buffer and its command buffer
        self._staging_buf = None
        self._objs_ok = True

    def _coopmat_f16_16(self) -> bool:
        """Whether the device lists a subgroup-scope 16 x 16 x 16 cooperative matrix product of float16 A and B with
        float32 C and result (vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR)."""
        fn = lib.vkGetInstanceProcAddr(self._inst, b"vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
        if fn == ffi.NULL:
            return False
        get = ffi.cast("PFN_vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR", fn)
        n = ffi.new("uint32_t*")
        if get(self._pd, n, ffi.NULL) != 0 or n[0] == 0:
            return False
        arr = ffi.new("VkCooperativeMatrixPropertiesKHR[]", n[0])
        for i in range(n[0]):
            arr[i].sType = vk.VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR
        if get(self._pd, n, arr) != 0:
            return False
        f16, f32 = vk.VK_COMPONENT_TYPE_FLOAT16_KHR, vk.VK_COMPONENT_TYPE_FLOAT32_KHR
        return any(p.MSize == 16 and p.NSize == 16 and p.KSize == 16 and p.AType == f16 and p.BType == f16
                   and p.CType == f32 and p.ResultType == f32 and p.scope == vk.VK_SCOPE_SUBGROUP_KHR
                   for p in arr)

    def _device_extensions(self) -> set[str]:
        n = ffi.new("uint32_t*")
        lib.vkEnumerateDeviceExtensionProperties(self._pd, ffi.NULL, n, ffi.NULL)
        arr = ffi.new("VkExtensionProperties[]", n[0])
        lib.vkEnumerateDeviceExtensionProperties(self._pd, ffi.NULL, n, arr)
        return {ffi.string(arr[i].extensionName).decode() for i in range(n[0])}

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

    # -- experts -----------------------------------------------------------------------------------
    @staticmethod
    def expert_bytes(gate, up, down) -> int:
        """Device bytes an expert takes (each ``(type_name, raw, (O, I))``), before 256-byte alignment: rows of
        a float format padded to a multiple of 32 weights, gate and up to a multiple of 32 rows
        (:meth:`upload_expert`)."""
        D, Fp = int(down[2][0]), _ceil32(int(down[2][1]))
        return sum(row_bytes(t, _ceil32(int(s[1]))) * o for (t, _, s), o in ((gate, Fp), (up, Fp), (down, D)))

    def upload_expert(self, gate, up, down) -> ExpertHandle:
        """Copy one expert's three matrices to the device, in their GGUF block bytes (no requantization).

        Each argument is ``(type_name, raw uint8 [O, row_bytes], (O, I))``: gate and up ``(F, D)``,
        down ``(D, F)``; gate and up must share a format (the fused gate/up kernel decodes both).
        Any D and F: a float format's rows (F32/F16/BF16) are zero-padded on the device to a multiple of 32
        weights and gate/up to a multiple of 32 rows (``Dp``, ``Fp`` of the handle; zeros add nothing to
        the products), a block format's inner size is a multiple of its block (and of 32) by the format.
        Raises BudgetExceeded past the budget,
        ValueError for shapes/formats the kernels do not take, VulkanError when the driver refuses,
        DeviceLost after a device loss.
        """
        self._check_alive()
        (tg, _, sg), (tu, _, su), (td, _, sd) = gate, up, down
        F, D = int(sg[0]), int(sg[1])
        if tuple(map(int, su)) != (F, D) or tuple(map(int, sd)) != (D, F):
            raise ValueError(f"expert shapes gate {tuple(sg)}, up {tuple(su)}, down {tuple(sd)} do not agree")
        if tg != tu:
            raise ValueError(f"gate ({tg}) and up ({tu}) formats differ; the device kernel needs one")
        need = self.expert_bytes(gate, up, down)
        if self._alloc.used_bytes + self.imported_live + need > self.budget_bytes:
            raise BudgetExceeded(f"expert of {need} bytes does not fit: "
                                 f"{self._alloc.used_bytes + self.imported_live} of "
                                 f"{self.budget_bytes} budget bytes used")
        for t in (tg, td):
            self._pipeline("gemv", t, 1 if t == tg else 0)
        parts = []
        try:
            Fp = _ceil32(F)
            for spec, rows in ((gate, Fp), (up, Fp), (down, D)):
                parts.append(self._place(*spec, rows=rows, host=self.zero_copy))
        except BaseException:
            for t in parts:
                self._drop(t)
            raise
        h = ExpertHandle()
        h.id = self._next_handle
        self._next_handle += 1
        h.gate, h.up, h.down = parts
        h.D, h.F = D, F
        h.Dp, h.Fp = parts[0].I, parts[0].O       # the device's shape: x padded to Dp, h of Fp
        h.sig = (tg, td)
        h.addr6 = _addr6(h)
        h.nbytes = need
        h.uploaded = 0 if self.zero_copy else need    # bytes copied into device memory (zero-copy: none)
        h.last_batch = None
        h.freed = False
        self._handles[h.id] = h
        return h

    def free_expert(self, h: ExpertHandle) -> None:
        """Give an expert's memory back; waits for the last batch that reads it, if still running."""
        if h.freed:
            return
        b = h.last_batch
        if b is not None and b.frame is not None and not self.lost:
            lib.vkWaitForFences(self._dev, 1, b.frame.fence_arr, 1, 60 * 10**9)
        for t in (h.gate, h.up, h.down):
            self._drop(t)
        h.freed = True
        h.last_batch = None
        self._handles.pop(h.id, None)

    # -- batches -----------------------------------------------------------------------------------
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

    def supports_ffn(self, ffn) -> bool:
        """True when :meth:`submit_experts` computes experts with ``ffn`` (a ``cpu_kernels.experts.ExpertFFN``):
        SwiGLU or gpt-oss's clamped SwiGLU, with or without gate/up biases (the down bias is the caller's: it
        is added to the joined rows, ``scheduler.step``)."""
        from cpu_kernels import experts as grouped

        return ffn.kind in (grouped.ACT_SWIGLU, grouped.ACT_SWIGLU_OAI)

    def submit_experts(self, x: np.ndarray, pair_rows, pair_handles, clamp: float | None = None,
                       act: str | None = None, act_kind: int = 0, bias_gu: np.ndarray | None = None) -> Batch:
        """Run every (row, expert) pair of one MoE step in ONE command buffer; returns without waiting.

        x: f32 [R, D]; pair_rows: int [P] (rows of x); pair_handles: P ExpertHandles (one layer: same D, F).
        Per pair: h = SwiGLU(x[row] @ gate.T, x[row] @ up.T) (clamped: gate <= clamp, |up| <= clamp,
        clamp > 0), out = h @ down.T. ``Batch.join()`` gives f32 [P, D], unweighted, in pair order.
        ``act`` (default ``self.act``): "int8" rounds x (on the host, with the CPU's own
        ``quantize_act_int8``) before a quantized gate/up and h (on the device, shaders/act_q8.comp) before
        a quantized down, per block of 32 as the CPU's int8 path does (docs/vulkan.md "int8 activations");
        F32/F16/BF16 weights always take f32 activations, as on the CPU. ``act_kind``: 0 SwiGLU, 2 gpt-oss's
        ``(u + 1) * g * sigmoid(1.702 g)`` (``cpu_kernels.experts.ACT_SWIGLU_OAI``; the clamp as above);
        ``bias_gu``: f32 [P, 2F] per pair, the expert's gate bias then up bias, added to gate x and up x before
        the activation (every pair of one expert carries the same row). ValueError for another act or kind,
        a bias of the wrong shape, or a batch whose gate formats disagree on the activation rounding.
        """
        self._check_alive()
        act = self.act if act is None else act
        if act not in ("f32", "int8"):
            raise ValueError(f"act {act!r}: expected 'f32' or 'int8'")
        x = np.ascontiguousarray(x, dtype=np.float32)
        rows = np.asarray(pair_rows, dtype=np.int64).reshape(-1)
        P = rows.size
        if len(pair_handles) != P:
            raise ValueError(f"{P} pair rows but {len(pair_handles)} handles")
        if x.ndim != 2:
            raise ValueError(f"x must be [R, D], got shape {x.shape}")
        R, D = x.shape
        if P == 0:
            return Batch(self, None, 0, D)
        if rows.min() < 0 or rows.max() >= R:
            raise ValueError(f"pair rows out of range [0, {R})")
        if clamp is not None and not clamp > 0:
            raise ValueError(f"the device clamps SwiGLU only above 0 (clamp={clamp})")
        if act_kind not in (0, 2):
            raise ValueError(f"act_kind {act_kind}: the device computes 0 (SwiGLU) or 2 (gpt-oss's SwiGLU)")
        F = pair_handles[0].F
        if bias_gu is not None:
            bias_gu = np.ascontiguousarray(bias_gu, dtype=np.float32)
            if bias_gu.shape != (P, 2 * F):
                raise ValueError(f"bias_gu must be f32 [{P}, {2 * F}] (pairs, gate + up), got {list(bias_gu.shape)}")
        by_id: dict = {}
        sigs: dict = {}
        sig_by_id: dict = {}
        for i, h in enumerate(pair_handles):          # each distinct expert checked once
            if h.id in by_id:
                continue
            if h.freed or self._handles.get(h.id) is not h:
                raise ValueError(f"expert handle {h.id} was freed or is not this device's")
            if h.D != D or h.F != F:
                raise ValueError(f"pair {i}: expert D={h.D} F={h.F}, batch D={D} F={F}")
            by_id[h.id] = h
            sig_by_id[h.id] = sigs.setdefault(h.sig, len(sigs))
        # pairs sorted by (format signature, expert), stable: pairs of one expert keep their order
        if P <= 256:                                  # plain Python is faster than NumPy's calls here
            ids = [h.id for h in pair_handles]
            order_l = sorted(range(P), key=lambda q: (sig_by_id[ids[q]], ids[q]))
            groups, start = [], 0
            for q in range(1, P + 1):
                if q == P or ids[order_l[q]] != ids[order_l[start]]:
                    groups.append((by_id[ids[order_l[start]]], start, q - start))
                    start = q
            order = np.asarray(order_l, np.int64)
        else:
            ids = np.fromiter((h.id for h in pair_handles), np.int64, P)
            sig_of = np.fromiter((sig_by_id[h.id] for h in pair_handles), np.int64, P)
            order = np.lexsort((ids, sig_of))
            sid = ids[order]
            starts = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1]])
            counts = np.diff(np.r_[starts, P])
            groups = [(by_id[int(sid[a])], int(a), int(c)) for a, c in zip(starts, counts)]
        Dp, Fp = pair_handles[0].Dp, pair_handles[0].Fp    # the device's row lengths (multiples of 32)
        if Dp != D:                                   # float gate/up rows padded with zeros: x too
            x = np.pad(x, ((0, 0), (0, Dp - D)))
        if bias_gu is not None and Fp != F:           # gate/up padded with zero rows: their biases too
            bias_gu = np.pad(bias_gu.reshape(P, 2, F), ((0, 0), (0, 0), (0, Fp - F))).reshape(P, 2 * Fp)
        round_h = []                                  # (first sorted pair, pairs) whose h the device rounds
        i8 = False
        if act == "int8":
            gate_i8 = {_int8_format(sig[0]) for sig in sigs}
            if len(gate_i8) > 1:
                raise ValueError("act int8: the batch mixes quantized and float gate/up formats")
            # integer dot products (gemv_i8.glsl): Q8_0 experts, every group a GEMV group
            i8 = (self.i8 and set(sigs) == {("Q8_0", "Q8_0")}
                  and (self.gemm_rows <= 0 or max(c for _, _, c in groups) < self.gemm_rows))
            if i8:
                x = _pack_rows_int8(x)
            elif gate_i8.pop():
                x = _round_rows_int8(x)
            for h, s0, c in groups:                   # sorted by signature: each group's pairs are contiguous
                if _int8_format(h.sig[1]):
                    if round_h and round_h[-1][0] + round_h[-1][1] == s0:
                        round_h[-1] = (round_h[-1][0], round_h[-1][1] + c)
                    else:
                        round_h.append((s0, c))
        return self._record_submit(x=x, D=D, F=Fp, P=P, rows_sorted=rows[order], out_sorted=order,
                                   groups=groups, clamp=clamp, plain=False, round_h=round_h, i8=i8, Din=Dp,
                                   act_kind=act_kind, bias_gu=bias_gu)

    def matmul(self, type_name: str, raw: np.ndarray, shape, x: np.ndarray, act: str = "f32") -> np.ndarray:
        """y = x @ W.T on the device for one GGUF matrix W ``(type_name, raw [O, row_bytes], (O, I))``.

        x: f32 [T, I] -> f32 [T, O]. GEMV below ``COLI_VK_TIER_GEMM_ROWS`` rows, tiled GEMM from there.
        ``act`` "int8": x is rounded per 32 on the device (shaders/act_q8.comp, the kernel that rounds the
        expert batch's h) before a quantized W, as the CPU's int8 activations. The matrix is uploaded, used
        once and freed (a parity and benchmark path).
        """
        self._check_alive()
        if act not in ("f32", "int8"):
            raise ValueError(f"act {act!r}: expected 'f32' or 'int8'")
        x = np.ascontiguousarray(x, dtype=np.float32)
        O, I = int(shape[0]), int(shape[1])
        if x.ndim != 2 or x.shape[1] != I:
            raise ValueError(f"x must be [T, {I}], got {x.shape}")
        t = self._place(type_name, raw, shape)
        if t.I != I:                                  # a float row zero-padded to a multiple of 32: x too
            x = np.pad(x, ((0, 0), (0, t.I - I)))
            I = t.I
        try:
            self._pipeline("gemv", type_name, 0)
            T = x.shape[0]

            class _One:
                pass
            h = _One()
            h.gate = h.up = h.down = t
            h.sig = (type_name, type_name)
            h.last_batch = None
            rh = [(0, T)] if act == "int8" and _int8_format(type_name) else []
            i8 = bool(rh) and self.i8 and type_name == "Q8_0" and (self.gemm_rows <= 0 or T < self.gemm_rows)
            b = self._record_submit(x=x, D=O, F=I, P=T, rows_sorted=np.arange(T), out_sorted=np.arange(T),
                                    groups=[(h, 0, T)], clamp=None, plain=True, round_h=rh, i8=i8)
            return b.join()
        finally:
            if not self.lost:
                self._drop(t)

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
        tab = np.concatenate(parts)

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
                cb = cmd_arr[0]
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

    def measure_copy(self, nbytes: int = 1 << 30, reps: int = 5) -> dict:
        """Device-to-device copy bandwidth, bytes copied per second in GB/s, best of ``reps`` by timestamps.

        ``{"shader": <copy.comp, 16-byte loads>, "transfer": <vkCmdCopyBuffer on this queue>}``. Each byte
        is read once and written once: the DRAM traffic is twice these figures. A benchmark reference for
        scripts/bench/gpu_kernels.py; needs timestamps.
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

    # -- reporting and closing ---------------------------------------------------------------------
    def describe(self) -> str:
        """One line: device, type, API, subgroup, queue, heaps, placement, budget."""
        heaps = ", ".join(f"{sz / GiB:.1f} GiB{' device-local' if loc else ''}" for sz, loc in self.heaps)
        q = (f"own compute queue (family {self.queue_family})" if self.dedicated_compute_queue
             else f"shared queue (family {self.queue_family})")
        return (f"{self.name} ({self.type_name}, Vulkan {self.api_version}), subgroup {self.subgroup_size}"
                f"{' pinned' if self.subgroup_pinned else ''}, {q}, {len(self.queue_families)} queue "
                f"families, heaps: {heaps}, {'staged' if self.staging else 'mapped'} uploads, "
                f"{self.expert_mode()}, "
                f"budget {self.budget_bytes / GiB:.2f} GiB ({self.budget_rule}), int8 dot product "
                f"{'on' if self.int_dot else 'emulated'}")

    def expert_mode(self) -> str:
        """The experts' placement in words: ``experts mapped from RAM (zero-copy, <why>)`` or ``experts copied to the
        device (<why>)``."""
        return (f"experts mapped from RAM (zero-copy, {self.zero_copy_why})" if self.zero_copy
                else f"experts copied to the device ({self.zero_copy_why})")

    def timestamp_ms(self, qpool, n: int = 2):
        """Milliseconds between the two timestamps of ``qpool`` (:func:`timestamp_pool`) after their command buffer
        ran, or None when the results are not there; with ``n`` > 2 timestamps, the list of the ``n - 1`` gaps."""
        data = ffi.new(f"uint64_t[{n}]")
        if lib.vkGetQueryPoolResults(self._dev, qpool, 0, n, 8 * n, data, 8, vk.VK_QUERY_RESULT_64_BIT) != 0:
            return None
        mask = (1 << self.timestamp_bits) - 1 if self.timestamp_bits < 64 else (1 << 64) - 1
        gaps = [((int(data[i + 1]) - int(data[i])) & mask) * self.timestamp_period / 1e6 for i in range(n - 1)]
        return gaps[0] if n == 2 else gaps

    def report(self) -> str:
        """``[VK] <label>: N matmuls on the GPU`` (the line each run ends with), and ``, M dispatches of the device
        layers`` when they ran (coli/vulkan/layers.py)."""
        s = f"[VK] {self.label}: {self.matmuls} matmuls on the GPU"
        n = self.layer_dispatches
        return s + (f", {n} dispatches of the device layers" if n else "")

    def close(self) -> None:
        """Wait for the device and destroy every object; safe to call twice."""
        d = self._dev
        if d is not None:
            lib.vkDeviceWaitIdle(d)
            if getattr(self, "_layer_kernels", None) is not None:
                self._layer_kernels.close()      # coli/vulkan/layers.py: its pipelines and buffers
                self._layer_kernels = None
            for h in list(self._handles.values()):
                h.last_batch = None
                self.free_expert(h)
            for f in self._frames_all:
                f.destroy()
            self._frames_all, self._frames_free = [], []
            if getattr(self, "_iq_grids", None) is not None:
                self._iq_grids.destroy()
                self._iq_grids = None
            if getattr(self, "_staging_buf", None) is not None:
                self._staging_buf.destroy()
                lib.vkDestroyFence(d, self._staging_fence[0], ffi.NULL)
                self._staging_buf = None
            if getattr(self, "_copy_pipe", None) is not None:
                lib.vkDestroyPipeline(d, self._copy_pipe, ffi.NULL)
                lib.vkDestroyPipelineLayout(d, self._copy_layout, ffi.NULL)
                self._copy_pipe = None
            for p in self._pipes.values():
                lib.vkDestroyPipeline(d, p, ffi.NULL)
            self._pipes = {}
            for m in self._modules.values():
                lib.vkDestroyShaderModule(d, m, ffi.NULL)
            self._modules = {}
            for name, fn in (("_cmd_pool", lib.vkDestroyCommandPool), ("_desc_pool", lib.vkDestroyDescriptorPool),
                             ("_layout", lib.vkDestroyPipelineLayout), ("_dsl", lib.vkDestroyDescriptorSetLayout)):
                if getattr(self, name, None) is not None:
                    fn(d, getattr(self, name), ffi.NULL)
                    setattr(self, name, None)
            lib.vkDestroyDevice(d, ffi.NULL)
            self._dev = None
        if getattr(self, "_inst", None) is not None:
            lib.vkDestroyInstance(self._inst, ffi.NULL)
            self._inst = None
        self._objs_ok = False