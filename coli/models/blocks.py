"""The layer blocks the family files build their decoder layers from (mlx-lm's shape: a family writes its layer
top to bottom in its own file, from small shared blocks; docs/families.md "Layer blocks").

* :class:`KV` the per-layer KV cache, :class:`Attention` (q/k/v/o projections with their optional biases and
  q/k norms, rope, the KV cache, ``cpu_kernels.attention.attend``),
* :class:`MLP` the dense gated FFN (SwiGLU or GeGLU), :class:`MoE` the router, the routed experts (handed to the
  step as ``(rows, expert_ids, weights)``) and the shared expert, :func:`softmax_topk` the usual routing rule,
  :func:`deepseek_route` the DeepSeek / noaux_tc rule (group-limited, correction bias) with
  :func:`expert_groups` reading its group keys.

Every block takes the model ``m`` (a ``coli.models.base.Model``: weights ``m.wt``, activation mode ``m.act``,
the MoE step ``m.step``, the rope tables) and a tensor prefix (``blk.<il>.``); attributes are named after the
GGUF tensors (``attn_q``, ``ffn_gate_exps``...). Shapes: hidden rows f32 [T, D]; q f32 [T, H, hd].
"""
from __future__ import annotations

import math

import numpy as np

from coli.base import memory
from coli.base.errors import ColiError
from cpu_kernels import decode as _decode
from cpu_kernels import decode_moe
from cpu_kernels import experts as grouped
from cpu_kernels import router as _router
from cpu_kernels.attention import attend
from cpu_kernels.kvcache import KVSide, row_bytes
from cpu_kernels.norms import geglu_tanh, rms_norm, rms_norm_heads, swiglu
from cpu_kernels.rope import apply_rope


def below_one(g, key: str, why: str = "") -> ColiError:
    """The ColiError for metadata ``<arch>.<key>`` that must be at least 1 and is not: ``is missing`` when the file
    lacks it, else its value (a key present with value 0 is not missing). ``why``: what needs it."""
    v = g.get(f"{g.arch}.{key}")
    tail = f" ({why})" if why else ""
    if v is None:
        return ColiError(f"{g.path.name}: metadata '{g.arch}.{key}' is missing{tail}")
    return ColiError(f"{g.path.name}: metadata '{g.arch}.{key}': {v} (must be at least 1{'; ' + why if why else ''})")


def any_rows(w, act: str, invariant: bool = False) -> bool:
    """True when weight ``w`` runs the grouped kernels (``cpu_kernels.experts``) at every row count, so that a
    prompt's row gets the bits of the same row alone (a decode row; docs/engine.md "Batch invariance"): t16 tiles
    always; with ``invariant`` (``--batch-invariant``), int8 activations and a VNNI CPU also every other format with
    a grouped-kernel code (row layouts: the row kernels per (weight row, activation row) pair; F32/F16/BF16: the
    decoded row's dot with the f32 row) instead of the prompt GEMMs (``gemm_i8``'s 4 x 4 tiles, the f32 GEMM),
    which sum in another order than the GEMVs and are 1.1-2.9x faster on those matrices."""
    return w.layout == "t16" or (invariant and act == "int8" and grouped.HAVE_VNNI and grouped.supports(w))


def window_start(p: int, window: int) -> int:
    """The first position a row at position ``p`` attends to under a sliding ``window`` (positions seen, the
    row's own included; 0: the whole context): ``max(0, p - window + 1)``, as ``cpu_kernels.attention`` and the
    device's attention shaders (``attn_dec.comp``: ``wlo``) mask keys, and as llama.cpp's SWA cache keeps them
    (``llama_hparams::is_masked_swa``, LLAMA_SWA_TYPE_STANDARD)."""
    return max(0, int(p) - int(window) + 1) if window > 0 else 0


class KV:
    """One attention layer's KV cache: sides ``K`` [n_kv, ctx, head_dim] and ``V`` [n_kv, ctx, head_dim_v]
    (``cpu_kernels.kvcache.KVSide``) of types ``types`` (K's, V's: ``"f32"``, ``"f16"``, ``"bf16"``, ``"q8_0"``;
    llama.cpp's ``--cache-type-k/-v``), preallocated for ``ctx`` positions; position p is row p (``Cache.pos`` may
    move back: the rows past it are overwritten). ``k``, ``v``: the f32 arrays of an f32 side (None for
    another type). ValueError for an unknown type or a q8_0 row width that is not a multiple of 32.

    ``window`` > 0 (a sliding-window layer): the sides are fresh mappings of 4 KiB pages and :meth:`slide` gives
    back the pages of the rows no later row reads (before :func:`window_start`), a window's worth at a time, so
    the layer holds at most about 2 windows plus a chunk of rows whatever the context (llama.cpp's SWA cache
    keeps ``n_swa + n_ubatch`` cells); ``lo``: rows ``lo ..`` are held, those before it read as zeros."""

    rewindable = True

    def __init__(self, n_kv: int, ctx: int, head_dim: int, head_dim_v: int | None = None,
                 types: tuple = ("f32", "f32"), window: int = 0):
        self.types = tuple(types)
        self.window, self.lo = int(window), 0
        side = KVSide
        if memory.fresh() or self.window > 0:  # a paged slot's cache (coli.kv_blocks), a window's: pages
            side, self.thp = _mapped_side, "never"  # committed as rows are written, given back by page
        self.K = side(self.types[0], n_kv, ctx, head_dim)
        self.V = side(self.types[1], n_kv, ctx, head_dim if head_dim_v is None else head_dim_v)
        self.k, self.v = self.K.f32, self.V.f32

    def nbytes(self) -> int:
        return self.K.nbytes() + self.V.nbytes()

    #: the page size its writes commit: None, the kernel's (``memory.page_granule``); "never" (4 KiB) for arrays
    #: made under ``memory.fresh_pages`` and a window's
    thp = None

    def resident_bytes(self, end: int) -> int:
        """Bytes of the pages positions ``0 .. end-1`` commit in both sides' arrays (``memory.touched_bytes``: each
        head's run of rows, at the kernel's page size), less the whole pages of rows ``0 .. lo-1`` a window's
        :meth:`slide` gave back: what the cache holds once written that far."""
        return sum(memory.touched_bytes(a, end, self.thp) - memory.run_bytes(a, 0, min(self.lo, end))
                   for a in self.arrays())

    def slide(self, pos0: int) -> None:
        """Rows at positions ``pos0 ..`` are about to be computed (a forward from ``pos0``): a window's layer gives
        back the rows before ``window_start(pos0)`` once a window's worth of them is held (one ``madvise`` a side's
        head per window of positions); ``pos0`` 0 starts over (``lo`` 0). ColiError for a ``pos0`` whose keys were
        given back (:meth:`resumes_at` says which positions a cache can go on from)."""
        if self.window <= 0:
            return
        if not self.resumes_at(pos0):
            raise ColiError(f"KV cache of a {self.window}-position window: positions before {self.lo} were given "
                            f"back, a forward from position {pos0} needs them")
        if pos0 == 0:
            self.lo = 0
            return
        new = window_start(pos0, self.window)
        if new - self.lo >= self.window:
            for a in self.arrays():   # from row 0: the page holding the last slide's boundary row goes too
                memory.give_back(a, 0, new)
            self.lo = new

    def forget_before(self, lo: int) -> None:
        """Rows ``0 .. lo-1`` are no longer held (a window's rows, copied from a cache that gave them back): their
        pages go back, ``lo`` is set."""
        for a in self.arrays():
            memory.give_back(a, 0, lo)
        self.lo = int(lo)

    def resumes_at(self, pos: int) -> bool:
        """Whether a forward may start at ``pos`` (``Cache.pos`` moved back to it, or a prefix of ``pos`` rows
        copied from this cache): every key a row at ``pos`` reads is held (a window's rows before ``lo`` are not)."""
        return pos == 0 or window_start(pos, self.window) >= self.lo

    def arrays(self) -> list:
        """The stored arrays, each [heads, positions, ...] (the kinds' own; the empty placeholders left out)."""
        return [a for side in (self.K, self.V) for a in side.t[1:] if a.size]

    def give_back(self, end: int) -> None:
        """The pages of positions ``end ..`` go back to the kernel (``memory.give_back``); they read as zeros."""
        for a in self.arrays():
            memory.give_back(a, end)

    def write(self, pos0: int, k: np.ndarray, v: np.ndarray) -> None:
        """Rows ``k`` f32 [T, n_kv, head_dim] and ``v`` [T, n_kv, head_dim_v] at positions ``pos0 ..``."""
        self.K.write(pos0, k)
        self.V.write(pos0, v)

    @staticmethod
    def bytes_per_position(n_kv: int, head_dim: int, head_dim_v: int | None = None,
                           types: tuple = ("f32", "f32")) -> int:
        """Bytes one position takes in a layer's cache (``kvcache.row_bytes`` of K and V per KV head)."""
        return n_kv * (row_bytes(types[0], head_dim) + row_bytes(types[1], head_dim if head_dim_v is None
                                                                   else head_dim_v))


def _mapped_side(kind: str, n: int, ctx: int, w: int) -> KVSide:
    """A ``KVSide`` whose arrays are ``memory.mapped_zeros`` (the kind's own: the placeholders stay empty)."""
    side = KVSide(kind, n, 0, w)
    t = [side.t[0]] + [memory.mapped_zeros((n, ctx, a.shape[2]), a.dtype) if a.shape[0] == n else a
                       for a in side.t[1:]]
    side.t, side.shape = tuple(t), (n, ctx, w)
    side.f32 = t[1] if kind == "f32" else None
    return side


class Attention:
    """Multi-head attention with grouped KV heads (llama.cpp ``build_attn``; HF ``*Attention`` of the families).

    ``rope_kind`` (cpu_kernels.rope NORM | NEOX), ``qk_norm``: None, ``"heads"`` (per-head RMSNorm, Qwen3 /
    Gemma 3) or ``"full"`` (RMSNorm over the whole projection before the head split, OLMoE); ``window``: sliding
    window in positions (0 = full); ``rope_base``/``rope_scaling`` default to the model's; ``scale`` to
    1/sqrt(head_dim). Tensors ``attn_q/k/v/output.weight``, optional ``.bias`` of each,
    ``attn_q_norm``/``attn_k_norm``; ColiError naming a missing one."""

    pageable = True  # its cache, a KV, holds rows by position and gives their pages back (Cache.pageable)

    def __init__(self, m, p: str, *, rope_kind: int, qk_norm: str | None = None, window: int = 0,
                 rope_base: float | None = None, rope_scaling=None, n_heads: int | None = None,
                 n_kv: int | None = None, head_dim: int | None = None, n_rot: int | None = None,
                 scale: float | None = None):
        a = m.args
        self.m = m
        self.n_heads = n_heads or a.n_heads
        self.n_kv = n_kv or a.n_kv_heads
        self.head_dim = head_dim or a.head_dim
        self.n_rot = n_rot or a.n_rot
        self.rope_kind = rope_kind
        self.rope_base = a.rope_base if rope_base is None else rope_base
        self.rope_scaling = a.rope_scaling if rope_scaling is None else rope_scaling
        self.window = window
        self.scale = scale or 1.0 / math.sqrt(self.head_dim)
        self.qk_norm = qk_norm
        wt = m.wt
        self.attn_q, self.attn_k = wt.w(p + "attn_q.weight"), wt.w(p + "attn_k.weight")
        self.attn_v, self.attn_output = wt.w(p + "attn_v.weight"), wt.w(p + "attn_output.weight")
        self.attn_q_b = wt.f32(p + "attn_q.bias", False)
        self.attn_k_b = wt.f32(p + "attn_k.bias", False)
        self.attn_v_b = wt.f32(p + "attn_v.bias", False)
        self.attn_output_b = wt.f32(p + "attn_output.bias", False)
        self.attn_q_norm = self.attn_k_norm = None
        if qk_norm is not None:
            self.attn_q_norm = wt.f32(p + "attn_q_norm.weight")
            self.attn_k_norm = wt.f32(p + "attn_k_norm.weight")
        self._check_shapes(wt.fname, p, a.d_model)
        qkv = [self.attn_q, self.attn_k, self.attn_v]
        # q/k/v in one grouped launch on the layer input quantized once (cpu_kernels.experts)
        self.qkv_group = grouped.Group(qkv) if all(grouped.supports(w) for w in qkv) else None
        # t16 tiles run in the grouped kernels at every row count (formats.matmul sends them there one by one)
        self.qkv_any_rows = self.qkv_group is not None and all(any_rows(w, m.act, m.invariant) for w in qkv)

    def _check_shapes(self, fname: str, p: str, d: int):
        """The projections' [O, I] shapes against the hyper-parameters (the head split in ``heads`` and the KV
        cache rely on them): a file whose ``attention.head_count_kv`` / ``key_length`` disagree with its tensors is
        a ColiError naming the tensor, not a reshape error mid-prompt."""
        checks = [("attn_k", 0, self.n_kv * self.head_dim,
                   f"attention.head_count_kv {self.n_kv} x key_length {self.head_dim}")]
        checks += [(n, 1, d, "embedding_length") for n in ("attn_q", "attn_k", "attn_v")]
        checks.append(("attn_output", 0, d, "embedding_length"))
        for n, axis, want, what in checks:
            shape = getattr(self, n).shape
            if shape[axis] != want:
                raise ColiError(f"{fname}: tensor '{p}{n}.weight' has {shape[axis]} {('rows', 'columns')[axis]} "
                                f"(shape [O, I] {list(shape)}), expected {want} ({what})")
        if self.attn_v.shape[0] % self.n_kv or self.attn_q.shape[0] % self.head_dim:
            raise ColiError(f"{fname}: tensors '{p}attn_q.weight' {list(self.attn_q.shape)} / '{p}attn_v.weight' "
                            f"{list(self.attn_v.shape)} do not split into {self.n_heads} / {self.n_kv} heads of "
                            f"{self.head_dim}")
        o_in = self.n_heads * (self.attn_v.shape[0] // self.n_kv)
        if self.attn_output.shape[1] != o_in:
            raise ColiError(f"{fname}: tensor '{p}attn_output.weight' has {self.attn_output.shape[1]} columns (shape "
                            f"[O, I] {list(self.attn_output.shape)}), expected {o_in} ({self.n_heads} heads x the V "
                            f"head width of '{p}attn_v.weight')")

    def new_cache(self, ctx: int) -> KV:
        return KV(self.n_kv, ctx, self.head_dim, types=self.m.args.kv_types, window=self.window)

    def qkv(self, x: np.ndarray, xa=None):
        """q, k, v projections of ``x`` f32 [T, D] (biases added): one quantization of x and one parallel launch
        for the three matrices when their formats have grouped kernels (``cpu_kernels.experts``)."""
        m = self.m
        if self.qkv_group is None or not (self.qkv_any_rows or m.grouped_rows(x.shape[0])):
            q, k, v = m.mm(self.attn_q, x), m.mm(self.attn_k, x), m.mm(self.attn_v, x)
        else:
            out = self.qkv_group(xa if xa is not None else grouped.Act(x, m.act))
            oq, ok = self.attn_q.shape[0], self.attn_k.shape[0]
            q, k, v = out[:, :oq], out[:, oq:oq + ok], out[:, oq + ok:]
            if x.shape[0] > 1:  # column slices of a [T, O] buffer: contiguous copies for the row kernels
                q, k, v = np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v)
        if self.attn_q_b is not None:
            q += self.attn_q_b
        if self.attn_k_b is not None:
            k += self.attn_k_b
        if self.attn_v_b is not None:
            v += self.attn_v_b
        return q, k, v

    def heads(self, q, k, v):
        """Split into heads (f32 [T, H, hd]) with the q/k norms of ``qk_norm`` applied."""
        eps = self.m.args.eps
        T = q.shape[0]
        if self.qk_norm == "full":
            q = rms_norm(q, self.attn_q_norm, eps)
            k = rms_norm(k, self.attn_k_norm, eps)
        q = q.reshape(T, self.n_heads, self.head_dim)
        k = k.reshape(T, self.n_kv, self.head_dim)
        v = v.reshape(T, self.n_kv, -1)
        if self.qk_norm == "heads":
            rms_norm_heads(q, self.attn_q_norm, eps)
            rms_norm_heads(k, self.attn_k_norm, eps)
        return q, k, v

    def rope(self, q, k, pos0: int):
        """Rotate q and k (f32 [T, H, hd], in place) at positions ``pos0 ..``."""
        pos = np.arange(pos0, pos0 + q.shape[0], dtype=np.int64)
        cos, sin = self.m.rope_table(self.rope_base, self.rope_scaling, self.n_rot)
        apply_rope(q, pos, cos, sin, self.n_rot, self.rope_kind)
        apply_rope(k, pos, cos, sin, self.n_rot, self.rope_kind)

    def attend(self, q, k, v, kv: KV, pos0: int) -> np.ndarray:
        """Write k, v at ``pos0 ..`` into the cache and attend; f32 [T, H, hd_v]."""
        kv.write(pos0, k, v)
        return attend(q, kv.K, kv.V, pos0, self.scale, self.window)

    def out(self, o: np.ndarray) -> np.ndarray:
        """The output projection of the heads' outputs f32 [T, H * hd_v] (bias added)."""
        y = self.m.mm(self.attn_output, o)
        if self.attn_output_b is not None:
            y += self.attn_output_b
        return y

    def decoder(self, w_norm: np.ndarray, post_w: np.ndarray | None = None):
        """The compiled decode block ``h += post_w-norm(self(rms_norm(h) * w_norm))`` of this attention
        (``cpu_kernels.decode.AttentionDecode``: one call for a decode row), or None where it cannot run (f32
        activations, no VNNI, a format without grouped kernels): the caller then runs the Python path."""
        if not _decode.AttentionDecode.supported(self):
            return None
        return _decode.AttentionDecode(self, w_norm, post_w, self.m.args.eps)

    def __call__(self, x: np.ndarray, xa, kv, pos0: int) -> np.ndarray:
        q, k, v = self.heads(*self.qkv(x, xa))
        if isinstance(kv, Rows):  # rows of several sequences: rope and attention per sequence, on its own cache
            o = None
            for c, p0, a, b in kv.parts:
                self.rope(q[a:b], k[a:b], p0)
                ob = self.attend(q[a:b], k[a:b], v[a:b], c, p0)
                if o is None:
                    o = np.empty((q.shape[0],) + ob.shape[1:], np.float32)
                o[a:b] = ob
        else:
            self.rope(q, k, pos0)
            o = self.attend(q, k, v, kv, pos0)
        return self.out(o.reshape(x.shape[0], -1))


class Rows:
    """The layer cache argument of a step over the rows of several sequences (``Model.forward_rows``): ``parts``
    is ``[(kv, pos0, a, b)]``, rows ``a:b`` of the step belong to the sequence whose layer cache is ``kv`` and
    sit at its positions ``pos0 ..``. Only :class:`Attention` reads it (every other block computes each row
    alone, so one call over all rows gives each row the bits it gets alone: docs/engine.md "Batch invariance")."""

    __slots__ = ("parts",)

    def __init__(self, parts):
        self.parts = parts


def expect_shapes(m, p: str, want: dict) -> None:
    """Check tensors of layer prefix ``p`` against the shapes the hyper-parameters give them: ``want`` maps a
    tensor name (after ``p``) to ``(shape, why)``, shape in NumPy order ([O, I] for a matrix, [n] for a norm) and
    ``why`` the metadata it comes from. ColiError naming the file and the tensor at load (not a NumPy broadcast or
    matmul error in the first forward pass, nor a norm silently read short); a missing tensor is the same
    ColiError as ``Weights.info``'s."""
    for n, (shape, why) in want.items():
        got = tuple(int(x) for x in m.wt.info(p + n).shape)
        if got != tuple(shape):
            raise ColiError(f"{m.wt.fname}: tensor '{p}{n}' has shape {list(got)} (NumPy order), expected "
                            f"{list(shape)} ({why})")


class MLP:
    """The dense gated FFN ``ffn_down(act(ffn_gate x) * ffn_up x)``, ``act`` "swiglu" (SiLU) or "geglu"
    (tanh GELU, Gemma); gate+up+activation in one grouped launch and down in one when the formats have grouped
    kernels, else three matmuls."""

    def __init__(self, m, p: str, act: str = "swiglu"):
        self.m = m
        self.act = act
        wt = m.wt
        self.ffn_gate, self.ffn_up, self.ffn_down = (wt.w(p + n + ".weight") for n in ("ffn_gate", "ffn_up", "ffn_down"))
        ws = [self.ffn_gate, self.ffn_up, self.ffn_down]
        kind = grouped.ACT_GEGLU if act == "geglu" else grouped.ACT_SWIGLU
        self.fused = grouped.FFN(*ws, kind, 0.0, m.act) if all(grouped.supports(w) for w in ws) else None
        # t16 tiles run in the grouped kernels at every row count; fused there a prompt chunk measured faster than
        # three matmuls and the NumPy-side activation: SwiGLU 8 % (SmolLM2), GeGLU (its tanh GELU in float32 in the
        # kernel) 20-32 % on Gemma-3-270M chunks of 16-64 rows (docs/cpu_kernels.md)
        self.fused_any_rows = self.fused is not None and all(any_rows(w, m.act, m.invariant) for w in ws)

    def decoder(self, w_norm: np.ndarray, post_w: np.ndarray | None = None):
        """The compiled decode block ``h += post_w-norm(self(rms_norm(h) * w_norm))`` of this FFN
        (``cpu_kernels.decode.FFNDecode``), or None where it cannot run (the caller runs the Python path)."""
        if not _decode.FFNDecode.supported(self.fused, self.m.act):
            return None
        return _decode.FFNDecode(self.fused, w_norm, post_w, self.m.args.eps)

    def __call__(self, x: np.ndarray, xa=None) -> np.ndarray:
        m = self.m
        if self.fused is not None and (self.fused_any_rows or m.grouped_rows(x.shape[0])):
            return self.fused(xa if xa is not None else grouped.Act(x, m.act), m.act)
        g = m.mm(self.ffn_gate, x)
        u = m.mm(self.ffn_up, x)
        return m.mm(self.ffn_down, geglu_tanh(g, u) if self.act == "geglu" else swiglu(g, u))


def softmax_topk(k: int, norm: bool):
    """The usual routing rule as a ``route`` callable: softmax over all experts, top-k (ties: lower id),
    renormalised to sum 1 when ``norm`` (Mixtral / Qwen3-MoE renormalise; OLMoE / Qwen2-MoE keep the softmax
    weights). logits f32 [R, E] -> (ids int32 [R, k], weights f32 [R, k])."""

    def route(logits: np.ndarray):
        # cpu_kernels.router: NumPy's exp between two compiled calls, bit-equal to the NumPy expression
        # p = exp(lg - max); p /= p.sum(1); ids = argsort(-p, stable)[:, :k] (ties: the lower expert id first)
        lg = np.array(logits, dtype=np.float32)
        _router.shift_by_max(lg)
        np.exp(lg, out=lg)
        kk = min(k, lg.shape[1])
        ids = np.empty((lg.shape[0], kk), np.int32)
        w = np.empty((lg.shape[0], kk), np.float32)
        _router.normalize_topk(lg, kk, norm, ids, w)
        return ids, w

    route.softmax_topk = (k, norm)  # the rule, for the compiled MoE decode region (cpu_kernels/decode_moe.py)
    return route


EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


class MoE:
    """The MoE FFN of layer ``il``: router ``ffn_gate_inp`` f32 [E, D], the routed experts
    ``ffn_{gate,up,down}_exps`` (run by the step, ``scheduler.step.MoEStep.run``: RAM cache, device tier, grouped
    CPU kernels, outputs joined in routing-rank order), an optional shared expert ``ffn_*_shexp`` scaled by
    ``sigmoid(x . ffn_gate_inp_shexp)`` when that tensor exists (Qwen2-MoE). ``route``: logits -> (ids, w)."""

    def __init__(self, m, p: str, il: int, *, route):
        self.m = m
        self.il = il
        self.route = route
        wt = m.wt
        self.ffn_gate_inp = wt.f32(p + "ffn_gate_inp.weight")
        for n in EXPERT_TENSORS:
            if not wt.has(p + n + ".weight"):
                raise ColiError(f"{wt.fname}: tensor '{p}{n}.weight' is missing")
        self.tensor_names = tuple(p + n + ".weight" for n in EXPERT_TENSORS)
        shexp = [p + n + ".weight" for n in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")]
        if any(wt.has(n) for n in shexp):  # part of a shared expert is a broken file, not a model without one
            for n in shexp:
                wt.info(n)  # ColiError naming the missing one
        self._check_expert_shapes(m, p, wt.has(shexp[0]))
        self.shared = self._shared_expert(p) if wt.has(shexp[0]) else None

    @staticmethod
    def _check_expert_shapes(m, p: str, shared: bool) -> None:
        """The routed experts ``ffn_{gate,up}_exps`` [E, F, D] and ``ffn_down_exps`` [E, D, F] (NumPy order;
        llama.cpp ``create_tensor`` {n_embd, n_ff_exp, n_expert}) against ``expert_count`` E, ``embedding_length``
        D and each other (F: ``ffn_gate_exps``' expert width), and the shared expert ``ffn_{gate,up}_shexp``
        [Fs, D], ``ffn_down_shexp`` [D, Fs] the same way (Fs: ``ffn_up_shexp``'s rows), and the expert biases
        ``ffn_{gate,up}_exps.bias`` [E, F], ``ffn_down_exps.bias`` [E, D] where present (gpt-oss), through
        :func:`expect_shapes`. Before, a tensor with fewer experts than expert_count was read past its end into
        the next tensor's bytes."""
        E, D = m.args.n_experts, m.args.d_model
        if E <= 0:
            raise below_one(m.g, "expert_count", f"the layer has routed experts '{p}ffn_gate_exps.weight'")
        gate = m.wt.info(p + "ffn_gate_exps.weight")
        F = int(gate.shape[1]) if len(gate.shape) == 3 else -1
        why = f"expert_count {E}, embedding_length {D}, expert width {F} of '{p}ffn_gate_exps.weight'"
        want = {"ffn_gate_exps.weight": ((E, F, D), why), "ffn_up_exps.weight": ((E, F, D), why),
                "ffn_down_exps.weight": ((E, D, F), why)}
        for n, shape in (("ffn_gate_exps.bias", (E, F)), ("ffn_up_exps.bias", (E, F)), ("ffn_down_exps.bias", (E, D))):
            if m.wt.has(p + n):  # gpt-oss's expert biases (llama.cpp {n_ff_exp or n_embd, n_expert})
                want[n] = (shape, why)
        if shared:
            Fs = int(m.wt.info(p + "ffn_up_shexp.weight").shape[0])
            why = f"embedding_length {D}, shared-expert width {Fs} of '{p}ffn_up_shexp.weight'"
            want.update({"ffn_gate_shexp.weight": ((Fs, D), why), "ffn_up_shexp.weight": ((Fs, D), why),
                         "ffn_down_shexp.weight": ((D, Fs), why)})
        expect_shapes(m, p, want)

    def _shared_expert(self, p):
        m, wt = self.m, self.m.wt
        gate, up, down = (wt.w(p + n + ".weight") for n in ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"))
        gate_inp = wt.f32(p + "ffn_gate_inp_shexp.weight", False)
        fused = None
        if all(grouped.supports(w) for w in (gate, up, down)):
            fused = grouped.FFN(gate, up, down, grouped.ACT_SWIGLU, 0.0, m.act)
        # t16 tiles: the fused kernels at every row count (MLP.fused_any_rows), so a prompt's rows get a decode
        # row's SwiGLU and bits
        every_count = fused is not None and all(any_rows(w, m.act, m.invariant) for w in (gate, up, down))

        def run(x):
            if fused is not None and (every_count or m.grouped_rows(x.shape[0])):
                y = fused(grouped.Act(x, m.act), m.act)
            else:
                y = m.mm(down, swiglu(m.mm(gate, x), m.mm(up, x)))
            if gate_inp is not None:  # Qwen2-MoE: sigmoid(x . w_gate_inp_shexp) scales it
                s = router_logits(x, gate_inp.reshape(1, -1))[:, 0]
                y *= (1.0 / (1.0 + np.exp(-s)))[:, None].astype(np.float32)
            return y

        return run

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Router logits f32 [R, E] of x f32 [R, D] (:func:`router_logits`: each row in the one order the compiled
        MoE decode region sums, whatever R)."""
        return router_logits(x, self.ffn_gate_inp)

    def decoder(self, attn_dec, w_norm: np.ndarray):
        """The compiled decode region of the whole layer (``attn_dec``'s attention block, then this MoE block's
        ``rms_norm(h, w_norm)``, router, top-k and routed experts: ``cpu_kernels.decode_moe.MoELayerDecode``), or
        None where it cannot run (the caller runs the blocks apart)."""
        return decode_moe.MoELayerDecode.of(attn_dec, self, w_norm, self.m.args.eps)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        ids, w = self.route(self.logits(x))
        return self.m.step.run(self.il, x, ids, w, shared=self.shared)


def router_logits(x: np.ndarray, W: np.ndarray) -> np.ndarray:
    """``x @ W.T`` f32 [R, E] for x f32 [R, D] and an f32 router W [E, D]: each row through
    ``cpu_kernels.router.logits_rows`` (float32 products in one fixed order, the decode row's and the compiled
    region's), so a token's routing does not depend on how many rows its step holds (NumPy's matmul sums in an
    order that changes with R: docs/engine.md "Batch invariance"). Another dtype or layout: NumPy's matmul."""
    if W.dtype == np.float32 and W.flags.c_contiguous and W.ndim == 2:
        return _router.logits_rows(x, W)
    return x @ W.T


def expert_groups(g, n_experts: int, top_k: int) -> tuple[int, int]:
    """``(n_group, topk_group)`` from ``<arch>.expert_group_count`` (absent: 1, no group limit) and
    ``<arch>.expert_group_used_count`` (absent: all groups), the keys llama.cpp's converter writes from HF's
    ``n_group`` / ``topk_group``. ColiError naming the keys when the experts do not split into the groups or the
    kept groups hold fewer than ``top_k`` experts (HF's top-k would then pick masked ones)."""
    a = g.arch
    n_group = int(g.get(f"{a}.expert_group_count", 1) or 1)
    topk_group = int(g.get(f"{a}.expert_group_used_count", n_group) or n_group)
    if n_group > 1 and (n_experts % n_group or not 0 < topk_group <= n_group
                        or topk_group * (n_experts // n_group) < top_k):
        raise ColiError(f"{g.path.name}: metadata '{a}.expert_group_count': {n_group} groups of {n_experts} "
                        f"experts with '{a}.expert_group_used_count' {topk_group} (the experts must split evenly "
                        f"and the kept groups hold at least expert_used_count {top_k})")
    return n_group, (topk_group if n_group > 1 else 1)


def deepseek_route(k: int, *, gating: str = "softmax", n_group: int = 1, topk_group: int = 1,
                   group_score: str = "max", norm: bool = False, scale: float = 1.0, bias: np.ndarray | None = None):
    """The DeepSeek routing rule as a ``route`` callable (logits f32 [R, E] -> ids int32 [R, k], w f32 [R, k]);
    DeepSeek-V2/V3, GLM-5 (glm-dsa), Kimi-Linear and MiMo-V2 route with it.

    Scores ``s`` = softmax (DeepSeek-V2) or sigmoid (V3, GLM-5, Kimi, MiMo) of the logits; the choice is made on
    ``s + bias`` (``exp_probs_b``, HF ``e_score_correction_bias``; none in V2). With ``n_group`` > 1 the experts
    are split into ``n_group`` contiguous groups, the ``topk_group`` groups with the best group score are kept
    (``max``: the group's best, HF V2 ``group_limited_greedy``; ``top2sum``: the sum of its two best, HF V3
    ``DeepseekV3TopkRouter`` / ``MiMoV2FlashTopkRouter`` (noaux_tc) and llama.cpp ``build_moe_ffn`` for every
    file) and top-k is taken among their experts (ties: lower id). Weights are the unbiased scores of the chosen
    experts, divided by their sum + 1e-20 when ``norm`` (``expert_weights_norm``; HF's denominator), times
    ``scale`` (``expert_weights_scale``, HF ``routed_scaling_factor``). docs/families.md."""
    if gating not in ("softmax", "sigmoid"):
        raise ColiError(f"expert gating function '{gating}' is not implemented (softmax, sigmoid)")
    if group_score not in ("max", "top2sum"):
        raise ColiError(f"expert group score '{group_score}' is not implemented (max, top2sum)")

    def route(logits: np.ndarray):
        lg = logits.astype(np.float32)
        if gating == "softmax":
            s = np.exp(lg - lg.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
        else:
            s = 1.0 / (1.0 + np.exp(-lg))
        choose = s if bias is None else s + bias
        if n_group > 1:
            R, E = choose.shape
            gsc = choose.reshape(R, n_group, E // n_group)
            if group_score == "max":
                gs = gsc.max(axis=2)
            else:
                gs = np.sort(gsc, axis=2)[:, :, -2:].sum(axis=2)
            keep = np.argsort(-gs, axis=1, kind="stable")[:, :topk_group]
            mask = np.zeros((R, n_group), bool)
            np.put_along_axis(mask, keep, True, axis=1)
            choose = np.where(np.repeat(mask, E // n_group, axis=1), choose, -np.inf)
        ids = np.argsort(-choose, axis=1, kind="stable")[:, :k]
        w = np.take_along_axis(s, ids, axis=1)
        if norm:
            w = w / (w.sum(axis=1, keepdims=True) + np.float32(1e-20))
        return ids.astype(np.int32), (w * np.float32(scale)).astype(np.float32)

    # the rule, for the device layers (coli/vulkan/layer_plan.py route_rule: shaders/topk.comp's DeepSeek flag)
    route.deepseek = dict(k=k, gating=gating, n_group=n_group, topk_group=topk_group, group_score=group_score,
                          norm=norm, scale=scale, bias=bias)
    return route
