"""Opening a Vulkan device: the instance, the physical device's choice (``COLI_VK_DEV``, ``COLI_VK_SOFTWARE``), its
properties and features (subgroups, integer dot product, cooperative matrices, timeline semaphores), the queue
family and the logical device with the features and extensions coli uses (docs/vulkan.md "Device choice and
queues").
"""
from __future__ import annotations

import threading

from .binding import (
    _Q_COMPUTE,
    _Q_GRAPHICS,
    _STAGE_COMPUTE,
    _TYPE_CPU,
    _chk,
    _env_int,
    _s,
    ffi,
    lib,
    vk,
)
from .errors import VulkanError

_TYPE_NAMES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
_TYPE_RANK = {2: 0, 1: 1, 3: 2, 4: 3, 0: 4}       # discrete > integrated > virtual > CPU
_V13 = (1 << 22) | (3 << 12)                        # VK_API_VERSION_1_3
# the process's one VkInstance, made at the first open and kept until the process ends: NVIDIA's driver (H100,
# 2026-12-07) refused the 31st vkCreateInstance of a process that had created and destroyed 30 (VkResult -9,
# VK_ERROR_INCOMPATIBLE_DRIVER; file descriptors and threads flat), where each open made and destroyed its own
_INSTANCE = None
_INSTANCE_LOCK = threading.Lock()


class InstanceMixin:
    """The opening steps of ``device.Device`` up to the logical device and its queues, in the order ``Device._open``
    calls them; each sets the figures it reads (``name``, ``type_name``, ``api_version``, ``subgroup_size``,
    ``subgroup_pinned``, ``coopmat``, ``int_dot``, ``timeline``, ``queue_family``, ``timestamps`` ...) and raises
    VulkanError where the device cannot serve."""

    def _create_instance(self) -> None:
        """The Vulkan instance (``_inst``): the process's one, asking for API 1.3, made at the first open (every
        device opened in the process shares it; no device destroys it)."""
        global _INSTANCE
        with _INSTANCE_LOCK:
            if _INSTANCE is None:
                _INSTANCE = _new_instance()
            self._inst = _INSTANCE

        app = _s("VkApplicationInfo")

    def _choose_physical_device(self, device_index: int | None) -> None:
        """``device_index``, ``_pd``, ``name`` and ``type_name`` of the device to open: ``device_index`` (else
        ``COLI_VK_DEV``) when given, else the best type (discrete > integrated > virtual), a software rasterizer only
        with ``COLI_VK_SOFTWARE=1``. VulkanError naming the devices there are when none fits."""
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

    def _read_properties(self, exts: set[str]) -> tuple:
        """``api_version``, ``subgroup_size`` and ``timestamp_period``; VulkanError without subgroup arithmetic in
        compute shaders. Returns ``(api, have_sgc, sgc, shared_mem)``: the API version word, whether subgroup size
        control is there, its properties (VkPhysicalDeviceSubgroupSizeControlProperties) and the bytes of shared
        memory a workgroup may have."""
        # properties: subgroup, subgroup size control, limits
        props2 = _s("VkPhysicalDeviceProperties2")
        sgp = _s("VkPhysicalDeviceSubgroupProperties")
        sgc = _s("VkPhysicalDeviceSubgroupSizeControlProperties")
        props2.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2
        sgp.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES
        sgc.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_PROPERTIES
        pr = _s("VkPhysicalDeviceProperties")
        lib.vkGetPhysicalDeviceProperties(self._pd, pr)
        api = pr.apiVersion
        have_sgc = api >= _V13 or "VK_EXT_subgroup_size_control" in exts
        props2.pNext = sgp
        if have_sgc:
            sgp.pNext = sgc
        lib.vkGetPhysicalDeviceProperties2(self._pd, props2)
        lim = props2.properties.limits
        self.api_version = f"{api >> 22}.{(api >> 12) & 0x3ff}.{api & 0xfff}"
        self.subgroup_size = int(sgp.subgroupSize)
        if not (sgp.supportedStages & _STAGE_COMPUTE) or not (sgp.supportedOperations & 0x8):
            raise VulkanError("no subgroup arithmetic in compute shaders")
        self.timestamp_period = float(lim.timestampPeriod)
        return api, have_sgc, sgc, int(lim.maxComputeSharedMemorySize)

    def _read_features(self, exts: set[str], api: int, have_sgc: bool, sgc, shared_mem: int) -> None:
        """``coopmat``, ``int_dot`` and ``i8_kernel``, ``timeline``, ``subgroup_pinned`` and ``_full_sg`` from the
        device's features (``_read_properties``' figures); VulkanError naming a feature coli cannot run
        without."""
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
        have_dp = api >= _V13 or "VK_KHR_shader_integer_dot_product" in exts
        if have_dp:
            (fsc if have_sgc else f12).pNext = fdp
        # VK_KHR_cooperative_matrix: the prompt GEMM's float16 route (shaders/lmm_cm.comp)
        fcm = _s("VkPhysicalDeviceCooperativeMatrixFeaturesKHR")
        fcm.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR
        have_cm = "VK_KHR_cooperative_matrix" in exts
        if have_cm:
            fcm.pNext = f2.pNext
            f2.pNext = fcm
        lib.vkGetPhysicalDeviceFeatures2(self._pd, f2)
        #: True when lmm_cm.comp can run: 16 x 16 x 16 float16 products with float32 sums on a subgroup of 32 or 64
        #: (the workgroup of 128 holds 4 or 2 of them), float16 arithmetic and 38 KiB of shared memory
        self.coopmat = bool(have_cm and fcm.cooperativeMatrix and f12.shaderFloat16
                            and self.subgroup_size in (32, 64) and shared_mem >= 38912
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
        self._full_sg = full_sg and self.subgroup_pinned

    def _choose_queue_family(self) -> None:
        """``queue_families`` ((index, flags, count) each), ``queue_family`` (a compute family without graphics
        first), ``dedicated_compute_queue``, ``timestamp_bits`` and ``timestamps``; VulkanError without one."""
        # queues: a compute family without graphics first (async compute), else any compute family
        qn = ffi.new("uint32_t*")
        lib.vkGetPhysicalDeviceQueueFamilyProperties(self._pd, qn, ffi.NULL)
        qf = ffi.new("VkQueueFamilyProperties[]", qn[0])
        lib.vkGetPhysicalDeviceQueueFamilyProperties(self._pd, qn, qf)
        self.queue_families = [(i, int(qf[i].queueFlags), int(qf[i].queueCount)) for i in range(qn[0])]
        comp = [i for i in range(qn[0]) if qf[i].queueFlags & _Q_COMPUTE]
        if not comp:
            raise VulkanError("no compute queue")
        own = [i for i in comp if not qf[i].queueFlags & _Q_GRAPHICS]
        self.queue_family = own[0] if own else comp[0]
        self.dedicated_compute_queue = bool(own)
        self.timestamp_bits = int(qf[self.queue_family].timestampValidBits)
        self.timestamps = self.timestamp_bits > 0 and self.timestamp_period > 0

    def _create_logical_device(self, exts: set[str], api: int) -> None:
        """The logical device ``_dev`` with the features and extensions chosen above (and VK_EXT_memory_budget,
        the zero-copy import where ``_choose_zero_copy`` wants it), its queue ``_queue`` and, where the family has
        two, ``_queue2`` at the lowest priority."""
        # a second queue of the family where it has one, at the lowest priority: the clock
        # holder of the device layers and the tier (coli/vulkan/layers.py, docs/vulkan.md "Clocks")
        nq = min(2, self.queue_families[self.queue_family][2])
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
            esc.computeFullSubgroups = 1 if self._full_sg else 0
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
        if self.int_dot and api < _V13:
            want_ext.append("VK_KHR_shader_integer_dot_product")
        if self.subgroup_pinned and api < _V13:
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
        _chk(lib.vkCreateDevice(self._pd, dci, ffi.NULL, pdv), "vkCreateDevice")
        self._dev = pdv[0]
        pq = ffi.new("VkQueue*")
        lib.vkGetDeviceQueue(self._dev, self.queue_family, 0, pq)
        self._queue = pq[0]
        self._queue2 = None
        if nq > 1:
            lib.vkGetDeviceQueue(self._dev, self.queue_family, 1, pq)
            self._queue2 = pq[0]

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
        """The names of the physical device's extensions."""
        n = ffi.new("uint32_t*")
        lib.vkEnumerateDeviceExtensionProperties(self._pd, ffi.NULL, n, ffi.NULL)
        arr = ffi.new("VkExtensionProperties[]", n[0])
        lib.vkEnumerateDeviceExtensionProperties(self._pd, ffi.NULL, n, arr)
        return {ffi.string(arr[i].extensionName).decode() for i in range(n[0])}


def _new_instance():
    """A new ``VkInstance`` asking for API 1.3 (1.2 is what coli needs); VulkanError when the loader refuses."""
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
    return pi[0]
