"""Device memory: memory types and heaps, the weights' placement (mapped or staged) and budget, the block
allocator's driver side, scratch buffers, zero-copy host mappings and ``memory_stats`` (docs/vulkan.md "Memory").

Each weight tensor is a VkBuffer bound at an offset inside a 256 MiB device-memory block (``alloc.BlockAllocator``),
read by the shaders through its buffer device address; on a zero-copy device an expert's host bytes are imported
as device memory instead (VK_EXT_external_memory_host, docs/vulkan.md "Zero-copy experts").
"""
from __future__ import annotations

import mmap

import numpy as np

from coli.base import settings
from coli.base.errors import ColiError
from coli.types import table as TT

from . import shaders as S
from .alloc import BlockAllocator
from .binding import (
    _ACC_SHADER_READ,
    _ACC_XFER_WRITE,
    _DEVICE_ADDRESS_BIT,
    _HEAP_DEVICE_LOCAL,
    _HOST_ALLOCATION,
    _MEM_DEVICE_LOCAL,
    _MEM_HOST_CACHED,
    _MEM_HOST_COHERENT,
    _MEM_HOST_VISIBLE,
    _PSTAGE_COMPUTE,
    _PSTAGE_TRANSFER,
    _USAGE_ADDRESS,
    _USAGE_STORAGE,
    _USAGE_XFER_DST,
    _USAGE_XFER_SRC,
    MiB,
    _chk,
    _s,
    ffi,
    lib,
    new_fence,
    vk,
)
from .errors import VulkanError

_SHARED_TYPES = ("integrated", "cpu")  # devices whose memory is the CPU's DRAM: zero-copy by default


def row_bytes(type_name: str, inner: int) -> int:
    """Bytes of one row of ``inner`` elements in GGUF format ``type_name`` (geometry: ``coli.types.table``)."""
    t = TT.get(type_name)
    return inner // t.block_size * t.type_size


def _ceil32(n: int) -> int:
    """``n`` rounded up to the device's unit of 32 inputs."""
    return (int(n) + 31) // 32 * 32


def _pad_rows(type_name: str, raw: np.ndarray, O: int, I: int, Op: int, Ip: int) -> np.ndarray:
    """GGUF bytes of an [O, I] matrix as an [Op, Ip] one: zero rows appended (O -> Op) and, for a float format
    (F32/F16/BF16: one weight per block), every row zero-padded from I to Ip weights. Zero bytes decode to
    0.0 in every format, so the padded products and SwiGLU(0, 0) add nothing: the device sees a row length
    that is a multiple of its unit of 32 (docs/vulkan.md "Row lengths"). uint8 [Op, row_bytes(Ip)]."""
    rb, rbp = row_bytes(type_name, I), row_bytes(type_name, Ip)
    out = np.zeros((Op, rbp), np.uint8)
    out[:O, :rb] = np.asarray(raw).reshape(O, rb)
    return out


class _Tensor:
    __slots__ = ("type_name", "O", "I", "alloc", "buffer", "addr", "nbytes", "memory", "host")


class _Buf:
    """A buffer with its own memory (scratch, staging, step tables)."""

    def __init__(self, dev: MemoryMixin, size: int, usage: int, req: int, pref: int, address: bool = False):
        self.dev, self.size = dev, size
        d = dev._dev
        bci = _s("VkBufferCreateInfo")
        bci.sType = vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO
        bci.size = size
        bci.usage = usage
        p = ffi.new("VkBuffer*")
        _chk(lib.vkCreateBuffer(d, bci, ffi.NULL, p), "vkCreateBuffer")
        self.buffer = p[0]
        self.memory = None
        try:
            mr = _s("VkMemoryRequirements")
            lib.vkGetBufferMemoryRequirements(d, self.buffer, mr)
            t = dev._pick_type(mr.memoryTypeBits, req, pref)
            mai = _s("VkMemoryAllocateInfo")
            mai.sType = vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO
            mai.allocationSize = mr.size
            mai.memoryTypeIndex = t
            fl = _s("VkMemoryAllocateFlagsInfo")
            if address:
                fl.sType = vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO
                fl.flags = _DEVICE_ADDRESS_BIT
                mai.pNext = fl
            pm = ffi.new("VkDeviceMemory*")
            _chk(lib.vkAllocateMemory(d, mai, ffi.NULL, pm), f"vkAllocateMemory({mr.size} bytes)")
            self.memory = pm[0]
            _chk(lib.vkBindBufferMemory(d, self.buffer, self.memory, 0), "vkBindBufferMemory")
            self.view = None
            self.addr = 0
            if address:
                ai = _s("VkBufferDeviceAddressInfo")
                ai.sType = vk.VK_STRUCTURE_TYPE_BUFFER_DEVICE_ADDRESS_INFO
                ai.buffer = self.buffer
                self.addr = int(lib.vkGetBufferDeviceAddress(d, ai))
            if req & _MEM_HOST_VISIBLE:
                pp = ffi.new("void**")
                _chk(lib.vkMapMemory(d, self.memory, 0, size, 0, pp), "vkMapMemory")
                self.view = np.frombuffer(ffi.buffer(pp[0], size), np.uint8)
        except BaseException:
            self.destroy()
            raise

    def destroy(self):
        d = self.dev._dev
        if self.buffer is not None:
            lib.vkDestroyBuffer(d, self.buffer, ffi.NULL)
            self.buffer = None
        if self.memory is not None:
            lib.vkFreeMemory(d, self.memory, ffi.NULL)
            self.memory = None
        self.view = None


class _Block:
    """A device-memory block of the weight allocator (mapped when the weights are written in place)."""
    __slots__ = ("memory", "view", "size")


class MemoryMixin:
    """The memory side of ``device.Device``: reads the memory types and heaps, chooses the experts' placement
    (zero-copy or copied; mapped or staged) and the budget while the device opens, places and drops weight
    tensors (in allocator blocks, or imported from the host), and reports ``memory_stats``. Needs the opened
    device (``_dev``, ``_pd``, ``_queue``, ``_cmd_pool``, ``name``, ``type_name``) from the other parts."""

    # -- opening steps -----------------------------------------------------------------------------
    def _choose_zero_copy(self, exts: set[str]) -> None:
        """``zero_copy`` and ``zero_copy_why`` from ``COLI_VK_ZERO_COPY`` (auto, on, off), the device's type and
        its extensions ``exts``. ColiError for "on" without VK_EXT_external_memory_host (another value: the settings')."""
        # zero-copy experts: host memory imported as device memory (VK_EXT_external_memory_host) instead of copies
        zc = settings.get("COLI_VK_ZERO_COPY")
        has_host = "VK_EXT_external_memory_host" in exts
        if zc == "on" and not has_host:
            raise ColiError(f"COLI_VK_ZERO_COPY=on: {self.name} lacks VK_EXT_external_memory_host (host memory "
                            f"imported as device memory); set auto or off")
        self.zero_copy = has_host and (zc == "on" or zc == "auto" and self.type_name in _SHARED_TYPES)
        self.zero_copy_why = ("COLI_VK_ZERO_COPY=on" if zc == "on" else
                              f"auto: a {self.type_name} device" + ("" if has_host or zc == "off" else
                                                                    " without VK_EXT_external_memory_host")
                              if zc == "auto" else "COLI_VK_ZERO_COPY=off")

    def _init_host_import(self) -> None:
        """After the device is made: the zero-copy mode's host pointer alignment and entry point, and its
        counters. VulkanError when the extension's function is missing."""
        self.host_align = 4096
        self._host_ptr_props = None
        if self.zero_copy:
            hp = _s("VkPhysicalDeviceExternalMemoryHostPropertiesEXT")
            hp.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_EXTERNAL_MEMORY_HOST_PROPERTIES_EXT
            p2 = _s("VkPhysicalDeviceProperties2")
            p2.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2
            p2.pNext = hp
            lib.vkGetPhysicalDeviceProperties2(self._pd, p2)
            self.host_align = max(1, int(hp.minImportedHostPointerAlignment))
            fn = lib.vkGetDeviceProcAddr(self._dev, b"vkGetMemoryHostPointerPropertiesEXT")
            if fn == ffi.NULL:
                raise VulkanError("VK_EXT_external_memory_host enabled but vkGetMemoryHostPointerPropertiesEXT missing")
            self._host_ptr_props = ffi.cast("PFN_vkGetMemoryHostPointerPropertiesEXT", fn)
        # counters of the zero-copy mode: matrices imported where they lay (the RAM cache's page-aligned bytes), and
        # those first copied into page-aligned host memory (not page-aligned, or rows the kernels need padded)
        self.imported_in_place = 0
        self.imported_copied = 0
        self.imported_copy_bytes = 0
        self.imported_live = 0        # bytes of the imported matrices the device holds now (count in the budget)

    def _read_memory_types(self) -> list[int]:
        """``_mtypes`` ((property flags, heap) per memory type) and ``heaps`` ((bytes, device_local) per heap);
        returns each heap's free bytes (VK_EXT_memory_budget's, else its size)."""
        mp2 = _s("VkPhysicalDeviceMemoryProperties2")
        mb = _s("VkPhysicalDeviceMemoryBudgetPropertiesEXT")
        mp2.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2
        mb.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT
        if self.memory_budget_ext:
            mp2.pNext = mb
        lib.vkGetPhysicalDeviceMemoryProperties2(self._pd, mp2)
        mp = mp2.memoryProperties
        self._mtypes = [(int(mp.memoryTypes[i].propertyFlags), int(mp.memoryTypes[i].heapIndex))
                        for i in range(mp.memoryTypeCount)]
        self.heaps = [(int(mp.memoryHeaps[i].size), bool(mp.memoryHeaps[i].flags & _HEAP_DEVICE_LOCAL))
                      for i in range(mp.memoryHeapCount)]
        heap_free = [int(mb.heapBudget[i]) - int(mb.heapUsage[i]) if self.memory_budget_ext else self.heaps[i][0]
                     for i in range(mp.memoryHeapCount)]
        return heap_free

    def _choose_weight_memory(self, staging, block_bytes: int) -> None:
        """The weights' memory type (``staging``: device-local only, written through a staging buffer; else
        mapped device-local), the scratch buffers' types, and the block allocator of ``block_bytes`` blocks."""
        # weight placement: mapped device-local memory, or staged copies (COLI_VK_STAGING=1, or when
        # the host-visible device-local heap is under a quarter of the largest device-local heap)
        dl_heaps = [i for i, (sz, loc) in enumerate(self.heaps) if loc] or list(range(len(self.heaps)))
        big = max(dl_heaps, key=lambda i: self.heaps[i][0])
        mapped = [t for t, (fl, h) in enumerate(self._mtypes)
                  if fl & _MEM_DEVICE_LOCAL and fl & _MEM_HOST_VISIBLE and fl & _MEM_HOST_COHERENT]
        mapped_ok = any(self.heaps[self._mtypes[t][1]][0] * 4 >= self.heaps[big][0] for t in mapped)
        env_st = settings.get("COLI_VK_STAGING")
        if staging is None:
            staging = env_st if env_st is not None else not mapped_ok
        self.staging = bool(staging)
        if self.staging:
            self._w_req, self._w_pref = _MEM_DEVICE_LOCAL, 0
        else:
            self._w_req, self._w_pref = _MEM_DEVICE_LOCAL | _MEM_HOST_VISIBLE | _MEM_HOST_COHERENT, 0
        self._scratch_types = {
            "x": (_MEM_HOST_VISIBLE | _MEM_HOST_COHERENT, _MEM_DEVICE_LOCAL),
            "tab": (_MEM_HOST_VISIBLE | _MEM_HOST_COHERENT, _MEM_DEVICE_LOCAL),
            "h": (_MEM_HOST_VISIBLE | _MEM_HOST_COHERENT, _MEM_DEVICE_LOCAL),
            "y": (_MEM_HOST_VISIBLE | _MEM_HOST_COHERENT, _MEM_HOST_CACHED),
        }

        # the buffer alignment of a storage buffer with a device address
        probe = _s("VkBufferCreateInfo")
        probe.sType = vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO
        probe.size = 4096
        probe.usage = _USAGE_STORAGE | _USAGE_ADDRESS | _USAGE_XFER_DST
        pb = ffi.new("VkBuffer*")
        _chk(lib.vkCreateBuffer(self._dev, probe, ffi.NULL, pb), "vkCreateBuffer")
        mr = _s("VkMemoryRequirements")
        lib.vkGetBufferMemoryRequirements(self._dev, pb[0], mr)
        lib.vkDestroyBuffer(self._dev, pb[0], ffi.NULL)
        self._w_bits = int(mr.memoryTypeBits)
        self._w_type = self._pick_type(self._w_bits, self._w_req, self._w_pref)
        align = max(256, int(mr.alignment))
        self.block_bytes = int(block_bytes)
        self._alloc = BlockAllocator(self.block_bytes, self._new_block, self._free_block, align)

    def _set_budget(self, budget, heap_free: list[int]) -> None:
        """``budget_bytes`` and ``budget_rule`` from the caller's ``budget`` (bytes, a callable of the device's
        figures, or None: the whole heap), ``budget_free`` (the weights' heap's free bytes, or None); docs/vulkan.md
        "The budget"."""
        w_heap = self._mtypes[self._w_type][1]
        # free bytes of the weights' heap by VK_EXT_memory_budget (None without it)
        self.budget_free = heap_free[w_heap] if self.memory_budget_ext else None
        # the budget is the caller's (one rule for RAM and device: scheduler.tier_policy.budget_bytes)
        if callable(budget):
            self.budget_bytes, self.budget_rule = budget(dict(name=self.name, kind=self.type_name,
                                                              heap_bytes=self.heaps[w_heap][0],
                                                              budget_free=self.budget_free))
            self.budget_bytes = int(self.budget_bytes)
        elif budget is not None:
            self.budget_bytes, self.budget_rule = int(budget), "given by the caller"
        else:
            self.budget_bytes, self.budget_rule = int(self.heaps[w_heap][0]), "the whole heap (no budget given)"

    def _pick_type(self, bits: int, req: int, pref: int) -> int:
        ok = [t for t, (fl, h) in enumerate(self._mtypes) if bits >> t & 1 and fl & req == req]
        if not ok:
            raise VulkanError(f"no memory type with flags {req:#x}")
        best = [t for t in ok if self._mtypes[t][0] & pref == pref]
        cand = best or ok
        return max(cand, key=lambda t: (self.heaps[self._mtypes[t][1]][0], -t))

    # -- tensors -----------------------------------------------------------------------------------
    def _new_block(self, size: int) -> _Block:
        mai = _s("VkMemoryAllocateInfo")
        fl = _s("VkMemoryAllocateFlagsInfo")
        fl.sType = vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO
        fl.flags = _DEVICE_ADDRESS_BIT
        mai.sType = vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO
        mai.pNext = fl
        mai.allocationSize = size
        mai.memoryTypeIndex = self._w_type
        pm = ffi.new("VkDeviceMemory*")
        _chk(lib.vkAllocateMemory(self._dev, mai, ffi.NULL, pm), f"vkAllocateMemory(block of {size} bytes)")
        b = _Block()
        b.memory, b.size, b.view = pm[0], size, None
        if not self.staging:
            pp = ffi.new("void**")
            r = lib.vkMapMemory(self._dev, b.memory, 0, size, 0, pp)
            if r != 0:
                lib.vkFreeMemory(self._dev, b.memory, ffi.NULL)
                _chk(r, "vkMapMemory(block)")
            b.view = np.frombuffer(ffi.buffer(pp[0], size), np.uint8)
        return b

    def _free_block(self, b: _Block) -> None:
        b.view = None
        lib.vkFreeMemory(self._dev, b.memory, ffi.NULL)

    def _place(self, type_name: str, raw: np.ndarray, shape, rows: int | None = None, host: bool = False) -> _Tensor:
        """One [O, I] GGUF matrix into device memory as [rows (default O), ceil32(I)]: a float format's rows
        are zero-padded to a multiple of 32 weights (:func:`_pad_rows`); a block format's inner size is a
        multiple of its block already (ValueError otherwise, as for bytes that do not match the shape). ``host``: the
        host's bytes imported as device memory (:meth:`_import`, zero-copy experts) instead of a copy in a block."""
        flat, O, I = self._device_bytes(type_name, raw, shape, rows)
        t = _Tensor()
        t.type_name, t.O, t.I, t.nbytes = type_name, O, I, flat.size
        t.memory = t.host = None
        if host:                 # zero-copy (an expert on a zero-copy device): the host's bytes, imported
            return self._import(t, flat)
        t.alloc = self._alloc.alloc(t.nbytes, 256)
        t.buffer = None
        try:
            blk = self._alloc.handle(t.alloc.block)
            bci = _s("VkBufferCreateInfo")
            bci.sType = vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO
            bci.size = t.nbytes
            bci.usage = _USAGE_STORAGE | _USAGE_ADDRESS | _USAGE_XFER_DST
            pb = ffi.new("VkBuffer*")
            _chk(lib.vkCreateBuffer(self._dev, bci, ffi.NULL, pb), "vkCreateBuffer")
            t.buffer = pb[0]
            _chk(lib.vkBindBufferMemory(self._dev, t.buffer, blk.memory, t.alloc.offset), "vkBindBufferMemory")
            ai = _s("VkBufferDeviceAddressInfo")
            ai.sType = vk.VK_STRUCTURE_TYPE_BUFFER_DEVICE_ADDRESS_INFO
            ai.buffer = t.buffer
            t.addr = int(lib.vkGetBufferDeviceAddress(self._dev, ai))
            self._write(t, flat)
        except BaseException:
            self._drop(t)
            raise
        return t

    def _rewrite(self, t: _Tensor, type_name: str, raw: np.ndarray, shape, rows: int | None = None) -> None:
        """Placed tensor ``t`` (in a block, not imported) rewritten in place with another matrix of its format and
        shape (laid out as :meth:`_place` does; ValueError otherwise): no allocation. Mapped blocks: a NumPy copy,
        which lets go of the GIL (a thread may run it while nothing reads ``t``); staged: through the queue."""
        flat, O, I = self._device_bytes(type_name, raw, shape, rows)
        if (type_name, O, I) != (t.type_name, t.O, t.I) or t.alloc is None:
            raise ValueError(f"{type_name} [{O}, {I}] rewritten into {t.type_name} [{t.O}, {t.I}]"
                             f"{'' if t.alloc is not None else ' (imported or dropped)'}")
        self._write(t, flat)

    def _write(self, t: _Tensor, flat: np.ndarray) -> None:
        """``flat`` (uint8, ``t.nbytes``) into ``t``'s block: a copy into the mapped block, or a staged copy."""
        blk = self._alloc.handle(t.alloc.block)
        if blk.view is not None:
            blk.view[t.alloc.offset:t.alloc.offset + t.nbytes] = flat
        else:
            self._staged_copy(flat, t.buffer)

    def _device_bytes(self, type_name: str, raw: np.ndarray, shape, rows: int | None = None) -> tuple:
        """``raw`` (uint8, an [O, I] GGUF matrix) as the device holds it: (flat uint8, rows, inner size), padded
        as :meth:`_place` says; ValueError for a format without a kernel or bytes that do not match."""
        O, I = (int(shape[0]), int(shape[1]))
        if type_name not in S.FORMATS:
            raise ValueError(f"weight format {type_name} has no device kernel")
        bs = TT.get(type_name).block_size
        if I % bs or (bs > 1 and I % 32):
            raise ValueError(f"{type_name}: inner size {I} is not a multiple of {max(bs, 32)} "
                             f"(its blocks; device kernels need it)")
        rb = row_bytes(type_name, I)
        raw = np.asarray(raw)
        if raw.dtype != np.uint8 or raw.size != O * rb:
            raise ValueError(f"{type_name} [{O}, {I}]: expected {O * rb} raw bytes, got {raw.size} {raw.dtype}")
        Op, Ip = (O if rows is None else int(rows)), _ceil32(I)
        if (Op, Ip) != (O, I):
            raw = _pad_rows(type_name, raw, O, I, Op, Ip)
        return raw.reshape(-1), Op, Ip

    def _drop(self, t: _Tensor):
        if t.buffer is not None:
            lib.vkDestroyBuffer(self._dev, t.buffer, ffi.NULL)
            t.buffer = None
        if t.alloc is not None:
            self._alloc.free(t.alloc)
            t.alloc = None
        if t.memory is not None:          # an imported host range: the device lets go, then the host may free it
            lib.vkFreeMemory(self._dev, t.memory, ffi.NULL)
            t.memory = None
            self.imported_live -= t.nbytes
        t.host = None

    def _import(self, t: _Tensor, flat: np.ndarray) -> _Tensor:
        """Zero-copy placement (VK_EXT_external_memory_host): ``flat`` (uint8, the matrix's device layout) is
        imported as device memory where it lies when its address is a multiple of ``host_align`` (the RAM
        cache's page-aligned reads; the import covers the whole pages it spans, which stay mapped while the array
        lives: the tensor holds a reference), else first copied into page-aligned host memory (``imported_copied``).
        The device then reads the host's bytes: no device copy, no upload. VulkanError when the driver refuses."""
        a = self.host_align
        size = -(-t.nbytes // a) * a
        ptr = flat.ctypes.data if flat.flags.c_contiguous else 0
        if ptr and ptr % a == 0:
            host = flat
            self.imported_in_place += 1
        else:
            mm = mmap.mmap(-1, size)          # page-aligned, zero-filled, freed when its last view goes
            host = np.frombuffer(mm, np.uint8)
            host[:t.nbytes] = flat
            ptr = host.ctypes.data
            self.imported_copied += 1
            self.imported_copy_bytes += t.nbytes
        t.alloc, t.buffer, t.host = None, None, host
        try:
            props = _s("VkMemoryHostPointerPropertiesEXT")
            props.sType = vk.VK_STRUCTURE_TYPE_MEMORY_HOST_POINTER_PROPERTIES_EXT
            _chk(self._host_ptr_props(self._dev, _HOST_ALLOCATION, ffi.cast("void*", ptr), props),
                 "vkGetMemoryHostPointerPropertiesEXT")
            ebi = _s("VkExternalMemoryBufferCreateInfo")
            ebi.sType = vk.VK_STRUCTURE_TYPE_EXTERNAL_MEMORY_BUFFER_CREATE_INFO
            ebi.handleTypes = _HOST_ALLOCATION
            bci = _s("VkBufferCreateInfo")
            bci.sType = vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO
            bci.pNext = ebi
            bci.size = size
            bci.usage = _USAGE_STORAGE | _USAGE_ADDRESS
            pb = ffi.new("VkBuffer*")
            _chk(lib.vkCreateBuffer(self._dev, bci, ffi.NULL, pb), "vkCreateBuffer(imported)")
            t.buffer = pb[0]
            mr = _s("VkMemoryRequirements")
            lib.vkGetBufferMemoryRequirements(self._dev, t.buffer, mr)
            bits = int(props.memoryTypeBits) & int(mr.memoryTypeBits)
            if not bits:
                raise VulkanError(f"no memory type both imports host memory and backs a storage buffer "
                                  f"(host {int(props.memoryTypeBits):#x}, buffer {int(mr.memoryTypeBits):#x})")
            imp = _s("VkImportMemoryHostPointerInfoEXT")
            imp.sType = vk.VK_STRUCTURE_TYPE_IMPORT_MEMORY_HOST_POINTER_INFO_EXT
            imp.handleType = _HOST_ALLOCATION
            imp.pHostPointer = ffi.cast("void*", ptr)
            fl = _s("VkMemoryAllocateFlagsInfo")
            fl.sType = vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_FLAGS_INFO
            fl.flags = _DEVICE_ADDRESS_BIT
            fl.pNext = imp
            mai = _s("VkMemoryAllocateInfo")
            mai.sType = vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO
            mai.pNext = fl
            mai.allocationSize = size
            mai.memoryTypeIndex = (bits & -bits).bit_length() - 1
            pm = ffi.new("VkDeviceMemory*")
            _chk(lib.vkAllocateMemory(self._dev, mai, ffi.NULL, pm), f"vkAllocateMemory(import of {size} bytes)")
            t.memory = pm[0]
            self.imported_live += t.nbytes    # (_drop takes it off again on a failure below)
            _chk(lib.vkBindBufferMemory(self._dev, t.buffer, t.memory, 0), "vkBindBufferMemory(imported)")
            ai = _s("VkBufferDeviceAddressInfo")
            ai.sType = vk.VK_STRUCTURE_TYPE_BUFFER_DEVICE_ADDRESS_INFO
            ai.buffer = t.buffer
            t.addr = int(lib.vkGetBufferDeviceAddress(self._dev, ai))
        except BaseException:
            self._drop(t)
            raise
        return t

    def _staged_copy(self, flat: np.ndarray, dst) -> None:
        """Copy bytes into a device-local buffer through a host-visible staging buffer (synchronous)."""
        self._staged_copies([(flat, dst, flat.size)])

    def _staged_copies(self, items) -> None:
        """Write device-local buffers from the start, synchronously: ``items`` ``[(flat, dst, nbytes)]``, ``flat``
        uint8 bytes to copy through a host-visible staging buffer, or None for ``nbytes`` zeros (vkCmdFillBuffer:
        nothing staged; ``nbytes`` a multiple of 4); ``dst`` a VkBuffer. One submit and wait for every item whose
        bytes fit the 16 MiB staging buffer together (a submit a staging buffer's worth otherwise)."""
        chunk = 16 * MiB
        if self._staging_buf is None:
            self._staging_buf = _Buf(self, chunk, _USAGE_XFER_SRC, _MEM_HOST_VISIBLE | _MEM_HOST_COHERENT, 0)
            cai = _s("VkCommandBufferAllocateInfo")
            cai.sType = vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO
            cai.commandPool = self._cmd_pool
            cai.level = vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY
            cai.commandBufferCount = 1
            self._staging_cmd = ffi.new("VkCommandBuffer[1]")
            _chk(lib.vkAllocateCommandBuffers(self._dev, cai, self._staging_cmd), "vkAllocateCommandBuffers")
            self._staging_fence = new_fence(self._dev)
        sb = self._staging_buf
        cb = self._staging_cmd[0]
        bi = _s("VkCommandBufferBeginInfo")
        bi.sType = vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO
        bi.flags = vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT
        region = _s("VkBufferCopy")
        used, open_ = 0, False
        # (flat or None, dst, destination offset, bytes): the items cut into pieces of at most a staging buffer
        pieces = [(f, dst, off, min(chunk, n - off)) for f, dst, n in items
                  for off in (range(0, n, chunk) if f is not None else (0,))]
        for i, (f, dst, off, n) in enumerate(pieces):
            if f is not None and used + n > chunk:
                self._staging_submit(cb)
                used, open_ = 0, False
            if not open_:
                _chk(lib.vkResetCommandBuffer(cb, 0), "vkResetCommandBuffer")
                _chk(lib.vkBeginCommandBuffer(cb, bi), "vkBeginCommandBuffer")
                open_ = True
            if f is None:
                lib.vkCmdFillBuffer(cb, dst, 0, n, 0)
                continue
            sb.view[used:used + n] = f[off:off + n]
            region.srcOffset, region.dstOffset, region.size = used, off, n
            lib.vkCmdCopyBuffer(cb, sb.buffer, dst, 1, region)
            used += n
            self.staged_bytes = getattr(self, "staged_bytes", 0) + n
        if open_:
            self._staging_submit(cb)

    def _staging_submit(self, cb) -> None:
        """End the staging command buffer ``cb`` (after a barrier that makes its transfers' writes visible to the
        compute shaders of later submissions), submit it and wait."""
        mb = _s("VkMemoryBarrier")
        mb.sType = vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER
        mb.srcAccessMask, mb.dstAccessMask = _ACC_XFER_WRITE, _ACC_SHADER_READ
        lib.vkCmdPipelineBarrier(cb, _PSTAGE_TRANSFER, _PSTAGE_COMPUTE, 0, 1, mb, 0, ffi.NULL, 0, ffi.NULL)
        _chk(lib.vkEndCommandBuffer(cb), "vkEndCommandBuffer")
        sub = _s("VkSubmitInfo")
        sub.sType = vk.VK_STRUCTURE_TYPE_SUBMIT_INFO
        sub.commandBufferCount = 1
        sub.pCommandBuffers = self._staging_cmd
        _chk(lib.vkResetFences(self._dev, 1, self._staging_fence), "vkResetFences")
        _chk(lib.vkQueueSubmit(self._queue, 1, sub, self._staging_fence[0]), "vkQueueSubmit(staging)")
        _chk(lib.vkWaitForFences(self._dev, 1, self._staging_fence, 1, 60 * 10**9), "vkWaitForFences(staging)")

    def memory_stats(self) -> dict:
        """budget, used (bytes of tensors, imported ones included), reserved (bytes in blocks), blocks, free,
        largest_free, frag, imported (bytes of the zero-copy experts' imported host memory)."""
        a = self._alloc
        return {"budget": self.budget_bytes, "used": a.used_bytes + self.imported_live, "reserved": a.reserved_bytes,
                "blocks": len(a.blocks), "free": a.free_bytes, "largest_free": a.largest_free, "frag": a.frag,
                "imported": self.imported_live}
