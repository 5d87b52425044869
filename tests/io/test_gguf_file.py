"""coli.gguf_file: real files agree with gguf.GGUFReader; every malformed header is a fast one-line ColiError.

The real models are the three cached GGUFs (``coli.fetch.model_path``). ``gguf.GGUFReader`` is the
reference reader; it takes ~2 s on SmolLM2 but 9-17 s on Qwen2.5 / Gemma-3 (one object per vocabulary
string), so those two are compared with it only when ``COLI_SLOW_TESTS=1``; the fast tests check them
against the type counts and dimensions recorded when the fixtures were chosen and exact layout invariants.
"""
from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from coli.base.errors import ColiError
from coli.fetch import model_path
from coli.gguf_file import describe, file_type_name, open_gguf
from conftest import ROOT

SLOW = os.environ.get("COLI_SLOW_TESTS") == "1"

# tensor count by ggml type, and dims, of each cached model
REAL = {
    "smollm2": dict(arch="llama", types={"Q4_1": 210, "Q8_0": 1, "F32": 61}, layers=30, d=576, vocab=49152,
                    ctx=8192, heads=9, kv_heads=3),
    "gemma3": dict(arch="gemma3", types={"Q5_0": 81, "Q4_K": 27, "Q6_K": 9, "Q8_0": 10, "F32": 109}, layers=18,
                   d=640, vocab=262144, ctx=32768, heads=4, kv_heads=1),
    "qwen25": dict(arch="qwen2", types={"Q5_0": 133, "Q8_0": 13, "Q6_K": 12, "Q4_K": 12, "F32": 121}, layers=24,
                   d=896, vocab=151936, ctx=32768, heads=14, kv_heads=2),
}


# ----------------------------------------------------------------------------------------------- real files

@pytest.mark.parametrize("name", list(REAL))
def test_real_file_layout_and_metadata(name):
    path = model_path(name)
    best = min(_timed(lambda: open_gguf(path))[1] for _ in range(3))
    m = open_gguf(path)
    # a guard against reading the tensors at open (seconds on a 400 MB file), not a speed figure: generous, since
    # a loaded machine slows the metadata parse too
    assert best < 10.0, f"open_gguf({path.name}) took {best:.2f} s (best of 3)"
    exp = REAL[name]
    assert m.arch == exp["arch"]
    assert m.arch_get("block_count") == exp["layers"] == m.get(f"{m.arch}.block_count")
    assert m.arch_get("embedding_length") == exp["d"]
    assert m.arch_get("context_length") == exp["ctx"]
    assert m.arch_get("attention.head_count") == exp["heads"]
    assert m.arch_get("attention.head_count_kv") == exp["kv_heads"]
    assert m.arch_get("no_such_key", "dflt") == "dflt"
    assert len(m.meta["tokenizer.ggml.tokens"]) == exp["vocab"]
    assert all(isinstance(t, str) for t in m.meta["tokenizer.ggml.tokens"][:100])
    tt = m.meta["tokenizer.ggml.token_type"]
    assert isinstance(tt, np.ndarray) and tt.dtype == np.int32 and tt.shape == (exp["vocab"],)
    counts = {}
    for t in m.tensors.values():
        counts[t.type_name] = counts.get(t.type_name, 0) + 1
    assert counts == exp["types"]
    emb = m.tensors["token_embd.weight"]
    assert emb.shape == (exp["vocab"], exp["d"])  # NumPy order [rows, I]

    # exact invariants of a well-formed file: each tensor's raw view covers exactly its bytes,
    # rows are whole blocks, and the data section is tiled in order with alignment padding only
    base = np.frombuffer(m._mm, dtype=np.uint8)
    base_ptr = base.__array_interface__["data"][0]
    end = m.data_offset
    for t in sorted(m.tensors.values(), key=lambda t: t.offset):
        block, tsize = GGML_QUANT_SIZES[GGMLQuantizationType[t.type_name]]
        assert t.offset == -(-end // m.alignment) * m.alignment
        assert t.nbytes == int(np.prod(t.shape)) // block * tsize
        assert t.raw.dtype == np.uint8 and t.raw.shape == (*t.shape[:-1], t.shape[-1] // block * tsize)
        assert t.raw.nbytes == t.nbytes
        assert not t.raw.flags.writeable and not t.raw.flags.owndata
        assert t.raw.__array_interface__["data"][0] - base_ptr == t.offset  # a view of the mapping
        end = t.offset + t.nbytes
    assert end <= m.file_size < end + m.alignment


def test_describe_real_file():
    m = open_gguf(model_path("qwen25"))
    text = describe(m)
    assert "qwen2" in text and "layers        24" in text and "heads         14 (kv 2)" in text
    assert "Q5_0       133 tensors" in text
    assert "blk.0.ffn_down.weight" in text and "[896, 4864]" in text
    assert len(text.splitlines()) == 291 + text.splitlines().index("") + 2


@pytest.mark.parametrize("name,ftype", [("qwen25", "Q4_K_M"), ("smollm2", "Q4_1")])
def test_file_type_is_llamacpps_name_of_general_file_type(name, ftype):
    # gguf.GGUFReader's general.file_type through gguf's LlamaFileType (the enum llama.cpp's llama_model_ftype
    # mirrors); the files' names say the same
    path = model_path(name)
    v = int(gguf.GGUFReader(path).fields["general.file_type"].contents())
    assert gguf.LlamaFileType(v).name == "MOSTLY_" + ftype
    m = open_gguf(path)
    assert file_type_name(m) == ftype
    assert f"file type     {ftype}  " in describe(m)


def test_cli_info_takes_a_model_name_as_run_does(capsys):
    from coli.cli import main

    assert main(["info", "-m", "smollm2"]) == 0
    assert "file type     Q4_1" in capsys.readouterr().out


def _compare_with_reader(path):
    m = open_gguf(path)
    r = gguf.GGUFReader(path)
    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(m.meta)
    for k, f in fields.items():
        if f.types[0] == GGUFValueType.ARRAY:
            assert m.kv_types[k] == (9, int(f.types[-1])), k
            want = f.contents()
            got = m.meta[k]
            if f.types[-1] == GGUFValueType.STRING:
                assert got == want, k
            else:
                assert np.array_equal(np.asarray(got), np.asarray(want)), k
        else:
            assert m.kv_types[k] == int(f.types[0]), k
            want = f.contents()
            assert m.meta[k] == want and type(m.meta[k]) is type(want), k
    assert [t.name for t in r.tensors] == list(m.tensors)
    for rt in r.tensors:
        t = m.tensors[rt.name]
        assert t.type_name == rt.tensor_type.name
        assert t.shape == tuple(int(x) for x in reversed(rt.shape))
        assert t.offset == rt.data_offset and t.nbytes == rt.n_bytes
        assert np.shares_memory(t.raw, t.raw) and np.array_equal(t.raw.reshape(-1), rt.data.reshape(-1).view(np.uint8))


def test_smollm2_matches_gguf_reader():
    _compare_with_reader(model_path("smollm2"))


@pytest.mark.skipif(not SLOW, reason="GGUFReader takes 9-17 s on these files; set COLI_SLOW_TESTS=1")
@pytest.mark.parametrize("name", ["qwen25", "gemma3"])
def test_big_files_match_gguf_reader(name):
    _compare_with_reader(model_path(name))


@pytest.mark.parametrize("name", ["mixtral", "olmoe", "qwen2moe", "qwen3moe"])
def test_moe_oracle_files(name):
    """The MoE oracle GGUFs (tests/fixtures/oracles, written from HF transformers checkpoints): expert
    tensors come out [E, O, I] with E/K/D/F from the HF config, and everything agrees with GGUFReader."""
    p = ROOT / "tests" / "fixtures" / "oracles" / f"{name}.gguf"
    cfg_path = p.with_name(f"{name}.config.json")
    if not (p.exists() and cfg_path.exists()):
        pytest.skip(f"{p.name} not generated")
    import json

    cfg = json.loads(cfg_path.read_text())
    E = cfg.get("num_experts") or cfg["num_local_experts"]
    K, D = cfg["num_experts_per_tok"], cfg["hidden_size"]
    F = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    m = open_gguf(p)
    assert (m.arch_get("expert_count"), m.arch_get("expert_used_count")) == (E, K)
    assert m.arch_get("block_count") == cfg["num_hidden_layers"]
    for layer in range(cfg["num_hidden_layers"]):
        t = m.tensors
        assert t[f"blk.{layer}.ffn_gate_inp.weight"].shape == (E, D)  # the router
        assert t[f"blk.{layer}.ffn_gate_exps.weight"].shape == (E, F, D)
        assert t[f"blk.{layer}.ffn_up_exps.weight"].shape == (E, F, D)
        down = t[f"blk.{layer}.ffn_down_exps.weight"]
        assert down.shape == (E, D, F)
        if down.type_name == "F32":
            assert down.raw.shape == (E, D, F * 4) and down.raw.view(np.float32).shape == (E, D, F)
    assert f"experts       {E} (used {K})" in describe(m)
    _compare_with_reader(p)


def _write_small(path, alignment=None):
    """A small file from gguf.GGUFWriter with every scalar type, arrays, and four tensors."""
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_block_count(2)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.5)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "Zürich 日本語")
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_str", ["a", "", "ß"])
    w.add_array("t.arr_f32", [0.25, 0.5])
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((2, 64)).astype(np.float32)
    qb = gguf.quants.quantize(b, GGMLQuantizationType.Q8_0)
    c = rng.standard_normal((2, 3, 4, 8)).astype(np.float16)
    d = rng.standard_normal(5).astype(np.float32)
    w.add_tensor("a.weight", a)
    w.add_tensor("b.weight", qb, raw_shape=qb.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("c.weight", c)
    w.add_tensor("d.bias", d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dict(a=a, b=b, qb=qb, c=c, d=d)


def test_small_written_file(tmp_path):
    p = tmp_path / "small.gguf"
    src = _write_small(p)
    m = open_gguf(p)
    assert m.arch == "llama" and m.arch_get("block_count") == 2
    assert (m.get("t.u8"), m.get("t.i8"), m.get("t.u16"), m.get("t.i16")) == (200, -100, 60000, -30000)
    assert (m.get("t.u32"), m.get("t.i32"), m.get("t.u64"), m.get("t.i64")) == (4_000_000_000, -2_000_000_000,
                                                                                2**63 + 5, -(2**62))
    assert m.get("t.f32") == 0.5 and m.get("t.f64") == 1e-300 and m.get("t.bool") is True
    assert m.get("t.str") == "Zürich 日本語"
    assert m.get("t.arr_i32").tolist() == [1, -2, 3] and m.get("t.arr_str") == ["a", "", "ß"]
    assert m.get("t.arr_f32").tolist() == [0.25, 0.5]
    assert m.get("missing", 7) == 7
    t = m.tensors
    assert (t["a.weight"].type_name, t["a.weight"].shape) == ("F32", (3, 4))
    assert np.array_equal(t["a.weight"].raw.view(np.float32), src["a"])
    assert (t["b.weight"].type_name, t["b.weight"].shape, t["b.weight"].raw.shape) == ("Q8_0", (2, 64), (2, 68))
    assert np.array_equal(t["b.weight"].raw, src["qb"])
    deq = gguf.quants.dequantize(t["b.weight"].raw, GGMLQuantizationType.Q8_0)
    assert deq.shape == (2, 64) and np.abs(deq - src["b"]).max() < 0.03
    assert (t["c.weight"].type_name, t["c.weight"].shape) == ("F16", (2, 3, 4, 8))
    assert np.array_equal(t["c.weight"].raw.view(np.float16), src["c"])
    assert t["d.bias"].shape == (5,) and np.array_equal(t["d.bias"].raw.view(np.float32), src["d"])
    _compare_with_reader(p)


# ----------------------------------------------------------------------------------------------- bad input

def _s(x) -> bytes:
    b = x.encode() if isinstance(x, str) else x
    return struct.pack("<Q", len(b)) + b


def _kv(key, vtype, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _tinfo(name, dims, ttype=0, offset=0) -> bytes:
    return _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", ttype, offset)


def _gguf(kvs=(), tinfos=(), n_tensors=None, n_kv=None, data=b"", version=3, magic=b"GGUF", align=32) -> bytes:
    head = magic + struct.pack("<IQQ", version, len(tinfos) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tinfos)
    return body + b"\0" * (-len(body) % align) + data


ARCH = _kv("general.architecture", 8, _s("llama"))

BAD = {
    "magic": (b"GGML" + bytes(40), "header: not a GGUF file"),
    "text_file": (b"this is just a text file, not a model at all\n", "header: not a GGUF file"),
    "empty": (b"", "header: the file is empty (0 bytes), not a GGUF file"),
    "magic_cut": (b"GG", "header: file is 2 bytes, shorter than the 24-byte GGUF header"),
    "short_header": (b"GGUF" + struct.pack("<I", 3) + bytes(8), "header: file is 16 bytes"),
    "version_1": (_gguf(version=1), "header: GGUF version 1 is not supported"),
    "version_99": (_gguf(version=99), "header: version 99"),
    "big_endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "header: big-endian"),
    "tensor_count_2^63": (_gguf(n_tensors=2**63), "header: tensor_count 9223372036854775808 is more than the file"),
    "kv_count_2^63": (_gguf(n_kv=2**63), "header: kv_count 9223372036854775808 is more than the file"),
    "kv_count_past_end": (_gguf([ARCH], n_kv=3, align=1), "kv #1: key length needs 8 bytes"),
    "key_length_past_end": (_gguf([struct.pack("<Q", 1000) + b"general"], n_kv=1),
                            "kv #0: key length 1000 is past the end"),
    "string_value_past_end": (_gguf([ARCH, _kv("general.name", 8, struct.pack("<Q", 2**40) + b"abc")]),
                              "kv 'general.name': string length 1099511627776 is past the end"),
    # 49 bytes: one kv whose uint32 array claims 2^61 elements (gguf.GGUFReader 0.19.0 ran > 20 s on it)
    "array_length_past_end_tiny_file": (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _s("a") + struct.pack("<IIQ", 9, 4, 2**61),
                                        "kv 'a': array of 2305843009213693952 uint32"),
    "array_length_cut": (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _s("a") + struct.pack("<IIQ", 9, 4, 2**61)[:10],
                         "kv 'a': array length needs 8 bytes"),
    "array_u32_huge": (_gguf([ARCH, _kv("x.arr", 9, struct.pack("<IQ", 4, 2**61))]),
                       "kv 'x.arr': array of 2305843009213693952 uint32"),
    "array_u64_overflow": (_gguf([ARCH, _kv("x.arr", 9, struct.pack("<IQ", 10, 2**63 + 1))]),
                           "kv 'x.arr': array of 9223372036854775809 uint64"),
    "array_of_strings_huge": (_gguf([ARCH, _kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2**62))]),
                              "kv 'tokenizer.ggml.tokens': array of 4611686018427387904 strings"),
    "array_string_item_past_end": (
        _gguf([ARCH, _kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + _s("ok") + struct.pack("<Q", 99))]),
        "kv 'tokenizer.ggml.tokens': string 1 of 2: length 99 is past the end"),
    "nested_array_huge": (_gguf([ARCH, _kv("x.nest", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 5, 2**60))]),
                          "kv 'x.nest': array of 1152921504606846976 int32"),
    "value_type_13": (_gguf([ARCH, _kv("x.bad", 13, b"\0" * 8)]), "kv 'x.bad': value type 13 is not a GGUF type"),
    "array_elem_type_77": (_gguf([ARCH, _kv("x.bad", 9, struct.pack("<IQ", 77, 1))]),
                           "kv 'x.bad': array element type 77"),
    "duplicate_key": (_gguf([ARCH, ARCH]), "kv 'general.architecture': duplicate key"),
    "bad_utf8_key": (_gguf([_kv(b"gen\xff", 4, struct.pack("<I", 1))]), "kv #0: key is not valid UTF-8"),
    "alignment_0": (_gguf([ARCH, _kv("general.alignment", 4, struct.pack("<I", 0))]),
                    "kv 'general.alignment': 0 is not a power of two"),
    "alignment_3": (_gguf([ARCH, _kv("general.alignment", 4, struct.pack("<I", 3))]),
                    "kv 'general.alignment': 3 is not a power of two"),
    "alignment_string": (_gguf([ARCH, _kv("general.alignment", 8, _s("32"))]),
                         "kv 'general.alignment': type string is not an integer"),
    "no_architecture": (_gguf([_kv("general.name", 8, _s("x"))]), "kv 'general.architecture': missing"),
    "tensor_5_dims": (_gguf([ARCH], [_tinfo("blk.0.ffn_up.weight", [32, 2, 2, 2, 2])], data=bytes(4096)),
                      "tensor 'blk.0.ffn_up.weight': 5 dimensions (at least 1, at most 4)"),
    "tensor_0_dims": (_gguf([ARCH], [_tinfo("w", [])], data=bytes(64)), "tensor 'w': 0 dimensions"),
    "tensor_dim_zero": (_gguf([ARCH], [_tinfo("w", [32, 0])], data=bytes(64)), "tensor 'w': dimension 1 is 0"),
    "tensor_dims_overflow_int64": (_gguf([ARCH], [_tinfo("w", [2**32, 2**32])], data=bytes(64)),
                                   "tensor 'w': dimensions [4294967296, 4294967296] overflow int64"),
    "tensor_dim_2^63": (_gguf([ARCH], [_tinfo("w", [2**63])], data=bytes(64)), "tensor 'w': dimension 0 is"),
    "tensor_unknown_type_99": (_gguf([ARCH], [_tinfo("w", [32], ttype=99)], data=bytes(64)),
                               "tensor 'w': unknown ggml type 99"),
    "tensor_removed_type_4": (_gguf([ARCH], [_tinfo("w", [32], ttype=4)], data=bytes(64)),
                              "tensor 'w': unknown ggml type 4"),
    "tensor_not_whole_blocks": (_gguf([ARCH], [_tinfo("w", [33], ttype=8)], data=bytes(64)),
                                "tensor 'w': first dimension 33 is not a multiple of the Q8_0 block size 32"),
    "tensor_misaligned_offset": (_gguf([ARCH], [_tinfo("w", [4], offset=4)], data=bytes(64)),
                                 "tensor 'w': data offset 4 is not a multiple of the alignment 32"),
    "tensor_data_past_end": (_gguf([ARCH], [_tinfo("w", [1024, 1024])], data=bytes(64)),
                             "tensor 'w': data ["),
    # a's 32 f32 values (128 bytes) run into b's data at offset 64: a type or shape enlarged without moving the data
    "tensor_overlap": (_gguf([ARCH], [_tinfo("a", [32]), _tinfo("b", [4], offset=64)], data=bytes(256)),
                       "overlaps tensor 'b'"),
    "tensor_duplicate_name": (_gguf([ARCH], [_tinfo("w", [4]), _tinfo("w", [4], offset=32)], data=bytes(64)),
                              "tensor 'w': duplicate tensor name"),
    "tensor_name_past_end": (_gguf([ARCH], [struct.pack("<Q", 500) + b"blk" + bytes(40)], n_tensors=1, align=1),
                             "tensor #0: name length 500 is past the end"),
    "tensor_count_past_infos": (_gguf([ARCH], [_tinfo("w", [4])], n_tensors=2, align=1),
                                "header: tensor_count 2 is more than the file can hold (33 bytes left"),
}


def _check_bad(path, expect):
    t0 = time.perf_counter()
    with pytest.raises(ColiError) as ei:
        open_gguf(path)
    dt = time.perf_counter() - t0
    msg = str(ei.value)
    assert dt < 10.0, f"{dt:.2f} s"  # no hang and no read of a huge claimed size (not a speed figure)
    assert "\n" not in msg
    assert msg.startswith(f"{Path(path).name}: "), msg
    assert expect in msg, msg
    return msg


@pytest.mark.parametrize("case", list(BAD))
def test_bad_header(tmp_path, case):
    data, expect = BAD[case]
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    _check_bad(p, expect)


def test_missing_file_and_directory(tmp_path):
    _check_bad(tmp_path / "nope.gguf", "no such file")
    d = tmp_path / "dir.gguf"
    d.mkdir()
    _check_bad(d, "is a directory")


def test_truncated_small_file_every_section(tmp_path):
    full = tmp_path / "full.gguf"
    _write_small(full)
    data = full.read_bytes()
    r = gguf.GGUFReader(full)  # the reference tells where each section starts
    kv_start = r.fields["general.architecture"].offset
    arr = r.fields["t.arr_str"]
    ti = r.tensors[0].field.offset  # tensor infos start
    td = r.tensors[3].field.offset  # the last one, d.bias
    last = r.tensors[-1]
    cuts = {
        12: "header: file is 12 bytes, shorter than the 24-byte GGUF header",
        kv_start + 3: "header: kv_count 17 is more than the file can hold",
        arr.offset + 17 + 4 + 2: "kv 't.arr_str': array element type needs 4 bytes",
        arr.offset + 17 + 4 + 4 + 8 + 9 + 8 + 8 + 1: "kv 't.arr_str': string 2 of 3: length 2 is past the end",
        r.fields["t.arr_f32"].offset + 17 + 4 + 4 + 8 + 3: "kv 't.arr_f32': array of 2 float32 (8 bytes) is more than the 3",
        ti: "header: tensor_count 4 is more than the file can hold",
        td + 10: "tensor #3: name length 6 is past the end",
        td + 8 + 6 + 2: "tensor 'd.bias': n_dims needs 4 bytes",
        td + 8 + 6 + 4 + 4: "tensor 'd.bias': dimension 0 needs 8 bytes",
        td + 8 + 6 + 4 + 8 + 2: "tensor 'd.bias': type needs 4 bytes",
        td + 8 + 6 + 4 + 8 + 4 + 3: "tensor 'd.bias': data offset needs 8 bytes",
        r.data_offset + 5: "tensor 'a.weight': data [736, 784) is past the end of the file",
        last.data_offset + last.n_bytes - 1: f"tensor '{last.name}': data [",
    }
    for cut, expect in cuts.items():
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        _check_bad(p, expect)


def test_truncated_real_file(tmp_path):
    """Cut SmolLM2 in the vocabulary, in the tensor infos and in the tensor data."""
    src = model_path("smollm2")
    m = open_gguf(src)
    with open(src, "rb") as f:
        head = f.read(m.data_offset + (1 << 20))
    tok = head.find(b"tokenizer.ggml.tokens")
    last = list(m.tensors)[-1]  # cut inside the last tensor info (earlier cuts trip the tensor_count check)
    info = head.rfind(last.encode(), 0, m.data_offset)
    assert tok > 0 and info > tok
    cuts = {
        tok + 500_000: "kv 'tokenizer.ggml.tokens': string ",
        info + 5: f"tensor #271: name length {len(last)} is past the end",
        info + len(last) + 6: f"tensor '{last}': dimension 0 needs 8 bytes",
        m.data_offset + (1 << 20): "data [",
    }
    for cut, expect in cuts.items():
        p = tmp_path / "SmolLM2-cut.gguf"
        p.write_bytes(head[:cut])
        _check_bad(p, expect)


# ----------------------------------------------------------------------------------------------- the CLI

needs_cli = pytest.mark.skipif(not (ROOT / "coli" / "cli.py").exists(), reason="coli/cli.py not written yet")


def _cli_info(path):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "coli", "info", str(path)], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    return r, time.perf_counter() - t0


@needs_cli
@pytest.mark.parametrize("case", ["text_file", "empty", "tensor_count_2^63", "kv_count_2^63", "string_value_past_end",
                                  "array_length_past_end_tiny_file", "array_u32_huge", "alignment_0",
                                  "alignment_3", "tensor_5_dims", "tensor_dims_overflow_int64",
                                  "tensor_unknown_type_99", "tensor_data_past_end"])
def test_cli_bad_header(tmp_path, case):
    data, expect = BAD[case]
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    r, _ = _cli_info(p)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert lines[0].startswith("coli: bad.gguf: ") and expect in lines[0], lines[0]


@needs_cli
def test_cli_missing_and_truncated(tmp_path):
    full = tmp_path / "full.gguf"
    _write_small(full)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full.read_bytes()[:700])
    for p, expect in [(tmp_path / "missing.gguf", "missing.gguf: no such file"), (cut, "cut.gguf: tensor ")]:
        r, _ = _cli_info(p)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.splitlines()) == 1 and expect in r.stderr, r.stderr


@needs_cli
def test_cli_info_real_file():
    r, _ = _cli_info(model_path("smollm2"))
    assert r.returncode == 0, r.stderr
    assert "llama" in r.stdout and "blk.29.ffn_down.weight" in r.stdout


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0
