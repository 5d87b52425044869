"""Open a Hugging Face model folder (``config.json``, ``*.safetensors``, ``tokenizer.json``) as coli opens a GGUF.

``open_folder(dir)`` returns an :class:`HFModel` with the interface the model classes read from a
``coli.gguf_file.GGUFModel``: ``path``, ``arch`` (the GGUF architecture name), ``meta`` (the GGUF keys that
llama.cpp's ``convert_hf_to_gguf.py`` would write from ``config.json``), ``get``/``arch_get``, and ``tensors``
(GGUF tensor names -> ``TensorInfo``, NumPy shapes ``[O, I]``, experts ``[E, O, I]``), plus
``tokenizer()`` and ``expert_source()``.

Folder layout (what ``save_pretrained`` writes and the FP8 releases ship):

* ``config.json``: ``model_type`` in :data:`ARCHS`; the usual ``hidden_size``, ``num_hidden_layers``...;
  ``rope_parameters`` / ``rope_scaling`` (-> ``<arch>.rope.scaling.*`` as the converter writes them);
  ``quantization_config`` absent, or ``{"quant_method": "fp8", "weight_block_size": [128, 128]}``.
* ``model.safetensors``, or shards listed by ``model.safetensors.index.json`` (``weight_map``). Opened with
  the ``safetensors`` package (which validates the header and the offsets) and read zero-copy through a
  read-only memory map (its NumPy backend has no bfloat16 / float8 dtypes, so the bytes are viewed as uint8
  at the header's ``data_offsets``). Dtypes: F32, F16, BF16 as the GGUF types of those names; F8_E4M3 with
  its ``weight_scale_inv`` (F32 or BF16, one per 128x128 block) as coli's ``FP8_E4M3_B128`` row
  (``coli/types/fp8_blocks.py``; the row layout is a copy, made at load for dense weights and per read for experts).
* ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``, ``generation_config.json``).

Tensor names (HF ``modeling_*.py`` -> GGUF, as ``gguf-py``'s ``tensor_mapping.py``): ``model.embed_tokens`` ->
``token_embd``, ``model.norm`` -> ``output_norm``, ``lm_head`` -> ``output``; per layer ``input_layernorm`` ->
``attn_norm``, ``post_attention_layernorm`` -> ``ffn_norm``, ``self_attn.{q,k,v,o}_proj`` ->
``attn_{q,k,v,output}``, ``self_attn.{q,k}_norm`` -> ``attn_{q,k}_norm``, ``mlp.{gate,up,down}_proj`` ->
``ffn_{gate,up,down}``, ``mlp.gate`` / ``block_sparse_moe.gate`` -> ``ffn_gate_inp``,
``mlp.experts.E.{gate,up,down}_proj`` / ``block_sparse_moe.experts.E.{w1,w3,w2}`` ->
``ffn_{gate,up,down}_exps`` (stacked), ``mlp.shared_expert.*`` -> ``ffn_*_shexp``, ``mlp.shared_expert_gate``
-> ``ffn_gate_inp_shexp``. For the llama architecture (llama, mixtral) the q/k rows are permuted as the
converter does (``LlamaModel.permute``: rotate-half -> interleaved pairs), so the model reads them as from a
GGUF. A tensor the map does not know is refused (a ColiError naming it), never skipped.

Errors: ``ColiError`` naming the folder and the file, key or tensor.
"""
from __future__ import annotations

import functools
import json
import math
import mmap
import os
import re
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from tokenizers import Tokenizer as HFTok

from coli.base.errors import ColiError
from coli.gguf_file import TensorInfo
from coli.tokenizer import CONTROL, Tokenizer, UNUSED, USER_DEFINED, _EOG_TEXTS
from coli.types import fp8_blocks as fp8

#: HF ``model_type`` -> GGUF architecture (coli's model files)
ARCHS = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "llama", "llama": "llama",
         "qwen2": "qwen2"}
FP8 = "FP8_E4M3_B128"
_DTYPES = {"F32": ("F32", 4), "F16": ("F16", 2), "BF16": ("BF16", 2)}
_MAX_HEADER = 100 << 20

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_PER_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_EXPERT_PROJ = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


@dataclass(eq=False)
class _Src:
    """One tensor in a safetensors file: where its bytes are."""

    file: Path
    dtype: str
    shape: tuple
    buf: Any  # uint8 view of the file mapping
    start: int
    end: int

    def bytes(self) -> np.ndarray:
        return self.buf[self.start:self.end]


def _fail(folder: Path, what: str):
    raise ColiError(f"{folder}: {what}")   # the path as given: the folder's last part alone was ambiguous


def _read_json(folder: Path, name: str, required: bool = True):
    p = folder / name
    if not p.exists():
        if required:
            _fail(folder, f"{name}: missing (a Hugging Face model folder has config.json, *.safetensors "
                          f"and tokenizer.json)")
        return None
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        _fail(folder, f"{name}: not valid JSON ({e})")


def _open_safetensors(folder: Path, fname: str, maps: list) -> dict[str, _Src]:
    """Validate one file with the ``safetensors`` package, then map it and view each tensor's bytes."""
    p = folder / fname
    if not p.is_file():
        _fail(folder, f"{fname}: missing (named by model.safetensors.index.json)")
    try:
        with safe_open(str(p), framework="numpy") as f:
            keys = list(f.keys())
            meta = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in keys}
    except Exception as e:  # safetensors raises its own SafetensorError / OSError on a bad file
        _fail(folder, f"{fname}: not a valid safetensors file ({e})")
    size = p.stat().st_size
    with open(p, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if n > min(size - 8, _MAX_HEADER):
            _fail(folder, f"{fname}: header length {n} is past the end of the file")
        header = json.loads(fh.read(n))
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None
    maps.append(mm)
    buf = np.frombuffer(mm, dtype=np.uint8)
    out = {}
    for k in keys:
        ent = header[k]
        b, e = ent["data_offsets"]
        dt, shape = meta[k]
        if tuple(ent["shape"]) != shape or 8 + n + e > size:
            _fail(folder, f"{fname}: tensor '{k}': header disagrees with safetensors' view")
        out[k] = _Src(p, dt, shape, buf, 8 + n + b, 8 + n + e)
    return out


def _permute_rows(a: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp ``LlamaModel.permute``: per head of d rows, rotate-half order -> interleaved pairs."""
    d = a.shape[0] // n_head
    return np.ascontiguousarray(a.reshape(n_head, 2, d // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape))


@dataclass(eq=False)
class HFModel:
    """A Hugging Face folder presented as a GGUF model (see the module docstring). ``config``: config.json."""

    path: Path
    arch: str
    meta: dict[str, Any]
    tensors: dict[str, TensorInfo]
    config: dict
    experts: dict = field(default_factory=dict)  # (layer, gguf name) -> [ (weight _Src, scale _Src | None) ] per expert
    _maps: list = field(default_factory=list, repr=False)
    file_size: int = 0  # bytes of the safetensors files (coli info)
    version: str = "Hugging Face folder"

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(key, default)

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{suffix}", default)

    def tokenizer(self):
        """The folder's tokenizer as a ``coli.tokenizer.Tokenizer`` (``tokenizer_from_folder``)."""
        return tokenizer_from_folder(self.path, self.config)

    def expert_source(self, layers: dict):
        """A ``scheduler.ram_cache.ExpertSource`` reading this folder's per-expert tensors."""
        return _hf_expert_source()(self, layers)

    def __repr__(self) -> str:
        return f"HFModel({self.path.name!r}, arch={self.arch!r}, {len(self.tensors)} tensors)"


# ----------------------------------------------------------------------------------------------- metadata
def _rope_meta(a: str, cfg: dict, meta: dict, folder: Path) -> None:
    """``<arch>.rope.*`` as llama.cpp's converter writes them (conversion/base.py ``set_gguf_parameters``)."""
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = rp.get("rope_theta", cfg.get("rope_theta"))
    if theta is not None:
        meta[f"{a}.rope.freq_base"] = float(theta)
    kind = rp.get("rope_type", rp.get("type"))
    if kind in (None, "default"):
        return
    factor = rp.get("factor")
    if kind == "linear" and factor is not None:
        meta[f"{a}.rope.scaling.type"] = "linear"
        meta[f"{a}.rope.scaling.factor"] = float(factor)
    elif kind == "yarn" and factor is not None:
        meta[f"{a}.rope.scaling.type"] = "yarn"
        meta[f"{a}.rope.scaling.factor"] = float(factor)
        orig = rp.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        if orig is None:
            _fail(folder, "config.json: rope_parameters.original_max_position_embeddings: missing (YaRN needs it)")
        meta[f"{a}.rope.scaling.original_context_length"] = int(orig)
        for hf, gg in (("extrapolation_factor", "yarn_ext_factor"), ("attention_factor", "yarn_attn_factor"),
                       ("attn_factor", "yarn_attn_factor"), ("beta_fast", "yarn_beta_fast"),
                       ("beta_slow", "yarn_beta_slow")):
            if rp.get(hf) is not None:
                meta[f"{a}.rope.scaling.{gg}"] = float(rp[hf])
        for hf in ("mscale", "mscale_all_dim"):
            if rp.get(hf) is not None:
                _fail(folder, f"config.json: rope_parameters.{hf}: not implemented by coli")
    elif kind == "llama3":
        pass  # the rope_freqs tensor, made in open_folder
    else:
        _fail(folder, f"config.json: rope_parameters.rope_type '{kind}': not implemented by coli "
                      f"(default, linear, yarn, llama3)")


def _meta(a: str, cfg: dict, folder: Path) -> dict:
    def need(*keys):
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        _fail(folder, f"config.json: '{keys[0]}' is missing")

    n_heads = int(need("num_attention_heads"))
    d = int(need("hidden_size"))
    head_dim = int(cfg.get("head_dim") or d // n_heads)
    meta = {
        "general.architecture": a,
        "general.name": folder.name,
        f"{a}.block_count": int(need("num_hidden_layers")),
        f"{a}.context_length": int(cfg.get("max_position_embeddings") or 4096),
        f"{a}.embedding_length": d,
        f"{a}.feed_forward_length": int(cfg.get("intermediate_size") or 0),
        f"{a}.attention.head_count": n_heads,
        f"{a}.attention.head_count_kv": int(cfg.get("num_key_value_heads") or n_heads),
        f"{a}.attention.key_length": head_dim,
        f"{a}.attention.value_length": head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        f"{a}.rope.dimension_count": head_dim,
        f"{a}.vocab_size": int(need("vocab_size")),
    }
    n_exp = cfg.get("num_experts") or cfg.get("num_local_experts")
    if n_exp:
        meta[f"{a}.expert_count"] = int(n_exp)
        meta[f"{a}.expert_used_count"] = int(need("num_experts_per_tok"))
        if cfg.get("moe_intermediate_size"):
            meta[f"{a}.expert_feed_forward_length"] = int(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            meta[f"{a}.expert_shared_feed_forward_length"] = int(cfg["shared_expert_intermediate_size"])
        if "norm_topk_prob" in cfg:  # HF's routing flag (Mixtral has none: it always renormalises)
            meta[f"{a}.expert_weights_norm"] = bool(cfg["norm_topk_prob"])
    if cfg.get("partial_rotary_factor") not in (None, 1, 1.0):
        _fail(folder, "config.json: partial_rotary_factor: not implemented by coli for this architecture")
    _rope_meta(a, cfg, meta, folder)
    return meta


def _check_quant(cfg: dict, folder: Path) -> bool:
    q = cfg.get("quantization_config")
    if q is None:
        return False
    if q.get("quant_method") != "fp8":
        _fail(folder, f"config.json: quantization_config.quant_method '{q.get('quant_method')}': not supported "
                      "(fp8 with 128x128 blocks, or none)")
    if list(q.get("weight_block_size") or []) != [128, 128]:
        _fail(folder, f"config.json: quantization_config.weight_block_size {q.get('weight_block_size')}: "
                      "not supported ([128, 128])")
    if q.get("fmt", "e4m3") != "e4m3":
        _fail(folder, f"config.json: quantization_config.fmt '{q.get('fmt')}': not supported (e4m3)")
    return True


# ----------------------------------------------------------------------------------------------- tensors
def _scale_f32(folder: Path, name: str, s: _Src) -> np.ndarray:
    raw = s.bytes()
    if s.dtype == "F32":
        return raw.view("<f4").reshape(s.shape)
    if s.dtype == "BF16":
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(s.shape)
    _fail(folder, f"tensor '{name}': dtype {s.dtype} (F32 or BF16 expected for a weight_scale_inv)")


def _fp8_raw(folder: Path, name: str, w: _Src, s: _Src) -> np.ndarray:
    if len(w.shape) != 2:
        _fail(folder, f"tensor '{name}': F8_E4M3 tensor of shape {list(w.shape)} (2-D expected)")
    codes = w.bytes().reshape(w.shape)
    try:
        return fp8.to_raw(codes, _scale_f32(folder, name + "_scale_inv", s), name)
    except ColiError as e:
        _fail(folder, f"tensor {e}")


def _raw(folder: Path, name: str, w: _Src, s: _Src | None) -> tuple[str, np.ndarray]:
    """(coli type name, uint8 [*shape[:-1], row_bytes]) of one checkpoint tensor."""
    if w.dtype == "F8_E4M3":
        if s is None:
            _fail(folder, f"tensor '{name}': F8_E4M3 without a '{name}_scale_inv' (128x128 block scales)")
        return FP8, _fp8_raw(folder, name, w, s)
    if s is not None:
        _fail(folder, f"tensor '{name}': {w.dtype} with a weight_scale_inv (only F8_E4M3 weights are scaled)")
    t = _DTYPES.get(w.dtype)
    if t is None:
        _fail(folder, f"tensor '{name}': dtype {w.dtype} is not supported (F32, F16, BF16, F8_E4M3)")
    if not w.shape:
        _fail(folder, f"tensor '{name}': a scalar (0-D) tensor")
    return t[0], w.bytes().reshape(*w.shape[:-1], w.shape[-1] * t[1])


def _info(name: str, type_name: str, shape: tuple, raw: np.ndarray) -> TensorInfo:
    return TensorInfo(name, type_name, tuple(int(x) for x in shape), raw, -1, int(raw.nbytes), -1, int(prod(shape)))


def open_folder(path) -> HFModel:
    """Open the Hugging Face model folder at ``path`` (see the module docstring).

    Raises ``ColiError`` (one line naming the folder and the file, key or tensor) for a missing or invalid
    config.json / safetensors / index, an unsupported ``model_type`` or ``quantization_config``, a tensor
    whose name, dtype or shape coli does not know, or experts of one layer that disagree in type or shape."""
    folder = Path(path)
    if not folder.is_dir():
        raise ColiError(f"{folder}: not a folder")
    cfg = _read_json(folder, "config.json")
    mt = cfg.get("model_type")
    a = ARCHS.get(mt)
    if mt is None:   # it read "model_type 'None' is not supported"
        _fail(folder, f"config.json: no 'model_type' (a Hugging Face config names it: {', '.join(sorted(ARCHS))})")
    if a is None:
        _fail(folder, f"config.json: model_type '{mt}' is not supported (supported: {', '.join(sorted(ARCHS))})")
    _check_quant(cfg, folder)
    meta = _meta(a, cfg, folder)

    index = _read_json(folder, "model.safetensors.index.json", required=False)
    if index is not None:
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            _fail(folder, "model.safetensors.index.json: 'weight_map' missing or empty")
        files = sorted(set(wm.values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            _fail(folder, "no *.safetensors file")
    maps: list = []
    src: dict[str, _Src] = {}
    for f in files:
        for k, v in _open_safetensors(folder, f, maps).items():
            if k in src:
                _fail(folder, f"{f}: tensor '{k}' is also in {src[k].file.name}")
            src[k] = v
    if index is not None:
        missing = sorted(set(wm) - set(src))
        if missing:
            _fail(folder, f"model.safetensors.index.json: tensor '{missing[0]}' is not in {wm[missing[0]]}")

    n_head = meta[f"{a}.attention.head_count"]
    n_kv = meta[f"{a}.attention.head_count_kv"]
    tensors: dict[str, TensorInfo] = {}
    experts: dict = {}
    for k, w in src.items():
        if k.endswith("_scale_inv"):
            if k[: -len("_scale_inv")] not in src:
                _fail(folder, f"tensor '{k}': no weight '{k[: -len('_scale_inv')]}' to scale")
            continue
        if k.endswith("rotary_emb.inv_freq"):  # a buffer old checkpoints saved; recomputed from the config
            continue
        s = src.get(k + "_scale_inv")
        m = _LAYER.match(k)
        if m is None:
            g = _GLOBAL.get(k)
            if g is None:
                _fail(folder, f"tensor '{k}': not a tensor coli maps for {mt}")
            tn, raw = _raw(folder, k, w, s)
            tensors[g] = _info(g, tn, w.shape, raw)
            continue
        il, rest = int(m.group(1)), m.group(2)
        em = _EXPERT.match(rest)
        if em is not None and em.group(2) in _EXPERT_PROJ:
            experts.setdefault((il, _EXPERT_PROJ[em.group(2)]), {})[int(em.group(1))] = (k, w, s)
            continue
        g = _PER_LAYER.get(rest)
        if g is None:
            _fail(folder, f"tensor '{k}': not a tensor coli maps for {mt}")
        g = f"blk.{il}.{g}"
        tn, raw = _raw(folder, k, w, s)
        if a == "llama" and g.endswith(("attn_q.weight", "attn_k.weight")):
            raw = _permute_rows(raw, n_head if g.endswith("attn_q.weight") else n_kv)
        tensors[g] = _info(g, tn, w.shape, raw)

    n_exp = meta.get(f"{a}.expert_count", 0)
    parts: dict = {}
    for (il, g), per in sorted(experts.items()):
        name = f"blk.{il}.{g}.weight"
        if sorted(per) != list(range(n_exp)):
            _fail(folder, f"tensor '{name}': experts {sorted(per)[:8]}... in the checkpoint, expected 0..{n_exp - 1}")
        k0, w0, s0 = per[0]
        for e, (k, w, s) in sorted(per.items()):
            if (w.dtype, w.shape, s is not None) != (w0.dtype, w0.shape, s0 is not None):
                _raw(folder, k, w, s)  # names a missing scale first
                _fail(folder, f"tensor '{k}': {w.dtype} {list(w.shape)}, unlike expert 0's {w0.dtype} {list(w0.shape)} "
                              f"(the experts of '{name}' must share a type and shape)")
        if len(w0.shape) != 2:
            _fail(folder, f"tensor '{k0}': expert weight of shape {list(w0.shape)} (2-D expected)")
        tn, raw0 = _raw(folder, k0, w0, s0)  # validates the first; the others are read on demand
        O = w0.shape[0]
        view = np.broadcast_to(np.zeros(1, np.uint8), (n_exp, O, raw0.shape[-1]))
        tensors[name] = TensorInfo(name, tn, (n_exp, *w0.shape), view, -1, n_exp * raw0.nbytes, -1,
                                   n_exp * int(prod(w0.shape)))
        parts[(il, name)] = [(per[e][0], per[e][1], per[e][2]) for e in range(n_exp)]

    if f"{a}.expert_count" in meta and not parts:
        _fail(folder, "config.json says experts, but the checkpoint has no per-expert tensors "
                      "(model.layers.N.mlp.experts.E.*_proj.weight)")
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rp.get("rope_type", rp.get("type")) == "llama3":
        tensors["rope_freqs.weight"] = _llama3_freqs(rp, meta[f"{a}.rope.dimension_count"])
    g = HFModel(path=folder, arch=a, meta=meta, tensors=tensors, config=cfg, experts=parts, _maps=maps,
                file_size=sum((folder / f).stat().st_size for f in files))
    return g


def _llama3_freqs(rp: dict, dim: int) -> TensorInfo:
    """The ``rope_freqs`` factors llama.cpp's converter computes for rope_type llama3 (conversion/llama.py)."""
    base = rp.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, lo, hi = rp.get("factor", 8.0), rp.get("low_freq_factor", 1.0), rp.get("high_freq_factor", 4.0)
    old = rp.get("original_max_position_embeddings", 8192)
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < old / hi:
            out.append(1.0)
        elif wl > old / lo:
            out.append(factor)
        else:
            smooth = (old / wl - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    arr = np.array(out, dtype=np.float32)
    return _info("rope_freqs.weight", "F32", arr.shape, arr.view(np.uint8))


# ----------------------------------------------------------------------------------------------- experts
@functools.cache
def _hf_expert_source():
    """The class below, made on first use: ``scheduler.ram_cache`` imports the CPU kernels, which a first run
    compiles for minutes, so a folder's errors (config.json missing...) and ``coli info DIR`` do not wait for it."""
    from scheduler.ram_cache import ExpertSource

    class HFExpertSource(ExpertSource):
        """``scheduler.ram_cache.ExpertSource`` over per-expert checkpoint tensors: expert e's three weights are
        copied out of the mapping (FP8 ones into coli's row layout) instead of read from one GGUF tensor."""

        def __init__(self, model: HFModel, layers: dict):
            super().__init__(model.path, layers, open_file=False)
            self.model = model

        def read_one(self, layer: int, t, e: int):
            k, w, s = self.model.experts[(layer, t.name)][e]
            tn, raw = _raw(self.model.path, k, w, s)
            return tn, np.array(raw, copy=True), w.end - w.start + (s.end - s.start if s is not None else 0)

    return HFExpertSource


# ----------------------------------------------------------------------------------------------- tokenizer
def _token_text(v):
    if isinstance(v, dict):
        return v.get("content")
    return v


def tokenizer_from_folder(folder: Path, cfg: dict):
    """A ``coli.tokenizer.Tokenizer`` from ``tokenizer.json`` (the ``tokenizers`` package) and
    ``tokenizer_config.json``: tokens by id, added tokens CONTROL (special) or USER_DEFINED, BOS/EOS from
    tokenizer_config's ``bos_token``/``eos_token`` or config.json's ids, ``add_bos`` from ``add_bos_token``
    (default false), end-of-generation ids also from generation_config.json, the chat template from
    ``chat_template.jinja`` or tokenizer_config's ``chat_template``. Byte-level vocabularies decode as
    ``gpt2``, SentencePiece ones (``byte_fallback``) as ``llama``."""
    p = folder / "tokenizer.json"
    if not p.exists():
        _fail(folder, "tokenizer.json: missing")
    try:
        hf = HFTok.from_file(str(p))
    except Exception as e:
        _fail(folder, f"tokenizer.json: not a tokenizers file ({e})")
    tj = _read_json(folder, "tokenizer.json")
    tc = _read_json(folder, "tokenizer_config.json", required=False) or {}
    gc = _read_json(folder, "generation_config.json", required=False) or {}
    n = max(hf.get_vocab_size(with_added_tokens=True), int(cfg.get("vocab_size") or 0))
    vocab = hf.get_vocab(with_added_tokens=True)
    tokens = [f"<unused_{i}>" for i in range(n)]  # embedding rows past the tokenizer's (HF pads the vocabulary)
    tt = np.full(n, UNUSED, dtype=np.int32)
    for t, i in vocab.items():
        if 0 <= i < n:
            tokens[i] = t
            tt[i] = 1  # NORMAL
    for at in tj.get("added_tokens", []):
        i = at.get("id")
        if isinstance(i, int) and 0 <= i < n:
            tt[i] = CONTROL if at.get("special") else USER_DEFINED
    kind = "llama" if (tj.get("model") or {}).get("byte_fallback") else "gpt2"

    def tid(text, cfg_key):
        text = _token_text(tc.get(text))
        if text is not None and text in vocab:
            return vocab[text]
        v = cfg.get(cfg_key)
        if isinstance(v, list):
            v = v[0] if v else None
        return v if isinstance(v, int) and 0 <= v < n else None

    bos_id = tid("bos_token", "bos_token_id")
    eos_id = tid("eos_token", "eos_token_id")
    add_bos = bool(tc.get("add_bos_token", False))
    if add_bos and bos_id is None:
        _fail(folder, "tokenizer_config.json: add_bos_token is true but there is no bos_token")
    eos_ids = {eos_id} if eos_id is not None else set()
    for src in (cfg.get("eos_token_id"), gc.get("eos_token_id")):
        for v in (src if isinstance(src, list) else [src]):
            if isinstance(v, int) and 0 <= v < n:
                eos_ids.add(v)
    for text in _EOG_TEXTS:
        i = vocab.get(text)
        if i is not None and i < n and tt[i] in (CONTROL, USER_DEFINED):
            eos_ids.add(i)
    tmpl = None
    if (folder / "chat_template.jinja").exists():
        tmpl = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    else:
        ct = tc.get("chat_template")
        if isinstance(ct, list):  # [{"name": "default", "template": ...}, ...]
            ct = next((c.get("template") for c in ct if c.get("name") == "default"), None)
        tmpl = ct if isinstance(ct, str) else None
    return Tokenizer(hf, tokens, tt, kind, None, bos_id, eos_id, eos_ids, add_bos, tmpl, folder.name)


def is_folder(path) -> bool:
    """True when ``path`` is a directory (``coli run -m DIR``)."""
    return os.path.isdir(path)
