"""Rope scaling read from GGUF metadata: none, linear (position interpolation) and YaRN.

Keys (``<arch>.rope.scaling.*``, llama.cpp ``src/llama-arch.cpp`` ``LLM_KV_ROPE_SCALING_*``; written by
llama.cpp's ``convert_hf_to_gguf.py`` from the HF config's ``rope_parameters`` / ``rope_scaling``):

========================================  ==============================================================
key                                       meaning here
========================================  ==============================================================
``type``                                  ``none`` | ``linear`` | ``yarn`` (absent: ``linear``, so a bare
                                          ``factor`` scales linearly, as llama.cpp's loader defaults)
``factor``                                the context extension factor s (absent or 0: 1); the older key
                                          ``<arch>.rope.scale_linear`` is read when it is absent
``original_context_length``               YaRN: the pre-training context L (absent: ``context_length``)
``attn_factor``                           a multiplier on cos and sin for every type (llama.cpp
                                          ``hparams.rope_attn_factor``, default 1)
``yarn_attn_factor``                      YaRN: HF's ``attention_factor``, the cos/sin multiplier that
                                          replaces the default ``0.1 ln s + 1``
``yarn_beta_fast`` / ``yarn_beta_slow``   YaRN: the ramp's rotation bounds (default 32 / 1)
``yarn_ext_factor``                       accepted only at 1 (HF's YaRN has no such knob)
``finetuned``                             informational; no effect on the math
========================================  ==============================================================

A ``rope_freqs.weight`` tensor (f32 [n_rot / 2]; llama.cpp's converter writes it for HF ``rope_type``
``llama3``, conversion/llama.py ``generate_extra_tensors``) divides each pair's frequency before the
scaling above (ggml ``ggml_rope_cache_init``: ``theta / freq_factors[i0 / 2]``); HF's
``_compute_llama3_parameters`` gives the same frequencies.

Any other key under ``<arch>.rope.scaling.`` (``yarn_log_multiplier``, ``alpha``...) and any other type
(``longrope``...) is refused with a ``ColiError`` naming it: a scaling coli does not implement would give
wrong logits past the first positions, silently.

The math (HF ``transformers/modeling_rope_utils.py`` ``_compute_linear_scaling_rope_parameters`` and
``_compute_yarn_parameters``; ggml ``ggml-cpu/ops.cpp`` ``rope_yarn`` with ``ggml_rope_yarn_corr_dims``;
llama.cpp ``llama-context.cpp`` for the attention factor). With d = rotated dims (``n_rot``), b = base,
``inv_j = b^(-2j/d)`` for j < d/2:

* linear: ``inv_j / s``;
* YaRN: ``corr(beta) = d ln(L / (2 pi beta)) / (2 ln b)``; ``lo = max(floor(corr(beta_fast)), 0)``,
  ``hi = min(ceil(corr(beta_slow)), d - 1)``; ``ramp_j = clip((j - lo) / (hi - lo), 0, 1)``
  (``hi - lo`` at least 0.001); ``inv'_j = inv_j / s * ramp_j + inv_j * (1 - ramp_j)`` (dims below
  ``lo`` keep their frequency, dims above ``hi`` are interpolated); cos and sin are multiplied by
  ``mscale = yarn_attn_factor or (0.1 ln s + 1 if s > 1 else 1)``.

Both multiply by ``attn_factor``. HF and llama.cpp agree on everything above for the keys the converter
writes; llama.cpp 0.3.36's loader does not read ``yarn_beta_*`` / ``yarn_attn_factor`` from the file (it
uses 32 / 1 / the default mscale) while HF uses the config values the converter copied into them, so coli
follows HF there. See docs/families.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from coli.base.errors import ColiError

TYPES = ("none", "linear", "yarn")
_KEYS = {"type", "factor", "original_context_length", "attn_factor", "finetuned", "yarn_ext_factor",
         "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow"}


@dataclass(frozen=True)
class RopeScaling:
    """One rope scaling rule: ``kind`` in ``TYPES``, ``factor`` s (>= 0; 1 = no scaling), ``orig_ctx`` L
    (YaRN), ``attn_factor`` (every kind), ``yarn_attn_factor`` (None: the default mscale), ``beta_fast``,
    ``beta_slow`` (YaRN), ``freq_factors`` (the ``rope_freqs`` tensor as a tuple of floats, or None)."""

    kind: str = "none"
    factor: float = 1.0
    orig_ctx: int = 0
    attn_factor: float = 1.0
    yarn_attn_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    freq_factors: tuple | None = None

    @property
    def is_identity(self) -> bool:
        """True when the table equals the unscaled one (so the plain ``rope_table`` path is taken)."""
        if self.attn_factor != 1.0 or self.freq_factors is not None:
            return False
        if self.kind == "none":
            return True
        if self.kind == "linear":
            return self.factor == 1.0
        return False

    def unscaled(self) -> "RopeScaling":
        """The rule of a layer whose frequencies are not scaled (llama.cpp's SWA layers: freq_scale 1) but
        whose cos/sin keep ``attn_factor``."""
        return RopeScaling(kind="none", attn_factor=self.attn_factor, freq_factors=self.freq_factors)

    def inv_freq(self, n_rot: int, base: float) -> np.ndarray:
        """The inverse frequencies f64 [n_rot // 2] (radians per position)."""
        inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
        if self.freq_factors is not None:
            inv = inv / np.asarray(self.freq_factors, dtype=np.float64)
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "yarn":
            lo, hi = yarn_corr_dims(n_rot, self.orig_ctx, base, self.beta_fast, self.beta_slow)
            ramp = np.clip((np.arange(n_rot // 2, dtype=np.float64) - lo) / max(hi - lo, 0.001), 0.0, 1.0)
            return inv / self.factor * ramp + inv * (1.0 - ramp)
        return inv

    @property
    def mscale(self) -> float:
        """The multiplier on cos and sin (dimensionless)."""
        m = self.attn_factor
        if self.kind == "yarn":
            if self.yarn_attn_factor is not None:
                m *= self.yarn_attn_factor
            elif self.factor > 1.0:
                m *= 0.1 * math.log(self.factor) + 1.0
        return m

    def table(self, n_pos: int, n_rot: int, base: float) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin f32 [n_pos, n_rot // 2], computed in float64 (the layout of
        ``cpu_kernels.rope.rope_table``, which this equals bit for bit when ``is_identity``)."""
        from cpu_kernels.rope import rope_table  # loads Numba: only when a table is built

        if self.is_identity:
            return rope_table(n_pos, n_rot, base)
        ang = np.arange(n_pos, dtype=np.float64)[:, None] * self.inv_freq(n_rot, base)[None, :]
        m = self.mscale
        return (np.cos(ang) * m).astype(np.float32), (np.sin(ang) * m).astype(np.float32)


def yarn_corr_dims(n_rot: int, orig_ctx: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """ggml ``ggml_rope_yarn_corr_dims``: the first and last rotated pair index of the ramp."""

    def corr(beta):
        return n_rot * math.log(orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, math.floor(corr(beta_fast))), min(float(n_rot - 1), math.ceil(corr(beta_slow)))


def _num(g, key, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise ColiError(f"{g.path.name}: metadata '{key}': {v!r} is not a finite number")
    return float(v)


def _freq_factors(g, n_rot: int):
    ti = g.tensors.get("rope_freqs.weight")
    if ti is None:
        return None
    if ti.type_name != "F32" or tuple(ti.shape) != (n_rot // 2,):
        raise ColiError(f"{g.path.name}: tensor 'rope_freqs.weight': {ti.type_name} {list(ti.shape)}, expected F32 "
                        f"[{n_rot // 2}] (n_rot / 2)")
    ff = ti.raw.view(np.float32).astype(np.float64)
    if not (np.isfinite(ff).all() and (ff > 0).all()):
        raise ColiError(f"{g.path.name}: tensor 'rope_freqs.weight': factors must be finite and > 0")
    return tuple(float(x) for x in ff)


def from_gguf(g, n_rot: int) -> RopeScaling:
    """The rule in ``g.meta`` and the ``rope_freqs.weight`` tensor of a ``GGUFModel`` (keys above; ``n_rot``
    the rotated dims). Raises ``ColiError`` naming the file and the key or tensor for an unknown key, an
    unknown type, a value of the wrong kind, a negative factor, YaRN parameters that make no ramp, or a
    ``rope_freqs`` tensor of the wrong type or shape."""
    a = g.arch
    ff = _freq_factors(g, n_rot)
    pre = f"{a}.rope.scaling."
    for key in g.meta:
        if key.startswith(pre) and key[len(pre):] not in _KEYS:
            raise ColiError(f"{g.path.name}: metadata '{key}': rope scaling key not implemented by coli "
                            f"(implemented: {', '.join(sorted(_KEYS))})")
    kind = g.get(pre + "type", "linear")
    if not isinstance(kind, str) or kind not in TYPES:
        raise ColiError(f"{g.path.name}: metadata '{pre}type': {kind!r} is not implemented by coli "
                        f"(implemented: {', '.join(TYPES)})")
    fkey = pre + "factor" if pre + "factor" in g.meta else f"{a}.rope.scale_linear"
    factor = _num(g, fkey, g.get(fkey, 0.0))
    if factor < 0:
        raise ColiError(f"{g.path.name}: metadata '{fkey}': {factor} (a rope scaling factor is >= 0)")
    factor = factor or 1.0
    attn = _num(g, pre + "attn_factor", g.get(pre + "attn_factor", 1.0))
    if kind == "none":
        return RopeScaling("none", 1.0, attn_factor=attn, freq_factors=ff)
    if kind == "linear":
        return RopeScaling("linear", factor, attn_factor=attn, freq_factors=ff)
    ext = _num(g, pre + "yarn_ext_factor", g.get(pre + "yarn_ext_factor", 1.0))
    if ext != 1.0:
        raise ColiError(f"{g.path.name}: metadata '{pre}yarn_ext_factor': {ext} is not implemented by coli "
                        "(only 1, HF's YaRN)")
    orig = g.get(pre + "original_context_length", g.get(f"{a}.context_length"))
    if orig is None:
        raise ColiError(f"{g.path.name}: metadata '{pre}original_context_length' is missing (YaRN needs it)")
    orig = int(_num(g, pre + "original_context_length", orig))
    yaf = g.get(pre + "yarn_attn_factor")
    bf = _num(g, pre + "yarn_beta_fast", g.get(pre + "yarn_beta_fast", 32.0))
    bs = _num(g, pre + "yarn_beta_slow", g.get(pre + "yarn_beta_slow", 1.0))
    if orig <= 0 or bf <= 0 or bs <= 0:
        raise ColiError(f"{g.path.name}: metadata '{pre}*': YaRN needs original_context_length, yarn_beta_fast "
                        f"and yarn_beta_slow > 0 (got {orig}, {bf}, {bs})")
    return RopeScaling("yarn", factor, orig, attn, None if yaf is None else _num(g, pre + "yarn_attn_factor", yaf),
                       bf, bs, ff)


__all__ = ["RopeScaling", "from_gguf", "yarn_corr_dims", "TYPES"]
