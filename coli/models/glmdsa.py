"""GLM-5 (GGUF ``glm-dsa``; HF ``models/glm_moe_dsa/modular_glm_moe_dsa.py``; llama.cpp ``src/models/glm-dsa.cpp``,
converter ``GlmMoeDsaModel``): DeepSeek-V2's layer (``coli/models/deepseek2.py``: MLA on a latent cache, leading
dense layers, routed + shared experts) with DeepSeek sparse attention: an indexer picks, per query row, the
``indexer.top_k`` earlier positions the MLA attends to.

Indexer of a layer (HF ``GlmMoeDsaIndexer``), x = the layer's normed input f32 [T, D], q_resid =
``RMSNorm(attn_q_a x)``:

    iq = indexer.attn_q_b q_resid                      # [T, Hi, Di], interleaved rope on the first dr dims
    ik = LayerNorm(indexer.attn_k x) (eps 1e-6, weight and bias ``indexer.k_norm``), rope the same way; cached
    w  = indexer.proj x * Hi^-1/2                      # [T, Hi]
    score[t, j] = sum_h w[t, h] * relu(iq[t, h] . ik[j] / sqrt(Di)),   j <= pos0 + t
    positions(t) = the top_k best j (all of them while there are at most top_k)

A layer whose ``attention.indexer.types`` entry is false ("shared") has no indexer and reuses the positions of
the last full layer before it in the same forward call (HF ``prev_topk_indices``). Routing: sigmoid scores
(the default here, as llama.cpp's), the choice on scores + ``exp_probs_b`` (HF ``e_score_correction_bias``),
groups scored by the sum of their two best, weights renormalised and scaled (``blocks.deepseek_route``).

The MTP layer (``nextn_predict_layers``, the last ``blk``: a full decoder layer plus ``nextn.eh_proj``,
``nextn.enorm``, ``nextn.hnorm``, ``nextn.shared_head_norm``) is loaded (``Model.mtp``) but not used: coli has no
speculative decoding yet, so the logits are the trunk's. docs/families.md "GLM-5 (glm-dsa)".
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coli.base import memory
from coli.base.errors import ColiError
from cpu_kernels.mla import dsa_topk
from cpu_kernels.rope import NORM, apply_rope

from . import base, deepseek2
from .blocks import expect_shapes
from .mla import LatentCache, expand_scratch_bytes

# llama.cpp glm-dsa.cpp GLM_5_2_DEFAULT_INDEXER_TYPES: the pattern of a file without the key whose trained
# context is at least 1M (GLM-5.2); smaller ones (GLM-5, 5.1) index every layer
_GLM52_TYPES = [1, 1] + [1, 0, 0, 0] * 19


@dataclass
class Args(deepseek2.Args):
    """DeepSeek-V2's fields plus the indexer's and the MTP layer count."""

    idx_heads: int = 0
    idx_dim: int = 0
    idx_topk: int = 0
    idx_full: list = field(default_factory=list)
    n_nextn: int = 0


def read_args(g) -> Args:
    """DeepSeek-V2's keys (``deepseek2.read_args``, sigmoid gating by default) plus ``attention.indexer.*``
    (head_count, key_length, top_k, types) and ``nextn_predict_layers`` (the trailing MTP blocks, not counted
    in ``n_layers``). ColiError naming a missing or inconsistent key."""
    a = g.arch

    def need(key):
        return base.need_key(g, key)

    n_nextn = int(g.get(f"{a}.nextn_predict_layers", 0) or 0)
    args = deepseek2.read_args(g, Args, gating_default=2, idx_heads=int(need("attention.indexer.head_count")),
                               idx_dim=int(need("attention.indexer.key_length")),
                               idx_topk=int(need("attention.indexer.top_k")), n_nextn=n_nextn)
    n_trunk = args.n_layers - n_nextn
    if n_trunk < 1:
        raise ColiError(f"{g.path.name}: metadata '{a}.nextn_predict_layers': {n_nextn} of {args.n_layers} blocks")
    types = g.get(f"{a}.attention.indexer.types")
    if types is None:
        types = _GLM52_TYPES if args.ctx_train >= 1048576 else [1] * n_trunk
    types = [bool(t) for t in list(types)[:n_trunk]]
    if len(types) < n_trunk or not types[0]:
        raise ColiError(f"{g.path.name}: metadata '{a}.attention.indexer.types': {len(types)} entries for "
                        f"{n_trunk} layers, the first must be full")
    if args.q_lora_rank <= 0:
        raise base.below_one(g, "attention.q_lora_rank", "the indexer reads the query latent")
    if args.idx_dim < args.n_rot:
        raise ColiError(f"{g.path.name}: metadata '{a}.attention.indexer.key_length': {args.idx_dim} is below the "
                        f"rope dims {args.n_rot}")
    args.n_layers, args.idx_full = n_trunk, types
    return args


class IndexedCache(LatentCache):
    """A full indexer layer's cache: the MLA latent and rope key plus the indexer's keys ``ik`` f32 [ctx, Di]."""

    def __init__(self, ctx: int, kv_lora_rank: int, n_rot: int, idx_dim: int):
        super().__init__(ctx, kv_lora_rank, n_rot)
        zeros = memory.mapped_zeros if memory.fresh() else np.zeros  # a paged slot's cache: pages as written
        self.ik = zeros((ctx, idx_dim), np.float32)

    def nbytes(self) -> int:
        return super().nbytes() + self.ik.nbytes

    def arrays(self) -> list:
        """The latent, rope key and indexer key arrays, [1, positions, width] (``give_back`` returns all three)."""
        return super().arrays() + [self.ik[None]]


class Indexer:
    """The DSA indexer of layer ``p`` (tensors ``indexer.attn_q_b``, ``indexer.attn_k``, ``indexer.k_norm``
    weight and bias, ``indexer.proj``); ``__call__`` returns the positions int64 [T, top_k] (-1 padded)."""

    def __init__(self, m, p: str):
        a = m.args
        wt = m.wt
        self.m, self.H, self.D, self.K, self.dr = m, a.idx_heads, a.idx_dim, a.idx_topk, a.n_rot
        self.attn_q_b = wt.w(p + "indexer.attn_q_b.weight")
        self.attn_k = wt.w(p + "indexer.attn_k.weight")
        self.k_norm = wt.f32(p + "indexer.k_norm.weight")
        self.k_norm_b = wt.f32(p + "indexer.k_norm.bias")
        self.proj = wt.f32(p + "indexer.proj.weight")                 # [Hi, D]
        H, Di, D = self.H, self.D, a.d_model
        expect_shapes(m, p, {
            "indexer.attn_q_b.weight": ((H * Di, a.q_lora_rank), f"indexer.head_count {H} x indexer.key_length {Di}"
                                                                 f" x q_lora_rank {a.q_lora_rank}"),
            "indexer.attn_k.weight": ((Di, D), "indexer.key_length x embedding_length"),
            "indexer.k_norm.weight": ((Di,), "indexer.key_length"),
            "indexer.k_norm.bias": ((Di,), "indexer.key_length"),
            "indexer.proj.weight": ((H, D), "indexer.head_count x embedding_length")})

    def rope(self, x, pos0: int):
        pos = np.arange(pos0, pos0 + x.shape[0], dtype=np.int64)
        a = self.m.args
        cos, sin = self.m.rope_table(a.rope_base, a.rope_scaling, self.dr)
        apply_rope(x, pos, cos, sin, self.dr, NORM)

    def __call__(self, x, q_resid, cache: IndexedCache, pos0: int) -> np.ndarray:
        m = self.m
        T = x.shape[0]
        iq = m.mm(self.attn_q_b, q_resid).reshape(T, self.H, self.D)
        self.rope(iq, pos0)
        k = m.mm(self.attn_k, x).astype(np.float64)
        k = (k - k.mean(1, keepdims=True)) / np.sqrt(k.var(1, keepdims=True) + 1e-6)
        ik = (k * self.k_norm + self.k_norm_b).astype(np.float32).reshape(T, 1, self.D)
        self.rope(ik, pos0)
        cache.ik[pos0:pos0 + T] = ik[:, 0]
        w = (x @ self.proj.T) * np.float32(self.H ** -0.5)                            # [T, Hi]
        return dsa_topk(iq, cache.ik, w, pos0, self.D ** -0.5, self.K)


class DSA:
    """MLA whose rows attend to the indexer's positions: a full layer runs its :class:`Indexer`, a shared layer
    takes the last full layer's positions of the same forward call (``m.dsa_positions``)."""

    pageable = True  # LatentCache / IndexedCache: rows by position, their pages given back (Cache.pageable)

    def __init__(self, m, p: str, il: int, full: bool):
        self.m = m
        self.mla = deepseek2.DecoderLayer.make_attention(m, p, il)
        self.indexer = Indexer(m, p) if full else None

    def new_cache(self, ctx: int):
        a = self.m.args
        if self.indexer is None:
            return LatentCache(ctx, a.kv_lora_rank, a.n_rot)
        return IndexedCache(ctx, a.kv_lora_rank, a.n_rot, a.idx_dim)

    def __call__(self, x, xa, cache, pos0: int):
        q, kv, q_resid = self.mla.project(x, xa)
        if self.indexer is not None:
            self.m.dsa_positions = self.indexer(x, q_resid, cache, pos0)
        return self.mla.attend(q, kv, cache, pos0, self.m.dsa_positions)


class DecoderLayer(deepseek2.DecoderLayer):
    """DeepSeek-V2's layer with :class:`DSA` as its attention. The MoE layers' ``exp_probs_b`` is required: HF's
    ``GlmMoeDsaTopkRouter`` always has its ``e_score_correction_bias`` and the converter always writes it, so a
    file without it is a broken conversion (llama.cpp would route it as a zero bias, HF would load zeros with a
    "newly initialized" warning)."""

    needs_bias = True

    def __init__(self, m, il: int, full: bool = True):
        self._full = full
        super().__init__(m, il)

    def make_attention(self, m, p: str, il: int):
        return DSA(m, p, il, self._full)


class MTP:
    """The next-token-prediction block (llama.cpp ``LLM_TENSOR_NEXTN_*``): its decoder layer and ``eh_proj``
    [D, 2D], ``enorm``, ``hnorm``, ``shared_head_norm`` [D]. Loaded (shapes checked: ColiError naming a tensor
    that disagrees) and not run."""

    def __init__(self, m, il: int):
        p = f"blk.{il}."
        self.layer = DecoderLayer(m, il, full=m.wt.has(p + "indexer.attn_k.weight"))
        self.eh_proj = m.wt.w(p + "nextn.eh_proj.weight")
        self.enorm = m.wt.f32(p + "nextn.enorm.weight")
        self.hnorm = m.wt.f32(p + "nextn.hnorm.weight")
        self.shared_head_norm = m.wt.f32(p + "nextn.shared_head_norm.weight", False)
        D = m.args.d_model
        want = {"nextn.eh_proj.weight": ((D, 2 * D), "embedding_length x 2 embedding_length"),
                "nextn.enorm.weight": ((D,), "embedding_length"), "nextn.hnorm.weight": ((D,), "embedding_length")}
        if self.shared_head_norm is not None:
            want["nextn.shared_head_norm.weight"] = ((D,), "embedding_length")
        expect_shapes(m, p, want)


class Model(base.Model):
    KV_TYPES = ("f32",)
    KV_WHAT = "an MLA latent cache"

    dsa_positions = None

    def __init__(self, g, args, step=None, act: str = "f32", invariant: bool = False):
        super().__init__(g, args, step, act, invariant)
        self.mtp = [MTP(self, args.n_layers + i) for i in range(args.n_nextn)]

    @staticmethod
    def args_from(g) -> Args:
        return read_args(g)

    def make_layer(self, il):
        return DecoderLayer(self, il, self.args.idx_full[il])

    @classmethod
    def cache_bytes(cls, args: Args, ctx: int) -> int:
        """The latent caches ((kv_lora_rank + rope dims) f32 per position per layer) and the full indexer
        layers' keys (indexer key length f32 per position)."""
        per = LatentCache.bytes_per_position(args.kv_lora_rank, args.n_rot)
        return int(ctx) * (args.n_layers * per + sum(args.idx_full) * 4 * args.idx_dim)

    @classmethod
    def scratch_bytes(cls, args: Args, ctx: int) -> int:
        """The expanded MLA keys and values (``mla.expand_scratch_bytes``) of a chunk whose rows see at most
        ``idx_topk`` positions: a chunk past them has the indexer choose and takes the absorbed form."""
        return expand_scratch_bytes(args.n_heads, args.nope, args.n_rot, args.v_dim, min(int(ctx), args.idx_topk))
