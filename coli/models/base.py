"""What every family shares: its hyper-parameters (:class:`BaseArgs`), its weights (:class:`Weights`), the
per-layer caches (:class:`Cache`) and the model around the decoder layers (:class:`Model`: embedding, the layer
loop, output norm and head, the rope tables, the activation mode).

A family file (``coli/models/<arch>.py``) writes its decoder layer top to bottom from the blocks of
``coli/models/blocks.py`` and a ``Model`` subclass with ``make_layer``; docs/families.md "Layer blocks".
Shapes: hidden rows ``h`` f32 [T, D].
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coli import finite
from coli.base.errors import ColiError
from coli.gguf_file import GGUFModel, drop_pages
from coli.vulkan import DeviceLost, VulkanError
from cpu_kernels import experts as grouped
from cpu_kernels import formats
from cpu_kernels.decode import TokenDecode
from cpu_kernels.decode_moe import MoETokenDecode
from cpu_kernels.decode_rows import RowsDecode
from cpu_kernels.embed import rows as embed_rows
from cpu_kernels.norms import rms_norm

from . import rope_scaling
from .blocks import KV, Attention, Rows, any_rows, below_one
from .rope_scaling import RopeScaling


def need_key(g, key: str):
    """The value of metadata ``<arch>.<key>`` of file ``g``; ColiError naming the file and the key when absent."""
    v = g.get(f"{g.arch}.{key}")
    if v is None:
        raise ColiError(f"{g.path.name}: metadata '{g.arch}.{key}' is missing")
    return v


@dataclass
class BaseArgs:
    """Hyper-parameters common to the families (GGUF keys ``<arch>.*``; llama.cpp's ``llama_hparams``)."""

    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    rope_base: float
    n_rot: int
    ctx_train: int
    vocab: int
    n_experts: int = 0
    top_k: int = 0
    norm_topk: bool = True
    sliding_window: int = 0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    #: the KV cache's (K, V) types (``--cache-type-k/-v``; cpu_kernels/kvcache.py): the engine sets them
    kv_types: tuple = ("f32", "f32")

    @classmethod
    def from_gguf(cls, g, **overrides):
        a = g.arch

        def need(key):
            return need_key(g, key)

        n_heads = int(need("attention.head_count"))
        d = int(need("embedding_length"))
        n_layers = int(need("block_count"))
        ctx_train = int(need("context_length"))  # required, as llama.cpp's loader: no silent default
        for key, v in (("attention.head_count", n_heads), ("embedding_length", d), ("block_count", n_layers),
                       ("context_length", ctx_train)):
            if v <= 0:
                raise below_one(g, key)
        n_kv = g.get(f"{a}.attention.head_count_kv", n_heads)
        if isinstance(n_kv, (list, np.ndarray)):
            n_kv = int(n_kv[0])
        head_dim = int(g.get(f"{a}.attention.key_length", d // n_heads))
        tok = g.tensors.get("token_embd.weight")
        vocab = int(g.get(f"{a}.vocab_size", tok.shape[0] if tok is not None else 0))
        kw = dict(
            arch=a,
            n_layers=n_layers,
            d_model=d,
            n_heads=n_heads,
            n_kv_heads=int(n_kv),
            head_dim=head_dim,
            eps=float(g.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_base=float(g.get(f"{a}.rope.freq_base", 10000.0)),
            n_rot=int(g.get(f"{a}.rope.dimension_count", head_dim)),
            ctx_train=ctx_train,
            vocab=vocab,
            n_experts=int(g.get(f"{a}.expert_count", 0) or 0),
            top_k=int(g.get(f"{a}.expert_used_count", 0) or 0),
            sliding_window=int(g.get(f"{a}.attention.sliding_window", 0) or 0),
        )
        if not kw["rope_base"] > 0:  # a base of 0, below 0 or NaN made NaN rotations: NaN logits, no error
            raise ColiError(f"{g.path.name}: metadata '{a}.rope.freq_base': {kw['rope_base']:g} (must be above 0)")
        n_rot = overrides.get("n_rot", kw["n_rot"])
        kw["rope_scaling"] = rope_scaling.from_gguf(g, n_rot)  # ColiError for a key coli does not implement
        norm = g.get(f"{a}.expert_weights_norm")
        if norm is not None:
            kw["norm_topk"] = bool(norm)
        kw.update(overrides)
        if norm is not None:
            kw["norm_topk"] = bool(norm)
        if kw["n_experts"] > 0 and not 1 <= kw["top_k"] <= kw["n_experts"]:  # llama.cpp asserts the same
            raise ColiError(f"{g.path.name}: metadata '{a}.expert_used_count' is "
                            f"{g.get(f'{a}.expert_used_count', 'missing')}: a MoE file with "
                            f"{kw['n_experts']} experts needs 1 to {kw['n_experts']} experts per token")
        return cls(**kw)


class Weights:
    """The model's tensors by GGUF name (a ``GGUFModel`` or a ``coli.hf_folder.HFModel``): ``w`` prepared for the
    matmul kernels (``cpu_kernels.formats.prepare``), ``f32`` dequantized through the format's NumPy reference.
    A missing required tensor or an unsupported type is a ColiError naming the file and the tensor."""

    def __init__(self, g, tiles: bool | None = None):
        self.g = g
        self.tiles = tiles  # formats.prepare's layout choice (the engine's activation mode decides it)
        self.t = g.tensors
        self.fname = g.path.name
        _refuse_nvfp4_scales(self.t, self.fname)
        #: tensors whose values were copied or repacked into arrays of their own (none of the file's mapping):
        #: their file pages can be given back once the model is loaded (``Model.drop_file_pages``)
        self.copied: set = set()

    def has(self, name: str) -> bool:
        return name in self.t

    def info(self, name: str):
        ti = self.t.get(name)
        if ti is None:
            raise ColiError(f"{self.fname}: tensor '{name}' is missing")
        return ti

    def prepare(self, ti, raw=None, shape=None):
        """``ti`` (a TensorInfo) prepared for the kernels (``raw``/``shape``: a row slice of it instead); a
        ColiError naming the file and the tensor for an unsupported type and for a NaN or infinity in its values
        or block scales (``coli.finite``)."""
        try:
            w = formats.prepare(ti.type_name, ti.raw if raw is None else raw,
                                tuple(ti.shape if shape is None else shape), tiles=self.tiles)
        except ColiError as e:
            raise ColiError(f"{self.fname}: tensor '{ti.name}': {e}") from None
        finite.check_weight(w, f"{self.fname}: tensor '{ti.name}'")
        if not any(np.may_share_memory(a, ti.raw) for a in w.arrays):
            self.copied.add(ti.name)
        return w

    def w(self, name: str):
        """The weight ``name`` [O, I] prepared for ``formats.matmul`` / the grouped kernels."""
        return self.prepare(self.info(name))

    def opt_w(self, name: str):
        return self.w(name) if name in self.t else None

    def f32(self, name: str, required: bool = True):
        """Tensor ``name`` as f32 of its GGUF shape (None when absent and not ``required``); ColiError naming
        the file and the tensor when it holds a NaN or an infinity (``coli.finite``). Always a writable array of
        its own (an F32 tensor is copied out of the mapped file): Numba types a read-only array apart from a
        writable one, so a kernel handed both would compile twice (docs/cpu_kernels.md, "Compile time")."""
        ti = self.t.get(name)
        if ti is None:
            if required:
                raise ColiError(f"{self.fname}: tensor '{name}' is missing")
            return None
        if ti.type_name == "F32":
            out = np.array(ti.raw.view(np.float32).reshape(ti.shape), dtype=np.float32, copy=True)
        else:
            raw = ti.raw.reshape(1, -1) if ti.raw.ndim == 1 else ti.raw.reshape(-1, ti.raw.shape[-1])
            try:
                out = dequantize(ti.type_name, raw, ti.shape[-1]).reshape(ti.shape)
            except ColiError as e:
                raise ColiError(f"{self.fname}: tensor '{name}': {e}") from None
        finite.check_array(out, f"{self.fname}: tensor '{name}'")
        self.copied.add(name)
        return out


def _refuse_nvfp4_scales(tensors, fname: str) -> None:
    """ColiError when an NVFP4 weight ``X.weight`` has a companion ``X.scale``: the per-tensor (per-expert for
    ``*_exps``) f32 scale that llama.cpp's converter writes for ModelOpt/compressed-tensors NVFP4 checkpoints
    (``weight_scale_2``) and multiplies into the matmul's output (llama.cpp ``build_lora_mm``'s ``w_s``). coli
    does not apply it, so such a file is refused rather than run with wrong outputs. (``X.input_scale``, the
    activation scale of FP4 activations, is loaded but not used by llama.cpp either, and is ignored.)"""
    for name, ti in tensors.items():
        if ti.type_name == "NVFP4" and name.endswith(".weight") and name[:-7] + ".scale" in tensors:
            raise ColiError(f"{fname}: tensor '{name[:-7]}.scale': a per-tensor scale of the NVFP4 weight "
                            f"'{name}' (llama.cpp's NVFP4 scale_2, from an NVFP4 checkpoint); coli does not apply "
                            "these scales yet (docs/formats.md, NVFP4)")


def dequantize(type_name: str, raw: np.ndarray, cols: int) -> np.ndarray:
    """Rows of GGUF type ``type_name`` (raw bytes [R, row bytes]) as f32 [R, cols] (the format's reference)."""
    fmt = formats.FORMATS.get(type_name)
    if fmt is None:
        raise ColiError(f"tensor type {type_name} is not supported")
    return fmt.reference(raw, (raw.shape[0], cols)).astype(np.float32, copy=False)


def matmul(w, x: np.ndarray, act: str, invariant: bool = False) -> np.ndarray:
    """``formats.matmul(w, x, act)`` (x f32 [T, I] -> f32 [T, O]); with ``invariant`` a weight :func:`any_rows`
    takes runs the grouped kernels at every T (as t16 weights always do there), so row t of the result is the
    GEMV's (T = 1) row bit for bit."""
    if invariant and w.layout != "t16" and any_rows(w, act, True):
        if w._group is None:
            w._group = grouped.Group([w])
        return w._group(grouped.Act(np.ascontiguousarray(x.reshape(-1, w.shape[1]), dtype=np.float32), act))
    return formats.matmul(w, x, act=act)


class Cache:
    """The per-layer caches of one sequence: ``layers[il]`` is what layer ``il``'s ``new_cache`` made (a
    ``blocks.KV`` for attention, a recurrent state for DeltaNet...), ``ctx`` positions, ``pos`` the next one.
    ``rewindable``: ``pos`` may move back (every layer cache is indexed by position), so the engine can keep a
    common prefix across calls; a recurrent state cannot be rewound."""

    def __init__(self, layers: list, ctx: int):
        self.layers = layers
        self.ctx = ctx
        self.pos = 0
        self.rewindable = all(getattr(c, "rewindable", False) for c in layers)
        #: the sliding-window layers' caches (``blocks.KV`` with a ``window``), by layer index
        self.windowed = [(il, c) for il, c in enumerate(layers) if getattr(c, "window", 0) > 0]

    def resumes_at(self, pos: int) -> bool:
        """Whether a forward may start at ``pos`` after positions past it were computed (``pos`` moved back, or a
        prefix of ``pos`` rows copied from this cache): rewindable, and every window's layer still holds the keys
        a row at ``pos`` reads (``blocks.KV.resumes_at``)."""
        return self.rewindable and all(c.resumes_at(pos) for _, c in self.windowed)

    def slide(self, pos0: int, stop: int | None = None) -> None:
        """A forward from ``pos0`` runs layers ``0 .. stop-1`` on the CPU (all with None): their window caches give
        back the rows no row from ``pos0`` on reads (``blocks.KV.slide``)."""
        for il, c in self.windowed:
            if stop is None or il < stop:
                c.slide(pos0)

    #: ``on_write(cache, end)``, called before rows up to position ``end`` are written (the engine's RAM ledger:
    #: ``coli.runtime.new_cache``); None: nobody counts this cache's bytes
    on_write = None

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers)

    def resident_bytes(self, end: int) -> int:
        """Bytes the caches hold once positions ``0 .. end-1`` are written: a layer cache's ``resident_bytes``
        (``blocks.KV``: the pages those rows commit), else all of its ``nbytes`` (a recurrent state, a latent or
        compressed cache: counted whole)."""
        return sum(c.resident_bytes(end) if hasattr(c, "resident_bytes") else c.nbytes() for c in self.layers)

    def will_write(self, end: int) -> None:
        """Rows up to position ``end`` (exclusive) are about to be written: tell ``on_write``."""
        if self.on_write is not None:
            self.on_write(self, min(int(end), self.ctx))

    #: ``on_give_back(cache, end)``, called after the pages of positions ``end ..`` went back (the RAM ledger
    #: lowers what it counts: ``coli.runtime.new_cache``); None: nobody counts
    on_give_back = None

    def pageable(self) -> bool:
        """Whether every layer cache holds its rows by position in arrays whose pages can be given back
        (``blocks.KV``, MLA's latent cache): the paged KV cells of ``coli.kv_blocks``. ``Model.pageable`` answers
        it from the layers, without a cache."""
        return all(hasattr(c, "give_back") for c in self.layers)

    def give_back(self, end: int) -> None:
        """The pages of positions ``end ..`` of every layer go back to the kernel (they read as zeros; ``pos``
        is moved back to ``end`` if past it), then ``on_give_back`` is told."""
        for c in self.layers:
            c.give_back(end)
        self.pos = min(self.pos, int(end))
        if self.on_give_back is not None:
            self.on_give_back(self, int(end))


class Model:
    """A decoder-only model over a ``GGUFModel``: embedding, ``layers`` (the family's decoder layers, made by
    ``make_layer(il)``), output norm and head.

    A decoder layer is an object with ``__call__(h, layer_cache, pos0) -> h`` (h f32 [T, D]), ``new_cache(ctx)``,
    ``pageable`` (whether that cache can be paged: :meth:`pageable`) and ``moe`` (a ``blocks.MoE`` or None).
    ``act``: "f32" | "int8" (the CPU activation mode, docs/cpu_kernels.md); ``step``: the
    ``scheduler.step.MoEStep`` the engine attaches for MoE files.
    """

    embed_scale = 0.0
    #: the KV cache types the family's caches take (``--cache-type-k/-v``); the latent (MLA) and compressed
    #: caches are f32 only
    KV_TYPES = ("f32", "f16", "bf16", "q8_0")
    #: what those caches are, for the error naming a type they do not take
    KV_WHAT = "its caches"
    #: ``coli.vulkan.device_layers.DeviceLayers`` when the last layers run on the device (the engine sets it)
    device_layers = None

    def __init__(self, g, args: BaseArgs, step=None, act: str = "f32", invariant: bool = False):
        self.g = g
        # --batch-invariant: every int8 matmul on the grouped kernels at every row count (any_rows)
        self.invariant = invariant
        self.args = args
        self.step = step
        self.act = act
        self.wt = Weights(g, tiles=act == "int8")
        self.t = g.tensors
        self.tok_embd = self.wt.info("token_embd.weight")
        self.w_out = self.wt.prepare(self.t.get("output.weight", self.tok_embd))
        self.out_norm = self.wt.f32("output_norm.weight")
        self._ctx = 0
        self._ropes: dict = {}
        self.check_shapes()
        self.layers = [self.make_layer(il) for il in range(args.n_layers)]
        # a dense model's decode row (or a MoE model's, every layer MoE) through every layer in one compiled call
        # (None: the layers one by one), with the output head in the same call where it can (token_head)
        self.token_dec = TokenDecode.of(self.layers) or MoETokenDecode.of(self.layers)
        self.token_head = self.token_dec is not None and self.token_dec.set_head(self.w_out, self.out_norm,
                                                                                  args.eps)
        # a step of several sequences' decode rows (coli serve's slots) through the same region with N-row scratch
        self.rows_dec = RowsDecode.of(self.token_dec)
        self.moe_layers = [il for il, L in enumerate(self.layers) if getattr(L, "moe", None) is not None]
        self.dense_bytes = sum(t.nbytes for n, t in self.t.items() if "_exps" not in n)
        #: bytes of the file's pages given back after the load (:meth:`drop_file_pages`)
        self.dropped_bytes = 0

    #: tensors read from the file's mapping at every token, never given back (the embedding's rows)
    READ_MAPPED = ("token_embd.weight",)

    def drop_file_pages(self) -> int:
        """Give back the file pages of the dense tensors that the load copied or repacked into RAM
        (``Weights.copied``, less ``READ_MAPPED``; ``coli.gguf_file.drop_pages``): the load read them through the
        mapping, so they sat in the resident set beside their repacked copy (docs/engine.md "Memory"). Returns
        the bytes advised (``dropped_bytes``, cumulative); 0 for a model that is not one mapped GGUF file."""
        if not isinstance(self.g, GGUFModel):
            return 0
        names = sorted(n for n in self.wt.copied if n not in self.READ_MAPPED and n in self.t)
        if names:
            self.dropped_bytes += drop_pages(self.g, names)
        return self.dropped_bytes

    # Tensors whose GGUF ne0 (inputs; NumPy shape[-1]) or ne1 (outputs; shape[-2], the row count of a 1-D bias
    # or norm) is the model width ``embedding_length`` in every family (llama.cpp's create_tensor shapes).
    D_IN = ("token_embd.weight", "output.weight", "output_norm.weight", "attn_norm.weight", "ffn_norm.weight",
            "post_attention_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q_a.weight",
            "attn_kv_a_mqa.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight",
            "ffn_up_shexp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_gate.weight", "ffn_up.weight",
            "attn_output.bias", "ffn_down_exps.bias")
    D_OUT = ("attn_output.weight", "ffn_down.weight", "ffn_down_shexp.weight", "ffn_down_exps.weight")

    def check_shapes(self):
        """Before any layer loads: each tensor of ``D_IN`` / ``D_OUT`` against ``embedding_length``, each
        ``X.bias`` against ``X.weight``'s rows, ``ffn_gate_inp`` and ``exp_probs_b`` against ``expert_count``.
        ColiError naming the tensor (not a NumPy broadcast error mid-prompt)."""
        a, fname = self.args, self.wt.fname

        def bad(name, shape, want):
            raise ColiError(f"{fname}: tensor '{name}' has shape {list(shape)} (NumPy order), expected {want}")

        for name, ti in self.t.items():
            shape = tuple(int(x) for x in ti.shape)
            base = name.split(".", 2)[-1] if name.startswith("blk.") else name
            if base in self.D_IN and shape[-1] != a.d_model:
                bad(name, shape, f"{a.d_model} columns (embedding_length)")
            if base in self.D_OUT and (len(shape) < 2 or shape[-2] != a.d_model):
                bad(name, shape, f"{a.d_model} rows (embedding_length)")
            if a.n_experts and base in ("ffn_gate_inp.weight", "ffn_gate_inp.bias", "exp_probs_b.bias") \
                    and (shape[0] if base == "ffn_gate_inp.weight" and len(shape) == 2 else shape[-1]) != a.n_experts:
                bad(name, shape, f"{a.n_experts} experts (expert_count)")
            if base in ("ffn_down.weight", "ffn_down_shexp.weight"):  # its inputs are ffn_up's rows
                up = self.t.get(name.replace("ffn_down", "ffn_up"))
                if up is not None and int(up.shape[-2]) != shape[-1]:
                    bad(name, shape, f"{int(up.shape[-2])} columns (the rows of its ffn_up)")
            if name.endswith(".bias") and not base.startswith(("exp_probs_b", "attn_output", "ffn_down_exps")):
                w = self.t.get(name[:-len("bias")] + "weight")
                if w is not None and len(w.shape) >= 2 and tuple(int(x) for x in w.shape[:-1]) != shape:
                    bad(name, shape, f"{list(int(x) for x in w.shape[:-1])} (the rows of its weight)")

    @staticmethod
    def args_from(g) -> BaseArgs:
        return BaseArgs.from_gguf(g)

    def make_layer(self, il: int):
        raise NotImplementedError

    def expert_tensors(self) -> dict:
        """``{layer: (gate_exps, up_exps, down_exps)}`` TensorInfos of the MoE layers."""
        return {il: tuple(self.t[n] for n in self.layers[il].moe.tensor_names) for il in self.moe_layers}

    # -- shared helpers of the blocks --------------------------------------------------------------------
    def mm(self, w, x):
        return matmul(w, x, self.act, self.invariant)

    def grouped_rows(self, T: int) -> bool:
        """True when ``T`` rows run the grouped kernels (``cpu_kernels.experts``): up to the GEMV crossover of
        ``formats.matmul``; above it the blocked f32 GEMM measured faster (docs/cpu_kernels.md)."""
        if self.act == "int8" and grouped.HAVE_VNNI:
            return T <= formats.GEMV_I8_MAX_T
        return T <= formats.GEMV_MAX_T

    def norm_in(self, h, w):
        """A layer input: ``(x, xa)`` with x = RMSNorm(h) f32 [T, D] and xa its ``grouped.Act`` (quantized once
        for every matmul that reads x) when T rows run the grouped kernels, else ``(x, None)``."""
        if self.grouped_rows(h.shape[0]) and h.shape[1] % 32 == 0:
            return grouped.Act.rms_norm(h, w, self.args.eps, self.act)
        return rms_norm(h, w, self.args.eps), None

    def rope_table(self, base: float, scaling: RopeScaling, n_rot: int):
        """cos, sin f32 [ctx, n_rot // 2] for a rope base and scaling rule (coli/models/rope_scaling.py), built
        once per (base, rule, n_rot) and context."""
        key = (base, scaling, n_rot)
        r = self._ropes.get(key)
        if r is None or r[0].shape[0] < self._ctx:
            r = scaling.table(self._ctx, n_rot, base)
            self._ropes[key] = r
        return r

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """The embedding rows of ``ids`` f32 [T, D]; ColiError naming ``token_embd.weight`` and the token when a
        row holds a NaN or an infinity (the table is not checked whole at load: it is read row by row)."""
        ti = self.tok_embd
        got = embed_rows(ti.type_name, ti.raw, ids, ti.shape[-1])   # one compiled call (cpu_kernels/embed.py)
        if got is not None:
            h, r = got
            r = None if r < 0 else r
        else:
            h = dequantize(ti.type_name, ti.raw[ids], ti.shape[-1])
            r = finite.first_bad_row(h)
        if r is not None:
            raise ColiError(f"{self.wt.fname}: tensor '{ti.name}' has a non-finite value in row {int(ids[r])} (the "
                            "embedding of that token): the file is damaged (a NaN or infinity in a weight)")
        return h

    # -- caches ------------------------------------------------------------------------------------------
    def new_cache(self, ctx: int, rope_ctx: int = 0) -> Cache:
        """The caches of one sequence of up to ``ctx`` positions. ``rope_ctx``: positions the RoPE tables cover
        at least (the engine's context, so that a later, longer cache does not rebuild them)."""
        # the RoPE tables cover the largest cache made so far: a smaller cache made later must not shrink what an
        # older, larger one still indexes (rope_table rebuilds a table only when it is shorter than this)
        self._ctx = max(self._ctx, ctx, int(rope_ctx))
        return Cache([L.new_cache(ctx) for L in self.layers], ctx)

    def pageable(self) -> bool:
        """Whether this model's caches can be paged (``Cache.pageable`` of the caches ``new_cache`` would make),
        from each layer's ``pageable``: True where the layer's cache holds K/V or latent rows by position, False
        for a recurrent state (DeltaNet, KDA) or DeepSeek-V4's window ring and compressed states."""
        return all(L.pageable for L in self.layers)

    @classmethod
    def cache_bytes(cls, args: BaseArgs, ctx: int) -> int:
        """Bytes of the caches at ``ctx`` positions, from the hyper-parameters alone (the engine sizes the
        default context by it before loading; ``coli plan`` shows it): here K and V [n_kv_heads, ctx,
        head_dim] per layer of the types ``args.kv_types`` (``blocks.KV.bytes_per_position``). A family with other caches (recurrent state, MLA latent)
        overrides it."""
        return args.n_layers * int(ctx) * KV.bytes_per_position(args.n_kv_heads, args.head_dim, types=args.kv_types)

    @classmethod
    def scratch_bytes(cls, args: BaseArgs, ctx: int) -> int:
        """Bytes of scratch a prompt step of a ``ctx``-position run may hold beyond the :func:`coli.runtime.headroom`,
        from the hyper-parameters alone (the engine and ``coli plan`` take it out of the memory budget): 0 here;
        a family with MLA layers counts their expanded form's keys and values (``mla.expand_scratch_bytes``)."""
        return 0

    # -- forward -----------------------------------------------------------------------------------------
    def forward(self, ids, cache: Cache, all_logits: bool = False) -> np.ndarray:
        """Run ``ids`` (int [T]) at positions ``cache.pos ..``; returns logits f32 [T or 1, vocab]. ColiError
        when the tokens do not fit the cache's context."""
        ids = np.asarray(ids, dtype=np.int64)
        T = len(ids)
        pos0 = cache.pos
        if pos0 + T > cache.ctx:
            raise ColiError(f"context: {pos0 + T} tokens do not fit the context of {cache.ctx} (--ctx)")
        dl = self.device_layers
        cache.slide(pos0, dl.first if dl is not None else None)
        cache.will_write(pos0 + T)
        h = self.embed(ids)
        if self.embed_scale:
            h *= np.float32(self.embed_scale)
        lg, done = None, False
        if T == 1 and self.token_dec is not None and dl is None:   # not with device layers: they take the last layers
            # every layer and (token_head) the head in one compiled call: the same kernels, the same bits
            lg = np.empty((1, self.token_dec.vocab), np.float32) if self.token_head else None
            done = self.token_dec(h, cache, pos0, lg)
        if dl is not None:
            dl.note_forward(cache, pos0)
        if not done:
            lg = None
            stop = dl.first if dl is not None else len(self.layers)
            for L, c in zip(self.layers[:stop], cache.layers):
                h = L(h, c, pos0)
            if stop < len(self.layers):
                h, lg = self._device_layers(h, cache, pos0, all_logits)
        if self.step is not None and self.step.usage is not None and self.moe_layers:
            self.step.usage.add_tokens(T)
        cache.pos = pos0 + T
        if lg is not None:
            return lg
        if not all_logits:
            h = h[-1:]
        return self.head(h)

    def batches_rows(self) -> bool:
        """True when :meth:`forward_rows` runs several sequences' rows as one step: every layer is one whose
        only per-sequence part is ``blocks.Attention`` (``many_rows``) over a ``blocks.KV`` cache, the family
        keeps this class's ``forward``, and no layer runs on the device. Else ``forward_rows`` runs the
        sequences one after the other (the same results, no sharing of the weights' reads)."""
        return (type(self).forward is Model.forward and self.device_layers is None
                and all(getattr(L, "many_rows", False) and type(L.attn).__call__ is Attention.__call__
                        for L in self.layers))

    def forward_rows(self, parts) -> list:
        """One step over the rows of several sequences: ``parts`` ``[(ids int [T_i], cache)]``, each sequence's
        ids at its positions ``cache.pos ..``; returns each one's last-row logits f32 [1, vocab] and advances
        each cache. The rows run through every matmul and MoE step together (an expert is read once for all of
        them), attention per sequence on its own cache (``blocks.Rows``); a row's logits are the bits it gets
        in :meth:`forward` alone (docs/engine.md "Batch invariance"), which ``tests/server/test_slots.py`` checks.
        ColiError when a sequence does not fit its cache."""
        if len(parts) == 1 or not self.batches_rows():
            return [self.forward(ids, c) for ids, c in parts]
        ids_all, spans, a = [], [], 0
        for ids, c in parts:
            ids = np.asarray(ids, dtype=np.int64)
            if c.pos + len(ids) > c.ctx:
                raise ColiError(f"context: {c.pos + len(ids)} tokens do not fit the context of {c.ctx} (--ctx)")
            c.slide(c.pos)
            c.will_write(c.pos + len(ids))
            ids_all.append(ids)
            spans.append((a, a + len(ids)))
            a += len(ids)
        h = self.embed(np.concatenate(ids_all))
        if self.embed_scale:
            h *= np.float32(self.embed_scale)
        if a == len(parts) and self.rows_dec is not None:   # decode rows only: one compiled call (decode_rows)
            lg = np.empty((a, self.rows_dec.tok.vocab), np.float32) if self.token_head else None
            if self.rows_dec(h, [c for _, c in parts], lg):
                if self.step is not None and self.step.usage is not None and self.moe_layers:
                    self.step.usage.add_tokens(a)
                for _, c in parts:
                    c.pos += 1
                if lg is None:
                    lg = self.head(h)
                return [lg[i:i + 1] for i in range(a)]
        for il, L in enumerate(self.layers):
            h = L(h, Rows([(c.layers[il], c.pos, s, e) for (_, c), (s, e) in zip(parts, spans)]), 0)
        if self.step is not None and self.step.usage is not None and self.moe_layers:
            self.step.usage.add_tokens(a)
        for (ids, c), (s, e) in zip(parts, spans):
            c.pos += e - s
        lg = self.head(np.ascontiguousarray(h[[e - 1 for _, e in spans]]))
        return [lg[i:i + 1] for i in range(len(parts))]

    def _device_layers(self, h, cache: Cache, pos0: int, all_logits: bool = False):
        """Layers ``device_layers.first ..`` of rows ``h`` on the device (a decode row, or a prompt chunk's rows):
        ``(h, logits or None)`` (the logits when the head ran there too: one row, or every row with
        ``all_logits``). When the device fails: one line on stderr, the device layers off, the K/V rows only the
        device held computed again on the CPU, and these rows' layers on the CPU (DESIGN invariant 3: never a
        wrong token)."""
        dl = self.device_layers
        try:
            if len(h) == 1:
                return dl(h, cache, pos0)
            return dl.prompt(h, cache, pos0, all_logits)
        except (DeviceLost, VulkanError) as e:
            import sys

            print(f"[VK] {self.wt.fname}: device layers failed ({e}); the CPU runs every layer from now on",
                  file=sys.stderr, flush=True)
            self.device_layers = None
        dl.recompute_on_cpu(cache, pos0)
        for L, c in zip(self.layers[dl.first:], cache.layers[dl.first:]):
            h = L(h, c, pos0)
        return h, None

    def head(self, h: np.ndarray) -> np.ndarray:
        """Logits f32 [T, vocab] of the last hidden rows ``h`` f32 [T, D]: output norm, then ``output``. A row of
        ``h`` holding a NaN or an infinity gives a row of NaN logits: int8 activations would round it to finite
        codes (normal-looking logits), and the engine reports NaN logits (``coli.sampling``: a ColiError when
        none is finite)."""
        bad = ~np.isfinite(h).all(axis=1)
        lg = self.mm(self.w_out, rms_norm(h, self.out_norm, self.args.eps))
        if bad.any():
            lg[bad] = np.nan
        return lg
