"""The shared transformer: attention with a KV cache, dense SwiGLU/GeGLU FFN, and the MoE block.

Each architecture file (llama.py, qwen2.py, gemma3.py, qwen2moe.py, qwen3moe.py, olmoe.py) holds a
``ModelArgs`` dataclass read from the GGUF metadata and a ``Model`` subclass that sets the family's choices
(rope pairing, biases, q/k norms, extra norms, routing rule); the pieces live here (mlx-lm's shape: one small
file per architecture, MoE in one shared module).

Shapes: hidden rows ``h`` f32 [T, D]; q f32 [T, H, hd]; KV cache per layer f32 [Hkv, ctx, hd].
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from coli.errors import ColiError
from cpu_kernels import experts as grouped
from cpu_kernels import formats
from cpu_kernels.attention import attend
from cpu_kernels.norms import geglu_tanh, rms_norm, rms_norm_heads, swiglu
from cpu_kernels.rope import NEOX, NORM, apply_rope

from . import rope_scaling
from .rope_scaling import RopeScaling


@dataclass
class BaseArgs:
    """Hyper-parameters common to the families (GGUF keys ``<arch>.*``; llama.cpp's ``llama_hparams``)."""

    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ff: int
    eps: float
    rope_base: float
    n_rot: int
    ctx_train: int
    vocab: int
    rope_kind: int = NORM
    n_experts: int = 0
    top_k: int = 0
    expert_ff: int = 0
    norm_topk: bool = True
    shared_ff: int = 0
    attn_scale: float = 0.0
    sliding_window: int = 0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_gguf(cls, g, **overrides):
        a = g.arch

        def need(key):
            v = g.get(f"{a}.{key}")
            if v is None:
                raise ColiError(f"{g.path.name}: metadata '{a}.{key}' is missing")
            return v

        n_heads = int(need("attention.head_count"))
        d = int(need("embedding_length"))
        n_kv = g.get(f"{a}.attention.head_count_kv", n_heads)
        if isinstance(n_kv, (list, np.ndarray)):
            n_kv = int(n_kv[0])
        head_dim = int(g.get(f"{a}.attention.key_length", d // n_heads))
        tok = g.tensors.get("token_embd.weight")
        vocab = int(g.get(f"{a}.vocab_size", tok.shape[0] if tok is not None else 0))
        kw = dict(
            arch=a,
            n_layers=int(need("block_count")),
            d_model=d,
            n_heads=n_heads,
            n_kv_heads=int(n_kv),
            head_dim=head_dim,
            ff=int(g.get(f"{a}.feed_forward_length", 0) or 0),
            eps=float(g.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_base=float(g.get(f"{a}.rope.freq_base", 10000.0)),
            n_rot=int(g.get(f"{a}.rope.dimension_count", head_dim)),
            ctx_train=int(g.get(f"{a}.context_length", 4096)),
            vocab=vocab,
            n_experts=int(g.get(f"{a}.expert_count", 0) or 0),
            top_k=int(g.get(f"{a}.expert_used_count", 0) or 0),
            expert_ff=int(g.get(f"{a}.expert_feed_forward_length", 0) or 0),
            shared_ff=int(g.get(f"{a}.expert_shared_feed_forward_length", 0) or 0),
            sliding_window=int(g.get(f"{a}.attention.sliding_window", 0) or 0),
        )
        n_rot = overrides.get("n_rot", kw["n_rot"])
        kw["rope_scaling"] = rope_scaling.from_gguf(g, n_rot)  # ColiError for a key coli does not implement
        norm = g.get(f"{a}.expert_weights_norm")
        if norm is not None:
            kw["norm_topk"] = bool(norm)
        kw.update(overrides)
        if norm is not None:
            kw["norm_topk"] = bool(norm)
        return cls(**kw)


class KVCache:
    """Per-layer K and V, f32 [Hkv, ctx, hd] each, preallocated for ``ctx`` positions."""

    def __init__(self, n_layers: int, n_kv: int, ctx: int, head_dim: int):
        self.ctx = ctx
        self.k = [np.zeros((n_kv, ctx, head_dim), np.float32) for _ in range(n_layers)]
        self.v = [np.zeros((n_kv, ctx, head_dim), np.float32) for _ in range(n_layers)]
        self.pos = 0

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) * 2


class Transformer:
    """Decoder-only transformer over a ``coli.gguf_file.GGUFModel``.

    Family hooks (class attributes / methods a subclass sets): ``rope_kind``, ``qk_norm`` ("heads" | "full" |
    None), ``post_norms`` (Gemma's post-attention/post-FFN norms), ``embed_scale``, ``ffn_act`` ("swiglu" |
    "geglu"), ``route(logits) -> (ids, weights)``, ``layer_window(il)``, ``layer_rope_base(il)``, ``layer_rope_scaling(il)``.
    """

    qk_norm: str | None = None
    post_norms = False
    ffn_act = "swiglu"

    def __init__(self, g, args: BaseArgs, step=None, act: str = "f32"):
        self.g = g
        self.args = args
        self.step = step
        self.act = act
        self.t = g.tensors
        a = args
        self.tok_embd = self.t["token_embd.weight"]
        out = self.t.get("output.weight", self.tok_embd)
        self.w_out = self._w(out)
        self.out_norm = self._f32("output_norm.weight")
        self.layers = [self._load_layer(il) for il in range(a.n_layers)]
        for L in self.layers:  # built once at load, not per token
            L["shared"] = self.shared_expert(L)
            # q/k/v in one grouped launch on the layer input quantized once (cpu_kernels.experts)
            qkv = [L["wq"], L["wk"], L["wv"]]
            L["qkv"] = grouped.Group(qkv) if all(grouped.supports(w) for w in qkv) else None
            ffn = [L.get("w_gate"), L.get("w_up"), L.get("w_down")]
            kind = grouped.ACT_GEGLU if self.ffn_act == "geglu" else grouped.ACT_SWIGLU
            L["ffn_grouped"] = (grouped.FFN(*ffn, kind, 0.0, act)
                                if ffn[0] is not None and all(grouped.supports(w) for w in ffn) else None)
        self.moe_layers = [il for il, L in enumerate(self.layers) if L.get("router") is not None]
        self._ropes: dict = {}
        self.dense_bytes = sum(t.nbytes for n, t in self.t.items() if "_exps" not in n)

    # -- loading -----------------------------------------------------------------------------------------
    def _w(self, ti):
        try:
            return formats.prepare(ti.type_name, ti.raw, tuple(ti.shape))
        except ColiError as e:
            raise ColiError(f"{self.g.path.name}: tensor '{ti.name}': {e}") from None

    def _f32(self, name, required=True):
        ti = self.t.get(name)
        if ti is None:
            if required:
                raise ColiError(f"{self.g.path.name}: tensor '{name}' is missing")
            return None
        if ti.type_name == "F32":
            return np.ascontiguousarray(ti.raw.view(np.float32).reshape(ti.shape))
        raw = ti.raw.reshape(1, -1) if ti.raw.ndim == 1 else ti.raw.reshape(-1, ti.raw.shape[-1])
        return self._ref(ti.type_name, raw, ti.shape[-1]).reshape(ti.shape)

    @staticmethod
    def _ref(type_name, raw, cols):
        fmt = formats.FORMATS.get(type_name)
        if fmt is None:
            raise ColiError(f"tensor type {type_name} is not supported")
        return fmt.reference(raw, (raw.shape[0], cols)).astype(np.float32, copy=False)

    def _opt_w(self, name):
        ti = self.t.get(name)
        return self._w(ti) if ti is not None else None

    def _load_layer(self, il):
        p = f"blk.{il}."
        L = {
            "attn_norm": self._f32(p + "attn_norm.weight"),
            "wq": self._w(self.t[p + "attn_q.weight"]),
            "wk": self._w(self.t[p + "attn_k.weight"]),
            "wv": self._w(self.t[p + "attn_v.weight"]),
            "wo": self._w(self.t[p + "attn_output.weight"]),
            "bq": self._f32(p + "attn_q.bias", False),
            "bk": self._f32(p + "attn_k.bias", False),
            "bv": self._f32(p + "attn_v.bias", False),
            "q_norm": self._f32(p + "attn_q_norm.weight", False),
            "k_norm": self._f32(p + "attn_k_norm.weight", False),
            "ffn_norm": self._f32(p + "ffn_norm.weight", False),
            "post_attn_norm": self._f32(p + "post_attention_norm.weight", False),
            "post_ffn_norm": self._f32(p + "post_ffw_norm.weight", False),
        }
        if L["ffn_norm"] is None:
            raise ColiError(f"{self.g.path.name}: tensor '{p}ffn_norm.weight' is missing")
        if p + "ffn_gate_inp.weight" in self.t:
            L["router"] = self._f32(p + "ffn_gate_inp.weight")  # [E, D]
            for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                if p + n + ".weight" not in self.t:
                    raise ColiError(f"{self.g.path.name}: tensor '{p}{n}.weight' is missing")
            if p + "ffn_gate_shexp.weight" in self.t:
                L["sh_gate"] = self._w(self.t[p + "ffn_gate_shexp.weight"])
                L["sh_up"] = self._w(self.t[p + "ffn_up_shexp.weight"])
                L["sh_down"] = self._w(self.t[p + "ffn_down_shexp.weight"])
                L["sh_gate_inp"] = self._f32(p + "ffn_gate_inp_shexp.weight", False)
        else:
            for n in ("ffn_gate", "ffn_up", "ffn_down"):
                if p + n + ".weight" not in self.t:
                    raise ColiError(f"{self.g.path.name}: tensor '{p}{n}.weight' is missing")
            L["w_gate"] = self._w(self.t[p + "ffn_gate.weight"])
            L["w_up"] = self._w(self.t[p + "ffn_up.weight"])
            L["w_down"] = self._w(self.t[p + "ffn_down.weight"])
        return L

    def expert_tensors(self) -> dict:
        """``{layer: (gate_exps, up_exps, down_exps)}`` TensorInfos of the MoE layers."""
        return {il: tuple(self.t[f"blk.{il}.{n}.weight"] for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
                for il in self.moe_layers}

    # -- family hooks ------------------------------------------------------------------------------------
    def layer_window(self, il: int) -> int:
        return 0

    def layer_rope_base(self, il: int) -> float:
        return self.args.rope_base

    def layer_rope_scaling(self, il: int) -> RopeScaling:
        """The rope scaling rule of layer ``il`` (coli/models/rope_scaling.py; docs/families.md)."""
        return self.args.rope_scaling

    def attn_scale(self) -> float:
        return self.args.attn_scale or 1.0 / math.sqrt(self.args.head_dim)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        ti = self.tok_embd
        return self._ref(ti.type_name, ti.raw[ids], ti.shape[-1])

    def route(self, logits: np.ndarray):
        """Softmax over all experts, top-k (ties: lower id), renormalised when ``norm_topk``
        (Mixtral/Qwen3-MoE renormalise; OLMoE/Qwen2-MoE keep the softmax weights). f32 [R, E] -> ids, w."""
        k = self.args.top_k
        lg = logits.astype(np.float32)
        m = lg.max(axis=1, keepdims=True)
        p = np.exp(lg - m)
        p /= p.sum(axis=1, keepdims=True)
        # stable descending sort: ties keep the lower expert id first
        ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
        w = np.take_along_axis(p, ids, axis=1)
        if self.args.norm_topk:
            w = w / w.sum(axis=1, keepdims=True)
        return ids.astype(np.int32), w.astype(np.float32)

    def rope(self, il):
        """cos, sin f32 [ctx, n_rot // 2] of layer ``il`` (its base and scaling), built once per (base, rule)."""
        key = (self.layer_rope_base(il), self.layer_rope_scaling(il))
        r = self._ropes.get(key)
        if r is None or r[0].shape[0] < self._ctx:
            r = key[1].table(self._ctx, self.args.n_rot, key[0])
            self._ropes[key] = r
        return r

    # -- forward -----------------------------------------------------------------------------------------
    def new_cache(self, ctx: int) -> KVCache:
        self._ctx = ctx
        a = self.args
        return KVCache(a.n_layers, a.n_kv_heads, ctx, a.head_dim)

    def mm(self, w, x):
        return formats.matmul(w, x, act=self.act)

    def grouped_rows(self, T: int) -> bool:
        """True when ``T`` rows run the grouped kernels (``cpu_kernels.experts``): up to the GEMV crossover of
        ``formats.matmul``; above it the blocked f32 GEMM measured faster (docs/cpu_kernels.md)."""
        if self.act == "int8" and grouped.HAVE_VNNI:
            return T <= formats.GEMV_I8_MAX_T
        return T <= formats.GEMV_MAX_T

    def norm_in(self, h, w):
        """The layer input: ``(x, xa)`` with x = RMSNorm(h) f32 [T, D] and xa its ``grouped.Act`` (quantized once
        for every matmul that reads x) when T rows run the grouped kernels, else ``(x, None)``."""
        if self.grouped_rows(h.shape[0]) and h.shape[1] % 32 == 0:
            return grouped.Act.rms_norm(h, w, self.args.eps, self.act)
        return rms_norm(h, w, self.args.eps), None

    def qkv(self, L, x, xa=None):
        """q, k, v projections of ``x`` f32 [T, D]: one quantization of x and one parallel launch for the three
        matrices when their formats have grouped kernels (``cpu_kernels.experts``), else three matmuls."""
        if L["qkv"] is None or not self.grouped_rows(x.shape[0]):
            return self.mm(L["wq"], x), self.mm(L["wk"], x), self.mm(L["wv"], x)
        out = L["qkv"](xa if xa is not None else grouped.Act(x, self.act))
        oq, ok = L["wq"].shape[0], L["wk"].shape[0]
        q, k, v = out[:, :oq], out[:, oq:oq + ok], out[:, oq + ok:]
        if x.shape[0] > 1:  # column slices of a [T, O] buffer: contiguous copies for the row kernels
            q, k, v = np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v)
        return q, k, v

    def attention(self, il, L, x, cache: KVCache, pos0: int, xa=None):
        a = self.args
        T = x.shape[0]
        q, k, v = self.qkv(L, x, xa)
        if L["bq"] is not None:
            q += L["bq"]
        if L["bk"] is not None:
            k += L["bk"]
        if L["bv"] is not None:
            v += L["bv"]
        if self.qk_norm == "full":  # OLMoE: RMSNorm over the whole projection before the head split
            q = rms_norm(q, L["q_norm"], a.eps)
            k = rms_norm(k, L["k_norm"], a.eps)
        q = q.reshape(T, a.n_heads, a.head_dim)
        k = k.reshape(T, a.n_kv_heads, a.head_dim)
        v = v.reshape(T, a.n_kv_heads, a.head_dim)
        if self.qk_norm == "heads":  # Qwen3 / Gemma 3: per-head RMSNorm
            rms_norm_heads(q, L["q_norm"], a.eps)
            rms_norm_heads(k, L["k_norm"], a.eps)
        pos = np.arange(pos0, pos0 + T, dtype=np.int64)
        cos, sin = self.rope(il)
        apply_rope(q, pos, cos, sin, a.n_rot, self.rope_kind)
        apply_rope(k, pos, cos, sin, a.n_rot, self.rope_kind)
        cache.k[il][:, pos0 : pos0 + T] = k.transpose(1, 0, 2)
        cache.v[il][:, pos0 : pos0 + T] = v.transpose(1, 0, 2)
        o = attend(q, cache.k[il], cache.v[il], pos0, self.attn_scale(), self.layer_window(il))
        return self.mm(L["wo"], o.reshape(T, a.n_heads * a.head_dim))

    def dense_ffn(self, L, x, xa=None):
        if L["ffn_grouped"] is not None and self.grouped_rows(x.shape[0]):  # gate+up+act in one launch, down in one
            return L["ffn_grouped"](xa if xa is not None else grouped.Act(x, self.act), self.act)
        g = self.mm(L["w_gate"], x)
        u = self.mm(L["w_up"], x)
        act = geglu_tanh(g, u) if self.ffn_act == "geglu" else swiglu(g, u)
        return self.mm(L["w_down"], act)

    def shared_expert(self, L):
        if "sh_gate" not in L:
            return None
        fused = None
        if all(grouped.supports(L[n]) for n in ("sh_gate", "sh_up", "sh_down")):
            fused = grouped.FFN(L["sh_gate"], L["sh_up"], L["sh_down"], grouped.ACT_SWIGLU, 0.0, self.act)

        def run(x):
            if fused is not None and self.grouped_rows(x.shape[0]):
                y = fused(grouped.Act(x, self.act), self.act)
            else:
                g = self.mm(L["sh_gate"], x)
                u = self.mm(L["sh_up"], x)
                y = self.mm(L["sh_down"], swiglu(g, u))
            if L.get("sh_gate_inp") is not None:  # Qwen2-MoE: sigmoid(x . w_gate_inp_shexp) scales it
                s = x @ L["sh_gate_inp"].reshape(-1)
                y *= (1.0 / (1.0 + np.exp(-s)))[:, None].astype(np.float32)
            return y

        return run

    def moe(self, il, L, x):
        logits = x @ L["router"].T
        ids, w = self.route(logits)
        return self.step.run(il, x, ids, w, shared=L["shared"])

    def forward(self, ids, cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Run ``ids`` (int [T]) at positions ``cache.pos ..``; returns logits f32 [T or 1, vocab]."""
        a = self.args
        ids = np.asarray(ids, dtype=np.int64)
        T = len(ids)
        pos0 = cache.pos
        if pos0 + T > cache.ctx:
            raise ColiError(f"context: {pos0 + T} tokens do not fit the context of {cache.ctx} (--ctx)")
        h = self.embed(ids)
        if self.embed_scale:
            h *= np.float32(self.embed_scale)
        for il, L in enumerate(self.layers):
            x, xa = self.norm_in(h, L["attn_norm"])
            o = self.attention(il, L, x, cache, pos0, xa)
            if self.post_norms:
                o = rms_norm(o, L["post_attn_norm"], a.eps)
            h += o
            if "router" in L:
                f = self.moe(il, L, rms_norm(h, L["ffn_norm"], a.eps))
            else:
                x, xa = self.norm_in(h, L["ffn_norm"])
                f = self.dense_ffn(L, x, xa)
            if self.post_norms:
                f = rms_norm(f, L["post_ffn_norm"], a.eps)
            h += f
        if self.step is not None and self.step.usage is not None and self.moe_layers:
            self.step.usage.add_tokens(T)
        cache.pos = pos0 + T
        if not all_logits:
            h = h[-1:]
        h = rms_norm(h, self.out_norm, a.eps)
        return self.mm(self.w_out, h)

    embed_scale = 0.0
    rope_kind = NORM
