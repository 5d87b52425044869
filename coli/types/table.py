"""The tensor-type table: one row per GGUF tensor type, the key every backend's registry is checked against.

Modelled on ggml's ``type_traits`` (``ggml/src/ggml.c``): per type, the geometry, the reference decoder and which
backends implement it. Columns:

* ``block_size`` (weights per block), ``type_size`` (bytes per block): from ``gguf.constants.GGML_QUANT_SIZES``
  (ggml's ``ggml_type_traits``), never typed here.
* ``reference(raw uint8 [O, row_bytes], (O, I)) -> f32 [O, I]``: the NumPy decoder, ``gguf.quants.dequantize``
  (mirrors ggml-quants.c ``dequantize_row_*``); None where gguf has none.
* ``quantizable``: ``gguf.quants.quantize`` can produce real blocks of the type (test weights use them).
* ``scale_offsets``: byte offsets of the f16 scales inside a block (``d``, ``dmin``; ggml-common.h ``block_*``
  structs), so ``random_blocks`` can make valid random blocks of a type gguf cannot quantize.
* ``shader``: suffix of the device decoder ``shaders/fmt_<shader>.glsl`` and of its .spv names.
* ``cpu_only``: the reason the device tier lacks the type on purpose (None: every backend must have it).
* ``backends``: filled by the backends' registries when they are imported (``register``): backend name ->
  what implements the type there (``"cpu"``: the ``cpu_kernels.formats.FORMATS`` row's kernels; ``"vulkan"``:
  the decoder file); importing ``cpu_kernels.formats`` and ``coli.vulkan.shaders`` fills it. ``gaps()`` lists a type one backend has and
  another lacks without a ``cpu_only`` reason (``tests/kernels/test_backend_ops.py`` fails on any).

coli's own types (``own`` set, ``qtype`` None: ``FP8_E4M3_B128``, made from FP8 Hugging Face checkpoints) are
rows too, added by ``_own_rows`` with their geometry, reference and ``random`` test-weight maker. GGUF types that
gguf.quants decodes but cannot quantize get a ``random`` maker where coli ports ggml's quantizer (NVFP4:
``coli/types/nvfp4.py``), so their test weights are real blocks too.

Adding a format: the checklist in docs/formats.md ("Adding a format"). Here: nothing for a GGUF type unless gguf
cannot quantize it and it has f16 scales (``_SCALES``); a type of coli's own gets a row in ``_own_rows``; one the
device lacks on purpose ``CPU_ONLY[name] = reason``.

Importing this module imports neither numba nor vulkan.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES

from coli.base.errors import ColiError
from coli.types import fp8_blocks as fb, nvfp4

#: Backends the table knows, in the order of the coverage table.
BACKENDS = ("cpu", "vulkan")

#: Types the device tier lacks on purpose: name -> reason. ``gaps()`` flags a mark the device has outgrown.
CPU_ONLY: dict[str, str] = {}

# Byte offsets of the f16 scales in one block (ggml-common.h): d first, then dmin where the type has one.
_SCALES: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "TQ1_0": (52,), "TQ2_0": (64,),
}


def _quantizable(qt: QT) -> bool:
    if qt in (QT.F32, QT.F16):
        return True
    cls = gq._type_traits.get(qt)
    if cls is None:
        return False
    base = cls.__mro__[1]   # gguf.quants.__Quant: quantize_blocks there raises NotImplementedError
    return cls.quantize_blocks.__func__ is not base.quantize_blocks.__func__


def _make_reference(qt: QT) -> Callable | None:
    if qt not in (QT.F32, QT.F16) and qt not in gq._type_traits:
        return None

    def reference(raw: np.ndarray, shape) -> np.ndarray:
        O, I = int(shape[0]), int(shape[1])
        raw = np.ascontiguousarray(raw)
        if qt == QT.F32:
            return raw.view(np.float32).reshape(O, I).copy()
        return np.asarray(gq.dequantize(raw, qt), np.float32).reshape(O, I)

    reference.__doc__ = (f"gguf.quants.dequantize(raw uint8 [O, row_bytes], {qt.name}) -> f32 [O, I] "
                         f"(ggml-quants.c dequantize_row_{qt.name.lower()}).")
    return reference


@dataclass
class TensorType:
    """One GGUF tensor type (see the module docstring for the columns)."""

    name: str
    qtype: QT
    block_size: int
    type_size: int
    reference: Callable | None
    quantizable: bool
    scale_offsets: tuple[int, ...]
    shader: str
    cpu_only: str | None
    backends: dict[str, str] = field(default_factory=dict)
    own: str | None = None         # coli's own type (qtype None, no GGUF id): what it is and where it comes from
    random: Callable | None = None  # own types, ported quantizers: random_blocks(O, I, rng, scale) (test weights)

    def row_bytes(self, inner: int) -> int:
        """Bytes of one row of ``inner`` weights. Raises ColiError when ``inner`` is not whole blocks."""
        if inner % self.block_size:
            raise ColiError(f"{self.name}: inner size {inner} is not a multiple of the block size {self.block_size}")
        return inner // self.block_size * self.type_size


#: Every type gguf knows (``GGML_QUANT_SIZES``), by GGUF type name.
TYPES: dict[str, TensorType] = {
    qt.name: TensorType(qt.name, qt, bs, ts, _make_reference(qt), _quantizable(qt), _SCALES.get(qt.name, ()),
                        qt.name.lower(), CPU_ONLY.get(qt.name))
    for qt, (bs, ts) in GGML_QUANT_SIZES.items()
}


# coli's own types: formats coli's loaders make from other checkpoints, never found in a GGUF file.
def _own_rows() -> dict[str, TensorType]:
    return {fb.NAME: TensorType(fb.NAME, None, fb.BLOCK, fb.TYPE_SIZE, fb.reference, False, (), fb.NAME.lower(),
                                CPU_ONLY.get(fb.NAME), own="E4M3 weights with an f32 scale per 128x128 block, from FP8 "
                                "Hugging Face checkpoints (coli/hf_folder.py; layout in coli/types/fp8_blocks.py)",
                                random=fb.random_blocks)}


TYPES.update(_own_rows())


# GGUF types gguf.quants decodes but cannot quantize, for which coli ports ggml's quantizer: their test weights
# (``random``) are real blocks, as for the types gguf quantizes.
def _ported_quantizers() -> None:
    TYPES["NVFP4"].random = nvfp4.random_blocks   # ggml quantize_row_nvfp4_ref


_ported_quantizers()


def get(name: str) -> TensorType:
    """The row of GGUF type ``name``. Raises ColiError naming it when gguf does not know it."""
    t = TYPES.get(name)
    if t is None:
        raise ColiError(f"tensor type {name!r}: not a GGUF type gguf {_gguf_version()} knows")
    return t


def _gguf_version() -> str:
    try:
        return version("gguf")
    except Exception:  # pragma: no cover - metadata missing in an odd install
        return "(unknown version)"


def register(backend: str, name: str, what: str) -> None:
    """Called by a backend's registry for each type it implements: fills the ``backends`` column."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (known: {BACKENDS})")
    get(name).backends[backend] = what


def gaps(types: dict[str, TensorType] | None = None) -> list[tuple[str, str]]:
    """(type, backend) pairs where some backend implements the type and this one does not, and the table gives
    no reason (``cpu_only`` excuses every backend but "cpu"); and (type, "cpu_only") where a type marked CPU only
    has a device implementation after all (the mark is stale)."""
    out = []
    for t in (TYPES if types is None else types).values():
        if not t.backends:
            continue
        for b in BACKENDS:
            if b in t.backends:
                if b != "cpu" and t.cpu_only:
                    out.append((t.name, "cpu_only"))
                continue
            if b != "cpu" and t.cpu_only:
                continue
            out.append((t.name, b))
    return out


def random_blocks(name: str, O: int, I: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Test weights of type ``name``: uint8 [O, row_bytes].

    Where gguf can quantize the type: ``gguf.quants.quantize`` of normal floats times ``scale`` (real blocks);
    the row's ``random`` maker where it has one (coli's own types; NVFP4: ggml's quantizer ported, real blocks).
    Elsewhere: random bytes with every f16 scale (``scale_offsets``) set to a finite value in
    [0.002, 0.02) * scale, so every code, sub-block scale and sign pattern is exercised and the decoded values
    stay finite. Raises ColiError for a type with neither (no quantizer and no known scale offsets).
    """
    t = get(name)
    rb = t.row_bytes(I)
    if t.random is not None:
        return t.random(O, I, rng, scale)
    if t.quantizable:
        w = (rng.standard_normal((O, I)) * scale).astype(np.float32)
        if t.qtype == QT.F32:
            return w.view(np.uint8).reshape(O, rb)
        return np.ascontiguousarray(np.asarray(gq.quantize(w, t.qtype)).view(np.uint8).reshape(O, rb))
    nb = O * I // t.block_size
    raw = rng.integers(0, 256, size=(nb, t.type_size), dtype=np.uint8)
    if name == "IQ1_M":
        # block_iq1_m has no d field: d's 16 bits sit in the top nibbles of its four u16 scales (iq1m_scale_t)
        d = (rng.uniform(0.002, 0.02, size=nb) * scale).astype(np.float16).view(np.uint16)
        sc = np.ascontiguousarray(raw[:, 48:56]).view("<u2") & np.uint16(0x0FFF)
        for k in range(4):
            sc[:, k] |= ((d >> np.uint16(4 * k)) & np.uint16(0xF)) << np.uint16(12)
        raw[:, 48:56] = sc.view(np.uint8).reshape(nb, 8)
        return raw.reshape(O, rb)
    if not t.scale_offsets:
        raise ColiError(f"tensor type {name}: no gguf quantizer and no known scale offsets for random blocks")
    for off in t.scale_offsets:
        d = (rng.uniform(0.002, 0.02, size=nb) * scale).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(nb, 2)
    return raw.reshape(O, rb)
