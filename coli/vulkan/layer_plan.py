"""Which decoder layers run whole on the device (coli/vulkan/device_layers.py) and what they cost in device bytes:
functions of the model alone (no device is opened here; docs/vulkan.md "Device layers").

Which layers: :func:`plan` (the device's budget: each layer's weights and its KV cache; ``COLI_VK_LAYERS``
sets the count). Which layers qualify: :func:`why_not`, by what a layer needs: its form (pre-norm, or Gemma 3's norms
after each block too), its attention (GQA, rope NORM / NEOX with a table a layer, q/k norms, biases, a sliding window,
gpt-oss's and MiMo-V2's sinks, MiMo-V2's KV heads a layer, narrower V heads and value scale, Qwen3-Next's output
gate; or DeepSeek-V2's MLA over a latent cache, shaders/mla.comp, with GLM-5's DSA indexer (:func:`is_dsa`); or
Gated DeltaNet, or Kimi-Linear's KDA (:func:`is_kda`), with its conv and recurrent states on the device,
shaders/deltanet.comp), its FFN (the softmax
top-k MoE with Qwen2-MoE's shared expert, gpt-oss's biased MoE with its top-k softmax router and clamped SwiGLU,
DeepSeek-V4's MoE with its hash or sqrt-softplus router (:func:`topk_args`), or the dense SwiGLU / GeGLU FFN) and its
tensors' formats; DeepSeek-V4's layers are refused for their attention over the hyper-connection streams. The
predicates that tell a layer's blocks apart (:func:`is_deltanet`,
:func:`is_mla`, :func:`is_gated`, :func:`attn_block`) and the sizes the device's buffers take (:func:`hidden_width`)
serve ``DeviceLayers`` too.
"""
from __future__ import annotations

import numpy as np

from coli.base import settings

_NORM, _NEOX = 0, 2


def device_formats():
    """The tensor types the device has kernels for (``coli.vulkan.shaders.FORMATS``)."""
    from coli.vulkan import shaders as S

    return S.FORMATS


#: the K/V cache types the device layers keep (shaders/kv_types.glsl, ``--cache-type-k/-v``), as the codes of
#: cpu_kernels/kvcache.py (f32 0, f16 1, bf16 2, q8_0 3), and their bytes a value (q8_0: :func:`kv_row_bytes`)
KV_CODES = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3}
KV_BYTES = {"f32": 4, "f16": 2, "bf16": 2}


def kv_row_bytes(kind: str, w: int) -> int:
    """Bytes one head's row of ``w`` values takes in a device K/V cache of type ``kind`` (q8_0: GGUF's block_q8_0,
    34 bytes per 32 values; ``w`` a multiple of 32 there, as the CPU's cache requires)."""
    return (w // 32) * 34 if kind == "q8_0" else KV_BYTES[kind] * w


def kv_mode(types: tuple) -> int:
    """The Dispatch ``mode`` bits of a K/V cache of ``types`` (K's, V's: names of :data:`KV_CODES`) for the kernels
    that read or write it (``coli.vulkan.layers.KV_KERNELS``): K's code << 24 | V's << 28 (or'd with the prompt
    attention's MAXD | G << 16)."""
    return (KV_CODES[types[0]] << 24) | (KV_CODES[types[1]] << 28)


def kv_value_bytes(m) -> tuple[str, str]:
    """The model's K and V cache types (``m.args.kv_types``; f32 when the model has none), for
    :func:`kv_row_bytes`."""
    kt = tuple(getattr(m.args, "kv_types", ("f32", "f32")))
    return kt[0], kt[1]


SHEXP_TENSORS = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight")
#: the FFN's down projections: an F32/F16/BF16 one may have any width, the FFN's hidden width padded to a multiple of
#: 32 on the device (gate and up with zero rows, down with zero columns: :func:`ffn_width`); so may MLA's q_b (and
#: GLM-5's indexer's), over a q_lora_rank padded the same way (attn_q_a with zero rows)
DOWN_TENSORS = ("ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")
Q_B_TENSORS = ("attn_q_b.weight",)


def ceil32(n: int) -> int:
    return -(-int(n) // 32) * 32


def is_float(type_name: str) -> bool:
    """Whether a tensor type is F32, F16 or BF16 (one value a block: its rows may be padded with zeros)."""
    return type_name in ("F32", "F16", "BF16")


def head_fits(out) -> bool:
    """Whether the output head ``out`` (``output.weight`` or the tied ``token_embd``, a GGUF tensor info [V, D])
    runs on the device (``lmv`` / ``lmm``): a format with a device kernel, rows in whole 32-weight units or, for
    F32/F16/BF16, of any width (zero-padded rows, the last unit's inputs past D read as 0: shaders/x_unit.glsl)."""
    return out.type_name in device_formats() and (int(out.shape[-1]) % 32 == 0 or is_float(out.type_name))
MLP_TENSORS = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
#: the layer forms the device runs (a family's decoder layer says its form in ``device_form``): "pre-norm"
#: ``h += attn(norm(h)); h += ffn(norm(h))`` (llama.DecoderLayer); "sandwich" with a norm after each block too,
#: ``h += norm(attn(norm(h))); h += norm(ffn(norm(h)))`` (gemma3.DecoderLayer: ``post_attention_norm``,
#: ``post_ffw_norm``)
FORMS = ("pre-norm", "sandwich")


def _cls(x) -> str:
    return f"{type(x).__module__.rsplit('.', 1)[-1]}.{type(x).__name__}"


def is_deepseek4(L) -> bool:
    """A DeepSeek-V4 block (``deepseek4.DecoderLayer``: its own device path, ``coli/vulkan/layer_dsv4.py``)."""
    return _is(L, "coli.models.deepseek4.DecoderLayer")


def dsv4_tensors(m, il: int) -> list[str]:
    """The GGUF matrices a DeepSeek-V4 layer places in its file's format (``layer_dsv4.Dsv4Layer``; its
    hyper-connection, compressor and norm weights, sinks, routing tables go as f32 / int32 constants)."""
    p = f"blk.{il}."
    names = [p + n for n in ("attn_q_a.weight", "attn_q_b.weight", "attn_kv.weight", "attn_output_a.weight",
                             "attn_output_b.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
                             "ffn_down_exps.weight") + SHEXP_TENSORS]
    for c in ("attn_compressor", "indexer_compressor"):
        names += [p + c + s for s in ("_kv.weight", "_gate.weight") if p + c + s in m.t]
    return names + [p + n for n in ("indexer.attn_q_b.weight", "indexer.proj.weight") if p + n in m.t]


def dsv4_layer_bytes(m, il: int, ctx: int, experts: bool = True) -> int:
    """Device bytes of DeepSeek-V4 layer ``il``: its tensors as stored (the router as f32; ``experts`` False: without
    its routed experts, which stay on the CPU) and its state f32: the window ring, each compressor's ring of rows
    (2m with overlap, else m) and entries of ``ctx`` positions."""
    at = m.layers[il].attn
    w = sum(_padded_bytes(m, n) for n in dsv4_tensors(m, il) if experts or "_exps." not in n)
    w += router_bytes(m, il)
    s = at.W * at.hd
    for c in (at.comp, at.idx_comp):
        if c is not None:
            s += (2 if c.overlap else 1) * c.ratio * 2 * c.width + (int(ctx) // c.ratio) * c.hd
    return w + 4 * s


def _layer_tensors(m, il: int) -> list[str]:
    """The GGUF tensors layer ``il`` places on the device (its norms besides: f32 vectors)."""
    p = f"blk.{il}."
    if is_deepseek4(m.layers[il]):
        return dsv4_tensors(m, il)
    at = attn_block(m.layers[il])
    if is_kda(m.layers[il]):        # ssm_f_b, ssm_g_b, the conv weights, ssm_a, dt bias and norm go as f32 (dn_bytes)
        names = [p + n for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ssm_f_a.weight", "ssm_g_a.weight",
                                 "ssm_beta.weight", "attn_output.weight")]
    elif is_deltanet(m.layers[il]):    # its conv weights, ssm_a, dt bias and norm go as f32 (dn_bytes)
        ba = ("ssm_ba.weight",) if p + "ssm_ba.weight" in m.t else ("ssm_beta.weight", "ssm_alpha.weight")
        names = [p + n for n in ("attn_qkv.weight", "attn_gate.weight") + ba + ("ssm_out.weight",)]
    elif is_mla(at):     # its attn_k_b / attn_v_b go as f32 (mla_bytes)
        qs = ("attn_q.weight",) if at.attn_q is not None else ("attn_q_a.weight", "attn_q_b.weight")
        names = [p + n for n in qs + ("attn_kv_a_mqa.weight", "attn_output.weight")]
        if is_dsa(m.layers[il]) and m.layers[il].attn.indexer is not None:   # k_norm's weight and bias: f32
            names += [p + "indexer." + n for n in ("attn_q_b.weight", "attn_k.weight", "proj.weight")]
    else:
        names = [p + n for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")]
    if getattr(m.layers[il], "moe", None) is None:      # the dense FFN
        return names + [p + n for n in MLP_TENSORS]
    names += [p + n for n in ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
                              "ffn_down_exps.weight")]
    if p + SHEXP_TENSORS[0] in m.t:     # Qwen2-MoE's shared expert and its gate
        names += [p + n for n in SHEXP_TENSORS]
        if p + "ffn_gate_inp_shexp.weight" in m.t:
            names.append(p + "ffn_gate_inp_shexp.weight")
    return names


def _is(x, name: str) -> bool:
    """Whether ``x`` is exactly the class ``name`` (``module.qualname``; by name: coli.vulkan imports no model)."""
    return f"{type(x).__module__}.{type(x).__qualname__}" == name


def is_kda(L) -> bool:
    """Whether layer ``L`` mixes with Kimi-Linear's KDA (``coli.models.kimi.KDA``: Gated DeltaNet's recurrence with a
    decay a key channel, shaders/deltanet.comp's flag bit 2)."""
    return _is(getattr(L, "attn", None), "coli.models.kimi.KDA")


def is_deltanet(L) -> bool:
    """Whether layer ``L`` mixes with Gated DeltaNet (``coli.models.deltanet.GatedDeltaNet``) or KDA (:func:`is_kda`):
    a conv state and a recurrent state, shaders/deltanet.comp."""
    return _is(getattr(L, "linear_attn", None), "coli.models.deltanet.GatedDeltaNet") or is_kda(L)


def linear_block(L):
    """Layer ``L``'s DeltaNet-like mixer: its ``GatedDeltaNet`` or its ``KDA``."""
    return L.attn if is_kda(L) else L.linear_attn


def dn_dims(x) -> tuple:
    """(Hk, Hv, dk, dv, conv kernel, conv channels C) of a Gated DeltaNet or KDA block (KDA: H key and value heads of
    its head size, C = 3 H d)."""
    if _is(x, "coli.models.kimi.KDA"):
        return (x.H, x.H, x.d, x.d, x.K, 3 * x.H * x.d)
    return (x.n_k_heads, x.n_v_heads, x.dk, x.dv, x.kernel, x.conv_channels)


def is_gated(L) -> bool:
    """Whether layer ``L``'s attention is Qwen3-Next's gated attention (``qwen3next.GatedAttention``: q and a
    sigmoid output gate from one ``attn_q``)."""
    return _is(getattr(L, "self_attn", None), "coli.models.qwen3next.GatedAttention")


def is_dsa(L) -> bool:
    """Whether layer ``L``'s attention is GLM-5's MLA with the DSA indexer (``glmdsa.DSA``: its own indexer, or a
    shared layer's use of the last full layer's positions)."""
    return _is(getattr(L, "attn", None), "coli.models.glmdsa.DSA")


def dsa_shape(m) -> tuple | None:
    """(indexer heads Hi, key length Di, top_k) of a GLM-5 model's DSA layers, None for another family."""
    if not any(is_dsa(L) for L in m.layers):
        return None
    a = m.args
    return (int(a.idx_heads), int(a.idx_dim), int(a.idx_topk))


def attn_block(L):
    """Layer ``L``'s attention block (``blocks.Attention``, MLA, ...: the gated attention's inner ``Attention``,
    GLM-5's DSA's MLA), or None (a DeltaNet layer)."""
    if is_dsa(L):
        return L.attn.mla
    return L.self_attn.attn if is_gated(L) else getattr(L, "attn", None)


#: shaders/deltanet.comp's bound on the key head width (its q and k rows in shared memory)
DN_MAXK = 256


def _why_not_dn(m, il: int, dn) -> str | None:
    """Why the Gated DeltaNet block ``dn`` of layer ``il`` has no device kernels, or None."""
    dk = dn_dims(dn)[2]
    if dk > DN_MAXK:
        return f"a DeltaNet key head of {dk} dims (the device's takes {DN_MAXK} at most)"
    if is_kda(m.layers[il]):
        return None
    if f"blk.{il}.attn_qkv.weight" not in m.t:
        return "a fused ssm_in (an older conversion: no device kernel)"
    return None


def dn_bytes(dn) -> int:
    """Device bytes of a DeltaNet block besides its GGUF matrices: the conv weights, ssm_a, dt bias and norm as f32,
    its conv state and recurrent state (independent of the context)."""
    Hk, Hv, dk, dv, K, C = dn_dims(dn)
    if _is(dn, "coli.models.kimi.KDA"):     # KDA: ssm_f_b and ssm_g_b [Hv dk, dk], the dt bias a channel
        return 4 * (C * K + Hv + 2 * Hv * dk * dk + Hv * dk + dv + (K - 1) * C + Hv * dk * dv)
    return 4 * (C * K + 2 * Hv + dv + (K - 1) * C + Hv * dk * dv)


def is_mla(a) -> bool:
    """Whether the attention block ``a`` is DeepSeek-V2's MLA (``coli.models.mla.MLA``, shaders/mla.comp)."""
    return _is(a, "coli.models.mla.MLA")


#: shaders/mla.comp's bounds: a cache row (kv_lora_rank + rope dims) and a nope part of at most MLA_MAXW floats
MLA_MAXW = 1152


#: the positions the expanded MLA buffers of a prompt chunk hold (the per-head keys and values, f32 [H, n, dn + dr]
#: and [H, n, dv]: :func:`mla_expand_keys`); a chunk whose last row sees more keys takes the absorbed form
MLA_EXPAND_KEYS = 4096


def _device_mla(m):
    """The first MLA block (GLM-5: a DSA layer's) of the layers that qualify for the device, or None."""
    return next((attn_block(L) for il, L in enumerate(m.layers)
                 if not is_deltanet(L) and is_mla(attn_block(L)) and why_not(m, il) is None), None)


def mla_expand_keys(m, ctx: int) -> int:
    """Positions of the expanded MLA buffers (shaders/mla.comp mode 7, then attn_pre.comp over per-head keys and
    values): min(ctx, :data:`MLA_EXPAND_KEYS`), and GLM-5's ``index_topk`` (up to that many keys every row takes
    them all: dense attention); 0 when the layers' MLA cannot take the expanded form (a key of more than 256 dims or
    values wider than the key: attn_pre.comp's bounds) or there is none."""
    a, ds = _device_mla(m), dsa_shape(m)
    if a is None or a.dn + a.dr > 256 or a.dv > a.dn + a.dr:
        return 0
    return min(int(ctx), MLA_EXPAND_KEYS, ds[2] if ds else MLA_EXPAND_KEYS)


def _mla_expand_floats(m, ctx: int) -> int:
    """Floats of the expanded MLA buffers (:func:`mla_expand_keys` positions of every head's key and value)."""
    n = mla_expand_keys(m, ctx)
    a = _device_mla(m)
    return a.H * n * (a.dn + a.dr + a.dv) if n else 0


def _why_not_mla(a) -> str | None:
    """Why the MLA block ``a`` has no device kernels, or None (shaders/mla.comp: the absorbed form over the latent
    cache, rope NORM or none)."""
    if a.r + a.dr > MLA_MAXW or a.dn > MLA_MAXW:
        return f"an MLA latent of {a.r} + {a.dr} dims (the device's MLA takes {MLA_MAXW} at most)"
    if a.dr % 2:
        return "an odd MLA rope width (no device kernel)"
    return None


def _why_not_dsa(m, il: int) -> str | None:
    """Why GLM-5's DSA layer ``il`` has no device kernels, or None (shaders/mla.comp modes 4-6: the indexer's keys
    in the latent cache's rows, its scores and top-k, then MLA over the chosen keys). A shared layer (no indexer of
    its own) reads the positions of the last full layer before it, on the device too (``plan``)."""
    Hi, Di, _ = dsa_shape(m)
    if Di % 2 or Di < m.layers[il].attn.mla.dr:
        return f"an indexer key of {Di} dims with {m.layers[il].attn.mla.dr} rope dims (no device kernel)"
    return None


def head_dims(a) -> tuple[int, int, int, float]:
    """(KV heads, K's head width, V's head width, value scale) of a GQA attention block: MiMo-V2's layers each have
    their own KV heads, V heads narrower than K's and V times ``value_scale`` (``mimo2.Attention``); 1.0 elsewhere."""
    return (int(a.n_kv), int(a.head_dim), int(a.attn_v.shape[0]) // int(a.n_kv),
            float(getattr(a, "value_scale", 1.0)))


def max_kv(m) -> int:
    """The most KV heads of a GQA layer of ``m`` (MiMo-V2's sliding layers have more than its full ones): the
    device's per-row buffers are sized by it."""
    return max([int(a.n_kv) for a in (attn_block(L) for L in m.layers)
                if a is not None and not is_mla(a) and hasattr(a, "n_kv")] or [int(m.args.n_kv_heads)])


def rope_key(at) -> tuple:
    """(base, scaling, rotated dims) of an attention block: its rope table."""
    return (at.rope_base, at.rope_scaling, at.dr if is_mla(at) else at.n_rot)


def mla_bytes(at, ctx: int) -> int:
    """Device bytes of an MLA block besides its GGUF matrices: attn_k_b and attn_v_b as f32 and the latent cache
    of ``ctx`` positions (f32 [ctx, kv_lora_rank + rope dims])."""
    return 4 * (int(at.attn_k_b.size) + int(at.attn_v_b.size)) + 4 * int(ctx) * (at.r + at.dr)


#: cpu_kernels.experts' activation kinds (its ACT_*), the numbers shaders/act.glsl takes
ACT_SWIGLU, ACT_GEGLU, ACT_SWIGLU_OAI = 0, 1, 2


def is_deepseek4_moe(moe) -> bool:
    """Whether ``moe`` is DeepSeek-V4's MoE block (``deepseek4.MoE``: sqrt-softplus scores, hash or biased top-k)."""
    return _is(moe, "coli.models.deepseek4.MoE")


def route_rule(moe) -> tuple | None:
    """The MoE block's routing rule as the device runs it: ``("softmax_topk", k, renormalise)`` (softmax over every
    expert, then top-k: ``blocks.softmax_topk``), ``("topk_softmax", k, False)`` (top-k of the logits, then the
    softmax over the k chosen: gpt-oss), ``("deepseek", k, renormalise, gating, n_group, topk_group, group_score,
    scale)`` (``blocks.deepseek_route``; its correction bias is the layer's own), ``("deepseek4", k, renormalise,
    scale)`` (``deepseek4.MoE.route_tokens``; whether the layer hashes, its ``tid2eid`` and its correction bias are
    the layer's own: :func:`topk_args`), or None (another rule)."""
    if is_deepseek4_moe(moe):
        return ("deepseek4", int(moe.k), bool(moe.norm), float(moe.wscale))
    r = getattr(moe.route, "softmax_topk", None)
    if r is not None:
        return ("softmax_topk", int(r[0]), bool(r[1]))
    ds = getattr(moe.route, "deepseek", None)
    if ds is not None:
        return ("deepseek", int(ds["k"]), bool(ds["norm"]), ds["gating"], int(ds["n_group"]), int(ds["topk_group"]),
                ds["group_score"], float(ds["scale"]))
    k = getattr(moe.route, "topk_softmax", None)
    return None if k is None else ("topk_softmax", int(k), False)


def topk_args(moe) -> tuple[int, list[int]]:
    """``(flags, words)``: shaders/topk.comp's flags (u2) and its words u3 .. u6 for the router of the MoE block
    ``moe`` (:func:`route_rule`). Bit 0 renormalise; bit 1 gpt-oss's top-k softmax; bit 2 the DeepSeek rule (bit 3
    sigmoid scores; words: groups, kept groups, group score, scale as float bits), its bit 4 (the correction bias
    in a2) added where the layer has one; DeepSeek-V4 (``deepseek4.MoE``): bits 2 and 5 (sqrt-softplus scores) and
    the layer's own bit 6 (a hash layer: experts from ``ffn_gate_tid2eid`` in a3 by the token in a4) or bit 4 (the
    top-k of the scores plus ``exp_probs_b``), one group, the scale ``expert_weights_scale``."""
    rule = route_rule(moe)
    f32_bits = lambda x: int(np.float32(x).view(np.uint32))    # noqa: E731
    if rule[0] == "deepseek4":
        return int(rule[2]) | 4 | 32 | (64 if moe.hash else 16), [1, 1, 0, f32_bits(rule[3])]
    if rule[0] == "deepseek":
        return int(rule[2]) | 4 | (8 if rule[3] == "sigmoid" else 0), \
            [rule[4], rule[5], int(rule[6] == "top2sum"), f32_bits(rule[7])]
    return (int(rule[2]) if rule[0] == "softmax_topk" else 2), []


def _why_not_attention(a) -> str | None:
    """Why the attention block ``a`` has no device kernels, or None: ``coli.models.blocks.Attention`` (GQA) with rope
    NORM / NEOX (any base and scaling: a table a layer), q/k norms per head or over the projection, q/k/v/o biases,
    a sliding window, gpt-oss's and MiMo-V2's sinks, head widths up to 256 with V's at most K's (MiMo-V2: its own
    KV heads a layer, the value scale); or DeepSeek-V2's MLA (:func:`_why_not_mla`)."""
    if is_mla(a):
        return _why_not_mla(a)
    # gpt-oss's: one sink logit a head in the softmax's denominator (attn_dec / attn_pre take it)
    if not any(_is(a, c) for c in ("coli.models.blocks.Attention", "coli.models.gptoss.SinkAttention",
                                   "coli.models.mimo2.Attention")):
        if getattr(a, "attn_sinks", None) is not None:
            return f"attention sinks ({_cls(a)}: no device kernel)"
        return f"its attention is {_cls(a)} (no device kernel)"
    if a.rope_kind not in (_NORM, _NEOX):
        return "a rope pairing without a device kernel"
    if a.qk_norm not in (None, "heads", "full"):
        return f"q/k norm '{a.qk_norm}' (no device kernel)"
    if a.head_dim > 256 or head_dims(a)[2] > a.head_dim or a.attn_v.shape[0] % a.n_kv:
        return "a head width above 256 or a V head wider than K's"
    if a.n_rot % 2 or a.n_rot > a.head_dim or a.n_heads % a.n_kv:
        return "a rope width or a head grouping without a device kernel"
    return None


def _why_not_ffn(m, il: int, L) -> str | None:
    """Why the FFN of layer ``L`` has no device kernels, or None: the MoE block (up to 512 experts, top-32) with the
    softmax top-k, gpt-oss's top-k softmax or the DeepSeek router (:func:`route_rule`) and an optional shared expert
    (with its sigmoid gate), gpt-oss's biased MoE, DeepSeek-V4's MoE (its routed and shared experts' clamped SwiGLU),
    or the dense gated FFN (SwiGLU or GeGLU)."""
    moe, mlp = getattr(L, "moe", None), getattr(L, "mlp", None)
    if moe is None and mlp is None:
        return "a layer without an FFN block"
    if moe is None:
        if not _is(mlp, "coli.models.blocks.MLP"):
            return f"its FFN is {_cls(mlp)} (no device kernel)"
        if mlp.act not in ("swiglu", "geglu"):
            return f"the FFN activation '{mlp.act}' (no device kernel)"
        return None
    if _is(moe, "coli.models.gptoss.BiasedMoE"):    # a router bias, expert biases, the clamped SwiGLU
        if moe.ffn.kind not in (ACT_SWIGLU, ACT_SWIGLU_OAI):
            return f"expert activation {moe.ffn.kind} (no device kernel)"
    elif is_deepseek4_moe(moe):     # topk.comp's bits 5 and 6; the experts' clamped SwiGLU (act.glsl's limit)
        if moe.ffn.kind != ACT_SWIGLU:
            return f"expert activation {moe.ffn.kind} (no device kernel)"
    elif not _is(moe, "coli.models.blocks.MoE"):
        return f"its MoE block is {_cls(moe)} (no device kernel)"
    rule = route_rule(moe)
    if rule is None:
        return "a router other than softmax top-k, top-k softmax or DeepSeek's"
    if rule[0] == "deepseek" and rule[4] > 64:
        return f"{rule[4]} expert groups (the device's top-k takes up to 64)"
    if hasattr(m.g, "expert_source"):
        return "experts of a Hugging Face folder (read through its expert source, not as GGUF tensors)"
    E, k = m.args.n_experts, rule[1]
    if E > 512 or not 1 <= k <= min(32, E):
        return f"{E} experts, top-{k} (the device's top-k takes up to 512 experts and 32 a token)"
    return None


def why_not(m, il: int) -> str | None:
    """None when layer ``il`` of model ``m`` can run whole on the device, else why not (one phrase). By what the
    layer needs, not by its class: its form (``device_form``: :data:`FORMS`), its attention block
    (:func:`_why_not_attention`), its FFN (:func:`_why_not_ffn`) and its tensors' formats (a device decoder for each,
    widths in whole 32-weight units, or any width for F32/F16/BF16: rows zero-padded on the device, the last unit's
    inputs past the width read as 0, shaders/x_unit.glsl; gate and up of one format: one kernel reads both)."""
    L = m.layers[il]
    form = getattr(L, "device_form", None)
    if is_deepseek4(L):      # its own device path: coli/vulkan/layer_dsv4.py (the FFN and formats checked here)
        f = _why_not_ffn(m, il, L)
        if f is not None:
            return f
        bad = sorted({m.t[n].type_name for n in dsv4_tensors(m, il)} - set(device_formats()))
        return f"tensor formats {', '.join(bad)} (no device kernel)" if bad else None
    if form not in FORMS:
        # the mixer's name where the layer has one (the first kernel it lacks), else the layer's
        mixer = next((x for x in (getattr(L, n, None) for n in ("attn", "linear_attn", "self_attn", "mla"))
                      if x is not None), None)
        if getattr(mixer, "attn_sinks", None) is not None:
            return f"attention sinks ({_cls(mixer)}: no device kernel)"
        if mixer is not None and not type(mixer).__module__.endswith(".blocks"):
            return f"its mixer is {_cls(mixer)} (no device kernel)"
        return f"its layers are {_cls(L)} (a block order without a device form)"
    w = (_why_not_dn(m, il, linear_block(L)) if is_deltanet(L) else _why_not_attention(attn_block(L))) or \
        (_why_not_dsa(m, il) if is_dsa(L) else None) or _why_not_ffn(m, il, L)
    if w is not None:
        return w
    kt = tuple(getattr(m.args, "kv_types", ("f32", "f32")))
    if kt != ("f32", "f32") and not is_deltanet(L) and not is_mla(attn_block(L)) and \
            any(x % (32 if "q8_0" in kt else 4) for x in head_dims(attn_block(L))[1:3]):
        return (f"a {kt[0]}/{kt[1]} KV cache with heads {head_dims(attn_block(L))[1:3]} wide "
                f"({'q8_0 rows: multiples of 32' if 'q8_0' in kt else '16-bit rows: multiples of 4'})")
    for n in _layer_tensors(m, il):
        ti = m.t[n]
        if ti.type_name not in device_formats():
            return f"tensor '{n}' is {ti.type_name} (no device kernel)"
        if int(ti.shape[-1]) % 32 and not is_float(ti.type_name):     # floats: rows of any width (x_unit.glsl)
            return f"tensor '{n}' has {int(ti.shape[-1])} columns (not a multiple of 32)"
    p = f"blk.{il}."
    pairs = [("ffn_gate_exps", "ffn_up_exps"), ("ffn_gate_shexp", "ffn_up_shexp"), ("ffn_gate", "ffn_up")]
    for g, u in pairs:
        if p + g + ".weight" in m.t and p + u + ".weight" in m.t and \
                m.t[p + g + ".weight"].type_name != m.t[p + u + ".weight"].type_name:
            return f"{g} and {u} of different types"
    return None


def expert_bytes(m, il: int) -> int:
    """Device bytes of one routed expert of layer ``il`` (its gate, up and down rows as stored)."""
    p = f"blk.{il}."
    return sum(_padded_bytes(m, p + n + ".weight") for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")) \
        // int(m.args.n_experts)


def why_not_all(m) -> str:
    """Every layer's :func:`why_not`, runs of layers with one reason together: ``layers 0-17: a sliding window; layer
    18: ...`` (empty when every layer qualifies)."""
    runs: list = []
    for il in range(len(m.layers)):
        w = why_not(m, il)
        if w is None:
            continue
        if runs and runs[-1][2] == w and runs[-1][1] == il - 1:
            runs[-1][1] = il
        else:
            runs.append([il, il, w])
    return "; ".join((f"layer {a}" if a == b else f"layers {a}-{b}") + f": {w}" for a, b, w in runs)


def layer_bytes(m, il: int, ctx: int, experts: bool = True) -> int:
    """Device bytes of layer ``il``: its weight tensors as stored (GGUF blocks; the router as f32) and its K and
    V cache of ``ctx`` positions (of the model's ``kv_types``: 4 bytes a value f32, 2 f16 / bf16, 34 per 32 q8_0); ``experts=False``:
    without the routed experts (they stay on the CPU or are placed one by one: ``expert_bytes``)."""
    a = attn_block(m.layers[il])
    w = sum(_padded_bytes(m, n) for n in _layer_tensors(m, il) if not n.endswith("ffn_gate_inp.weight")
            and (experts or "_exps." not in n))
    w += router_bytes(m, il)
    if is_deltanet(m.layers[il]):
        return w + dn_bytes(linear_block(m.layers[il]))
    if is_mla(a):     # GLM-5: the indexer's key in each cache row, k_norm's weight and bias
        Di = dsa_shape(m)[1] if is_dsa(m.layers[il]) else 0
        return w + mla_bytes(a, ctx) + 4 * Di * (int(ctx) + 2)
    nkv, hd, hdv, _ = head_dims(a)
    kb, vb = kv_value_bytes(m)
    return w + nkv * int(ctx) * (kv_row_bytes(kb, hd) + kv_row_bytes(vb, hdv))


def router_bytes(m, il: int) -> int:
    """Device bytes of layer ``il``'s router (0 without one): f32 [E, D] whatever the file's format (dequantized at
    load), its rows zero-padded to a multiple of 32 weights as every float row (``Device._place``)."""
    ti = m.t.get(f"blk.{il}.ffn_gate_inp.weight")
    return 0 if ti is None else 4 * int(ti.shape[-2]) * ceil32(ti.shape[-1])


def _padded_bytes(m, n: str) -> int:
    """Device bytes of tensor ``n``: as stored, or with the FFN's hidden width padded to a multiple of 32 (gate and up
    rows, down columns: :func:`ffn_width`)."""
    ti = m.t[n]
    b = int(ti.nbytes)
    if n.endswith("attn_q_a.weight"):       # q_lora_rank rows, padded (any format: rows are blocks of their own)
        return b // int(ti.shape[-2]) * ceil32(ti.shape[-2])
    if not is_float(ti.type_name) or "gate_inp" in n:
        return b
    b = b // int(ti.shape[-1]) * ceil32(ti.shape[-1])       # a float row of any width, zero-padded (Device._place)
    if "ffn_" in n and not n.endswith(DOWN_TENSORS):        # gate and up: zero rows up to the padded hidden width
        b = b // int(ti.shape[-2]) * ceil32(ti.shape[-2])
    return b


def ffn_width(F: int) -> int:
    """The device's hidden width of an FFN ``F`` wide: a multiple of 32 (an F32/F16/BF16 down projection may be any
    width; its zero columns meet gate's and up's zero rows, whose activation is 0)."""
    return ceil32(F)


def _ffn_key(m, il: int) -> tuple:
    L, t, p = m.layers[il], m.t, f"blk.{il}."
    if L.moe is None:
        return ("dense", int(t[p + MLP_TENSORS[0]].shape[0]))
    return ("moe", tuple(int(s) for s in t[p + "ffn_gate_exps.weight"].shape), route_rule(L.moe),
            tuple(int(s) for s in t[p + SHEXP_TENSORS[0]].shape) if p + SHEXP_TENSORS[0] in t else None)


def _shape_key(m, il: int) -> tuple:
    """What the device's buffers take from one layer (they are sized from the first of its mixer kind): (the mixer's
    shape, its first item the kind: "mla", "gqa" or "dn", the FFN's); the rest (rope, window, norms, scale,
    formats) is a layer's own."""
    L = m.layers[il]
    if is_kda(L):
        return (("dn", *dn_dims(L.attn), "kda"), _ffn_key(m, il))
    if is_deltanet(L):
        x = L.linear_attn
        return (("dn", x.n_k_heads, x.n_v_heads, x.dk, x.dv, x.kernel, x.tiled, x.ssm_ba is not None),
                _ffn_key(m, il))
    a = attn_block(L)
    if is_mla(a):
        return (("mla", a.H, a.r, a.dn, a.dr, a.dv, a.attn_q is None, is_dsa(L)), _ffn_key(m, il))
    # KV heads, V's width and the value scale are a layer's own (MiMo-V2): buffers sized by the largest
    return (("gqa", a.n_heads, a.head_dim, is_gated(L)), _ffn_key(m, il))


def _shapes_agree(m, il: int) -> bool:
    """Whether layer ``il`` shares its FFN's shape with every later layer and its mixer's with the later layers of
    its kind; DeltaNet layers mix with one other kind (Qwen3-Next's gated attention), MLA and GQA do not mix."""
    k = _shape_key(m, il)
    later = [_shape_key(m, j) for j in range(il + 1, len(m.layers))]
    kinds = {x[0][0] for x in later + [k]} - {"dn"}
    # a dense FFN of any width sits beside MoE layers (DeepSeek's leading dense layers); MoE layers share theirs
    return len(kinds) <= 1 and all((x[1] == k[1] or "dense" in (x[1][0], k[1][0]))
                                   and (x[0] == k[0] or x[0][0] != k[0][0]) for x in later)


def hidden_width(m, il: int) -> int:
    """Floats of the FFN's hidden rows of one token in layer ``il``: top-k x the expert width, the shared expert's
    width, or the dense FFN's."""
    L, t, p = m.layers[il], m.t, f"blk.{il}."
    if L.moe is None:
        return ffn_width(t[p + MLP_TENSORS[0]].shape[0])
    w = route_rule(L.moe)[1] * ffn_width(t[p + "ffn_gate_exps.weight"].shape[1])
    return max(w, ffn_width(t[p + SHEXP_TENSORS[0]].shape[0]) if p + SHEXP_TENSORS[0] in t else 0)


def _rope_tables(m) -> int:
    """Distinct rope tables (base, scaling, width) of the model's layers (Gemma 3: the local and the global one)."""
    keys = {rope_key(attn_block(L)) for il, L in enumerate(m.layers) if why_not(m, il) is None and not is_deltanet(L)}
    return max(1, len(keys))


def _mla_floats(m) -> int:
    """Floats of one row's MLA scratch (q, kv, q_a, the absorbed q, the attended latent, the values), 0 without MLA
    layers on the device."""
    out = 0
    for il, L in enumerate(m.layers):
        a = None if is_deltanet(L) else attn_block(L)    # GLM-5: a DSA layer's MLA
        if is_mla(a) and why_not(m, il) is None:
            W = a.r + a.dr
            ql = 0 if a.attn_q is not None else ceil32(a.attn_q_a.shape[0])
            out = max(out, a.H * (a.dn + a.dr) + W + ql + a.H * W + a.H * a.r + a.H * a.dv)
    ds = dsa_shape(m)
    if out and ds:      # the indexer's q, key row, head weights and chosen positions (its scores: _dsa_scores)
        out += ds[0] * ds[1] + ds[1] + ds[0] + ds[2]
    return out


def _dsa_scores(m, ctx: int) -> int:
    """Floats of one row's DSA indexer scores (one a position), 0 without GLM-5 layers on the device."""
    return int(ctx) if dsa_shape(m) and _mla_floats(m) else 0


def _dn_floats(m) -> int:
    """Floats of one row's DeltaNet scratch (the q/k/v rows before and after the conv, z, beta and alpha, the
    output), 0 without DeltaNet layers on the device."""
    out = 0
    for il, L in enumerate(m.layers):
        if is_deltanet(L) and why_not(m, il) is None:
            Hk, Hv, dk, dv, _, C = dn_dims(linear_block(L))
            # KDA: beta and the decay inputs a channel, the two low-rank rows
            ba = Hv + Hv * dk + 2 * dk if is_kda(L) else 2 * Hv
            out = max(out, 2 * C + 2 * Hv * dv + ba)
    return out


def dn_chunk_floats(dn, kda: bool = False) -> int:
    """Floats of one prompt row of the chunked delta rule's scratch (shaders/dn_chunk.comp: W, U, the 64-row block's
    q k^T row and 4 row factors a value head; KDA also q and k with their channels' decay factors); ``dn``:
    :func:`dn_dims`' (Hk, Hv, dk, dv, conv kernel, C)."""
    _, Hv, dk, dv, _, _ = dn
    return Hv * (dk + dv + 64 + 4 + (2 * dk if kda else 0))


def _dn_chunk_row(m) -> int:
    """Floats of one prompt row of the chunked delta rule's scratch, 0 without DeltaNet layers on the device."""
    return max((dn_chunk_floats(dn_dims(linear_block(L)), is_kda(L)) for il, L in enumerate(m.layers)
                if is_deltanet(L) and why_not(m, il) is None), default=0)


#: rows of a device prompt chunk (COLI_VK_PROMPT_ROWS unset): PROMPT_ROWS_WHOLE where the device holds every layer
#: and its experts with that chunk's scratch (H200, OLMoE-shaped: one 2,048-row chunk 107 ms, four of 512 ~122 ms),
#: else PROMPT_ROWS (coli/runtime.py setup_layers)
PROMPT_ROWS, PROMPT_ROWS_WHOLE = 512, 2048

#: rows x parts the prompt attention's key split keeps at most by its own rule (coli/vulkan/layers.py
#: Kernels.attn_split): its scratch, 4 (hdv + 2) bytes a row, head and part
ATTN_PARTS_ROWS = 2048


def attn_parts_rows(rows: int, split: int | None = None) -> int:
    """Rows x parts of the prompt attention's key-split scratch (f32 [parts, rows, heads, hdv + 2]) that chunks of
    up to ``rows`` rows can write (``Kernels.attn_split``): ``rows`` x ``split`` where ``COLI_VK_PROMPT_ATTN_SPLIT``
    gives one (0 at 1: no split), else the rule's most, 8 parts and at most :data:`ATTN_PARTS_ROWS` rows x parts.
    What ``DeviceLayers._prompt_bufs`` allocates (``Kernels.attn_parts_rows``: 0 where the rule splits none) and
    :func:`prompt_bytes` counts."""
    if split is not None:
        return int(rows) * int(split) if split > 1 else 0
    return min(ATTN_PARTS_ROWS, 8 * int(rows))


def prompt_bytes(m, rows: int, env=None) -> int:
    """Device bytes of the prompt chunks' scratch at ``rows`` rows (``DeviceLayers._prompt_bufs``): the hidden and
    normalized rows, q/k/v, q, the attention output, router logits, routes, the grouped pairs, the experts' h and
    outputs, the shared expert's output, a post-norm's input, the DeltaNet rows, the logits of every row and the
    attention's parts when its keys are split (:func:`attn_parts_rows` at ``COLI_VK_PROMPT_ATTN_SPLIT`` of ``env``,
    the settings)."""
    a = m.args
    n = len(m.layers)
    F = max((hidden_width(m, il) for il in range(n) if why_not(m, il) is None), default=0)
    nqkv = (a.n_heads + 2 * max_kv(m)) * a.head_dim
    k = a.top_k if m.moe_layers else 0
    per_row = (5 * a.d_model + nqkv + 2 * a.n_heads * a.head_dim + a.n_experts + 2 * n * k + 2 + k
               + F + k * a.d_model + a.vocab + _mla_floats(m) + _dn_floats(m) + _dn_chunk_row(m)
               + a.n_heads * a.head_dim)
    parts = attn_parts_rows(rows, settings.get("COLI_VK_PROMPT_ATTN_SPLIT", env)) * a.n_heads * (a.head_dim + 2)
    return 4 * int(rows) * per_row + 4 * parts + 4 * (a.n_experts + 1) + 256 * 25


def fixed_bytes(m, ctx: int, prompt_rows: int = 0, env=None) -> int:
    """Device bytes besides the layers': the head (``output``, or the tied ``token_embd``, the output norm and its
    logits), the rope tables, the attention scores and the scratch rows (``DeviceLayers``' buffers, rounded up),
    and the prompt chunks' scratch at ``prompt_rows`` rows (:func:`prompt_bytes` with the settings of ``env``, and
    MLA's expanded keys and values: :func:`mla_expand_keys`)."""
    a = m.args
    out = m.t.get("output.weight", m.tok_embd)
    n = len(m.layers)
    F = max((hidden_width(m, il) for il in range(n) if why_not(m, il) is None), default=0)
    k = a.top_k if m.moe_layers else 0
    rows = (9 * a.d_model + 4 * a.n_heads * a.head_dim        # hidden rows in and out, q/k/v, q, attention out
            + a.n_heads * int(ctx) + _rope_tables(m) * int(ctx) * a.n_rot   # the scores, the rope tables
            + a.n_heads * (-(-int(ctx) // 128)) * (a.head_dim + 2)   # decode attention's parts (at most 1 / 128 keys)
            + 2 * a.vocab + a.n_experts + F + 8 * n * (a.head_dim * max_kv(m) + k) + 2 * _mla_floats(m)
            + a.n_heads * a.head_dim + _dn_floats(m) + _dsa_scores(m, ctx))
    pb = (prompt_bytes(m, prompt_rows, env) + 4 * prompt_rows * _dsa_scores(m, ctx) + 4 * _mla_expand_floats(m, ctx)
          if prompt_rows else 0)
    return int(out.nbytes) + 4 * rows + 256 * 32 + pb         # 256 bytes of rounding a buffer


def plan(m, budget: int, ctx: int, want: int | None = None, prompt_rows: int = 0,
         experts: bool = True, env=None) -> tuple[int, str]:
    """``(first, why)``: layers ``first ..`` go to the device. The last layers that qualify (:func:`why_not`), share
    their shapes, and fit ``budget`` bytes together (:func:`layer_bytes`, with :func:`fixed_bytes`), at most ``want`` of them (``COLI_VK_LAYERS``; None: as
    many as fit; ``prompt_rows``: the prompt chunks' rows, whose scratch counts too, by the settings of ``env``;
    ``experts=False``: the layers' routed experts not counted, they are placed apart: :func:`residency`). ``first == n_layers`` when none does;
    ``why`` says what stopped the count."""
    n = len(m.layers)
    v4 = n > 0 and is_deepseek4(m.layers[0])
    if v4:   # the head and the rope tables; the calls' scratch (layer_dsv4.Dsv4Scratch, kept from call to call) is not counted
        out = m.t.get("output.weight", m.tok_embd)
        first, used, why = n, int(out.nbytes) + 8 * n * int(ctx) * m.args.n_rot, "every layer"
    else:
        first, used, why = n, fixed_bytes(m, ctx, prompt_rows, env), "every layer"
    for il in range(n - 1, -1, -1):
        if want is not None and n - first >= want:
            why = f"{want} asked (COLI_VK_LAYERS)"
            break
        w = why_not(m, il)
        if w is None and il < n - 1 and not v4 and not _shapes_agree(m, il):
            w = "other attention or expert shapes than the layers after it"
        if w is not None:
            why = f"layer {il}: {w}"
            break
        b = dsv4_layer_bytes(m, il, ctx, experts) if v4 else layer_bytes(m, il, ctx, experts)
        if used + b > budget:
            why = f"the device budget ({budget / 2**30:.2f} GiB)"
            break
        used += b
        first = il
    # a shared DSA layer reads the positions of the full layer before it: the device's run starts at a full one
    while first < n and is_dsa(m.layers[first]) and m.layers[first].attn.indexer is None:
        first += 1
    return first, why
