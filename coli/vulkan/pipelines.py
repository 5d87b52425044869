"""Pipelines and kernels: the SPIR-V modules (``shaders/``), the expert batch's descriptor set layout, pool and
pipeline layout, the i-quant grids at binding 6, and the compute pipelines per (kernel, format, mode) with their
specialization constants and required subgroup size (docs/vulkan.md "Shaders").
"""
from __future__ import annotations

import numpy as np

from coli.types import iq_tables

from . import shaders as S
from .binding import (
    _FULL_SUBGROUPS,
    _MEM_DEVICE_LOCAL,
    _MEM_HOST_COHERENT,
    _MEM_HOST_VISIBLE,
    _STAGE_COMPUTE,
    _USAGE_STORAGE,
    _chk,
    _env_int,
    _s,
    ffi,
    lib,
    vk,
)
from .errors import VulkanError
from .memory import _Buf

_PC_WORDS = 10     # push constants (shaders/common.glsl)


def storage_set_layout(d, bindings) -> object:
    """A descriptor set layout of one storage buffer at each of ``bindings`` (compute stage) on device ``d``."""
    bindings = list(bindings)
    b = ffi.new("VkDescriptorSetLayoutBinding[]", len(bindings))
    for j, n in enumerate(bindings):
        b[j].binding = n
        b[j].descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
        b[j].descriptorCount = 1
        b[j].stageFlags = _STAGE_COMPUTE
    lci = _s("VkDescriptorSetLayoutCreateInfo")
    lci.sType = vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO
    lci.bindingCount = len(bindings)
    lci.pBindings = b
    p = ffi.new("VkDescriptorSetLayout*")
    _chk(lib.vkCreateDescriptorSetLayout(d, lci, ffi.NULL, p), "vkCreateDescriptorSetLayout")
    return p[0]


def push_constant_layout(d, dsl, pc_bytes: int) -> object:
    """A pipeline layout of the one set layout ``dsl`` and ``pc_bytes`` of push constants (compute stage)."""
    pcr = _s("VkPushConstantRange")
    pcr.stageFlags = _STAGE_COMPUTE
    pcr.offset = 0
    pcr.size = pc_bytes
    plci = _s("VkPipelineLayoutCreateInfo")
    plci.sType = vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO
    arr = ffi.new("VkDescriptorSetLayout[1]", [dsl])
    plci.setLayoutCount = 1
    plci.pSetLayouts = arr
    plci.pushConstantRangeCount = 1
    plci.pPushConstantRanges = pcr
    pl = ffi.new("VkPipelineLayout*")
    _chk(lib.vkCreatePipelineLayout(d, plci, ffi.NULL, pl), "vkCreatePipelineLayout")
    return pl[0]


class PipelineMixin:
    """The kernels of ``device.Device``: reads the shaders before the device opens, then makes the descriptor
    set layout, pools and pipeline layout, the shader modules (those the device's features allow) and the
    pipelines on demand, cached per (kernel, type_name, mode). Needs the opened device (``_dev``,
    ``subgroup_size``, ``subgroup_pinned``, ``int_dot``, ``coopmat``) from the other parts."""

    @staticmethod
    def _read_spirv() -> dict:
        """Every built kernel's SPIR-V bytes by (kernel, type_name); VulkanError naming a missing ``.spv``
        (a reason not to open, checked before the instance is made)."""
        sdir = S.shader_dir()
        spv = {}
        for k, t in S.builds():
            p = sdir / S.spv_name(k, t)
            if not p.exists():
                raise VulkanError(f"missing shaders ({p})")
            spv[(k, t)] = p.read_bytes()
        return spv

    def _make_layouts(self):
        """The expert batch's descriptor set layout (7 storage buffers), its pipeline layout (``_PC_WORDS`` words
        of push constants) and a descriptor pool for the two sets of each of 64 frames."""
        d = self._dev
        self._dsl = storage_set_layout(d, range(7))
        self._layout = push_constant_layout(d, self._dsl, 4 * _PC_WORDS)
        ps = ffi.new("VkDescriptorPoolSize[1]")
        ps[0].type = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
        ps[0].descriptorCount = 7 * 2 * 64
        dpci = _s("VkDescriptorPoolCreateInfo")
        dpci.sType = vk.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO
        dpci.maxSets = 2 * 64
        dpci.poolSizeCount = 1
        dpci.pPoolSizes = ps
        pp = ffi.new("VkDescriptorPool*")
        _chk(lib.vkCreateDescriptorPool(d, dpci, ffi.NULL, pp), "vkCreateDescriptorPool")
        self._desc_pool = pp[0]

    def _load_kernels(self, spv: dict) -> None:
        """The i-quant grids' buffer, a shader module per kernel of ``spv`` the device can run (the int8 dot
        product and cooperative-matrix kernels only with their features), and the GEMV's geometry."""
        # binding 6: the i-quant grids (coli/types/iq_tables.py, read by shaders/fmt_iq*.glsl), uploaded once
        words, _ = iq_tables.device_grids()
        self._iq_grids = _Buf(self, words.nbytes, _USAGE_STORAGE, _MEM_HOST_VISIBLE | _MEM_HOST_COHERENT,
                              _MEM_DEVICE_LOCAL)
        self._iq_grids.view[:] = words.view(np.uint8)
        for (k, t), code in spv.items():
            if k == "gemv_i8dot" and not self.int_dot:
                continue                    # its OpSDot needs the feature
            if (k in S.COOP_KERNELS or k in S.COOP_EXTRA) and not self.coopmat:
                continue                    # cooperative matrices
            smci = _s("VkShaderModuleCreateInfo")
            smci.sType = vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO
            smci.codeSize = len(code)
            buf = ffi.from_buffer("uint32_t[]", code)
            smci.pCode = buf
            pm = ffi.new("VkShaderModule*")
            r = lib.vkCreateShaderModule(self._dev, smci, ffi.NULL, pm)
            if r != 0 and k == "gemv_i8dot":    # the driver refuses OpSDot: the emulated kernel instead
                self.int_dot, self.i8_kernel = False, "gemv_i8emu"
                continue
            _chk(r, f"vkCreateShaderModule({k}_{t})")
            self._modules[(k, t)] = pm[0]
        # GEMV: a workgroup of 4 subgroups (at least 32 lanes), one output row per subgroup
        self.gemv_wg = max(32, min(256, 4 * self.subgroup_size))
        # output rows a GEMV workgroup owns (a subgroup carries 4 at once): COLI_VK_GEMV_ROWS
        self.gemv_rows = max(1, _env_int("COLI_VK_GEMV_ROWS", 4 * (self.gemv_wg // self.subgroup_size)))
        # units (of 32 inputs) of the activation rows the GEMV stages in shared memory at a time: a multiple
        # of the subgroup size keeps every lane busy (32 KiB of shared memory at most for 64)
        self.gemv_chunk = max(32, self.subgroup_size)

    def _pipeline(self, kernel: str, type_name: str, mode: int):
        if kernel == "gemv_i8dot":
            try:
                return self._make_pipeline(kernel, type_name, mode)
            except VulkanError:      # the driver refuses the OpSDot pipeline: the emulated kernel from now on
                self.int_dot, self.i8_kernel = False, "gemv_i8emu"
                kernel = "gemv_i8emu"
        return self._make_pipeline(kernel, type_name, mode)

    def _make_pipeline(self, kernel: str, type_name: str, mode: int):
        key = (kernel, type_name, mode)
        p = self._pipes.get(key)
        if p is not None:
            return p
        if kernel.startswith("gemv"):
            vals = [self.gemv_wg, self.gemv_rows, mode, self.gemv_chunk]
            ids = [0, 1, 2, 3]
        else:
            vals = [mode]
            ids = [2]
        pipe = self.compute_pipeline(self._modules[(kernel, type_name)], self._layout, vals, ids,
                                     self.gemv_wg if kernel.startswith("gemv") else None, f"{kernel}_{type_name}")
        self._pipes[key] = pipe
        return pipe

    def compute_pipeline(self, module, layout, vals, ids, pin_wg: int | None, what: str):
        """A compute pipeline of ``module`` (entry ``main``) with specialization constants ``ids`` = ``vals`` (uint32)
        on ``layout``; with ``pin_wg`` (its workgroup size) the device's subgroup size is required where it can be
        pinned, and full subgroups where the size divides it. ``what`` names it in a VulkanError."""
        data = ffi.new("uint32_t[]", vals)
        ents = ffi.new("VkSpecializationMapEntry[]", len(vals))
        for j, cid in enumerate(ids):
            ents[j].constantID = cid
            ents[j].offset = 4 * j
            ents[j].size = 4
        si = _s("VkSpecializationInfo")
        si.mapEntryCount = len(vals)
        si.pMapEntries = ents
        si.dataSize = 4 * len(vals)
        si.pData = data
        name = ffi.new("char[]", b"main")
        cpi = _s("VkComputePipelineCreateInfo")
        cpi.sType = vk.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO
        cpi.stage.sType = vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO
        cpi.stage.stage = _STAGE_COMPUTE
        cpi.stage.module = module
        cpi.stage.pName = name
        cpi.stage.pSpecializationInfo = si
        rss = _s("VkPipelineShaderStageRequiredSubgroupSizeCreateInfo")
        if pin_wg is not None and self.subgroup_pinned:
            rss.sType = vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_REQUIRED_SUBGROUP_SIZE_CREATE_INFO
            rss.requiredSubgroupSize = self.subgroup_size
            cpi.stage.pNext = rss
            if self._full_sg and pin_wg % self.subgroup_size == 0:
                cpi.stage.flags = _FULL_SUBGROUPS
        cpi.layout = layout
        pp = ffi.new("VkPipeline*")
        _chk(lib.vkCreateComputePipelines(self._dev, ffi.NULL, 1, cpi, ffi.NULL, pp),
             f"vkCreateComputePipelines({what})")
        return pp[0]

    def _copy_pipeline(self):
        if getattr(self, "_copy_pipe", None) is None:
            pcr = _s("VkPushConstantRange")
            pcr.stageFlags, pcr.offset, pcr.size = _STAGE_COMPUTE, 0, 20
            plci = _s("VkPipelineLayoutCreateInfo")
            plci.sType = vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO
            plci.pushConstantRangeCount = 1
            plci.pPushConstantRanges = pcr
            pl = ffi.new("VkPipelineLayout*")
            _chk(lib.vkCreatePipelineLayout(self._dev, plci, ffi.NULL, pl), "vkCreatePipelineLayout")
            self._copy_layout = pl[0]
            name = ffi.new("char[]", b"main")
            cpi = _s("VkComputePipelineCreateInfo")
            cpi.sType = vk.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO
            cpi.stage.sType = vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO
            cpi.stage.stage = _STAGE_COMPUTE
            cpi.stage.module = self._modules[("copy", None)]
            cpi.stage.pName = name
            cpi.layout = self._copy_layout
            pp = ffi.new("VkPipeline*")
            _chk(lib.vkCreateComputePipelines(self._dev, ffi.NULL, 1, cpi, ffi.NULL, pp), "vkCreateComputePipelines(copy)")
            self._copy_pipe = pp[0]
        return self._copy_pipe
