"""The Gated DeltaNet token mixer (linear attention with a recurrent state), shared by the families that use it
(``qwen3next``, ``qwen35moe``).

Source: HF transformers ``models/qwen3_next/modeling_qwen3_next.py`` ``Qwen3NextGatedDeltaNet`` and
``models/qwen3_5_moe/modeling_qwen3_5_moe.py`` ``Qwen3_5MoeGatedDeltaNet``; the GGUF layout is what llama.cpp's
``convert_hf_to_gguf.py`` writes (``conversion/qwen.py`` ``Qwen3NextModel``, ``_LinearAttentionVReorderBase``) and
``src/models/qwen3next.cpp`` / ``qwen35moe.cpp`` read. Tensors of layer ``blk.N.``:

* ``attn_qkv.weight`` [2 Hk dk + Hv dv, D]: q heads, k heads, v heads (the converter regroups HF's per-key-head
  ``in_proj_qkvz``); ``attn_gate.weight`` [Hv dv, D]: z, the output gate; older conversions store the fused
  ``ssm_in.weight`` in HF's order instead, whose rows are regrouped at load;
* ``ssm_ba.weight`` [2 Hv, D] (Qwen3-Next: per key head, Hv/Hk beta rows then Hv/Hk alpha rows) or
  ``ssm_beta.weight`` / ``ssm_alpha.weight`` [Hv, D] (Qwen3.5);
* ``ssm_conv1d.weight`` [C, K] with C = 2 Hk dk + Hv dv: the depthwise causal convolution over q/k/v;
* ``ssm_a`` [Hv] (= -exp(A_log)), ``ssm_dt.bias`` [Hv], ``ssm_norm.weight`` [dv] (the gated RMSNorm, stored
  without the +1 the other norms get), ``ssm_out.weight`` [D, Hv dv].

Value-head order: Qwen3-Next files keep HF's grouped order (value head h reads key head h // (Hv/Hk)); the converter
reorders Qwen3.5 files to the tiled order (h reads key head h % Hk), so ``tiled`` follows the architecture.

Per call (T rows, prefill block or decode step): the projections of all rows (one grouped launch where the formats
allow it), the convolution with its rolling state, then the recurrence over the rows in order
(``cpu_kernels.deltanet``), then ``ssm_out``. The layer cache (``DeltaNetCache``) holds the convolution state f32
[K - 1, C] and the recurrent state f32 [Hv, dk, dv]: constant bytes per sequence, whatever the context length
(docs/families.md).
"""
from __future__ import annotations

import numpy as np

from coli.base.errors import ColiError
from cpu_kernels import experts as grouped
from cpu_kernels.deltanet import causal_conv1d_silu, gated_deltanet


class DeltaNetCache:
    """One Gated DeltaNet layer's state for one sequence: ``conv`` f32 [K - 1, C] (the last K - 1 rows of the
    q/k/v projections) and ``state`` f32 [Hv, dk, dv] (the delta rule's matrices). Zeros = a fresh sequence.
    Not indexed by position, so not ``rewindable``: the engine starts a fresh cache instead of moving ``pos`` back
    to a shorter common prefix."""

    rewindable = False

    def __init__(self, conv_channels: int, kernel: int, n_v_heads: int, dk: int, dv: int):
        self.conv = np.zeros((kernel - 1, conv_channels), np.float32)
        self.state = np.zeros((n_v_heads, dk, dv), np.float32)

    def nbytes(self) -> int:
        return self.conv.nbytes + self.state.nbytes

    @staticmethod
    def bytes_for(dims: dict) -> int:
        """The bytes of one layer's cache for ``ssm_dims`` ``dims`` (what ``nbytes`` of a new one gives)."""
        c = 2 * dims["n_k_heads"] * dims["dk"] + dims["n_v_heads"] * dims["dv"]
        return 4 * ((dims["kernel"] - 1) * c + dims["n_v_heads"] * dims["dk"] * dims["dv"])


def ssm_dims(g) -> dict:
    """The DeltaNet hyper-parameters from GGUF ``<arch>.ssm.*`` (llama.cpp ``LLM_KV_SSM_*``): ``kernel`` (conv_kernel),
    ``dk`` (state_size), ``n_k_heads`` (group_count), ``n_v_heads`` (time_step_rank), ``dv`` (inner_size / Hv).
    ColiError naming the missing key."""
    a = g.arch

    def need(k):
        v = g.get(f"{a}.ssm.{k}")
        if v is None:
            raise ColiError(f"{g.path.name}: metadata '{a}.ssm.{k}' is missing")
        return int(v)

    d = dict(kernel=need("conv_kernel"), dk=need("state_size"), n_k_heads=need("group_count"),
             n_v_heads=need("time_step_rank"))
    inner = need("inner_size")
    if d["n_v_heads"] <= 0 or d["n_k_heads"] <= 0 or inner % d["n_v_heads"] or d["n_v_heads"] % d["n_k_heads"] \
            or d["kernel"] < 1:
        raise ColiError(f"{g.path.name}: metadata '{a}.ssm.*' is inconsistent: inner_size {inner}, "
                        f"time_step_rank {d['n_v_heads']}, group_count {d['n_k_heads']}, conv_kernel {d['kernel']}")
    d["dv"] = inner // d["n_v_heads"]
    return d


class GatedDeltaNet:
    """The linear-attention mixer of one layer. ``m``: the model (``m.wt``, ``m.mm``, ``m.grouped_rows``,
    ``m.act``, ``m.args.eps``); ``dims``: ``ssm_dims(g)``; ``tiled``: the value-head order (module docstring).

    ``__call__(x, xa, cache) -> f32 [T, D]``: x f32 [T, D] the normed layer input, xa its quantized activation
    (``m.norm_in``) or None, cache a ``DeltaNetCache`` updated in place. ColiError at load naming a missing tensor
    or one whose shape does not match the ``ssm`` keys."""

    pageable = False  # a recurrent state, not rows by position (Cache.pageable)

    def __init__(self, m, prefix: str, dims: dict, tiled: bool):
        self.m = m
        wt = m.wt
        p = prefix
        self.kernel, self.dk, self.n_k_heads = dims["kernel"], dims["dk"], dims["n_k_heads"]
        self.n_v_heads, self.dv = dims["n_v_heads"], dims["dv"]
        self.tiled = bool(tiled)
        Hk, Hv, dk, dv = self.n_k_heads, self.n_v_heads, self.dk, self.dv
        self.conv_channels = C = 2 * Hk * dk + Hv * dv
        self.eps = m.args.eps
        if not wt.has(p + "attn_qkv.weight") and wt.has(p + "ssm_in.weight"):
            self.attn_qkv, self.attn_gate = self._split_ssm_in(wt.info(p + "ssm_in.weight"), wt.fname, m.args.d_model)
        else:
            self.attn_qkv = wt.w(p + "attn_qkv.weight")
            self.attn_gate = wt.w(p + "attn_gate.weight")
        if wt.has(p + "ssm_ba.weight"):
            self.ssm_ba = wt.w(p + "ssm_ba.weight")
            self.ssm_beta = self.ssm_alpha = None
            proj = [self.attn_qkv, self.attn_gate, self.ssm_ba]
        else:
            self.ssm_ba = None
            self.ssm_beta = wt.w(p + "ssm_beta.weight")
            self.ssm_alpha = wt.w(p + "ssm_alpha.weight")
            proj = [self.attn_qkv, self.attn_gate, self.ssm_beta, self.ssm_alpha]
        self.ssm_conv1d = wt.f32(p + "ssm_conv1d.weight")
        self.ssm_a = wt.f32(p + "ssm_a")
        self.ssm_dt = wt.f32(p + "ssm_dt.bias")
        self.ssm_norm = wt.f32(p + "ssm_norm.weight")
        self.ssm_out = wt.w(p + "ssm_out.weight")
        D = m.args.d_model
        want = {"attn_qkv.weight": (C, D), "attn_gate.weight": (Hv * dv, D), "ssm_conv1d.weight": (C, self.kernel),
                "ssm_a": (Hv,), "ssm_dt.bias": (Hv,), "ssm_norm.weight": (dv,), "ssm_out.weight": (D, Hv * dv)}
        if self.ssm_ba is not None:
            want["ssm_ba.weight"] = (2 * Hv, D)
        else:
            want["ssm_beta.weight"] = want["ssm_alpha.weight"] = (Hv, D)
        if not wt.has(p + "attn_qkv.weight"):  # the legacy ssm_in: checked by _split_ssm_in
            del want["attn_qkv.weight"], want["attn_gate.weight"]
        for n, shape in want.items():
            got = tuple(m.g.tensors[p + n].shape)
            if got != shape:
                raise ColiError(f"{m.g.path.name}: tensor '{p}{n}' has shape {list(got)}, expected {list(shape)} "
                                "(from the ssm.* metadata)")
        self._proj = proj
        self._group = grouped.Group(proj) if all(grouped.supports(w) for w in proj) else None

    def _split_ssm_in(self, ti, fname: str, D: int):
        """The ``attn_qkv`` and ``attn_gate`` weights from an older file's fused ``ssm_in`` [2 Hk dk + 2 Hv dv, D],
        whose rows are HF's ``in_proj_qkvz`` order: per key head q (dk), k (dk), v (Hv/Hk dv), z (Hv/Hk dv)
        (llama.cpp ``build_qkvz``'s legacy path). Rows are independent in every GGUF format, so the raw rows are
        regrouped and prepared as two weights."""
        Hk, Hv, dk, dv = self.n_k_heads, self.n_v_heads, self.dk, self.dv
        rv = Hv // Hk * dv
        G = 2 * dk + 2 * rv
        if tuple(ti.shape) != (Hk * G, D):
            raise ColiError(f"{fname}: tensor '{ti.name}' has shape {list(ti.shape)}, expected {[Hk * G, D]} "
                            "(from the ssm.* metadata)")
        base = np.arange(Hk)[:, None] * G
        q = (base + np.arange(dk)).reshape(-1)
        k = (base + dk + np.arange(dk)).reshape(-1)
        v = (base + 2 * dk + np.arange(rv)).reshape(-1)
        z = (base + 2 * dk + rv + np.arange(rv)).reshape(-1)
        qkv_rows, z_rows = np.concatenate([q, k, v]), z
        out = []
        for rows in (qkv_rows, z_rows):  # Weights.prepare: ColiError naming the tensor (type, NaN / inf)
            out.append(self.m.wt.prepare(ti, np.ascontiguousarray(ti.raw[rows]), (len(rows), D)))
        return out

    def new_cache(self, ctx: int) -> DeltaNetCache:
        """A fresh (zero) state; its size does not depend on ``ctx``."""
        return DeltaNetCache(self.conv_channels, self.kernel, self.n_v_heads, self.dk, self.dv)

    def projections(self, x, xa=None):
        """q/k/v (pre-convolution) f32 [T, C], z f32 [T, Hv dv], b and a f32 [T, Hv] (raw) for the rows ``x``."""
        m = self.m
        T = x.shape[0]
        if self._group is not None and m.grouped_rows(T):
            out = self._group(xa if xa is not None else grouped.Act(x, m.act))
            parts, o = [], 0
            for w in self._proj:
                parts.append(out[:, o:o + w.shape[0]])
                o += w.shape[0]
        else:
            parts = [m.mm(w, x) for w in self._proj]
        qkv, z = parts[0], parts[1]
        Hk, Hv = self.n_k_heads, self.n_v_heads
        if self.ssm_ba is not None:  # per key head: Hv/Hk beta rows, then Hv/Hk alpha rows (HF fix_query_key_value_ordering)
            ba = np.ascontiguousarray(parts[2]).reshape(T, Hk, 2, Hv // Hk)
            b, a = ba[:, :, 0].reshape(T, Hv), ba[:, :, 1].reshape(T, Hv)
        else:
            b, a = parts[2], parts[3]
        return qkv, z, b, a

    def __call__(self, x, xa, cache: DeltaNetCache):
        qkv, z, b, a = self.projections(x, xa)
        conv = causal_conv1d_silu(qkv, self.ssm_conv1d, cache.conv)
        o = gated_deltanet(conv, z, b, a, self.ssm_a, self.ssm_dt, self.ssm_norm, self.eps, cache.state,
                           self.n_k_heads, self.tiled)
        return self.m.mm(self.ssm_out, o)
