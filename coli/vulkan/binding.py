"""The ``vulkan`` binding's raw cffi layer as the device modules call it: numeric constants, result checks,
struct allocation, the device's ``COLI_VK_*`` integers, fences and timestamp pools.

Importing it imports the ``vulkan`` binding, which dlopens ``libvulkan.so.1`` and raises OSError where there is
none (``coli.vulkan.open_device`` imports it only when a device is asked for). Calls go through the binding's
raw cffi layer (``vk.ffi`` / ``vk.lib``): the wrappers cost 2-8 us a call, raise exceptions for success codes
and return the wrong value for vkGetBufferDeviceAddress (the PyPI ``vulkan`` package, 1.3.275.1).
"""
from __future__ import annotations

import vulkan as vk

from coli.base import settings

from .errors import DeviceLost, VulkanError

ffi, lib = vk.ffi, vk.lib
GiB = 1 << 30
MiB = 1 << 20

# numeric Vulkan constants the binding lacks or spells differently (values from vulkan_core.h)
_DEVICE_ADDRESS_BIT = 0x2              # VK_MEMORY_ALLOCATE_DEVICE_ADDRESS_BIT
_USAGE_STORAGE = 0x20                  # VK_BUFFER_USAGE_STORAGE_BUFFER_BIT
_USAGE_XFER_SRC, _USAGE_XFER_DST = 0x1, 0x2
_USAGE_ADDRESS = 0x20000               # VK_BUFFER_USAGE_SHADER_DEVICE_ADDRESS_BIT
_MEM_DEVICE_LOCAL, _MEM_HOST_VISIBLE, _MEM_HOST_COHERENT, _MEM_HOST_CACHED = 0x1, 0x2, 0x4, 0x8
_HEAP_DEVICE_LOCAL = 0x1
_Q_GRAPHICS, _Q_COMPUTE = 0x1, 0x2
_STAGE_COMPUTE = 0x20                  # VK_SHADER_STAGE_COMPUTE_BIT
_PSTAGE_TOP, _PSTAGE_COMPUTE, _PSTAGE_TRANSFER, _PSTAGE_BOTTOM, _PSTAGE_HOST = 0x1, 0x800, 0x1000, 0x2000, 0x4000
_ACC_SHADER_READ, _ACC_SHADER_WRITE, _ACC_XFER_WRITE, _ACC_HOST_READ = 0x20, 0x40, 0x1000, 0x2000
_FULL_SUBGROUPS = 0x2                  # VK_PIPELINE_SHADER_STAGE_CREATE_REQUIRE_FULL_SUBGROUPS_BIT
_DEVICE_LOST = -4
_HOST_ALLOCATION = 0x80                # VK_EXTERNAL_MEMORY_HANDLE_TYPE_HOST_ALLOCATION_BIT_EXT
_TIMEOUT, _NOT_READY = 2, 1
_TYPE_CPU = 4                          # VK_PHYSICAL_DEVICE_TYPE_CPU: a software rasterizer (llvmpipe)


def _chk(res: int, what: str) -> None:
    if res == 0:
        return
    if res == _DEVICE_LOST:
        raise DeviceLost(f"{what}: device lost")
    raise VulkanError(f"{what} failed (VkResult {res})")


def _env_int(name: str, default: int) -> int:
    """``COLI_*`` integer through coli.base.settings (one parser, errors naming the variable)."""
    v = settings.get(name)
    return default if v is None else int(v)


def _env_float(name: str, default: float | None) -> float | None:
    v = settings.get(name)
    return default if v is None else float(v)


def _s(st):
    return ffi.new(st + "*")


def new_fence(d) -> object:
    """An unsignalled ``VkFence[1]`` on device ``d``."""
    fci = _s("VkFenceCreateInfo")
    fci.sType = vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO
    f = ffi.new("VkFence[1]")
    _chk(lib.vkCreateFence(d, fci, ffi.NULL, f), "vkCreateFence")
    return f


def timestamp_pool(d, n: int = 2) -> object:
    """A query pool of ``n`` timestamps (two: a command buffer's first and last) on device ``d``."""
    qci = _s("VkQueryPoolCreateInfo")
    qci.sType = vk.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO
    qci.queryType = vk.VK_QUERY_TYPE_TIMESTAMP
    qci.queryCount = n
    pq = ffi.new("VkQueryPool*")
    _chk(lib.vkCreateQueryPool(d, qci, ffi.NULL, pq), "vkCreateQueryPool")
    return pq[0]
