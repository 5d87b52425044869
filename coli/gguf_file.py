"""Open a GGUF model file: a bounds-checked header walk, then zero-copy views of the tensor data.

Format: GGUF v2/v3 as specified in ggml's ``docs/gguf.md`` (ggml-org/ggml) and implemented by
``ggml/src/gguf.cpp`` and ``gguf-py`` (PyPI ``gguf`` 0.19.0)::

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x  (string key, u32 value_type, value)
    tensor_count x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset)
    padding to general.alignment (default 32) | tensor data (each at data_start + offset)

A string is ``u64 length`` + UTF-8 bytes; an array is ``u32 element_type, u64 count`` + elements.
All little-endian.

Why not hand the file straight to ``gguf.GGUFReader``: on a corrupt length it hangs or allocates
without bound (a 49-byte file whose uint32 array claims 2^61 elements ran for > 20 s, killed), and on real vocabularies it is slow (it builds
one field object per string: 9.4 s for Qwen2.5's 151936 tokens + 151387 merges, 17 s for Gemma-3's
262144 tokens, measured on the 2-core dev machine). So the walk below checks every length against the
bytes left in the file *and* decodes the values in the same pass; the type tables (block size, bytes
per block, type names) come from ``gguf.constants``. Tests compare the result with ``GGUFReader``.

Errors: every malformed input raises :class:`coli.base.errors.ColiError` with one line
``"<file>: <field>: <what>"`` (``header``, ``kv '<key>'``, ``tensor '<name>'``), before any large
allocation.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from .base.errors import ColiError

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4  # ggml.h
INT64_MAX = (1 << 63) - 1

# GGUF metadata value types (ggml docs/gguf.md, ``gguf_type``): id -> (name, struct format, width)
_T_STRING, _T_ARRAY, _T_BOOL = 8, 9, 7
_SCALAR = {
    0: ("uint8", "<B", 1), 1: ("int8", "<b", 1), 2: ("uint16", "<H", 2), 3: ("int16", "<h", 2),
    4: ("uint32", "<I", 4), 5: ("int32", "<i", 4), 6: ("float32", "<f", 4), 7: ("bool", "<?", 1),
    10: ("uint64", "<Q", 8), 11: ("int64", "<q", 8), 12: ("float64", "<d", 8),
}
_NP_DTYPE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
             10: "<u8", 11: "<i8", 12: "<f8"}
TYPE_NAMES = {**{k: v[0] for k, v in _SCALAR.items()}, _T_STRING: "string", _T_ARRAY: "array"}

_U32 = struct.Struct("<I").unpack_from
_U64 = struct.Struct("<Q").unpack_from


@dataclass(frozen=True, eq=False)
class TensorInfo:
    """One tensor of a GGUF file.

    * ``name``: the GGUF tensor name (``"blk.0.ffn_up.weight"``).
    * ``type_name``: the ggml type name from ``gguf.GGMLQuantizationType`` (``"Q4_K"``, ``"F32"``).
    * ``shape``: NumPy order, i.e. ggml's ``ne`` reversed: a weight ``[O, I]``, experts ``[E, O, I]``.
    * ``raw``: read-only zero-copy ``uint8`` view of the file mapping, shaped ``[*shape[:-1], row_bytes]``
      with ``row_bytes = shape[-1] // block_size * type_size`` (ggml's block layout).
    * ``offset``: absolute byte offset of the data in the file; ``nbytes``: its size in bytes.
    * ``type_id``: the ggml type number; ``n_elements``: ``prod(shape)``.
    * ``file``: the path of the shard holding the data when the model is split (``offset`` is then in that
      file), None for a single file.
    """

    name: str
    type_name: str
    shape: tuple[int, ...]
    raw: np.ndarray
    offset: int
    nbytes: int
    type_id: int = -1
    n_elements: int = 0
    file: str | None = None


@dataclass(eq=False)
class GGUFModel:
    """A validated, memory-mapped GGUF file.

    ``meta`` maps each key to a Python value: ``str`` for strings, ``int``/``float``/``bool`` for
    scalars, ``list[str]`` for string arrays (``tokenizer.ggml.tokens``/``merges``), a read-only
    ``np.ndarray`` view of the file for numeric/bool arrays (``tokenizer.ggml.token_type``/``scores``),
    and ``list`` for arrays of arrays. ``kv_types`` gives each key's GGUF value type number (an array's
    is ``(9, element_type)``). ``tensors`` keeps file order.

    A split model (llama.cpp's ``gguf-split``: ``NAME-0000i-of-0000N.gguf``) is one ``GGUFModel``: ``path`` is
    the first shard (which holds the metadata), ``shards`` every shard's path in order, ``tensors`` all of them
    (each ``TensorInfo.file`` naming its shard), ``file_size`` the shards' total bytes. ``shards`` is empty for
    a single file.
    """

    path: Path
    arch: str
    meta: dict[str, Any]
    tensors: dict[str, TensorInfo]
    version: int
    alignment: int
    data_offset: int
    file_size: int
    kv_types: dict[str, Any] = field(default_factory=dict)
    shards: list = field(default_factory=list)
    _mm: Any = field(default=None, repr=False)

    def get(self, key: str, default: Any = None) -> Any:
        """``meta[key]`` or ``default``."""
        return self.meta.get(key, default)

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """``meta[f"{arch}.{suffix}"]`` or ``default``, e.g. ``arch_get("block_count")``."""
        return self.meta.get(f"{self.arch}.{suffix}", default)

    def __repr__(self) -> str:
        return f"GGUFModel({self.path.name!r}, arch={self.arch!r}, {len(self.tensors)} tensors)"


class _Walker:
    """Bounds-checked reads from the mapping; every failure is a ColiError naming the field."""

    __slots__ = ("buf", "size", "pos", "fname")

    def __init__(self, buf, size: int, fname: str):
        self.buf, self.size, self.pos, self.fname = buf, size, 0, fname

    def fail(self, where: str, what: str):
        raise ColiError(f"{self.fname}: {where}: {what}")

    def need(self, n: int, where: str, what: str):
        if n > self.size - self.pos:
            self.fail(where, f"{what} needs {n} bytes at offset {self.pos}, but the file ends at {self.size}")

    def u32(self, where: str, what: str) -> int:
        self.need(4, where, what)
        (v,) = _U32(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, where: str, what: str) -> int:
        self.need(8, where, what)
        (v,) = _U64(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, where: str, what: str) -> str:
        n = self.u64(where, f"{what} length")
        if n > self.size - self.pos:
            self.fail(where, f"{what} length {n} is past the end of the file ({self.size - self.pos} bytes left)")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self.fail(where, f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})")


# ``<arch>.*`` keys that are numbers in every family (llama.cpp's LLM_KV table, a per-layer array allowed): a string
# there is a broken file, reported here rather than as a ValueError where a family converts it.
NUMERIC_ARCH_KEYS = frozenset((
    "block_count", "context_length", "embedding_length", "embedding_length_out", "feed_forward_length",
    "expert_feed_forward_length", "expert_shared_feed_forward_length", "expert_count", "expert_used_count",
    "expert_shared_count", "expert_weights_scale", "leading_dense_block_count", "vocab_size",
    "full_attention_interval", "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_epsilon", "attention.layer_norm_rms_epsilon",
    "attention.sliding_window", "attention.q_lora_rank", "attention.kv_lora_rank", "rope.dimension_count",
    "rope.freq_base", "rope.scaling.factor", "rope.scaling.original_context_length", "ssm.conv_kernel",
    "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size"))


def _read_value(w: _Walker, vtype: int, where: str, arr: np.ndarray, depth: int = 0):
    """Read one value of GGUF type ``vtype`` at ``w.pos``; returns (python value, type descriptor)."""
    if vtype in _SCALAR:
        _, fmt, width = _SCALAR[vtype]
        w.need(width, where, f"{TYPE_NAMES[vtype]} value")
        (v,) = struct.unpack_from(fmt, w.buf, w.pos)
        w.pos += width
        return v, vtype
    if vtype == _T_STRING:
        return w.string(where, "string"), vtype
    if vtype != _T_ARRAY:
        w.fail(where, f"value type {vtype} is not a GGUF type (0..12)")
    if depth > 8:
        w.fail(where, "arrays nested more than 8 deep")
    etype = w.u32(where, "array element type")
    count = w.u64(where, "array length")
    left = w.size - w.pos
    if etype in _SCALAR:
        width = _SCALAR[etype][2]
        if count * width > left:
            w.fail(where, f"array of {count} {TYPE_NAMES[etype]} ({count * width} bytes) "
                          f"is more than the {left} bytes left in the file")
        start = w.pos
        w.pos += count * width
        a = arr[start:start + count * width].view(_NP_DTYPE[etype])
        if etype == _T_BOOL:
            a = a.astype(bool)
        return a, (_T_ARRAY, etype)
    if etype == _T_STRING:
        if count * 8 > left:
            w.fail(where, f"array of {count} strings is more than the {left} bytes left in the file")
        return _read_strings(w, count, where), (_T_ARRAY, etype)
    if etype == _T_ARRAY:
        if count * 12 > left:  # each nested array is at least u32 type + u64 count
            w.fail(where, f"array of {count} arrays is more than the {left} bytes left in the file")
        items = []
        for _ in range(count):
            v, t = _read_value(w, _T_ARRAY, where, arr, depth + 1)
            items.append(v)
        return items, (_T_ARRAY, etype)
    w.fail(where, f"array element type {etype} is not a GGUF type (0..12)")


def _read_strings(w: _Walker, count: int, where: str) -> list[str]:
    """The hot loop for vocabularies (Qwen2.5: 151936 tokens + 151387 merges)."""
    buf, size, pos = w.buf, w.size, w.pos
    out = []
    append = out.append
    u64 = _U64
    try:
        for i in range(count):
            if pos + 8 > size:
                w.pos = pos
                w.fail(where, f"string {i} of {count}: length needs 8 bytes at offset {pos}, "
                              f"but the file ends at {size}")
            (n,) = u64(buf, pos)
            pos += 8
            end = pos + n
            if end > size:
                w.fail(where, f"string {i} of {count}: length {n} is past the end of the file "
                              f"({size - pos} bytes left)")
            append(buf[pos:end].decode("utf-8"))
            pos = end
    except UnicodeDecodeError as e:
        w.fail(where, f"string {len(out)} of {count} is not valid UTF-8 ({e.reason})")
    w.pos = pos
    return out


def _type_tables():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES, GGMLQuantizationType


# llama.cpp's split keys (``LLM_KV_SPLIT_*``) and shard names (``llama_split_path``: "%s-%05d-of-%05d.gguf")
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"


def split_path(prefix: str, no: int, count: int) -> str:
    """The path of shard ``no`` (0-based) of ``count``: ``f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"``."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def open_gguf(path) -> GGUFModel:
    """Validate and open the GGUF model at ``path``: a single file, or any shard of a split model as llama.cpp's
    ``gguf-split`` writes it (``NAME-0000i-of-0000N.gguf``; the first shard holds every metadata key plus
    ``split.no`` (u16, 0-based), ``split.count`` (u16) and ``split.tensors.count`` (i32); the others only the
    ``split.*`` keys and their tensors). Every shard is opened and checked as :func:`open_gguf_file` does; then
    each shard's ``split.count`` and ``split.no`` must match its name, no tensor may be in two shards, and the
    shards must hold ``split.tensors.count`` tensors in all (llama.cpp's loader checks the same).

    Returns a :class:`GGUFModel` (for a split model: the first shard's metadata, every shard's tensors).
    Raises :class:`ColiError` naming the file and field, or the missing or mismatched shard.
    """
    first = open_gguf_file(path, require_arch=False)
    n = first.meta.get(SPLIT_COUNT)
    if n is None or (_is_int(n) and n <= 1):  # one shard of one is a whole file (llama.cpp reads it so)
        if first.arch is None:
            raise ColiError(f"{first.path.name}: kv 'general.architecture': missing")
        return first
    return _open_split(first)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _open_split(given: GGUFModel) -> GGUFModel:
    """The shards of the split model ``given`` belongs to, as one GGUFModel (see :func:`open_gguf`)."""
    fname = given.path.name
    n, no = given.meta.get(SPLIT_COUNT), given.meta.get(SPLIT_NO)
    if not _is_int(n) or n < 1:
        raise ColiError(f"{fname}: kv '{SPLIT_COUNT}': {n!r} (the number of shards, at least 1)")
    if not _is_int(no) or not 0 <= no < n:
        raise ColiError(f"{fname}: kv '{SPLIT_NO}': {no!r} (the shard's index, 0 to {n - 1}, with {SPLIT_COUNT} {n})")
    tail = split_path("", no, n)
    full = str(given.path)
    if not full.endswith(tail) or len(full) == len(tail):
        raise ColiError(f"{fname}: shard {no + 1} of {n} (kv '{SPLIT_NO}' {no}, '{SPLIT_COUNT}' {n}), but the file "
                        f"name does not end in '{tail}', so the other shards cannot be found (llama.cpp names them "
                        "NAME-0000i-of-0000N.gguf)")
    prefix = full[:-len(tail)]
    shards: list[GGUFModel] = []
    for i in range(n):
        p = split_path(prefix, i, n)
        if i == no:
            m = given
        else:
            if not os.path.exists(p):
                raise ColiError(f"{Path(p).name}: missing: shard {i + 1} of {n} of the split model {fname} "
                                "(every shard must be in the same folder)")
            m = open_gguf_file(p, require_arch=False)
        sn, sc = m.meta.get(SPLIT_NO), m.meta.get(SPLIT_COUNT)
        if sc != n or sn != i:
            raise ColiError(f"{m.path.name}: kv '{SPLIT_NO}' {sn!r}, '{SPLIT_COUNT}' {sc!r}: expected shard "
                            f"{i} of {n} (from its name); the shard belongs to another split")
        shards.append(m)
    head = shards[0]
    if head.arch is None:
        raise ColiError(f"{head.path.name}: kv 'general.architecture': missing (the first shard holds the metadata)")
    tensors: dict[str, TensorInfo] = {}
    for m in shards:
        for name, t in m.tensors.items():
            if name in tensors:
                raise ColiError(f"{m.path.name}: tensor '{name}': also in shard {tensors[name].file}")
            tensors[name] = TensorInfo(t.name, t.type_name, t.shape, t.raw, t.offset, t.nbytes, t.type_id,
                                       t.n_elements, file=str(m.path))
    want = head.meta.get(SPLIT_TENSORS)
    if want is not None and want != len(tensors):
        raise ColiError(f"{head.path.name}: kv '{SPLIT_TENSORS}': {want!r}, but the {n} shards hold {len(tensors)} "
                        "tensors (a shard of another split, or a damaged one)")
    return GGUFModel(path=head.path, arch=head.arch, meta=head.meta, tensors=tensors, version=head.version,
                     alignment=head.alignment, data_offset=head.data_offset,
                     file_size=sum(m.file_size for m in shards), kv_types=head.kv_types,
                     shards=[m.path for m in shards], _mm=[m._mm for m in shards])


def open_gguf_file(path, require_arch: bool = True) -> GGUFModel:
    """Validate and open one GGUF file at ``path`` (memory-mapped, read-only), a shard of a split model as is.

    Checks, in file order, with every length bounded by the bytes left: magic ``GGUF``; version 2 or 3;
    ``tensor_count`` and ``kv_count`` no more than the file can hold; each key (valid UTF-8, unique);
    each value's type (0..12), string lengths, array lengths (``count * element size <= bytes left``,
    nested arrays too); ``general.alignment`` an integer, nonzero and a power of two; each tensor info:
    name (unique), ``1 <= n_dims <= 4``, every dim ``> 0``, element count within int64, type known to
    ``gguf.GGMLQuantizationType``, first dim a multiple of the type's block size, byte size
    ``elements / block_size * type_size`` within int64, offset a multiple of the alignment, and data
    ``[data_start + offset, + nbytes)`` inside the file.

    Returns a :class:`GGUFModel`. Raises :class:`ColiError` (one line naming the file and field) on a
    missing/unreadable file or any failed check.
    """
    path = Path(path)
    mm, size = _map_file(path)
    arr = np.frombuffer(mm, dtype=np.uint8)
    w = _Walker(mm, size, path.name)
    version, tensor_count, kv_count = _read_header(w)
    meta, kv_types = _read_kvs(w, kv_count, arr)
    alignment, arch = _check_meta(w, meta, kv_types)
    infos = _read_tensor_infos(w, tensor_count, alignment)
    data_offset, tensors = _tensor_views(w, infos, arr, alignment)
    if arch is None and require_arch:
        w.fail("kv 'general.architecture'", "missing")
    return GGUFModel(path=path, arch=arch, meta=meta, tensors=tensors, version=version, alignment=alignment,
                     data_offset=data_offset, file_size=size, kv_types=kv_types, _mm=mm)


def _map_file(path: Path):
    """``(mmap, size in bytes)`` of the file at ``path``, read-only; ColiError for a missing, unreadable or
    directory path, an empty file, and a file shorter than the 24-byte header (naming its magic when that is wrong
    too)."""
    fname = path.name
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise ColiError(f"{fname}: no such file ({path})") from None
    except IsADirectoryError:
        raise ColiError(f"{fname}: is a directory, not a GGUF file ({path})") from None
    except OSError as e:
        raise ColiError(f"{fname}: cannot open: {e.strerror}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:  # a failed download or copy: say so rather than print an empty magic
            raise ColiError(f"{fname}: header: the file is empty (0 bytes), not a GGUF file")
        if size < 24:
            head = f.read(4)
            if head != GGUF_MAGIC[:len(head)]:
                raise ColiError(f"{fname}: header: not a GGUF file (magic {head!r}, expected b'GGUF')")
            raise ColiError(f"{fname}: header: file is {size} bytes, shorter than the 24-byte GGUF header")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return mm, size


def _read_header(w: _Walker) -> tuple[int, int, int]:
    """``(version, tensor_count, kv_count)`` from the header at offset 0: magic, version 2 or 3 (v1 and big-endian
    files named), and a ``kv_count`` no more than the bytes left can hold. Leaves ``w`` after the header."""
    mm, size = w.buf, w.size
    magic = mm[0:4]
    if magic != GGUF_MAGIC:
        w.fail("header", f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
    w.pos = 4
    version = w.u32("header", "version")
    if version not in (2, 3):
        if version in (1,):
            w.fail("header", "GGUF version 1 is not supported (2 or 3)")
        if struct.unpack(">I", mm[4:8])[0] in (2, 3):
            w.fail("header", "big-endian GGUF is not supported")
        w.fail("header", f"version {version} is not a GGUF version (2 or 3)")
    tensor_count = w.u64("header", "tensor_count")
    kv_count = w.u64("header", "kv_count")
    # the smallest kv is 8 (key length) + 4 (type) + 1 (u8) bytes; the smallest tensor info is
    # 8 (name length) + 4 (n_dims) + 8 (one dim) + 4 (type) + 8 (offset)
    # (tensor_count is checked after the kvs, against the bytes left then)
    left = size - w.pos
    if kv_count * 13 > left:
        w.fail("header", f"kv_count {kv_count} is more than the file can hold ({left} bytes left)")
    return version, tensor_count, kv_count


def _read_kvs(w: _Walker, kv_count: int, arr: np.ndarray) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(meta, kv_types)``: the ``kv_count`` key/value pairs at ``w.pos`` (unique UTF-8 keys, known value types),
    values decoded by :func:`_read_value` (``arr``: the file as uint8, for zero-copy numeric arrays)."""
    meta: dict[str, Any] = {}
    kv_types: dict[str, Any] = {}
    for i in range(kv_count):
        key = w.string(f"kv #{i}", "key")
        where = f"kv '{key}'"
        if key in meta:
            w.fail(where, "duplicate key")
        vtype = w.u32(where, "value type")
        if vtype not in TYPE_NAMES:
            w.fail(where, f"value type {vtype} is not a GGUF type (0..12)")
        meta[key], kv_types[key] = _read_value(w, vtype, where, arr)
    return meta, kv_types


def _check_meta(w: _Walker, meta: dict, kv_types: dict) -> tuple[int, str | None]:
    """``(alignment, arch)``: ``general.alignment`` an integer power of two (default 32), ``general.architecture``
    a string when present, and the family's :data:`NUMERIC_ARCH_KEYS` numbers."""
    alignment = GGUF_DEFAULT_ALIGNMENT
    if "general.alignment" in meta:
        a = meta["general.alignment"]
        if kv_types["general.alignment"] not in (0, 1, 2, 3, 4, 5, 10, 11):
            w.fail("kv 'general.alignment'", f"type {TYPE_NAMES.get(kv_types['general.alignment'], '?')} "
                                             "is not an integer (uint32)")
        if a <= 0 or a & (a - 1):
            w.fail("kv 'general.alignment'", f"{a} is not a power of two")
        alignment = a
    arch = meta.get("general.architecture")
    if arch is not None and not isinstance(arch, str):
        w.fail("kv 'general.architecture'", f"type {TYPE_NAMES.get(kv_types['general.architecture'])}, "
                                            "expected string")
    if isinstance(arch, str):
        for key, v in meta.items():
            if key.startswith(arch + ".") and key[len(arch) + 1:] in NUMERIC_ARCH_KEYS and (
                    isinstance(v, (str, list, bool)) or (isinstance(v, np.ndarray) and v.dtype.kind not in "iuf")):
                kt = kv_types[key]
                w.fail(f"kv '{key}'", f"type {TYPE_NAMES.get(kt[1] if isinstance(kt, tuple) else kt, '?')}"
                                      f"{' array' if isinstance(kt, tuple) else ''}, expected a number "
                                      "(or numbers, one per layer)")
    return alignment, arch


def _read_tensor_infos(w: _Walker, tensor_count: int, alignment: int) -> list[tuple]:
    """The ``tensor_count`` tensor infos at ``w.pos``, checked (see :func:`open_gguf_file`): a list of ``(name,
    GGMLQuantizationType, shape in NumPy order, row bytes, data offset, nbytes, elements)``."""
    size = w.size
    left = size - w.pos
    if tensor_count * 32 > left:
        w.fail("header", f"tensor_count {tensor_count} is more than the file can hold "
                         f"({left} bytes left after the metadata)")
    quant_sizes, qtype = _type_tables()
    infos = []
    names = set()
    for i in range(tensor_count):
        name = w.string(f"tensor #{i}", "name")
        where = f"tensor '{name}'"
        if name in names:
            w.fail(where, "duplicate tensor name")
        names.add(name)
        n_dims = w.u32(where, "n_dims")
        if n_dims == 0 or n_dims > GGML_MAX_DIMS:
            w.fail(where, f"{n_dims} dimensions (at least 1, at most {GGML_MAX_DIMS})")
        ne = [w.u64(where, f"dimension {d}") for d in range(n_dims)]
        for d, n in enumerate(ne):
            if n == 0 or n > INT64_MAX:
                w.fail(where, f"dimension {d} is {n} (must be 1..2^63-1)")
        n_el = prod(ne)
        if n_el > INT64_MAX:
            w.fail(where, f"dimensions {ne} overflow int64 ({n_el} elements)")
        t = w.u32(where, "type")
        try:
            qt = qtype(t)
            block, tsize = quant_sizes[qt]
        except (ValueError, KeyError):
            w.fail(where, f"unknown ggml type {t}")
        if ne[0] % block:
            w.fail(where, f"first dimension {ne[0]} is not a multiple of the {qt.name} block size {block}")
        nbytes = n_el // block * tsize
        if nbytes > INT64_MAX:
            w.fail(where, f"{nbytes} bytes overflow int64")
        off = w.u64(where, "data offset")
        if off % alignment:
            w.fail(where, f"data offset {off} is not a multiple of the alignment {alignment}")
        infos.append((name, qt, tuple(reversed(ne)), ne[0] // block * tsize, off, nbytes, n_el))
    return infos


def _tensor_views(w: _Walker, infos: list[tuple], arr: np.ndarray, alignment: int) -> tuple[int, dict]:
    """``(data_offset, tensors)``: the data section's start (after the infos, aligned) and a :class:`TensorInfo`
    per info whose ``raw`` is a zero-copy view of ``arr``; each tensor's data inside the file and overlapping no
    other's."""
    size = w.size
    data_offset = -(-w.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, qt, shape, row_bytes, off, nbytes, n_el in infos:
        start = data_offset + off
        if start + nbytes > size:
            w.fail(f"tensor '{name}'", f"data [{start}, {start + nbytes}) is past the end of the file ({size} bytes)")
        raw = arr[start:start + nbytes].reshape(*shape[:-1], row_bytes)
        tensors[name] = TensorInfo(name, qt.name, shape, raw, start, nbytes, int(qt), n_el)
    # every tensor's bytes are its own (a type or shape changed to a bigger one would read its neighbour's data)
    spans = sorted((off, nbytes, name) for name, _qt, _s, _rb, off, nbytes, _n in infos)
    for (o1, n1, a), (o2, _n2, b) in zip(spans, spans[1:]):
        if o1 + n1 > o2:
            w.fail(f"tensor '{a}'", f"data [{data_offset + o1}, {data_offset + o1 + n1}) overlaps tensor '{b}' "
                                    f"(from {data_offset + o2}): a tensor's type or shape does not match its data")

    return data_offset, tensors


def drop_pages(model: GGUFModel, names) -> int:
    """Give the file pages of tensors ``names`` back to the system once the process no longer reads them through
    the mapping (their values were copied or repacked into RAM at load): ``madvise(MADV_DONTNEED)`` on the
    mapping's whole pages inside those tensors' byte ranges (adjacent tensors merged first), which drops them
    from the process's resident set, then ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the same ranges, which
    drops them from the page cache where no other mapping holds them. The mapping stays valid: a later read of
    such a page faults it back from the file, the same bytes. Returns the bytes advised (0 where the system has
    no ``madvise``); OSError from the system calls is not caught (a valid mapping does not raise it)."""
    mms = model._mm if isinstance(model._mm, list) else [model._mm]
    files = [str(p) for p in model.shards] if model.shards else [None]
    if not hasattr(mmap, "MADV_DONTNEED") or any(m is None for m in mms):
        return 0
    spans: dict = {}
    for n in names:
        t = model.tensors[n]
        spans.setdefault(files.index(t.file) if model.shards else 0, []).append((t.offset, t.offset + t.nbytes))
    page = mmap.PAGESIZE
    done = 0
    for i, rs in spans.items():
        rs.sort()
        merged = [list(rs[0])]
        for a, b in rs[1:]:
            if a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        fd = None
        try:
            for a, b in merged:
                a, b = -(-a // page) * page, b // page * page   # the whole pages inside the range
                if b <= a:
                    continue
                mms[i].madvise(mmap.MADV_DONTNEED, a, b - a)
                if hasattr(os, "posix_fadvise"):
                    if fd is None:
                        fd = os.open(files[i] or model.path, os.O_RDONLY)
                    os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_DONTNEED)
                done += b - a
        finally:
            if fd is not None:
                os.close(fd)
    return done


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def file_type_name(model: GGUFModel) -> str | None:
    """The file's ``general.file_type`` as llama.cpp names it (gguf's ``LlamaFileType`` less its ``MOSTLY_`` /
    ``ALL_`` prefix: ``Q4_K_M``, ``IQ2_XXS``, ``F16``), or None when the key is absent or not a known value."""
    v = model.get("general.file_type")
    try:
        name = gguf.LlamaFileType(int(v)).name
    except (TypeError, ValueError):
        return None
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def describe(model: GGUFModel) -> str:
    """A human summary for ``coli info``: the shards of a split model (name, tensors, MiB), architecture, parameters, context, layers, heads, experts,
    file size, tensor count and bytes by ggml type, then every tensor (name, type, shape, MiB)."""
    g = model.arch_get
    n_params = sum(t.n_elements for t in model.tensors.values())
    shards = getattr(model, "shards", [])  # a Hugging Face folder (coli/hf_folder.py) has none
    lines = [
        f"file          {model.path.name}  ({model.file_size / 2**20:.1f} MiB, "
        + (f"GGUF v{model.version})" if isinstance(model.version, int) else f"{model.version})"),
        *([f"shards        {len(shards)}: " + ", ".join(
            f"{Path(p).name} ({sum(1 for t in model.tensors.values() if t.file == str(p))} tensors, "
            f"{os.path.getsize(p) / 2**20:.1f} MiB)" for p in shards)] if shards else []),
        f"architecture  {model.arch}" + (f"  ({model.get('general.name')})" if model.get("general.name") else ""),
        f"parameters    {n_params / 1e6:.1f} M ({n_params})",
        f"file type     {file_type_name(model) or '?'}  (general.file_type: the type the file was quantized to)",
        f"context       {g('context_length', '?')}",
        f"layers        {g('block_count', '?')}",
        f"embedding     {g('embedding_length', '?')}",
    ]
    heads = g("attention.head_count")
    if heads is not None:
        kv = g("attention.head_count_kv")
        fmt = lambda v: v.tolist() if isinstance(v, np.ndarray) else v  # noqa: E731
        lines.append(f"heads         {fmt(heads)}" + (f" (kv {fmt(kv)})" if kv is not None else ""))
    if g("expert_count") is not None:
        lines.append(f"experts       {g('expert_count')} (used {g('expert_used_count', '?')})"
                     + (f", shared {g('expert_shared_count')}" if g("expert_shared_count") else ""))
    tok = model.get("tokenizer.ggml.model")
    if tok is not None:
        n_tok = len(model.get("tokenizer.ggml.tokens", ()))
        lines.append(f"tokenizer     {tok}" + (f" / {model.get('tokenizer.ggml.pre')}"
                                               if model.get("tokenizer.ggml.pre") else "") + f", {n_tok} tokens")
    by_type: dict[str, list[int]] = {}
    for t in model.tensors.values():
        c = by_type.setdefault(t.type_name, [0, 0])
        c[0] += 1
        c[1] += t.nbytes
    lines.append(f"tensors       {len(model.tensors)}")
    for name, (n, b) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {name:<8} {n:>5} tensor{'s' if n != 1 else ' '}  {_mib(b):>10} MiB")
    width = max((len(n) for n in model.tensors), default=4)
    lines.append("")
    lines.append(f"{'name':<{width}}  {'type':<7} {'shape':<22} {'MiB':>9}")
    for t in model.tensors.values():
        lines.append(f"{t.name:<{width}}  {t.type_name:<7} {str(list(t.shape)):<22} {_mib(t.nbytes):>9}")
    return "\n".join(lines)
