"""Split a GGUF file into shards the way llama.cpp's ``llama-gguf-split --split --split-max-tensors N`` does,
for tests that cannot build llama.cpp (``tools/gguf-split/gguf-split.cpp`` ``split_strategy``, written by
``ggml/src/gguf.cpp`` ``gguf_write_to_buf``):

* shard ``i`` is ``PREFIX-{i+1:05d}-of-{n:05d}.gguf``, GGUF v3; a new shard starts every N tensors;
* the first shard holds every metadata key of the source in its order, then ``split.no`` (u16),
  ``split.tensors.count`` (i32), ``split.count`` (u16: set last, once the count is known, which moves it to the
  end); the others only those three keys;
* tensor infos in source order with ``n_dims = ggml_n_dims`` (trailing dimensions of 1 dropped), offsets
  from the shard's data start, each tensor padded to the alignment with zeros.

``tests/io/test_split_gguf.py`` checks the output against the real tool byte for byte where it is built.
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from coli.gguf_file import _NP_DTYPE, _SCALAR, _T_ARRAY, _T_STRING, open_gguf_file, split_path


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _value(v, t) -> bytes:
    if t == _T_STRING:
        return _str(v)
    if isinstance(t, tuple):
        et = t[1]
        if et == _T_STRING:
            return struct.pack("<IQ", et, len(v)) + b"".join(_str(x) for x in v)
        if et in _SCALAR:
            a = np.asarray(v).astype(_NP_DTYPE[et])
            return struct.pack("<IQ", et, len(a)) + a.tobytes()
        raise ValueError("nested arrays are not written by this helper")
    return struct.pack(_SCALAR[t][1], v)


def _kv(key: str, v, t) -> bytes:
    return _str(key) + struct.pack("<I", _T_ARRAY if isinstance(t, tuple) else t) + _value(v, t)


def write_split(src, prefix, max_tensors: int) -> list[Path]:
    """Write ``src`` (a GGUF path) as shards of at most ``max_tensors`` tensors; returns their paths."""
    g = open_gguf_file(src)
    names = list(g.tensors)
    groups = [names[i:i + max_tensors] for i in range(0, len(names), max_tensors)]
    n = len(groups)
    al = g.alignment
    out = []
    for i, group in enumerate(groups):
        kvs = [_kv(k, g.meta[k], g.kv_types[k]) for k in g.meta] if i == 0 else []
        kvs += [_kv("split.no", i, 2), _kv("split.tensors.count", len(names), 5), _kv("split.count", n, 2)]
        infos, off = [], 0
        for name in group:
            t = g.tensors[name]
            ne = list(reversed(t.shape))
            while len(ne) > 1 and ne[-1] == 1:
                ne.pop()
            infos.append(_str(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, t.type_id, off))
            off += -(-t.nbytes // al) * al
        head = b"GGUF" + struct.pack("<IQQ", 3, len(group), len(kvs)) + b"".join(kvs) + b"".join(infos)
        p = Path(split_path(str(prefix), i, n))
        with open(p, "wb") as f:
            f.write(head + b"\0" * (-len(head) % al))
            for name in group:
                t = g.tensors[name]
                f.write(np.ascontiguousarray(t.raw).tobytes())
                f.write(b"\0" * (-t.nbytes % al))
        out.append(p)
    return out
