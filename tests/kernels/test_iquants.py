"""The i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M): the packed kernel layout decodes to
gguf.quants.dequantize bit for bit, the tables come from gguf.quants, and the generated shader tables hold the
same grids. GEMV/GEMM/int8 parity: tests/kernels/test_formats.py (every FORMATS row, these included)."""
from __future__ import annotations

import re
import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from coli.types import iq_tables
from cpu_kernels.vnni import HAVE_VNNI
from cpu_kernels import formats as F
from cpu_kernels import iquants
from coli.types import table as TT


@pytest.mark.parametrize("name", iq_tables.IQ_TYPES)
def test_packed_layout_equals_gguf_dequantize(name):
    """scale[o, i // G] * q[o, i] == gguf.quants.dequantize(raw) exactly (f32), on random valid blocks
    (coli.types.table.random_blocks) with ordinary, tiny and large super-block scales."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    for O, I, scale in ((5, 256, 1.0), (3, 768, 1e-3), (2, 512, 1e4)):
        raw = TT.random_blocks(name, O, I, rng, scale)
        want = gq.dequantize(raw, QT[name]).reshape(O, I)
        assert np.isfinite(want).all()
        q, s = F.prepare(name, raw, (O, I)).arrays
        G = iquants.GROUP[name]
        assert q.dtype == np.int8 and q.shape == (O, I) and s.dtype == np.float32 and s.shape == (O, I // G)
        got = np.repeat(s, G, axis=1) * q.astype(np.float32)
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_every_grid_entry_and_sign_decodes():
    """One block per grid entry is too many; instead all 256 values of every index and sign byte occur in the
    random blocks of the test above. Here: IQ2_XXS block whose indices enumerate the whole grid, signs all set."""
    g = iq_tables.grid("IQ2_XXS")
    raw = np.zeros((8, 66), np.uint8)  # 8 blocks x 32 groups = 256 grid entries
    raw[:, 0:2] = np.array([1.0], np.float16).view(np.uint8)
    for b in range(8):
        for ib in range(8):
            raw[b, 2 + 8 * ib:6 + 8 * ib] = np.arange(4) + 32 * b + 4 * ib
            raw[b, 6 + 8 * ib:10 + 8 * ib] = np.array([0x7F | 0x7F << 7 | 0x7F << 14 | 0x7F << 21], "<u4").view(np.uint8)
    want = gq.dequantize(raw.reshape(1, -1), QT.IQ2_XXS).reshape(1, -1)
    q, s = F.prepare("IQ2_XXS", raw.reshape(1, -1), (1, 2048)).arrays
    np.testing.assert_array_equal(np.repeat(s, 32, axis=1) * q, want)
    np.testing.assert_array_equal(-q.reshape(256, 8), g)  # ksigns[127] = 0xFF: all negative


def test_ksigns_is_index_with_parity_bit():
    """The shaders compute ksigns_iq2xs as i | parity(i) << 7 instead of a table: gguf.quants' table says so."""
    i = np.arange(128)
    parity = np.array([bin(v).count("1") & 1 for v in i])
    np.testing.assert_array_equal(iq_tables.ksigns(), i | parity << 7)


def test_tables_are_gguf_quants_grids():
    for name in iq_tables.IQ_TYPES:
        cls = {"IQ1_M": gq.IQ1_S}.get(name, getattr(gq, name))
        cls.init_grid()
        np.testing.assert_array_equal(iq_tables.grid(name), cls.grid.reshape(cls.grid_shape))


def test_shader_grids_are_current_and_decode_to_the_grids():
    """shaders/iq_grids.glsl is what coli/types/iq_tables.py generates, and the words the device uploads at each of its
    offsets unpack (as shaders/fmt_iq*.glsl read them) to gguf.quants' grids."""
    from coli.vulkan.shaders import SHADER_DIR

    for fname, text in iq_tables.glsl_tables().items():
        assert (SHADER_DIR / fname).read_text() == text, f"shaders/{fname} is stale: run coli.vulkan.build"
    words, offs = iq_tables.device_grids()
    text = iq_tables.glsl_tables()["iq_grids.glsl"]
    for acc, name in iq_tables.GLSL_GRIDS.items():
        off = int(re.search(rf"#define {acc}\(i\) IQGRID\[(\d+)u \+ \(i\)\]", text).group(1))
        assert off == offs[acc]
        g = iq_tables.grid(name)
        if name.startswith("IQ1"):
            w = words[off:off + len(g)]
            got = ((w[:, None] >> (2 * np.arange(8, dtype=np.uint32))) & 3).astype(np.int8) - 1
        else:
            got = words[off:off + g.size // 4].view(np.uint8).reshape(g.shape).astype(np.int8)
        np.testing.assert_array_equal(got, g, err_msg=acc)


def test_bad_inner_size_is_a_coli_error():
    from coli.base.errors import ColiError

    with pytest.raises(ColiError, match="IQ2_XXS.*multiple of the block size 256"):
        F.prepare("IQ2_XXS", np.zeros(66, np.uint8), (1, 288))


# ----------------------------------------------------------------------------------------------- a whole model
# A tiny llama-architecture MoE (2 layers, d 256, 4 experts top-2) whose experts and attention are i-quants with
# random valid blocks, written twice: as is, and with exactly those tensors dequantized to F32 by gguf.quants. The
# engine must compute the same logits from both (the oracle: gguf.quants' decoding through the F32 kernels).
_IQ_MODEL = {  # tensor -> type
    "blk.0.attn_q.weight": "IQ3_S", "blk.1.attn_output.weight": "IQ2_S",
    "blk.0.ffn_gate_exps.weight": "IQ2_XXS", "blk.0.ffn_up_exps.weight": "IQ2_XS", "blk.0.ffn_down_exps.weight": "IQ3_XXS",
    "blk.1.ffn_gate_exps.weight": "IQ1_S", "blk.1.ffn_up_exps.weight": "IQ1_M", "blk.1.ffn_down_exps.weight": "IQ2_S",
}


def _scaled_blocks(name, O, I, seed):
    """Random valid blocks with weights of RMS about 1/sqrt(I) (activations stay O(1) through the layers)."""
    probe = TT.random_blocks(name, O, I, np.random.default_rng(seed))
    rms = float(np.sqrt(np.mean(gq.dequantize(probe, QT[name]) ** 2)))
    return TT.random_blocks(name, O, I, np.random.default_rng(seed), 1.0 / (rms * np.sqrt(I)))


def _write_tiny_moe(path, dequantize: bool):
    import gguf

    d, F, E, L, V, H = 256, 256, 4, 2, 64, 4
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("iq test MoE")
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(d)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(H)
    w.add_rope_dimension_count(d // H)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(E)
    w.add_expert_used_count(2)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    toks = [f"<t{i}>" for i in range(V)]
    toks[3:6] = ["a", "b", "ab"]
    w.add_token_list(toks)
    w.add_token_types([1] * V)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    def f32(name, shape, scale):
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def mat(name, O, I, n_exp=None):
        t = _IQ_MODEL.get(name)
        if t is None:
            f32(name, (O, I) if n_exp is None else (n_exp, O, I), 1.0 / np.sqrt(I))
            return
        seed = zlib.crc32(name.encode())
        raws = [_scaled_blocks(t, O, I, seed + e) for e in range(n_exp or 1)]
        if dequantize:
            deq = np.stack([gq.dequantize(r, QT[t]).reshape(O, I) for r in raws]).astype(np.float32)
            w.add_tensor(name, deq if n_exp else deq[0])
        else:
            raw = np.stack(raws) if n_exp else raws[0]
            w.add_tensor(name, raw, raw_dtype=QT[t])

    f32("token_embd.weight", (V, d), 1.0)
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    f32("output.weight", (V, d), 1.0 / np.sqrt(d))
    for il in range(L):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(d, np.float32))
        for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
            mat(p + n + ".weight", d, d)
        f32(p + "ffn_gate_inp.weight", (E, d), 3.0 / np.sqrt(d))
        mat(p + "ffn_gate_exps.weight", F, d, E)
        mat(p + "ffn_up_exps.weight", F, d, E)
        mat(p + "ffn_down_exps.weight", d, F, E)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_engine_on_iquant_moe_equals_its_f32_dequantization(tmp_path):
    import coli
    from coli.gguf_file import open_gguf

    paths = {}
    for deq in (False, True):
        paths[deq] = tmp_path / f"iq-moe-{'f32' if deq else 'iq'}.gguf"
        _write_tiny_moe(paths[deq], deq)
    types = {n: t.type_name for n, t in open_gguf(str(paths[False])).tensors.items() if n in _IQ_MODEL}
    assert types == _IQ_MODEL
    ids = [3, 7, 11, 5, 40, 2, 9, 33, 17, 4, 60, 21]
    out = {}
    for deq, p in paths.items():
        eng = coli.Engine(str(p), threads=2, ctx=64, cpu_act="f32", quiet=True, save_usage=False)
        try:
            out[deq] = eng.logits(ids)
        finally:
            eng.close()
    want = out[True].astype(np.float64)
    assert np.isfinite(want).all() and want.std() > 0.1
    err = np.abs(out[False] - want).max() / np.abs(want).max()
    assert err < 1e-4, f"i-quant model vs its F32 dequantization: {err:.3g}"


@pytest.mark.skipif(not HAVE_VNNI, reason="the grid i-quants' t16 tiles are used only with AVX-512 VNNI")
def test_int8_engine_on_tiled_iquants_matches_the_expanded_layout(tmp_path, monkeypatch):
    """An int8 engine prepares the tiny MoE's IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M matrices
    (256 rows) as t16 tiles (cpu_kernels/tiles.py); with the tiles refused it expands them all. The
    int32 block dots are the same, only the f32 sums' order differs: the logits agree to f32 rounding."""
    import coli
    from cpu_kernels import tiles

    path = tmp_path / "iq-moe.gguf"
    _write_tiny_moe(path, False)
    ids = [3, 7, 11, 5, 40, 2, 9, 33, 17, 4, 60, 21]
    out = {}
    for layout in ("t16", "rows"):
        if layout == "rows":
            monkeypatch.setattr(tiles, "supports", lambda *a: False)
        eng = coli.Engine(str(path), threads=2, ctx=64, cpu_act="int8", quiet=True, save_usage=False)
        try:
            m = eng.model
            got = {}
            for il in range(2):
                ex = eng.cache.fetch(m.moe_layers[il], 0).result()
                got.update({f"blk.{il}.ffn_gate_exps.weight": ex.gate, f"blk.{il}.ffn_up_exps.weight": ex.up,
                            f"blk.{il}.ffn_down_exps.weight": ex.down})
            for name, w in got.items():
                tiled = layout == "t16" and w.name in tiles.SPEC
                assert w.name == _IQ_MODEL[name] and w.layout == ("t16" if tiled else "rows"), (layout, name)
            out[layout] = eng.logits(ids)
        finally:
            eng.close()
    want = out["rows"].astype(np.float64)
    assert np.isfinite(want).all() and want.std() > 0.1
    err = np.abs(out["t16"] - want).max() / np.abs(want).max()
    assert err < 1e-4, f"tiled vs expanded i-quants, int8 engine: {err:.3g}"
