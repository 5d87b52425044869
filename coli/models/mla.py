"""Multi-head latent attention (MLA) as a layer block, with its latent cache (the DeepSeek routing rule is
``coli.models.blocks.deepseek_route``).

MLA (DeepSeek-V2; HF ``models/deepseek_v2/modeling_deepseek_v2.py`` ``DeepseekV2Attention``; llama.cpp
``src/models/deepseek2.cpp``), for x f32 [T, D]:

    q        = attn_q x                       or attn_q_b RMSNorm(attn_q_a x, attn_q_a_norm)   # [T, H, dn + dr]
    [c, kr]  = attn_kv_a_mqa x                                                                # [T, r + dr]
    c        = RMSNorm(c, attn_kv_a_norm);  kr, q[..., dn:] rotated (rope NORM: adjacent pairs, HF's complex form)
    o        = attention over the cache                                                       # [T, H, dv]
    out      = attn_output o

The attention takes one of two forms per call, whichever costs fewer multiply-adds
(:meth:`MLA.expanded_is_cheaper`, which the device's layers ask too): the absorbed form (cpu_kernels.mla, every
decode row and a few rows after a long context) or, for a prompt chunk, HF's expanded form: each head's keys
``[W_kb c_j, kr_j]`` f32 [n, dn + dr] and values ``W_vb c_j`` f32 [n, dv] for the ``n = pos0 + T`` cached positions
(two f32 GEMMs per group of heads, ``cpu_kernels.formats.gemm_f32``), then the query-block attention of plain
layers (``cpu_kernels.attention.attend``, key width dn + dr, value width dv). Same numbers in exact arithmetic; the
expanded form moves the latent's r-wide products out of the per-key work (V2-Lite's shape: 320 against 1,088
multiply-adds a key and head).

The cache of a layer (:class:`LatentCache`) holds only c f32 [ctx, r] and kr f32 [ctx, dr]: (r + dr) * 4 bytes per
position per layer, for every head (plain attention would keep 2 * H * head_dim * 4). The GGUF holds
``attn_k_b`` [H, r, dn] and ``attn_v_b`` [H, dv, r] (llama.cpp's converter splits HF's ``kv_b_proj``); an older
file with the unsplit ``attn_kv_b`` [H * (dn + dv), r] is split here the same way. docs/families.md
"DeepSeek-V2 (MLA)".
"""
from __future__ import annotations

import numpy as np

from coli.base import memory
from coli.base.errors import ColiError
from cpu_kernels import experts as grouped
from cpu_kernels.attention import attend as attend_blocks
from cpu_kernels.formats import gemm_f32
from cpu_kernels.mla import mla_attend
from cpu_kernels.norms import rms_norm
from cpu_kernels.rope import NORM, apply_rope

from .blocks import KV, expect_shapes


class LatentCache:
    """One MLA layer's cache: ``lat`` f32 [ctx, kv_lora_rank] (the normalized KV latent) and ``kr`` f32
    [ctx, n_rot] (the rotated rope key); position p is row p, so the cache can be rewound like a KV cache."""

    rewindable = True

    def __init__(self, ctx: int, kv_lora_rank: int, n_rot: int):
        zeros = memory.mapped_zeros if memory.fresh() else np.zeros  # a paged slot's cache: pages as written
        self.lat = zeros((ctx, kv_lora_rank), np.float32)
        self.kr = zeros((ctx, n_rot), np.float32)

    def nbytes(self) -> int:
        return self.lat.nbytes + self.kr.nbytes

    def arrays(self) -> list:
        """The arrays as ``coli.models.blocks.KV.arrays`` gives them, [1, positions, width]."""
        return [self.lat[None], self.kr[None]]

    give_back = KV.give_back

    @staticmethod
    def bytes_per_position(kv_lora_rank: int, n_rot: int) -> int:
        return 4 * (kv_lora_rank + n_rot)


def _shape(wt, name, arr, want):
    if tuple(arr.shape) != tuple(want):
        raise ColiError(f"{wt.fname}: tensor '{name}': shape {list(arr.shape)}, expected {list(want)}")
    return arr


#: bytes of one head group's scratch: its expanded keys and values (f32 [G, n, dn + dr] and [G, n, dv]) and the
#: larger GEMM output they are copied from (f32 [n, G max(dn, dv)]); heads go in groups of as many as fit (at least
#: one), so a long context holds at most this much beside the latent cache (a 32k context: one head at a time,
#: at most 56 MiB at V2's dims)
EXPAND_BYTES = 64 << 20


def _head_floats(dn: int, dr: int, dv: int) -> int:
    """f32s the expanded form holds a head and position: its key (dn + dr), value (dv) and one GEMM output."""
    return dn + dr + dv + max(dn, dv)


def expand_scratch_bytes(H: int, dn: int, dr: int, dv: int, n: int) -> int:
    """The most bytes :meth:`MLA.expanded`'s group of heads holds at once for chunks whose rows see at most ``n``
    positions (H heads, key dims dn + dr, value dims dv): as many heads as :data:`EXPAND_BYTES` takes, at least one,
    so at most EXPAND_BYTES, or one head's (4 n (dn + dr + dv + max(dn, dv)) bytes: 224 MiB at V2's dims and
    128k positions) where that is more; 0 for n = 0. The engine and ``coli plan`` count it in the memory budget
    (``Model.scratch_bytes``)."""
    one = 4 * int(n) * _head_floats(dn, dr, dv)
    return min(H * one, max(EXPAND_BYTES, one))


def every_key_chosen(sel: np.ndarray, pos0: int) -> bool:
    """Whether the positions ``sel`` int64 [T, K] of rows at ``pos0 ..`` are, row by row, every earlier position in
    order then -1 padding (``cpu_kernels.mla.dsa_topk``'s choice while a row sees at most K positions): the
    attention is then the dense causal one."""
    T, K = sel.shape
    n = pos0 + T
    if K < n:
        return False
    j = np.arange(K)
    want = np.where(j[None, :] <= pos0 + np.arange(T)[:, None], j[None, :], -1)
    return bool((sel == want).all())


class MLA:
    """The MLA block of one layer (tensors above, prefix ``p`` = ``blk.<il>.``). ``n_heads`` H, ``q_lora_rank``
    (0: ``attn_q`` straight from x), ``kv_lora_rank`` r, ``nope`` dn, ``n_rot`` dr, ``v_dim`` dv; ``scale`` the
    softmax scale; ``rope_base``/``rope_scaling`` the rope rule (``rope_base`` None: no rotation). ColiError
    naming a missing tensor or one whose shape disagrees with these. ``__call__(x, xa, cache, pos0, sel=None)
    -> f32 [T, D]``; ``sel`` int64 [T, K]: the positions each row attends to (a sparse indexer's choice), None =
    all earlier ones."""

    pageable = True  # its LatentCache holds rows by position and gives their pages back (Cache.pageable)

    def __init__(self, m, p: str, *, n_heads: int, q_lora_rank: int, kv_lora_rank: int, nope: int, n_rot: int,
                 v_dim: int, scale: float, rope_base: float | None, rope_scaling):
        self.m = m
        wt = m.wt
        self.H, self.r, self.dn, self.dr, self.dv = n_heads, kv_lora_rank, nope, n_rot, v_dim
        self.scale = scale
        self.rope_base, self.rope_scaling = rope_base, rope_scaling
        self.eps = m.args.eps
        self.attn_q = self.attn_q_a = self.attn_q_a_norm = self.attn_q_b = None
        if q_lora_rank:
            self.attn_q_a = wt.w(p + "attn_q_a.weight")
            self.attn_q_a_norm = wt.f32(p + "attn_q_a_norm.weight")
            self.attn_q_b = wt.w(p + "attn_q_b.weight")
            first = self.attn_q_a
        else:
            self.attn_q = wt.w(p + "attn_q.weight")
            first = self.attn_q
        self.attn_kv_a_mqa = wt.w(p + "attn_kv_a_mqa.weight")
        if self.attn_kv_a_mqa.shape[0] != kv_lora_rank + n_rot:
            raise ColiError(f"{wt.fname}: tensor '{p}attn_kv_a_mqa.weight': {self.attn_kv_a_mqa.shape[0]} rows, "
                            f"expected kv_lora_rank + rope dims = {kv_lora_rank + n_rot}")
        self.attn_kv_a_norm = wt.f32(p + "attn_kv_a_norm.weight")
        if wt.has(p + "attn_k_b.weight"):
            self.attn_k_b = _shape(wt, p + "attn_k_b.weight", wt.f32(p + "attn_k_b.weight"), (n_heads, kv_lora_rank, nope))
            self.attn_v_b = _shape(wt, p + "attn_v_b.weight", wt.f32(p + "attn_v_b.weight"), (n_heads, v_dim, kv_lora_rank))
        else:  # an older file: HF's kv_b_proj unsplit, [H * (dn + dv), r]
            kvb = _shape(wt, p + "attn_kv_b.weight", wt.f32(p + "attn_kv_b.weight"),
                         (n_heads * (nope + v_dim), kv_lora_rank)).reshape(n_heads, nope + v_dim, kv_lora_rank)
            self.attn_k_b = np.ascontiguousarray(kvb[:, :nope].transpose(0, 2, 1))
            self.attn_v_b = np.ascontiguousarray(kvb[:, nope:])
        self.attn_output = wt.w(p + "attn_output.weight")
        D, dq = m.args.d_model, n_heads * (nope + n_rot)
        heads = f"head_count {n_heads} x (key_length_mla {nope + n_rot})"
        want = {"attn_kv_a_norm.weight": ((kv_lora_rank,), "kv_lora_rank"),
                "attn_output.weight": ((D, n_heads * v_dim),
                                       f"embedding_length x head_count {n_heads} x value_length_mla {v_dim}")}
        if q_lora_rank:
            want.update({"attn_q_a.weight": ((q_lora_rank, D), "q_lora_rank x embedding_length"),
                         "attn_q_a_norm.weight": ((q_lora_rank,), "q_lora_rank"),
                         "attn_q_b.weight": ((dq, q_lora_rank), f"{heads} x q_lora_rank {q_lora_rank}")})
        else:
            want["attn_q.weight"] = ((dq, D), f"{heads} x embedding_length")
        expect_shapes(m, p, want)
        # the two projections of x (q or q_a, and kv_a) in one grouped launch on x quantized once
        pair = [first, self.attn_kv_a_mqa]
        self.group = grouped.Group(pair) if all(grouped.supports(w) for w in pair) else None

    def new_cache(self, ctx: int) -> LatentCache:
        return LatentCache(ctx, self.r, self.dr)

    def project(self, x, xa=None):
        """``(q f32 [T, H, dn + dr], kv f32 [T, r + dr], q_resid)`` from x f32 [T, D]; ``q_resid`` f32 [T, q_lora_rank]
        is ``RMSNorm(attn_q_a x)`` (what a DSA indexer reads), None without ``q_lora_rank``."""
        m = self.m
        first = self.attn_q if self.attn_q is not None else self.attn_q_a
        if self.group is None or not m.grouped_rows(x.shape[0]):
            a, kv = m.mm(first, x), m.mm(self.attn_kv_a_mqa, x)
        else:
            out = self.group(xa if xa is not None else grouped.Act(x, m.act))
            o1 = first.shape[0]
            a, kv = np.ascontiguousarray(out[:, :o1]), np.ascontiguousarray(out[:, o1:])
        if self.attn_q is not None:
            return a.reshape(x.shape[0], self.H, self.dn + self.dr), kv, None
        qr = rms_norm(a, self.attn_q_a_norm, self.eps)
        return m.mm(self.attn_q_b, qr).reshape(x.shape[0], self.H, self.dn + self.dr), kv, qr

    def latent(self, kv, cache: LatentCache, pos0: int):
        """Normalize and rotate the new rows' latent and rope key and write them at ``pos0 ..``."""
        T = kv.shape[0]
        c = rms_norm(np.ascontiguousarray(kv[:, :self.r]), self.attn_kv_a_norm, self.eps)
        kr = np.ascontiguousarray(kv[:, self.r:]).reshape(T, 1, self.dr)
        self.rope(kr, pos0)
        cache.lat[pos0:pos0 + T] = c
        cache.kr[pos0:pos0 + T] = kr[:, 0]

    def rope(self, x, pos0: int):
        """Rotate x f32 [T, heads, dr] in place at positions ``pos0 ..`` (adjacent pairs); nothing when
        ``rope_base`` is None (Kimi-Linear's MLA: NoPE, the "rope" dims used as they are)."""
        if self.rope_base is None:
            return
        pos = np.arange(pos0, pos0 + x.shape[0], dtype=np.int64)
        cos, sin = self.m.rope_table(self.rope_base, self.rope_scaling, self.dr)
        apply_rope(x, pos, cos, sin, self.dr, NORM)

    def expanded_is_cheaper(self, R: int, pos0: int) -> bool:
        """Whether a chunk of ``R`` rows at ``pos0`` costs fewer multiply-adds per head in the expanded form than in
        the absorbed one (this block's :meth:`expands` and the device's ``MLAMixer._mla_expand``): expanding the
        ``n = pos0 + R`` keys and values from the latent (n r (dn + dv)) plus attention over them (R n (dn + dr + dv))
        against the absorbed q and output products (R r (dn + dv)) plus its scores and weighted latent (R n (2 r + dr)).
        A chunk from position 0 always does; a few rows after a long context do not. ``r`` kv_lora_rank, ``dn`` /
        ``dr`` the key's nope / rope dims, ``dv`` the value's."""
        r, dn, dr, dv = self.r, self.dn, self.dr, self.dv
        n = pos0 + R
        return n * r * (dn + dv) + R * n * (dn + dr + dv) <= R * r * (dn + dv) + R * n * (2 * r + dr)

    def expands(self, T: int, pos0: int, sel=None) -> bool:
        """Whether ``T`` rows at ``pos0`` take the expanded form (module docstring): more than one row, fewer
        multiply-adds (:meth:`expanded_is_cheaper`), and every earlier position attended (``sel`` None, or
        :func:`every_key_chosen`)."""
        return (T > 1 and self.expanded_is_cheaper(T, pos0)
                and (sel is None or every_key_chosen(sel, pos0)))

    def expanded(self, q, cache: LatentCache, pos0: int):
        """HF's form for ``q`` f32 [T, H, dn + dr] (rope applied) at ``pos0 ..`` over the cache's ``pos0 + T``
        positions: per group of heads (:data:`EXPAND_BYTES`) their keys and values from the latent, then
        ``cpu_kernels.attention.attend``'s causal query blocks. Returns f32 [T, H, dv]."""
        T, H, dn, dv = q.shape[0], self.H, self.dn, self.dv
        n = pos0 + T
        lat, kr = cache.lat[:n], cache.kr[:n]
        per = _head_floats(dn, self.dr, dv)  # K, V and one GEMM output at a time: expand_scratch_bytes bounds it
        G = max(1, min(H, EXPAND_BYTES // (4 * n * per)))
        out = np.empty((T, H, dv), np.float32)
        for h0 in range(0, H, G):
            h1 = min(h0 + G, H)
            g = h1 - h0
            # one GEMM a side for the group's heads: k_j = W_kb c_j, v_j = W_vb c_j (the engine's threads, as
            # every kernel; NumPy's BLAS ran it at the same speed here but with a thread pool of its own)
            kn = np.empty((n, g * dn), np.float32)
            kb = np.ascontiguousarray(self.attn_k_b[h0:h1].transpose(0, 2, 1)).reshape(g * dn, self.r)
            gemm_f32(memory.read_only(kb), lat, kn)   # read-only, as the F32 weights' kernels: one compile
            K = np.empty((g, n, dn + self.dr), np.float32)
            K[:, :, :dn] = kn.reshape(n, g, dn).transpose(1, 0, 2)
            K[:, :, dn:] = kr                                             # the rope key, shared by the heads
            del kn  # before vn: the group's scratch is K, V and one GEMM output (EXPAND_BYTES)
            vn = np.empty((n, g * dv), np.float32)
            gemm_f32(memory.read_only(np.ascontiguousarray(self.attn_v_b[h0:h1]).reshape(g * dv, self.r)), lat, vn)
            V = np.ascontiguousarray(vn.reshape(n, g, dv).transpose(1, 0, 2))
            del vn
            if G == H:
                attend_blocks(q, K, V, pos0, self.scale, out=out)
            else:  # contiguous groups: the kernels' compiled signatures take C arrays
                out[:, h0:h1] = attend_blocks(np.ascontiguousarray(q[:, h0:h1]), K, V, pos0, self.scale)
            del K, V  # freed before the next group's are made
        return out

    def attend(self, q, kv, cache: LatentCache, pos0: int, sel=None):
        """Rope, the latent cache write, the attention (absorbed or expanded: :meth:`expands`) and ``attn_output``
        for ``project``'s q and kv: f32 [T, D]."""
        T = q.shape[0]
        q_pe = np.ascontiguousarray(q[:, :, self.dn:])
        self.rope(q_pe, pos0)
        self.latent(kv, cache, pos0)
        if self.expands(T, pos0, sel):
            o = self.expanded(np.concatenate([q[:, :, :self.dn], q_pe], axis=2), cache, pos0)
        else:
            o = mla_attend(np.ascontiguousarray(q[:, :, :self.dn]), q_pe, self.attn_k_b, self.attn_v_b, cache.lat,
                           cache.kr, pos0, self.scale, sel)
        return self.m.mm(self.attn_output, o.reshape(T, self.H * self.dv))

    def __call__(self, x, xa, cache: LatentCache, pos0: int, sel=None):
        q, kv, _ = self.project(x, xa)
        return self.attend(q, kv, cache, pos0, sel)
