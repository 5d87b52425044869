"""The 16-row interleaved layout (cpu_kernels/tiles.py) of Q4_0, Q4_1, Q8_0, Q5_0, Q4_K, Q6_K, MXFP4, IQ4_NL,
IQ4_XS, Q2_K, Q3_K, Q5_1, Q5_K, IQ2_XXS, IQ3_XXS, IQ3_S, IQ2_XS, IQ2_S, IQ1_S, IQ1_M and NVFP4 (and TQ1_0, TQ2_0 on
Q2_K's tile):
packing against the GGUF bytes, every
op against the NumPy reference through tests/kernels/test_backend_ops.py's cases (O a multiple of 16, so the weights
take the layout), a row's result independent of its batch, and the finite checks on the tiles' scales."""
from __future__ import annotations

import gguf.quants as gq
import numpy as np
import pytest
from numba import njit

from coli.base.memory import read_only
from coli.types import table as TT
from coli.base.errors import ColiError
from coli.finite import check_weight
from cpu_kernels import formats as F
from cpu_kernels import tiles
from cpu_kernels.experts import Act, Group
from cpu_kernels.vnni import HAVE_VNNI
from tests.kernels import test_backend_ops as BO

TYPES = list(tiles.SPEC)
TQ = list(tiles.AS_BLOCKS)   # TQ1_0, TQ2_0: written as Q2_K blocks at load, Q2_K's tile


def _bs(type_name):
    return tiles.SPEC[tiles.AS_BLOCKS.get(type_name, type_name)][0]
needs_vnni = pytest.mark.skipif(not HAVE_VNNI, reason="the t16 layout is used only with AVX-512 VNNI")


@njit(cache=False)
def _decode_all(rec, kind, O, I, out):
    for o in range(O):
        tiles.decode_row(rec[o // 16], kind, o % 16, I, out[o])


@pytest.mark.parametrize("type_name", TYPES)
def test_tiles_hold_the_file_and_decode_to_ggml_values(type_name):
    """Every row decoded from the tiles equals gguf.quants' dequantization; the scales read back are the
    file's f16 d (and m / dmin)."""
    rng = np.random.default_rng(3)
    bs, rb, _, bsz = tiles.SPEC[type_name]
    O, I = 48, 5 * bs
    raw = TT.random_blocks(type_name, O, I, rng)
    rec = tiles.pack(type_name, raw, O, I)
    assert rec.shape == (O // 16, I // bs * rb)
    # the file's bytes, except the unpacked sub-block scales of Q4_K (1.028x), Q5_K (1.023x), IQ4_XS (1.015x),
    # Q3_K (1.036x), and the grid i-quants' per-weight level codes and sign bits (IQ2_XXS 1.61x, IQ3_XXS 1.41x,
    # IQ3_S 1.25x, IQ2_XS 1.54x, IQ2_S 1.39x, IQ1_S 1.40x, IQ1_M 1.39x)
    assert rec.nbytes <= raw.nbytes * {"Q4_K": 1.03, "Q5_K": 1.023, "IQ4_XS": 1.015, "Q3_K": 1.037,
                                       "IQ2_XXS": 1.607, "IQ3_XXS": 1.409, "IQ3_S": 1.255,
                                       "IQ2_XS": 1.541, "IQ2_S": 1.391, "IQ1_S": 1.401,
                                       "IQ1_M": 1.393}.get(type_name, 1.0)
    want = TT.get(type_name).reference(raw, (O, I)).astype(np.float32)
    got = np.empty((O, I), np.float32)
    _decode_all(rec, tiles.KIND[type_name], O, I, got)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(np.abs(want).max()))
    if (type_name.startswith("IQ") and type_name not in ("IQ4_NL", "IQ4_XS")) or type_name == "NVFP4":
        # the grid i-quants' codes and scales re-encoded, NVFP4's UE4M3 scale x code (exact in f32): the
        # reference's f32 values bit for bit
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    d, m = tiles.scales(type_name, rec, O, I)
    blocks = raw.reshape(O, I // bs, bsz)

    def f16(lo):
        return blocks[..., lo:lo + 2].copy().view(np.float16)[..., 0].astype(np.float32)

    if type_name == "MXFP4":   # block_mxfp4's E8M0 byte, as gguf.quants decodes it (halved: the table is doubled)
        assert np.array_equal(d, gq.MXFP4.e8m0_to_fp32_half(np.ascontiguousarray(blocks[..., 0])))
        assert m is None
        return
    if type_name == "IQ1_M":   # d's 16 bits in the top nibbles of the four u16 scales (iq1m_scale_t)
        sc = np.ascontiguousarray(blocks[..., 48:56]).view("<u2")
        bits = sum((sc[..., k] >> np.uint16(12)) << np.uint16(4 * k) for k in range(4)).astype(np.uint16)
        assert np.array_equal(d, bits.view(np.float16).astype(np.float32)) and m is None
        return
    if type_name == "NVFP4":   # block_nvfp4's four UE4M3 bytes, as gguf.quants decodes them (a scale per 16)
        want_d = gq.NVFP4.ue4m3_to_fp32(np.ascontiguousarray(blocks[..., :4])).astype(np.float32).reshape(O, -1)
        assert np.array_equal(d, want_d) and m is None
        return
    offs = TT.get(type_name).scale_offsets      # d (and m / dmin) in the GGUF block: ggml-common.h
    assert np.array_equal(d, f16(offs[0]))
    if type_name in ("Q4_1", "Q4_K", "Q2_K", "Q5_1", "Q5_K"):
        assert np.array_equal(m, f16(offs[1]))
    else:
        assert m is None


def _fields_reference(blk, fields, rec):
    """The ``tiles._FIELDS`` spec by NumPy reshape / transpose: field (src, count, width, dst) of the blocks
    [T, 16, nb, block bytes] -> bytes dst .. dst + 16 count width of each record [T, nb, rec] as [count][row]
    [width]; the bytes no field writes stay 0."""
    T, R, nb, _ = blk.shape
    out = np.zeros((T, nb, rec), np.uint8)
    for src, cnt, w, dst in fields:
        items = blk[..., src:src + cnt * w].reshape(T, R, nb, cnt, w).transpose(0, 2, 3, 1, 4)
        out[..., dst:dst + cnt * R * w] = items.reshape(T, nb, cnt * R * w)
    return out


@pytest.mark.parametrize("type_name", list(tiles._FIELDS))
@pytest.mark.parametrize("T,nb", [(1, 1), (3, 5)])
def test_field_copy_matches_a_numpy_reference(type_name, T, nb):
    """``tiles._pack`` (the byte shuffle of every non-grid type) writes exactly the NumPy reference of its
    ``_FIELDS`` spec, odd tile and block counts, from a C-contiguous array and from a strided view (``pack`` makes
    it contiguous); ``pack`` keeps those bytes and fills the rest of each record (the unpacked sub-block scales)."""
    rng = np.random.default_rng(5)
    bs, rec, _, bsz = tiles.SPEC[type_name]
    O, I = 16 * T, nb * bs
    fields = tiles._FIELDS[type_name]
    wide = rng.integers(0, 256, (O, nb * bsz + 7), dtype=np.uint8)
    raw = wide[:, 3:3 + nb * bsz]                                         # a strided view of the blocks
    want = _fields_reference(np.ascontiguousarray(raw).reshape(T, 16, nb, bsz), fields, rec)
    got = np.zeros((T, nb, rec), np.uint8)
    tiles._pack(read_only(np.ascontiguousarray(raw).reshape(T, 16, nb, bsz)), got, np.array(fields, np.int64))
    assert np.array_equal(got, want)
    written = np.zeros(rec, bool)
    for _, cnt, w, dst in fields:
        assert not written[dst:dst + 16 * cnt * w].any()                 # the fields do not overlap
        written[dst:dst + 16 * cnt * w] = True
    filled = {"Q4_K": 256, "Q5_K": 256, "IQ4_XS": 128, "Q3_K": 256}.get(type_name, 0)  # NumPy-filled scales
    assert written.sum() + filled == rec
    if type_name == "NVFP4":   # pack then rewrites the UE4M3 scale bytes: 0x7F (0 for ggml) as 0, bit 7 cleared
        nc = tiles.SPEC[type_name][2]
        sc = want[..., nc:].copy()
        want[..., nc:] = np.where(sc == 0x7F, 0, sc & 0x7F)
    for r in (raw, np.ascontiguousarray(raw)):
        full = tiles.pack(type_name, r, O, I).reshape(T, nb, rec)
        assert np.array_equal(full[..., written], want[..., written])


@pytest.mark.parametrize("type_name", TYPES)
def test_the_kernel_reads_a_records_code_lines_in_order(type_name, monkeypatch):
    """Each tile kernel first reads the 64-byte lines of a record's codes (and their second plane: Q6_K's qh,
    Q5_K's qh, Q3_K's hmask, the IQ2 types' signs) in the order they are stored: a record read out of order
    streamed from memory at half the rate (docs/cpu_kernels.md "Q6_K in load order"). The emitter's load offsets
    are recorded while it writes its LLVM IR; nothing is compiled."""
    from llvmlite import ir

    seen = []
    ld = tiles._Rec.ld
    monkeypatch.setattr(tiles._Rec, "ld", lambda self, o, ty: (seen.append(o), ld(self, o, ty))[1])
    fn = ir.Function(ir.Module(), ir.FunctionType(ir.VoidType(), []), "f")
    i8p, fp = ir.IntType(8).as_pointer(), ir.FloatType().as_pointer()
    rows = [(ir.Constant(i8p, None), ir.Constant(fp, None), ir.Constant(fp, None), ir.Constant(fp, None))]
    tiles._emit_tile(ir.IRBuilder(fn.append_basic_block()), type_name, ir.Constant(i8p, None),
                     ir.Constant(ir.IntType(64), 1), rows)
    nc = tiles.SPEC[type_name][2]
    lines = list(dict.fromkeys(o // 64 for o in seen if o < nc))   # first touches of the code lines
    assert lines == sorted(lines) and len(lines) == nc // 64, lines


@pytest.mark.parametrize("type_name", TQ)
def test_ternary_types_take_q2_ks_tile_with_ggml_values(type_name):
    """TQ1_0 and TQ2_0 written as Q2_K blocks (every scale and min 1, dmin = d) decode from Q2_K's tile to
    gguf.quants' values bit for bit, in 84 / 66 (TQ2_0) and 84 / 54 (TQ1_0) of the file's bytes; the tile's d and
    dmin read back are the file's f16 d."""
    rng = np.random.default_rng(3)
    O, I = 48, 5 * 256
    raw = TT.random_blocks(type_name, O, I, rng)
    rec = tiles.pack(type_name, raw, O, I)
    assert rec.nbytes == raw.nbytes * 84 // TT.get(type_name).type_size
    want = TT.get(type_name).reference(raw, (O, I)).astype(np.float32)
    got = np.empty((O, I), np.float32)
    _decode_all(rec, tiles.KIND["Q2_K"], O, I, got)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    d, m = tiles.scales(type_name, rec, O, I)
    bsz = TT.get(type_name).type_size
    fd = raw.reshape(O, I // 256, bsz)[..., bsz - 2:].copy().view(np.float16)[..., 0].astype(np.float32)
    assert np.array_equal(d, fd) and np.array_equal(m, fd)


@needs_vnni
@pytest.mark.parametrize("type_name", TYPES + TQ)
def test_prepare_takes_tiles_only_where_they_fit(type_name, monkeypatch):
    rng = np.random.default_rng(4)
    I = 2 * _bs(type_name)
    assert F.prepare(type_name, TT.random_blocks(type_name, 48, I, rng), (48, I)).layout == "t16"
    assert F.prepare(type_name, TT.random_blocks(type_name, 40, I, rng), (40, I)).layout == "rows"
    monkeypatch.setattr(F, "TILES", False)
    assert F.prepare(type_name, TT.random_blocks(type_name, 48, I, rng), (48, I)).layout == "rows"


class _TileBackend(BO.Backend):
    """The CPU backend, asserting that every weight it prepares took the layout under test."""

    def __init__(self, layout):
        super().__init__("cpu-" + layout)
        self.layout = layout
        self.seen = 0

    def matmul(self, type_name, raw, shape, x, act):
        w = F.prepare(type_name, raw, shape)
        assert w.layout == self.layout, (type_name, shape, w.layout)
        self.seen += 1
        self.calls += 1
        return F.matmul(w, x, act=act)

    def experts(self, specs, x, rows, eids, act):
        for s in specs:
            for type_name, raw, shape in s:
                assert F.prepare(type_name, raw, shape).layout == self.layout
                self.seen += 1
        return super().experts(specs, x, rows, eids, act)


@needs_vnni
@pytest.mark.parametrize("layout", ["t16", "rows"])
@pytest.mark.parametrize("act", ["int8", "f32"])
@pytest.mark.parametrize("op", BO.BACKEND_OPS["cpu"])
@pytest.mark.parametrize("type_name", TYPES + TQ)
def test_op_matches_reference_in_both_layouts(type_name, op, act, layout, monkeypatch):
    """test_backend_ops's case with 48 and 80 output rows (multiples of 16; its own cases use 37 and 69, which
    keep the row layout), every op and activation mode, tiles on and off."""
    monkeypatch.setattr(BO, "O_ODD", 48)
    monkeypatch.setattr(F, "TILES", layout == "t16")
    be = _TileBackend(layout)
    e = BO.run_case(be, type_name, op, act)
    assert be.seen > 0
    assert e < BO.TOL[(op, act)], f"{layout} {type_name} {op} act={act}: error {e:.3g}"


@needs_vnni
@pytest.mark.parametrize("type_name", TYPES + TQ)
def test_a_rows_result_does_not_depend_on_its_batch(type_name):
    """Decode (one row), a few rows and a prompt chunk run the same per-row tile arithmetic: bit-equal."""
    rng = np.random.default_rng(5)
    O, I = 64, {256: 3 * 256, 64: 320}.get(_bs(type_name), 288)
    w = F.prepare(type_name, TT.random_blocks(type_name, O, I, rng), (O, I))
    assert w.layout == "t16"
    x = rng.standard_normal((40, I)).astype(np.float32)
    g = Group([w])
    whole = g(Act(x, "int8"))
    for lo, hi in ((0, 1), (7, 8), (20, 22), (3, 6), (10, 40)):   # one row, 2 rows, 3, and 7 x 4 + 2
        assert np.array_equal(g(Act(np.ascontiguousarray(x[lo:hi]), "int8")), whole[lo:hi]), (lo, hi)


@needs_vnni
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K", "IQ4_XS", "Q2_K"])
def test_a_rows_fused_gate_up_does_not_depend_on_its_batch(type_name):
    """The fused gate/up of one row (a decode row's FFN or expert: its work items' scratch on the stack) and of a
    batch of rows run the same tile arithmetic: the FFN's outputs bit-equal, with both activation functions."""
    from cpu_kernels.experts import ACT_GEGLU, ACT_SWIGLU, FFN
    rng = np.random.default_rng(9)
    D, Fd = (512, 256) if _bs(type_name) == 256 else (288, 96)
    g, u = (F.prepare(type_name, TT.random_blocks(type_name, Fd, D, rng), (Fd, D)) for _ in range(2))
    d = F.prepare(type_name, TT.random_blocks(type_name, D, Fd, rng), (D, Fd))
    assert g.layout == u.layout == d.layout == "t16"
    x = rng.standard_normal((6, D)).astype(np.float32)
    for kind in (ACT_SWIGLU, ACT_GEGLU):
        f = FFN(g, u, d, kind, 0.0, "int8")
        whole = f(Act(x, "int8"))
        assert np.isfinite(whole).all() and np.abs(whole).max() > 0
        for r in range(6):
            assert np.array_equal(f(Act(np.ascontiguousarray(x[r:r + 1]), "int8")), whole[r:r + 1]), (kind, r)


@needs_vnni
@pytest.mark.parametrize("type_name,field", [("Q8_0", 0), ("Q4_0", 0), ("Q4_1", 0), ("Q4_1", 2), ("Q5_0", 0),
                                              ("Q4_K", 0), ("Q4_K", 2), ("Q6_K", 208), ("IQ4_NL", 0),
                                              ("IQ4_XS", 0), ("Q2_K", 80), ("Q2_K", 82), ("Q3_K", 108),
                                              ("Q5_1", 0), ("Q5_1", 2), ("Q5_K", 0), ("Q5_K", 2),
                                              ("IQ2_XXS", 0), ("IQ3_XXS", 0), ("IQ3_S", 0), ("IQ2_XS", 0),
                                              ("IQ2_S", 0), ("IQ1_S", 0), ("IQ1_M", 48)])
def test_a_non_finite_scale_inside_a_tile_is_named(type_name, field):
    rng = np.random.default_rng(6)
    O, I = 48, 3 * tiles.SPEC[type_name][0]
    raw = TT.random_blocks(type_name, O, I, rng)
    bsz = tiles.SPEC[type_name][3]
    inf = np.array([np.inf], np.float16).view(np.uint16)[0]
    if type_name == "IQ1_M":   # d's 16 bits in the top nibbles of the four u16 scales at 48 (iq1m_scale_t)
        sc = np.ascontiguousarray(raw[37, bsz + 48:bsz + 56]).view("<u2")
        sc[:] = (sc & np.uint16(0x0FFF)) | (((inf >> np.uint16([0, 4, 8, 12])) & np.uint16(15)) << np.uint16(12))
        raw[37, bsz + 48:bsz + 56] = sc.view(np.uint8)
    else:
        raw[37, bsz + field:bsz + field + 2] = np.array([inf], np.uint16).view(np.uint8)   # row 37, block 1
    w = F.prepare(type_name, raw, (O, I))
    assert w.layout == "t16"
    # Q4_1's and Q5_1's m, Q4_K's, Q5_K's and Q2_K's dmin (at 2, 82); Q6_K's d at 208, Q2_K's at 80, Q3_K's at 108
    what = "block minimum" if field in (2, 82) else "block scale"
    with pytest.raises(ColiError, match=f"non-finite {what} .*in row 37"):
        check_weight(w, "t.gguf: tensor 'blk.0.ffn_up.weight'")


def _nvfp4_every_scale_byte(O, I, rng):
    """Random NVFP4 bytes whose UE4M3 scale bytes run through 0..255 (0x7F, subnormals, bit 7 set, 0xFF = 240)."""
    raw = rng.integers(0, 256, size=(O * I // 64, 36), dtype=np.uint8)
    raw[:, :4] = (np.arange(raw.shape[0] * 4) % 256).astype(np.uint8).reshape(-1, 4)
    return raw.reshape(O, I // 64 * 36)


def test_nvfp4_tile_decodes_every_scale_byte_bit_for_bit():
    """The tile rewrites NVFP4's UE4M3 bytes (0x7F as 0x00, bit 7 cleared): every one of the 256 bytes still
    decodes to gguf.quants' value, bit for bit, and the scales read back are gguf.quants' (and finite)."""
    rng = np.random.default_rng(8)
    O, I = 32, 64 * 8
    raw = _nvfp4_every_scale_byte(O, I, rng)
    rec = tiles.pack("NVFP4", raw, O, I)
    assert rec.nbytes == raw.nbytes
    want = gq.dequantize(raw, gq.GGMLQuantizationType.NVFP4).reshape(O, I).astype(np.float32)
    got = np.empty((O, I), np.float32)
    _decode_all(rec, tiles.KIND["NVFP4"], O, I, got)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    d, _ = tiles.scales("NVFP4", rec, O, I)
    assert np.array_equal(d, gq.NVFP4.ue4m3_to_fp32(raw.reshape(O, -1, 36)[..., :4]).astype(np.float32).reshape(O, -1))


@needs_vnni
def test_nvfp4_tile_gemv_on_every_scale_byte_matches_the_int8_reference():
    """The tile kernels decode the UE4M3 bytes in registers (cpu_kernels/tiles.py): with every byte present, one
    row and a batch of 6 match the exact NumPy dot of gguf.quants' weights and the int8 activation blocks (f64) to
    f32 rounding, and the finite check passes on the tile."""
    from tests.kernels.test_experts import _act_rows

    rng = np.random.default_rng(9)
    O, I = 64, 64 * 8
    raw = _nvfp4_every_scale_byte(O, I, rng)
    w = F.prepare("NVFP4", raw, (O, I))
    assert w.layout == "t16"
    check_weight(w, "t.gguf: tensor 'blk.0.ffn_up.weight'")
    W = gq.dequantize(raw, gq.GGMLQuantizationType.NVFP4).reshape(O, I).astype(np.float64)
    x = rng.standard_normal((6, I)).astype(np.float32)
    want = _act_rows(x, "int8") @ W.T
    scale = np.abs(_act_rows(x, "int8")) @ np.abs(W).T    # the size of the sums' terms, per output
    for xs in (x[:1], x):
        got = F.matmul(w, np.ascontiguousarray(xs), act="int8")
        assert (np.abs(got - want[:len(xs)]) <= 1e-6 * scale[:len(xs)]).all()


@pytest.mark.parametrize("type_name", [t for t in TYPES if t not in ("MXFP4", "NVFP4")])
def test_the_scale_bit_check_agrees_with_the_scales(type_name):
    """``tiles.f16_scales_finite`` (the finite checks' fast path, on the f16 bits) is True exactly when every
    value ``tiles.scales`` reads back is finite: the largest finite f16 (0x7BFF, -0x7BFF), inf, -inf and a NaN
    written into a d (and m / dmin) of the records, one at a time."""
    rng = np.random.default_rng(7)
    bs = tiles.SPEC[type_name][0]
    O, I = 32, 3 * bs
    rec = tiles.pack(type_name, TT.random_blocks(type_name, O, I, rng), O, I)
    d, m = tiles.scales(type_name, rec, O, I)
    assert np.isfinite(d).all() and (m is None or np.isfinite(m).all())
    assert tiles.f16_scales_finite(type_name, rec, O, I)
    _, rb, nc, _ = tiles.SPEC[type_name]
    for bits in (0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E01):
        for which in ("d", "m") if m is not None else ("d",):
            r = rec.copy()      # the f16 of row 21 (tile 1, row 5), block 1
            o = nc + tiles._SCALE_AT.get(type_name, 0) + (32 if which == "m" else 0) + 2 * 5
            r.reshape(O // 16, I // bs, rb)[1, 1, o:o + 2] = np.array([bits], "<u2").view(np.uint8)
            d1, m1 = tiles.scales(type_name, r, O, I)
            want = np.array([bits], "<u2").view(np.float16).astype(np.float32)
            assert np.array_equal((d1 if which == "d" else m1)[21, 1:2], want, equal_nan=True)   # that scale
            finite = bool(np.isfinite(d1).all() and (m1 is None or np.isfinite(m1).all()))
            assert finite == (bits in (0x7BFF, 0xFBFF))
            assert tiles.f16_scales_finite(type_name, r, O, I) == finite
    mx = tiles.pack("MXFP4", TT.random_blocks("MXFP4", O, 64, rng), O, 64)
    assert not tiles.f16_scales_finite("MXFP4", mx, O, 64)   # E8M0 scales: not f16, the caller's full path
    nv = tiles.pack("NVFP4", TT.random_blocks("NVFP4", O, 64, rng), O, 64)
    assert not tiles.f16_scales_finite("NVFP4", nv, O, 64)   # UE4M3 bytes: the full path too


@needs_vnni
def test_the_engines_activation_mode_picks_the_layout(tmp_path):
    """The tiles are the int8 kernels' layout: an int8 engine prepares its Q8_0 matrices and RAM-cache experts
    as t16, an f32 engine keeps the row layouts (whose f32 kernels measured 2x faster than decoding tiles)."""
    from coli.engine import Engine
    from tests.conftest import FIXTURES
    from tests.oracle_check import copy_gguf, q8_matrices

    path = copy_gguf(FIXTURES / "oracles" / "qwen3next.gguf", tmp_path / "q8.gguf", convert=q8_matrices)
    for act, layout in (("int8", "t16"), ("f32", "rows")):
        with Engine(path, cpu_act=act, usage=str(tmp_path / "u"), save_usage=False, quiet=True) as eng:
            m = eng.model
            w = m.w_out
            assert w.name == "Q8_0" and w.shape[0] % 16 == 0 and w.layout == layout, (act, w)
            layer = m.moe_layers[0]
            ex = eng.cache.fetch(layer, 0).result()   # read and prepared as a step would
            assert ex.gate.name == "Q8_0" and ex.gate.layout == layout, (act, ex.gate.layout)


@needs_vnni
@pytest.mark.parametrize("act", ["int8", "f32"])
def test_zero_rows_give_an_empty_result_in_both_layouts(act):
    """x f32 [0, I] -> f32 [0, O], as the row layouts' matmul returns (a t16 weight runs through a one-weight
    experts.Group, whose row slots once divided by T)."""
    rng = np.random.default_rng(7)
    raw = TT.random_blocks("Q4_0", 32, 64, rng)
    for tl, layout in ((True, "t16"), (False, "rows")):
        w = F.prepare("Q4_0", raw, (32, 64), tiles=tl)
        assert w.layout == layout
        y = F.matmul(w, np.zeros((0, 64), np.float32), act)
        assert y.shape == (0, 32) and y.dtype == np.float32
