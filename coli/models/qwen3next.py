"""Qwen3-Next (HF ``models/qwen3_next/modeling_qwen3_next.py``; llama.cpp ``LLM_ARCH_QWEN3NEXT``,
``src/models/qwen3next.cpp``; GGUF as ``convert_hf_to_gguf.py`` ``Qwen3NextModel`` writes it).

Hybrid decoder: the layers flagged in ``qwen3next.attention.recurrent_layers`` (else every layer but each
``full_attention_interval``-th) mix tokens with Gated DeltaNet (``coli/models/deltanet.py``: a conv state and a
recurrent state per layer instead of a KV cache), the others with gated full attention:

* ``attn_q`` [2 H hd, D] gives, per head, hd query rows then hd gate rows; the attention output is multiplied by
  ``sigmoid(gate)`` before ``attn_output``;
* per-head RMSNorm of q and k (``attn_q_norm`` / ``attn_k_norm``), rope NEOX over the first
  ``rope.dimension_count`` dims of each head (HF ``partial_rotary_factor``), scale 1/sqrt(hd).

Every layer: ``h += mixer(attn_norm(h)); h += moe(post_attention_norm(h))``; the MoE is softmax top-k renormalised
(llama.cpp passes norm_w = true) plus the shared expert scaled by ``sigmoid(x . ffn_gate_inp_shexp)``. HF's norms
are zero-centred (``x * (1 + w)``); the converter stores ``1 + w``, so they are plain RMSNorms here (the gated norm
``ssm_norm`` is stored as is). MTP layers (``nextn_predict_layers``, appended after the trunk) are left unread.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coli.base.errors import ColiError
from cpu_kernels.norms import rms_norm
from cpu_kernels.rope import NEOX

from . import base
from .blocks import KV, MLP, Attention, MoE, softmax_topk
from .deltanet import DeltaNetCache, GatedDeltaNet, ssm_dims


@dataclass
class Args(base.BaseArgs):
    """``BaseArgs`` plus the hybrid layout: ``recurrent`` (one bool per run layer) and the DeltaNet dims
    (``coli.models.deltanet.ssm_dims``: conv kernel, key/value head counts and sizes)."""

    recurrent: tuple = ()
    ssm: dict | None = None

    @classmethod
    def from_gguf(cls, g, **overrides):
        a = g.arch
        n_blocks = int(g.get(f"{a}.block_count", 0) or 0)
        n_mtp = int(g.get(f"{a}.nextn_predict_layers", 0) or 0)
        n_run = n_blocks - n_mtp
        rec = g.get(f"{a}.attention.recurrent_layers")
        if rec is not None:
            rec = [bool(r) for r in np.asarray(rec).reshape(-1)]
            if len(rec) < n_run:
                raise ColiError(f"{g.path.name}: metadata '{a}.attention.recurrent_layers' has {len(rec)} entries "
                                f"for {n_run} layers")
        else:  # llama.cpp's default: every interval-th layer is full attention
            iv = int(g.get(f"{a}.full_attention_interval", 4) or 4)
            rec = [(il + 1) % iv != 0 for il in range(n_run)]
        return super().from_gguf(g, n_layers=n_run, recurrent=tuple(rec[:n_run]), ssm=ssm_dims(g), **overrides)


class GatedAttention:
    """Qwen3-Next's full attention: q and its output gate from one ``attn_q``, per-head q/k norms, partial NEOX
    rope, ``attn_output(attend(q, k, v) * sigmoid(gate))`` (HF ``Qwen3NextAttention``; llama.cpp
    ``build_layer_attn``). The q/k/v projections, rope, KV cache and output are ``blocks.Attention``'s."""

    pageable = property(lambda self: self.attn.pageable)  # Model.pageable: its cache is its attention's

    def __init__(self, m, p: str):
        self.m = m
        self.attn = Attention(m, p, rope_kind=NEOX, qk_norm="heads")
        a = self.attn
        want = 2 * a.n_heads * a.head_dim
        if a.attn_q.shape[0] != want:
            raise ColiError(f"{m.wt.fname}: tensor '{p}attn_q.weight' has {a.attn_q.shape[0]} rows, expected {want} "
                            "(query and gate of each head)")

    def new_cache(self, ctx: int):
        return self.attn.new_cache(ctx)

    def __call__(self, x, xa, kv, pos0: int):
        a = self.attn
        T, H, hd = x.shape[0], a.n_heads, a.head_dim
        qg, k, v = a.qkv(x, xa)
        qg = qg.reshape(T, H, 2 * hd)
        q = np.ascontiguousarray(qg[:, :, :hd]).reshape(T, H * hd)
        gate = qg[:, :, hd:].reshape(T, H * hd)
        q, k, v = a.heads(q, k, v)
        a.rope(q, k, pos0)
        o = a.attend(q, k, v, kv, pos0).reshape(T, H * hd)
        o *= (1.0 / (1.0 + np.exp(-gate))).astype(np.float32)
        return a.out(o)


class DecoderLayer:
    """``h += mixer(attn_norm(h)); h += ffn(post_attention_norm(h))``: the mixer is ``linear_attn`` (Gated
    DeltaNet) on recurrent layers, else ``self_attn`` (gated attention); ffn the MoE block when the layer has a
    router, else the dense SwiGLU FFN. ``tiled``: the DeltaNet value-head order (coli/models/deltanet.py)."""

    #: the device runs this layer (coli/vulkan/device_layers.py): ``post_attention_norm`` is its FFN's pre-norm
    device_form = "pre-norm"
    pageable = property(lambda self: (self.linear_attn or self.self_attn).pageable)  # Model.pageable

    def __init__(self, m, il: int, *, tiled: bool = False):
        p = f"blk.{il}."
        a = m.args
        self.m = m
        self.eps = a.eps
        self.attn_norm = m.wt.f32(p + "attn_norm.weight")
        self.linear_attn = self.self_attn = None
        if a.recurrent[il]:
            self.linear_attn = GatedDeltaNet(m, p, a.ssm, tiled)
        else:
            self.self_attn = GatedAttention(m, p)
        self.post_attention_norm = m.wt.f32(p + "post_attention_norm.weight")
        self.moe = self.mlp = None
        if m.wt.has(p + "ffn_gate_inp.weight"):
            self.moe = MoE(m, p, il, route=softmax_topk(a.top_k, a.norm_topk))
            if self.moe.shared is not None:  # Qwen3-Next's shared expert is always gated (llama.cpp requires it)
                m.wt.info(p + "ffn_gate_inp_shexp.weight")  # ColiError naming it when missing
        else:
            self.mlp = MLP(m, p)

    def new_cache(self, ctx: int):
        return (self.linear_attn or self.self_attn).new_cache(ctx)

    def __call__(self, h, cache, pos0: int):
        x, xa = self.m.norm_in(h, self.attn_norm)
        if self.linear_attn is not None:
            h += self.linear_attn(x, xa, cache)
        else:
            h += self.self_attn(x, xa, cache, pos0)
        if self.moe is not None:
            h += self.moe(rms_norm(h, self.post_attention_norm, self.eps))
        else:
            h += self.mlp(*self.m.norm_in(h, self.post_attention_norm))
        return h


class Model(base.Model):
    #: DeltaNet value heads in the tiled order (Qwen3.5 files); Qwen3-Next keeps HF's grouped order
    tiled = False

    @staticmethod
    def args_from(g):
        return Args.from_gguf(g)

    def make_layer(self, il):
        return DecoderLayer(self, il, tiled=self.tiled)

    @classmethod
    def cache_bytes(cls, args, ctx: int) -> int:
        """K and V f32 [n_kv_heads, ctx, head_dim] per full-attention layer, plus per DeltaNet layer its conv state
        f32 [K - 1, 2 Hk dk + Hv dv] and recurrent state f32 [Hv, dk, dv] (independent of ``ctx``)."""
        n_rec = sum(args.recurrent)
        kv = (args.n_layers - n_rec) * int(ctx) * KV.bytes_per_position(args.n_kv_heads, args.head_dim,
                                                                                 types=args.kv_types)
        return kv + n_rec * DeltaNetCache.bytes_for(args.ssm)
