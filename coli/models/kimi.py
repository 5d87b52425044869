"""Kimi-Linear (GGUF ``kimi-linear``; HF ``models/kimi_linear/modeling_kimi_linear.py``; llama.cpp
``src/models/kimi-linear.cpp``, converter ``KimiLinearModel``): KDA linear-attention layers beside MLA layers,
leading dense layers, routed + shared experts.

Decoder layer: ``h += mixer(attn_norm(h)); h += ffn(ffn_norm(h))``. The mixer of layer ``il`` is KDA where the
file's per-layer ``attention.head_count_kv`` is 0 (the converter's mark for ``linear_attn_config.kda_layers``),
else MLA. ffn is DeepSeek-V2's (``coli/models/deepseek2.py``): the dense SwiGLU MLP for the first
``leading_dense_block_count`` layers, else routed experts (sigmoid scores, the choice on scores + ``exp_probs_b``,
weights renormalised as llama.cpp always does for this architecture (HF ``moe_renormalize``), times
``expert_weights_scale``) plus the shared expert.

KDA (HF ``KimiLinearDeltaAttention``) of H heads of ``kda.head_dim`` d (H = ``attention.head_count``, as
llama.cpp reads it), x the normed input f32 [T, D]:

    q, k, v = SiLU(causal conv of width ``ssm.conv_kernel``(attn_q x, attn_k x, attn_v x))  # ssm_conv1d_{q,k,v}
    g       = ssm_a * softplus(ssm_f_b (ssm_f_a x) + ssm_dt.bias)     # [T, H, d]: a decay per channel
    beta    = sigmoid(ssm_beta x)                                        # [T, H]
    o       = the gated delta rule with per-channel decay (cpu_kernels.kda)
    out     = attn_output(RMSNorm(o, ssm_norm) * sigmoid(ssm_g_b (ssm_g_a x)))

The convolution is the Gated DeltaNet one (``cpu_kernels.deltanet.causal_conv1d_silu``) over the three
projections side by side. The KDA cache is Gated DeltaNet's (``coli.models.deltanet.DeltaNetCache``): the
convolution's last K - 1 input rows f32 [K - 1, 3 H d] and the state f32 [H, d, d], constant bytes, not indexed
by position (``rewindable = False``).

MLA (HF ``KimiLinearAttention``): DeepSeek-V2's latent attention (``coli/models/mla.py``, the latent cache)
WITHOUT rope: Kimi's MLA is NoPE, the ``rope.dimension_count`` dims of q and of the shared key are used unrotated;
softmax scale 1/sqrt(key_length_mla). docs/families.md "Kimi-Linear (KDA + MLA)".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from coli.base.errors import ColiError
from cpu_kernels import experts as grouped
from cpu_kernels.deltanet import causal_conv1d_silu
from cpu_kernels.kda import kda

from . import base, deepseek2
from .deltanet import DeltaNetCache
from .mla import MLA, LatentCache, expand_scratch_bytes


@dataclass
class Args(deepseek2.Args):
    """DeepSeek-V2's fields plus KDA's: ``kda_dim`` (``kda.head_dim``), ``conv_kernel`` (``ssm.conv_kernel``) and
    ``kda_layers`` (per layer: True for KDA, from ``attention.head_count_kv`` == 0)."""

    kda_dim: int = 0
    conv_kernel: int = 0
    kda_layers: list = field(default_factory=list)

    @property
    def attn_scale(self) -> float:
        """1/sqrt(nope + rope dims) (HF ``qk_head_dim ** -0.5``; no YaRN factor: the MLA has no rope)."""
        return 1.0 / math.sqrt(self.nope + self.n_rot)


def read_args(g) -> Args:
    """DeepSeek-V2's keys (``deepseek2.read_args``; sigmoid gating by default, weights renormalised unless the file
    says otherwise) plus ``kda.head_dim``, ``ssm.conv_kernel`` and the per-layer ``attention.head_count_kv``.
    ColiError naming a missing or inconsistent key."""
    a = g.arch

    def need(key):
        return base.need_key(g, key)

    kv = need("attention.head_count_kv")
    n_layers = int(need("block_count"))
    kv = [int(x) for x in (kv if isinstance(kv, (list, tuple, np.ndarray)) else [kv] * n_layers)]
    if len(kv) != n_layers:
        raise ColiError(f"{g.path.name}: metadata '{a}.attention.head_count_kv' has {len(kv)} entries for "
                        f"{n_layers} layers")
    dim, kernel = int(need("kda.head_dim")), int(need("ssm.conv_kernel"))
    if dim <= 0 or kernel < 1:
        raise ColiError(f"{g.path.name}: metadata '{a}.kda.head_dim' {dim} / '{a}.ssm.conv_kernel' {kernel}")
    args = deepseek2.read_args(g, cls=Args, gating_default=2, kda_dim=dim, conv_kernel=kernel,
                               kda_layers=[n == 0 for n in kv])
    if g.get(f"{a}.expert_weights_norm") is None:   # llama.cpp kimi-linear.cpp: build_moe_ffn(..., norm_w = true)
        args.norm_topk = True
    return args


def kda_dims(n_heads: int, dim: int, kernel: int) -> dict:
    """The shape of a KDA layer's state in ``deltanet.ssm_dims`` terms (as many key as value heads, dk = dv = the
    head size), for the shared ``DeltaNetCache``: convolution rows of 3 H d channels, state [H, d, d]."""
    return dict(kernel=kernel, dk=dim, dv=dim, n_k_heads=n_heads, n_v_heads=n_heads)


class KDA:
    """The KDA mixer of one layer (module docstring). ``__call__(x, xa, cache, pos0) -> f32 [T, D]`` (``pos0``
    unused: the state carries the position). ColiError at load naming a missing tensor or one whose shape does
    not match ``attention.head_count`` x ``kda.head_dim``."""

    pageable = False  # a recurrent state, not rows by position (Cache.pageable)

    def __init__(self, m, p: str):
        a = m.args
        wt = m.wt
        self.m = m
        self.H, self.d, self.K = H, d, K = a.n_heads, a.kda_dim, a.conv_kernel
        self.eps = a.eps
        C, D = H * d, a.d_model
        self.attn_q, self.attn_k, self.attn_v = (wt.w(p + f"attn_{n}.weight") for n in "qkv")
        self.ssm_f_a, self.ssm_f_b = wt.w(p + "ssm_f_a.weight"), wt.w(p + "ssm_f_b.weight")
        self.ssm_g_a, self.ssm_g_b = wt.w(p + "ssm_g_a.weight"), wt.w(p + "ssm_g_b.weight")
        self.ssm_beta = wt.w(p + "ssm_beta.weight")
        self.attn_output = wt.w(p + "attn_output.weight")
        want = {"attn_q.weight": (C, D), "attn_k.weight": (C, D), "attn_v.weight": (C, D), "ssm_f_a.weight": (d, D),
                "ssm_f_b.weight": (C, d), "ssm_g_a.weight": (d, D), "ssm_g_b.weight": (C, d),
                "ssm_beta.weight": (H, D), "attn_output.weight": (D, C)}
        for n, shape in want.items():
            got = tuple(m.g.tensors[p + n].shape)
            if got != shape:
                raise ColiError(f"{wt.fname}: tensor '{p}{n}' has shape {list(got)}, expected {list(shape)} (from "
                                f"attention.head_count {H} x kda.head_dim {d}, embedding_length {D})")

        def vec(name, n):  # the converter's [1, C, 1, K] / [1, 1, H, 1] shapes (or squeezed ones) as n values
            arr = wt.f32(p + name)
            if arr.size != n:
                raise ColiError(f"{wt.fname}: tensor '{p}{name}' has {arr.size} values ({list(arr.shape)}), "
                                f"expected {n}")
            return arr.reshape(-1)

        self.conv_w = np.ascontiguousarray(np.concatenate(
            [vec(f"ssm_conv1d_{n}.weight", C * K).reshape(C, K) for n in "qkv"]))      # [3C, K]
        self.ssm_a = vec("ssm_a", H)                    # -exp(A_log) per head
        self.dt_bias = vec("ssm_dt.bias", C)            # per channel
        self.ssm_norm = vec("ssm_norm.weight", d)
        # the six projections of x in one grouped launch on x quantized once (where the formats allow it)
        self._proj = [self.attn_q, self.attn_k, self.attn_v, self.ssm_f_a, self.ssm_g_a, self.ssm_beta]
        self._group = grouped.Group(self._proj) if all(grouped.supports(w) for w in self._proj) else None

    def projections(self, x, xa=None):
        """``[q, k, v, f_a, g_a, beta]`` (pre-convolution; f_a and g_a the low-rank halves) for the rows x."""
        m = self.m
        if self._group is None or not m.grouped_rows(x.shape[0]):
            return [m.mm(w, x) for w in self._proj]
        out = self._group(xa if xa is not None else grouped.Act(x, m.act))
        o = np.cumsum([0] + [w.shape[0] for w in self._proj])
        return [np.ascontiguousarray(out[:, o[i]:o[i + 1]]) for i in range(len(self._proj))]

    def new_cache(self, ctx: int) -> DeltaNetCache:
        """A fresh (zero) state (the Gated DeltaNet layer's cache: the same two arrays); its size does not depend
        on ``ctx``."""
        return DeltaNetCache(3 * self.H * self.d, self.K, self.H, self.d, self.d)

    def __call__(self, x, xa, cache: DeltaNetCache, pos0: int):
        m, H, d = self.m, self.H, self.d
        T = x.shape[0]
        q, k, v, fa, ga, b = self.projections(x, xa)
        qkv = causal_conv1d_silu(np.concatenate([q, k, v], axis=1), self.conv_w, cache.conv).reshape(T, 3, H, d)
        f = m.mm(self.ssm_f_b, fa).astype(np.float64) + self.dt_bias
        sp = np.where(f > 20.0, f, np.log1p(np.exp(np.minimum(f, 20.0))))   # torch's softplus threshold
        g = (sp.reshape(T, H, d) * self.ssm_a[None, :, None]).astype(np.float32)
        beta = (0.5 * (1.0 + np.tanh(0.5 * b.astype(np.float64)))).astype(np.float32)  # sigmoid, no overflow
        gate = m.mm(self.ssm_g_b, ga).reshape(T, H, d)
        o = kda(qkv[:, 0], qkv[:, 1], qkv[:, 2], g, beta, cache.state, gate, self.ssm_norm, self.eps)
        return m.mm(self.attn_output, o.reshape(T, H * d))


class DecoderLayer(deepseek2.DecoderLayer):
    """DeepSeek-V2's layer with the mixer chosen per layer: KDA or MLA without rope. ``exp_probs_b`` is required
    (llama.cpp kimi-linear.cpp loads it without TENSOR_NOT_REQUIRED; HF ``KimiLinearTopkRouter`` always has its
    ``e_score_correction_bias``)."""

    needs_bias = True

    @staticmethod
    def make_attention(m, p: str, il: int):
        a = m.args
        if a.kda_layers[il]:
            return KDA(m, p)
        return MLA(m, p, n_heads=a.n_heads, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, nope=a.nope,
                   n_rot=a.n_rot, v_dim=a.v_dim, scale=a.attn_scale, rope_base=None, rope_scaling=None)


class Model(base.Model):
    KV_TYPES = ("f32",)
    KV_WHAT = "an MLA latent cache"

    @staticmethod
    def args_from(g) -> Args:
        return read_args(g)

    def make_layer(self, il):
        return DecoderLayer(self, il)

    @classmethod
    def cache_bytes(cls, args: Args, ctx: int) -> int:
        """MLA layers: (kv_lora_rank + rope dims) f32 per position; KDA layers: their fixed convolution rows and
        state (the engine takes ``cache_bytes(args, 0)`` as the fixed part)."""
        n_kda = sum(args.kda_layers)
        return ((args.n_layers - n_kda) * int(ctx) * LatentCache.bytes_per_position(args.kv_lora_rank, args.n_rot)
                + n_kda * DeltaNetCache.bytes_for(kda_dims(args.n_heads, args.kda_dim, args.conv_kernel)))

    @classmethod
    def scratch_bytes(cls, args: Args, ctx: int) -> int:
        """The MLA layers' expanded keys and values (``mla.expand_scratch_bytes``); none without an MLA layer."""
        if sum(args.kda_layers) == args.n_layers:
            return 0
        return expand_scratch_bytes(args.n_heads, args.nope, args.n_rot, args.v_dim, ctx)
