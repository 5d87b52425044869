"""The Vulkan device: ``Device``, its experts (upload, free, the expert batch), the plain matmul, reporting and
closing; opening is ``Device._open``, a list of named steps.

Imported only when a device is asked for (``coli.vulkan.open_device``): it imports the ``vulkan`` binding
(``coli.vulkan.binding``), which dlopens ``libvulkan.so.1`` and raises OSError where there is none.

``Device`` is assembled from parts by concern (docs/vulkan.md "Modules"): ``instance.InstanceMixin`` (instance,
physical device, features, queues, logical device), ``memory.MemoryMixin`` (memory types, placement, budget,
zero-copy imports, tensors), ``pipelines.PipelineMixin`` (shader modules, layouts, pipelines) and
``batches.BatchMixin`` (frames, plans, recording, submits, fences, timestamps).

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

import numpy as np

from .batches import Batch, BatchMixin, _addr6, _Frame
from .binding import GiB, MiB, _env_float, _env_int, ffi, lib
from .errors import BudgetExceeded
from .instance import InstanceMixin
from .memory import MemoryMixin, _ceil32, row_bytes
from .pipelines import PipelineMixin


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


class Device(InstanceMixin, MemoryMixin, PipelineMixin, BatchMixin):
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
        # a batch's join may poll its fence this long before it blocks in vkWaitForFences (a thread that slept
        # in the wait runs the next layer's Python ~2x slower); off by default: on the H200 it shortened the
        # fence wait but not the token (docs/vulkan.md "Fence wait")
        self.spin_s = _env_int("COLI_VK_SPIN_US", 0) / 1e6
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
        """Open the device in named steps, each setting the figures the next ones read (a failing step raises;
        ``__init__`` then closes what the earlier ones made)."""
        spv = self._read_spirv()            # shaders first: a missing .spv is a reason not to open
        self._create_instance()
        self._choose_physical_device(device_index)
        exts = self._device_extensions()
        api, have_sgc, sgc, shared_mem = self._read_properties(exts)
        self._read_features(exts, api, have_sgc, sgc, shared_mem)
        self._choose_queue_family()
        self._create_logical_device(exts, api)
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

    # -- the expert batch and the plain matmul -----------------------------------------------------
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

    def report(self) -> str:
        """The line each run ends with: ``[VK] <label>: N matmuls on the GPU`` (the expert tier's and other
        single matmuls), with ``, M dispatches of the device layers`` when they ran (coli/vulkan/layers.py); when
        the device layers did all the work, ``[VK] <label>: M dispatches of the device layers on the GPU`` (not
        "0 matmuls")."""
        n = self.layer_dispatches
        if n and not self.matmuls:
            return f"[VK] {self.label}: {n} dispatches of the device layers on the GPU"
        return f"[VK] {self.label}: {self.matmuls} matmuls on the GPU" + (
            f", {n} dispatches of the device layers" if n else "")

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
        self._inst = None    # the process's instance stays (coli/vulkan/instance.py _INSTANCE)
        self._objs_ok = False