"""Checks shared by the family oracle tests (HF transformers' logits of a tiny random model converted with
llama.cpp's converter: tests/fixtures/oracles, docs/oracles.md)."""
from __future__ import annotations

import numpy as np


def oracle_engine(path, tmp_path, **kw):
    """A ``coli.engine.Engine`` on a fixture for a test: f32 activations and one thread unless ``kw`` says
    otherwise, quiet, its usage file under ``tmp_path`` and never saved; ``kw`` goes to the engine."""
    from coli.engine import Engine

    kw = {"cpu_act": "f32", "threads": 1, **kw}
    return Engine(path, quiet=True, save_usage=False, usage=str(tmp_path / "u.coli_usage"), **kw)


def rel(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per row (last axis) max |got - ref| over the reference's largest |logit|: the families' oracle measure."""
    return np.abs(got - ref).max(axis=-1) / np.abs(ref).max()


def check_prompt_and_decode(m, kv, oracle, tol: float = 1e-4) -> np.ndarray:
    """``oracle["ids"]`` through ``m.forward`` into the cache ``kv``: every prompt row within ``tol`` of
    ``oracle["logits"]`` with the same argmax; then greedy decode from the last row: each step within ``tol`` of
    ``oracle["gen_logits"]`` and the ids equal to HF's ``gen_ids``. Returns the prompt's logits."""
    got = m.forward(oracle["ids"], kv, all_logits=True)
    r = rel(got, oracle["logits"])
    assert (r <= tol).all(), r.max()
    assert (got.argmax(1) == oracle["logits"].argmax(1)).all()
    last, gen = got[-1], []
    for i, want in enumerate(oracle["gen_logits"]):
        assert rel(last, want) <= tol, (i, rel(last, want))
        tok = int(last.argmax())
        gen.append(tok)
        last = m.forward([tok], kv)[0]
    assert gen == oracle["gen_ids"].tolist()
    return got


def capture_routes(m, seq) -> list:
    """``seq`` through ``m.forward`` on a fresh cache, recording every MoE layer's ``route`` result
    ``(ids int [T, k], weights f32 [T, k])`` in call order (one per MoE layer and call); the routes restored."""
    seen = []
    moes = [L.moe for L in m.layers if L.moe is not None]
    own = [mo.__dict__.get("route") for mo in moes]  # an instance's route (a closure) or None (the class's method)
    for mo in moes:
        mo.route = lambda lg, f=mo.route: seen.append(f(lg)) or seen[-1]
    try:
        m.forward(seq, m.new_cache(len(seq) + 1))
    finally:
        for mo, f in zip(moes, own):
            if f is None:
                del mo.route
            else:
                mo.route = f
    return seen


def check_routes(seen, expert_ids: np.ndarray, expert_weights: np.ndarray) -> None:
    """``capture_routes``' records equal HF's ``expert_ids`` / ``expert_weights`` [moe layer, T, k] at every layer and
    position, compared per expert id (coli ranks by the choice score, which may carry a bias; the fixture by
    weight): the same ids, weights within rtol 1e-4 / atol 3e-5."""
    assert len(seen) == expert_ids.shape[0]
    for (ids, w), hi, hw in zip(seen, expert_ids, expert_weights):
        o, oh = np.argsort(ids, axis=1), np.argsort(hi, axis=1)
        assert (np.take_along_axis(ids, o, 1) == np.take_along_axis(hi, oh, 1)).all()
        np.testing.assert_allclose(np.take_along_axis(w, o, 1), np.take_along_axis(hw, oh, 1), rtol=1e-4, atol=3e-5)


class Typed:
    """A metadata value for ``copy_gguf``'s ``keys`` written with its own GGUF value type (e.g. a string where the
    file has an integer), not the stored key's."""

    def __init__(self, value, vtype):
        self.value, self.vtype = value, vtype


def copy_gguf(src, dest, keys: dict | None = None, tensors: dict | None = None, convert=None):
    """A copy of the GGUF ``src`` at ``dest`` through gguf-py's reader and writer (returns ``dest``).

    ``keys``: {key: None (left out), a value (written with the stored key's type) or a ``Typed``}; a key the file
    lacks is added as a ``Typed``. ``tensors``: {name: None (left out), an array (written with the type NumPy's
    dtype gives) or ``(raw uint8 array, GGMLQuantizationType)``}, a name the file lacks appended after the stored
    tensors. ``convert(tensor)`` for every other stored tensor: ``(array, GGMLQuantizationType or None)`` or a list
    of ``(name, array, type or None)`` written in its place (default: the stored data and type)."""
    import gguf

    keys, tensors = keys or {}, tensors or {}
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dest), r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or (k in keys and keys[k] is None):
            continue
        v = keys.get(k, f.contents())
        if isinstance(v, Typed):
            w.add_key_value(k, v.value, v.vtype)
            continue
        vt = gguf.GGUFValueType(f.types[0])
        w.add_key_value(k, v, vt, sub_type=gguf.GGUFValueType(f.types[-1]) if vt == gguf.GGUFValueType.ARRAY else None)
    for k, v in keys.items():
        if k not in r.fields and isinstance(v, Typed):
            w.add_key_value(k, v.value, v.vtype)

    def put(name, a, raw=None):
        if isinstance(a, tuple):
            a, raw = a
        w.add_tensor(name, a, raw_dtype=raw if a.dtype == np.uint8 else None)  # other dtypes name their type

    for t in r.tensors:
        if t.name in tensors:
            if tensors[t.name] is not None:
                put(t.name, tensors[t.name])
            continue
        out = convert(t) if convert else (np.asarray(t.data), t.tensor_type)
        for name, a, raw in ([(t.name, *out)] if isinstance(out, tuple) else out):
            put(name, a, raw)
    stored = {t.name for t in r.tensors}
    for name, a in tensors.items():
        if name not in stored and a is not None:
            put(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def malformed_copy(src, dest, drop_key: str = "", drop_tensor: str = "", widen: str = "", to_str: str = "",
                   zero: str = "", edit: dict | None = None):
    """``copy_gguf`` of ``src`` with metadata key ``drop_key`` and tensor ``drop_tensor`` left out, the tensor
    ``widen`` one column (GGUF ne0) wider, key ``to_str`` a string, integer key ``zero`` 0, tensor ``n`` of ``edit``
    replaced by ``edit[n](data)`` (a copy of its NumPy data: float values of an F32 / F16 tensor, the raw bytes
    uint8 [..., row bytes] of a block format); every other key and tensor as stored."""
    import gguf

    keys = {drop_key: None} if drop_key else {}
    if to_str:
        keys[to_str] = Typed("sixteen", gguf.GGUFValueType.STRING)
    if zero:
        keys[zero] = Typed(0, gguf.GGUFValueType.UINT32)
    edit = dict(edit or {})
    if widen:
        edit[widen] = lambda a: np.concatenate([a, a[..., :1]], axis=-1)

    def convert(t):
        a = np.asarray(t.data)
        return (edit[t.name](a.copy()) if t.name in edit else a), t.tensor_type

    return copy_gguf(src, dest, keys, {drop_tensor: None} if drop_tensor else None, convert)


def q8_matrices(t):
    """A ``copy_gguf`` converter: every F32/F16 matrix with rows of a multiple of 32 (not token_embd) quantized to
    Q8_0 by gguf.quants, the rest as is."""
    import gguf

    a = np.asarray(t.data)
    if a.ndim >= 2 and a.shape[-1] % 32 == 0 and "token_embd" not in t.name and t.tensor_type in (0, 1):
        Q8 = gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.quantize(a.astype(np.float32), Q8), Q8
    return a, t.tensor_type
