"""DeepSeek-V2 / V2-Lite (GGUF ``deepseek2``; HF ``models/deepseek_v2/modeling_deepseek_v2.py``; llama.cpp
``src/models/deepseek2.cpp``, converter ``DeepseekV2Model``).

Decoder layer: ``h += attn_output(MLA(attn_norm(h))); h += ffn(ffn_norm(h))`` where the attention is multi-head
latent attention (``coli/models/mla.py``: absorbed at decode and prefill, the cache holds the KV latent and the
rope key only) and ffn is the dense SwiGLU MLP for the first ``leading_dense_block_count`` layers, else the MoE
block: routed experts chosen by the DeepSeek rule (``blocks.deepseek_route``: softmax or sigmoid scores as
``expert_gating_func`` says, group-limited top-k with ``expert_group_count`` / ``expert_group_used_count``,
``expert_weights_norm``, ``expert_weights_scale``) plus the shared experts (``ffn_*_shexp``, added ungated).

Keys read beyond the common ones (``deepseek2.*``): ``attention.q_lora_rank`` (absent: q straight from x),
``attention.kv_lora_rank``, ``attention.key_length_mla`` / ``value_length_mla`` (absent: ``key_length`` /
``value_length``, older files), ``rope.dimension_count`` (the rope dims dr), ``leading_dense_block_count``,
``expert_*``. docs/families.md "DeepSeek-V2 (MLA)".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from coli.base.errors import ColiError
from cpu_kernels.norms import rms_norm

from . import base
from .blocks import MLP, MoE, deepseek_route, expert_groups
from .mla import MLA, LatentCache, expand_scratch_bytes

GATING = {1: "softmax", 2: "sigmoid"}  # gguf.ExpertGatingFuncType; absent = softmax (llama.cpp's V2 default)


@dataclass
class Args(base.BaseArgs):
    """``BaseArgs`` plus MLA's dimensions and DeepSeek's routing keys."""

    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    nope: int = 0
    v_dim: int = 0
    n_dense_lead: int = 0
    weights_scale: float = 1.0
    gating: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    yarn_log_mul: float = 0.0

    @property
    def attn_scale(self) -> float:
        """The softmax scale: 1/sqrt(dn + dr), times mscale^2 with mscale = 1 + yarn_log_multiplier x ln(factor)
        under YaRN (HF ``yarn_apply_mscale`` with mscale_all_dim; llama.cpp deepseek2.cpp ``kq_scale``)."""
        s = 1.0 / math.sqrt(self.nope + self.n_rot)
        rs = self.rope_scaling
        if self.yarn_log_mul and rs.kind == "yarn" and rs.factor > 1.0:
            ms = 1.0 + self.yarn_log_mul * math.log(rs.factor)
            s *= ms * ms
        return s


class _MetaWithout:
    """A view of a GGUF file without some metadata keys (the ones this family reads itself), for
    ``BaseArgs.from_gguf``, whose rope-scaling reader refuses keys it does not know."""

    def __init__(self, g, keys):
        self._g = g
        self.meta = {k: v for k, v in g.meta.items() if k not in keys}

    def get(self, key, default=None):
        return self.meta.get(key, default)

    def __getattr__(self, name):
        return getattr(self._g, name)


def read_args(g, cls=Args, gating_default: int = 1, **extra) -> Args:
    """The hyper-parameters of a ``deepseek2``-like file (``gating_default``: the gating function when the file
    has no ``expert_gating_func``; ``extra``: fields of a subclass ``cls``); ColiError naming a missing or
    inconsistent key."""
    a = g.arch
    # rope.scaling.yarn_log_multiplier (0.1 x HF's mscale_all_dim, converter [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]):
    # read here, where the attention scale is made; the cos/sin then keep HF's attention_factor
    # mscale(s, mscale) / mscale(s, mscale_all_dim), 1 for DeepSeek's releases (mscale = mscale_all_dim), as
    # llama.cpp assumes too (it cancels ggml's YaRN mscale for this architecture)
    lkey = f"{a}.rope.scaling.yarn_log_multiplier"
    log_mul = g.get(lkey)
    args = base.BaseArgs.from_gguf(_MetaWithout(g, {lkey}) if log_mul is not None else g)
    kw = dict(vars(args))
    if log_mul is not None:
        if args.rope_scaling.kind != "yarn" or not isinstance(log_mul, (int, float)) or not math.isfinite(log_mul):
            raise ColiError(f"{g.path.name}: metadata '{lkey}': {log_mul!r} needs rope scaling type yarn and a number")
        if args.rope_scaling.yarn_attn_factor is None:
            kw["rope_scaling"] = replace(args.rope_scaling, yarn_attn_factor=1.0)
        kw["yarn_log_mul"] = float(log_mul)

    def need(key):
        return base.need_key(g, key)

    r = int(need("attention.kv_lora_rank"))
    k_len = int(g.get(f"{a}.attention.key_length_mla", 0) or need("attention.key_length"))
    v_len = int(g.get(f"{a}.attention.value_length_mla", 0) or need("attention.value_length"))
    n_rot = int(need("rope.dimension_count"))
    if not 0 < n_rot < k_len or n_rot % 2:
        raise ColiError(f"{g.path.name}: metadata '{a}.rope.dimension_count': {n_rot} (an even number below the "
                        f"key length {k_len})")
    gating_id = int(g.get(f"{a}.expert_gating_func", 0) or gating_default)
    if gating_id not in GATING:
        raise ColiError(f"{g.path.name}: metadata '{a}.expert_gating_func': {gating_id} is not implemented "
                        f"(1 softmax, 2 sigmoid)")
    n_group, topk_group = expert_groups(g, args.n_experts, args.top_k)
    kw.update(q_lora_rank=int(g.get(f"{a}.attention.q_lora_rank", 0) or 0), kv_lora_rank=r, nope=k_len - n_rot,
              v_dim=v_len, n_rot=n_rot, n_dense_lead=int(g.get(f"{a}.leading_dense_block_count", 0) or 0),
              weights_scale=float(g.get(f"{a}.expert_weights_scale", 1.0) or 1.0), gating=GATING[gating_id],
              n_group=n_group, topk_group=topk_group,
              norm_topk=bool(g.get(f"{a}.expert_weights_norm", False)), **extra)
    return cls(**kw)


class DecoderLayer:
    """``h += MLA(attn_norm(h)); h += ffn(ffn_norm(h))``: ffn the dense MLP for the leading dense layers, else
    the MoE block (routed experts by the DeepSeek rule plus the shared experts). ``exp_probs_b`` (the correction
    bias) is optional here, as llama.cpp's deepseek2 loader has it (V2 files have none); a family whose reference
    always has one sets ``needs_bias``."""

    needs_bias = False
    pageable = property(lambda self: self.attn.pageable)  # Model.pageable: its cache is its attention's
    #: the device's layer form (coli/vulkan/layer_plan.py ``FORMS``): the MLA block qualifies by its kernels there
    device_form = "pre-norm"

    def __init__(self, m, il: int):
        a = m.args
        p = f"blk.{il}."
        self.m = m
        self.eps = a.eps
        self.attn_norm = m.wt.f32(p + "attn_norm.weight")
        self.attn = self.make_attention(m, p, il)
        self.ffn_norm = m.wt.f32(p + "ffn_norm.weight")
        self.moe = self.mlp = None
        if il < a.n_dense_lead:
            self.mlp = MLP(m, p)
        else:
            bias = m.wt.f32(p + "exp_probs_b.bias", self.needs_bias)
            route = deepseek_route(a.top_k, gating=a.gating, n_group=a.n_group, topk_group=a.topk_group,
                                   group_score="max" if a.gating == "softmax" and bias is None else "top2sum",
                                   norm=a.norm_topk, scale=a.weights_scale, bias=bias)
            self.moe = MoE(m, p, il, route=route)

    @staticmethod
    def make_attention(m, p: str, il: int):
        """The layer's MLA block (a family with another attention on the same latent overrides this)."""
        a = m.args
        return MLA(m, p, n_heads=a.n_heads, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, nope=a.nope,
                   n_rot=a.n_rot, v_dim=a.v_dim, scale=a.attn_scale, rope_base=a.rope_base,
                   rope_scaling=a.rope_scaling)

    def new_cache(self, ctx: int) -> LatentCache:
        return self.attn.new_cache(ctx)

    def __call__(self, h, cache, pos0: int):
        x, xa = self.m.norm_in(h, self.attn_norm)
        h += self.attn(x, xa, cache, pos0)
        if self.moe is not None:
            h += self.moe(rms_norm(h, self.ffn_norm, self.eps))
        else:
            h += self.mlp(*self.m.norm_in(h, self.ffn_norm))
        return h


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
        """The latent caches: (kv_lora_rank + rope dims) f32 per position per layer."""
        return args.n_layers * int(ctx) * LatentCache.bytes_per_position(args.kv_lora_rank, args.n_rot)

    @classmethod
    def scratch_bytes(cls, args: Args, ctx: int) -> int:
        """A prompt chunk's expanded MLA keys and values (``mla.expand_scratch_bytes`` over ``ctx`` positions)."""
        return expand_scratch_bytes(args.n_heads, args.nope, args.n_rot, args.v_dim, ctx)
