"""The 16-row interleaved weight layout ("t16") of Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K,
MXFP4, NVFP4, IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M for the int8 (VNNI) kernels.

The row layouts of ``formats`` give each output row its own dot product: a few ``vpdpbusd`` per row, then a
horizontal sum and the block scales one at a time. For a decode GEMV that is compute-bound on one core (a
576-wide Q4_1 row costs ~100 cycles; docs/cpu_kernels.md "t16 tiles"). llama.cpp's CPU "extra buffer" types
(``ggml-cpu/repack.cpp``, ``ggml-cpu/amx``) interleave rows instead, so that one instruction serves several
output rows. coli does the same, with AVX-512 VNNI: a tile is 16 consecutive output rows, stored block by block
as one stream of records:

======  ======  ===============================================================================================
type    record  one record = one 32-weight block of the tile's 16 rows (bytes)
======  ======  ===============================================================================================
Q4_0    288     codes [g = 0..3][row 0..15][4 bytes of ggml's qs: bytes 4g..4g+3], then d f16 [16]
Q4_1    320     codes as Q4_0, then d f16 [16], then m f16 [16]
Q8_0    544     codes [g = 0..7][row 0..15][qs int8 4g..4g+3], then d f16 [16]
Q5_0    352     codes as Q4_0, then qh uint32 [16] (ggml's fifth bits, bit j: element j), then d f16 [16]
Q4_K    2368    per 256-weight super-block: codes [j = 0..3][g = 0..7][row][qs 32j+4g..32j+4g+3], sub-block
                scales uint8 [8][16] and mins uint8 [8][16] (ggml's 6-bit ``get_scale_min_k4`` unpacked), then
                d f16 [16], dmin f16 [16]
Q6_K    3360    per 256-weight super-block, in the kernel's load order (``_q6_k_at``): four 832-byte parts
                (n, h) = (0, 0), (0, 1), (1, 0), (1, 1), each four triples of 64-byte lines [ql group 16n + 4h + gg,
                ql group 16n + 8 + 4h + gg, qh group 8n + 4h + gg][row] (gg = 0..3; a group: 4 bytes), then the
                int8 scales of sub-blocks 8n + h, 8n + 2 + h, 8n + 4 + h, 8n + 6 + h [4][16 rows]; then d f16 [16]
Q5_1    384     codes as Q4_0, then qh uint32 [16], then d f16 [16], then m f16 [16]
Q5_K    2880    per 256: codes as Q4_K and qh [g = 0..7][row][qh 4g..4g+3] in load order (``_il``: code line l and
                qh line l alternating for l < 8, then code lines 8..31), then Q4_K's unpacked scales and mins,
                d f16 [16], dmin f16 [16]
Q2_K    1344    per 256: qs [g = 0..15][row][qs 4g..4g+3], ggml's scale bytes [16][16 rows] (scale low nibble, min
                high), d f16 [16], dmin f16 [16]
Q3_K    1824    per 256: qs as Q2_K and hmask [g = 0..7][row][4 bytes] in load order (``_il``: qs line l and hmask
                line l alternating for l < 8, then qs lines 8..15), scales - 32 int8 [16][16 rows]
                (``lowbit.q3_k_scales``), d f16 [16]
MXFP4   272     codes as Q4_0, then the E8M0 exponents uint8 [16]
NVFP4   576     per 64: codes [g = 0..7][row][4 bytes of ggml's qs: bytes 4g..4g+3] (sub-block g / 2), then the
                UE4M3 scale bytes [s = 0..3][16 rows] (0x7F written as 0x00 and bit 7 cleared: the same values)
IQ4_NL  288     codes as Q4_0, then d f16 [16]
IQ4_XS  2208    per 256: codes [ib = 0..7][g = 0..3][row][4 bytes of sub-block ib's 16], ls - 32 int8 [8][16 rows]
                (``dequantize_row_iq4_xs``'s 6-bit scales unpacked), d f16 [16]
IQ2_XXS 1696    per 256: level codes (2 bits, into 8, 25, 43) as Q2_K's qs, sign bits [g = 0..7][row][4 bytes]
                (Q3_K's hmask: bit ib of byte l, element 32 ib + l; the two interleaved as Q3_K's), 2s + 1 int8
                [ib = 0..7][16 rows], d f16 [16]
IQ2_XS  1824    as IQ2_XXS with a scale per 16: 2s + 1 int8 [u = 0..15][16 rows], d f16 [16]
IQ2_S   1824    as IQ2_XS
IQ3_XXS 2208    per 256: nibbles c | sign << 3 (c: 3-bit level code into 4, 12, ..., 52, 62) as IQ4_XS's codes,
                2s + 1 int8 [ib = 0..7][16 rows], d f16 [16]
IQ3_S   2208    as IQ3_XXS, levels 1, 3, ..., 15, and 1 + 2s per sub-block
IQ1_S   1120    per 256: level codes grid + 1 (0, 1, 2) as Q2_K's qs, nibbles s | neg << 3 (3-bit scale, delta
                sign) [ib / 2][16 rows] (even ib: low nibble), d f16 [16]
IQ1_M   1248    per 256: codes as IQ1_S, 3-bit scale nibbles [ib][16 rows] (first 16 weights: low nibble), delta
                sign bits [8-group / 8][16 rows] (bit: 8-group % 8), d f16 [16] (from ``iq1m_scale_t``)
======  ======  ===============================================================================================

so a 64-byte load holds 4 codes (8 nibbles) of each of the 16 rows. ggml's Q4 byte j holds element j (low
nibble) and element j + 16 (high nibble) of a block (``ggml-common.h`` ``block_q4_0``), so group g's low nibbles
meet activation codes 4g..4g+3 and its high nibbles 16+4g..16+4g+3, each broadcast to all 16 lanes:
``vpdpbusd`` then gives 16 rows' exact int32 partial dots at once and a block's 16 sums need no horizontal
reduction. Per block: ``acc16 += float(isum16) * (d16 * xd[b])``, plus ``m16 * xm[b]`` (Q4_1) or minus
``8 * d16 * xm[b]`` (Q4_0), with xm[b] = xd[b] * (sum of the block's activation codes), the activation blocks of
``formats._quantize_act_i8`` (llama.cpp's Q8 blocks). Q5_0: its fifth bits spread into bit 4 of each code byte in
registers, and its -16 taken off in int32 (``isum16 - 16 S``, S the exact sum of the block's 32 activation codes),
so its block dot is Q8_0's on the codes q - 16: a prompt's rows run Q8_0's ``tile4u_q8_0`` on the tile widened
once per work item (``widen_t16_q5_0``), bit-identical. Q8_0's signed codes are ``vpdpbusd``'s signed operand
and the activations its unsigned one as ``x ^ 0x80`` (= x + 128), with 128 x the codes' sum taken off exactly in
int32 (as the table types below). Q4_K: per sub-block pair the low nibbles meet sub-block 2j's activations and the high
ones 2j+1's; per super-block ``acc16 += d16 * sum_s sc16_s * xd[s] * isum16_s - dmin16 * sum_s mn16_s * xm[s]``
(``vnni.row_q4_k``'s formula). Q6_K: the 6-bit codes q are put together in registers from ql and qh as ggml's
``dequantize_row_q6_K`` does (four 32-element quarters per 128), multiplied unsigned, and each 16-element
sub-block's dot corrected exactly by 32 x the sum of its activation codes; per super-block
``acc16 += d16 * sum_s sc16_s * xd[s/2] * (isum16_s - 32 S_s)``, S_s the exact int32 sum of the sub-block's
16 activation codes. Q5_1: Q5_0's codes with Q4_1's ``+ m16 * xm[b]``. Q5_K: Q4_K's tile with qh's bits 2j, 2j + 1
moved into bit 4 of the nibbles in registers. Q2_K, Q3_K (``dequantize_row_q2_K``/``q3_K``): per 128-element half
n the 2-bit codes ``(qs >> 2j) & 3`` of sub-blocks u = 8n + 2j + h (Q3_K: hmask bit 4n + j as bit 2, then its -4
as ``4 S_u``); ``acc16 += d16 * sum_u sc16_u * xd[u/2] * isum16_u - dmin16 * sum_u mn16_u * xd[u/2] * S_u``
(Q2_K) or ``d16 * sum_u sc16_u * xd[u/2] * (isum16_u - 4 S_u)`` (Q3_K). MXFP4, IQ4_NL, IQ4_XS: the nibbles index a
16-entry int8 table (``vpshufb`` with the table in every 128-bit lane, as llama.cpp's ``ggml_vec_dot_iq4_nl``);
the looked-up weights w are signed, so they take vpdpbusd's signed operand and the activations its unsigned one as
x + 128 (``x ^ 0x80``): ``dot = sum w x + 128 sum w``, and ``sum w`` per block and row (one more vpdpbusd against
ones, weight-side, so shared by a batch's rows) is subtracted exactly in int32. Per block
``acc16 += float(isum16 - 128 wsum16) * (d16 * xd[b])``; MXFP4's d16 is ``2^(e - 128)`` built from the E8M0 byte
in integer registers (ggml's ``ggml_e8m0_to_fp32_half``, exact; the table holds doubled e2m1 values); IQ4_XS:
``d16 * sum_ib ls16_ib * xd[ib] * (isum - 128 wsum)_ib`` per super-block. NVFP4 (``dequantize_row_nvfp4``: w =
kvalues_mxfp4[q] * ue4m3(d_s) / 2, a scale per 16) is MXFP4's tile on its own 64-weight block: byte j of sub-block
s's 8 holds weight 16s + j (low nibble) and 16s + 8 + j (high), so group g's nibbles meet activation codes
16s + 4(g & 1) and 16s + 8 + 4(g & 1); the weight sum is one vpdpbusd per sub-block on the four looked-up vectors
added bytewise (|sum| <= 48); the scales are decoded in registers from the UE4M3 byte u (``pack`` writes 0x7F as 0
and clears bit 7, ggml decoding both the same way): the f32 bits ``(u << 20) + (119 << 23)`` (E4M3's exponent
bias 7 moved to f32's 127, the 1/2 of the doubled table folded in), or ``u * 2^-10`` for u < 8 (subnormal), exact;
``acc16 += xd[b] * sum_(s in b) float(isum16_s - 128 wsum16_s) * sc16_s`` per 32-weight activation block b
(ggml's ``ggml_vec_dot_nvfp4_q8_0``: ``dy * d * sumi`` per sub-block).

IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (``dequantize_row_iq2_xxs``/``iq2_xs``/``iq2_s``/``iq3_xxs``: w = d
(0.5 + s) / 4 (IQ3_XXS / 2) x grid x sign; ``iq3_s``: d (1 + 2s) x grid x sign): every value of their grids is
one of 3 (IQ2: 8, 25, 43) or 8 (IQ3_XXS: 4, 12, ..., 52, 62; IQ3_S: 1, 3, ..., 15) levels (``coli.types.iq_tables``),
so ``pack`` (``_pack_grid``) re-encodes each weight as its level code and sign bit (ksigns' parity bit written
out) and the kernels decode them in registers, no table gathers. IQ3_XXS and IQ3_S are IQ4_XS's tile with the 16
signed levels as its table. IQ2_* cut 2-bit codes as Q2_K's tile, look them up as unsigned levels (``vpshufb``:
8, 25, 43) and put the signs on the broadcast activation codes instead (a masked negation under a ``vptestmb``
of the sign plane; |x| <= 127), so ``vpdpbusd`` needs neither the x + 128 trick nor a weight sum. All then run
IQ4_XS's arithmetic with the integer sub-block scale 2s + 1 and d / 8 (IQ3_XXS: d / 4; a power of two, exact;
IQ3_S: d) once per super-block; IQ2_XS and IQ2_S sum the two 16-weight halves of a sub-block apart for their
scales per 16. Bytes: 1.61x (IQ2_XXS), 1.54x (IQ2_XS), 1.39x (IQ2_S), 1.41x (IQ3_XXS) and 1.25x (IQ3_S) the
file, against 4.36x, 4.32x, 3.90x, 2.94x and 2.62x for their expanded row layout (``cpu_kernels.iquants``): the
file's grid index holds 8 weights in 8-10 bits (IQ3: 4 in 8 or 9), the level codes take 16 (12)
(docs/iquants.md).

IQ1_S, IQ1_M (``dequantize_row_iq1_s``/``iq1_m``: w = d (2s + 1) (grid + delta), grid in {-1, 0, 1}, delta =
+-1/8 per 32 / per 8 weights): ``pack`` (``_pack_iq1``) writes c = grid + 1 as Q2_K's 2-bit codes; the kernels
build a weight byte from 8c (a shift and a mask) and a per-row delta term (constant over a dword lane, as a lane
holds 4 weights of one 8-group), either the unsigned 8c + 2 [delta > 0] against the activations, minus 9 x the
scale group's activation code sum (IQ1_S; IQ1_M with one activation row), or the signed 8 (grid + delta) = 8c - 7
or 8c - 9 with the table types' operand order (x + 128, 128 x the weight sum off in int32: IQ1_M's ``tile4``);
the same int32 dots. Then the integer scale 2s + 1 and d / 8 once per super-block (a power of two, exact).
1.40x (IQ1_S) and 1.39x (IQ1_M) the file, against 5.76x and 5.71x expanded.

The scales stay f16 (one ``vcvtph2ps`` per 16 rows), so a tile holds the file's bytes (the unpacked 6-bit
sub-block scales: Q4_K 1.028x, Q5_K 1.023x, IQ4_XS 1.015x, Q3_K 1.036x; the grid i-quants above 1.25-1.61x): the
GEMV streams about 1.0x the file instead of the row layouts' 1.06-1.67x.

Results: the same exact int32 block dots as the row kernels; the f32 sums over blocks run in block order per
row (the row kernels sum lanes of partial dots), so the two layouts agree to f32 rounding, not bit for bit.
Every t16 path (decode, expert batch, prompt rows) runs the same per-row tile arithmetic, so a row's result never
depends on how it was batched.

TQ1_0, TQ2_0 (ternary, ``dequantize_row_tq1_0``/``tq2_0``: w = d (t - 1), t in 0..2): ``pack`` writes their blocks as
Q2_K blocks (``AS_BLOCKS``: the 2-bit codes in Q2_K's order, every 4-bit scale and min 1, dmin = d, so Q2_K's
d x 1 x q - dmin x 1 = d (q - 1) exactly) and they take Q2_K's tile: 1.27x (TQ2_0) and 1.56x (TQ1_0, whose base-3
digits are decoded at load) the file, against 1.58x / 1.93x for their Q2_K row layouts.

Used where ``formats.prepare`` sees VNNI (``HAVE_VNNI``), ``formats.TILES`` on and O a multiple of 16. The float
types keep their row layouts (and every type where the tiles do not apply: no VNNI, O not a multiple of 16).
"""
from __future__ import annotations

import numpy as np
import gguf.quants as gq
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils

from coli.base.memory import read_only

from .vnni import _F32, _F32x16, _I8x64, _I32, _I32x8, _I32x16, _Ops, _arrays, vnni_intrinsic

_JIT = dict(nogil=True, cache=True, fastmath=True)

ROWS = 16
#: bytes ahead of the record in use that the tile loops prefetch (one ``prefetcht0`` per cache line of a record, an
#: iteration): a decode token streams every layer's tiles once, and on the 2-core VM the hardware prefetchers alone
#: left the GEMVs well below the read bandwidth (docs/cpu_kernels.md "Software prefetch")
PREFETCH = 2048
#: per type: (weights per record, record bytes, code bytes, GGUF block bytes); the kinds of ``decode_row``
SPEC = {"Q4_0": (32, 288, 256, 18), "Q4_1": (32, 320, 256, 20), "Q8_0": (32, 544, 512, 34),
        "Q5_0": (32, 352, 256, 22), "Q4_K": (256, 2368, 2048, 144), "Q6_K": (256, 3360, 3072, 210),
        "MXFP4": (32, 272, 256, 17), "IQ4_NL": (32, 288, 256, 18), "IQ4_XS": (256, 2208, 2048, 136),
        "Q2_K": (256, 1344, 1024, 84), "Q3_K": (256, 1824, 1536, 110), "Q5_1": (32, 384, 256, 24),
        "Q5_K": (256, 2880, 2560, 176), "IQ2_XXS": (256, 1696, 1536, 66), "IQ3_XXS": (256, 2208, 2048, 98),
        "IQ3_S": (256, 2208, 2048, 110), "IQ2_XS": (256, 1824, 1536, 74), "IQ2_S": (256, 1824, 1536, 82),
        "IQ1_S": (256, 1120, 1024, 50), "IQ1_M": (256, 1248, 1024, 56), "NVFP4": (64, 576, 512, 36)}
RECORD = {k: v[1] for k, v in SPEC.items()}
#: types written at load as another type's GGUF blocks, then tiled as that type (``_as_blocks``)
AS_BLOCKS = {"TQ1_0": "Q2_K", "TQ2_0": "Q2_K"}
KIND = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q5_0": 3, "Q4_K": 4, "Q6_K": 5, "MXFP4": 6, "IQ4_NL": 7, "IQ4_XS": 8,
        "Q2_K": 9, "Q3_K": 10, "Q5_1": 11, "Q5_K": 12, "IQ2_XXS": 13, "IQ3_XXS": 14, "IQ3_S": 15,
        "IQ2_XS": 16, "IQ2_S": 17, "IQ1_S": 18, "IQ1_M": 19, "NVFP4": 20}
#: the 16-entry int8 tables of the 4-bit table types (gguf.quants: MXFP4's doubled e2m1 values, ggml's
#: ``kvalues_mxfp4``; IQ4_NL/IQ4_XS's ``kvalues_iq4nl``; the grid i-quants' signed levels, from ``_levels``)
_LUT = {"MXFP4": 0, "IQ4_NL": 1, "IQ4_XS": 1, "IQ3_XXS": 2, "IQ3_S": 4}


def _levels(type_name):
    """The distinct values of a grid i-quant's codebook (coli.types.iq_tables: IQ2 8, 25, 43; IQ3_XXS 4, 12, ..., 52,
    62; IQ3_S 1, 3, ..., 15), ascending: a grid entry is a code per weight into these (2 bits for the IQ2 types,
    3 for the IQ3 types)."""
    from coli.types import iq_tables

    return np.unique(iq_tables.grid(type_name)).astype(np.int8)


#: IQ3_XXS's nibble c | sign << 3 -> the signed weight code (the 8 levels, then their negatives)
_IQ3_TABLE = np.concatenate([_levels("IQ3_XXS"), -_levels("IQ3_XXS")]).astype(np.int8)
#: the IQ2 types' 3-bit c | sign << 2 -> signed code (the 3 levels, 0, their negatives, 0; 8 unused entries;
#: ``decode_row``; the kernels look up the first 4)
_IQ2_TABLE = np.zeros(16, np.int8)
_IQ2_TABLE[:3], _IQ2_TABLE[4:7] = _levels("IQ2_XXS"), -_levels("IQ2_XXS")
#: IQ3_S's nibble c | sign << 3 -> signed code (1, 3, ..., 15, then their negatives)
_IQ3S_TABLE = np.concatenate([_levels("IQ3_S"), -_levels("IQ3_S")]).astype(np.int8)
assert len(_levels("IQ2_XXS")) == 3 and len(_levels("IQ3_XXS")) == 8 and len(_levels("IQ3_S")) == 8
_TABLES = np.array([gq.MXFP4.kvalues, gq.IQ4_NL.kvalues, _IQ3_TABLE, _IQ2_TABLE, _IQ3S_TABLE], np.int8)
assert tuple(gq.NVFP4.kvalues) == tuple(gq.MXFP4.kvalues)   # NVFP4 looks its codes up in MXFP4's table


def _ue4m3_byte(u):
    """NVFP4's UE4M3 scale bytes uint8 -> the tile's bytes (0x7F -> 0x00, bit 7 cleared: the same values)."""
    return np.where(u == 0x7F, 0, u & 0x7F).astype(np.uint8)


_U7 = np.arange(128, dtype=np.uint32)
#: the tile's UE4M3 byte u (< 128) -> its f32 scale, halved as ggml_ue4m3_to_fp32: u * 2^-10 below 8 (subnormal),
#: else the f32 bits (u << 20) + (119 << 23), the formula the kernels use; checked against gguf.quants on every byte
_UE4M3 = np.where(_U7 < 8, _U7.astype(np.float32) * np.float32(2.0 ** -10),
                  ((_U7 << 20) + (119 << 23)).view(np.float32)).astype(np.float32)
_B8 = np.arange(256, dtype=np.uint8)
assert np.array_equal(_UE4M3[_ue4m3_byte(_B8)].view(np.uint32),
                      gq.NVFP4.ue4m3_to_fp32(_B8).astype(np.float32).view(np.uint32))
#: record bytes and code bytes by kind (``SPEC`` as tuples: constants inside the compiled ``decode_row``)
_REC = tuple(SPEC[n][1] for n in sorted(KIND, key=KIND.get))
_NC = tuple(SPEC[n][2] for n in sorted(KIND, key=KIND.get))   # experts.FC_T4_0 + kind


def supports(type_name: str, O: int, I: int) -> bool:
    """True when a [O, I] weight of this type can take the t16 layout (the type has one, O % 16 == 0)."""
    t = AS_BLOCKS.get(type_name, type_name)
    return t in SPEC and O % ROWS == 0 and O > 0 and I % SPEC[t][0] == 0


_POW3 = np.array([1, 3, 9, 27, 81], np.uint8)


def tq1_0_codes(blocks: np.ndarray) -> np.ndarray:
    """block_tq1_0 bytes (uint8 [..., 54]: qs[48], qh[4], d) -> ternary codes 0..2 (uint8 [..., 256]) in element
    order, as dequantize_row_tq1_0: a byte holds 5 (qh: 4) base-3 digits, digit k = ((byte * 3^k) mod 256 * 3) >> 8;
    elements 0-159 from qs[0:32] (digit k: elements 32k..32k+31), 160-239 from qs[32:48] (16 per digit),
    240-255 from qh (4 per digit)."""
    def digits(q, n):   # q uint8 [..., m] -> [..., n * m], digit-major
        v = (q[..., None, :] * _POW3[:n, None]).astype(np.uint16)   # uint8 products wrap mod 256
        return ((v * 3) >> 8).astype(np.uint8).reshape(q.shape[:-1] + (n * q.shape[-1],))
    return np.concatenate([digits(blocks[..., 0:32], 5), digits(blocks[..., 32:48], 5),
                           digits(blocks[..., 48:52], 4)], axis=-1)


def tq_codes(type_name: str, raw, O: int, nb: int):
    """TQ1_0 / TQ2_0 blocks (uint8 [O, nb * block bytes]) -> (2-bit codes uint8 [O, nb, 64] in Q2_K's order, the
    f16 d's bytes uint8 [O, nb, 2]). block_tq2_0 {qs[64]; d}: element 128n + 32j + l is (qs[32n + l] >> 2j) & 3,
    minus 1 (dequantize_row_tq2_0), which is Q2_K's code order; block_tq1_0's base-3 digits (``tq1_0_codes``) are
    packed the same way. Q2_K's kernels with every scale and min 1 and dmin = d then give w = d*q - d: the row
    layout of cpu_kernels/lowbit.py, Q2_K's tile here."""
    if type_name == "TQ2_0":
        b = raw.reshape(O, nb, 66)
        return b[:, :, 0:64], b[:, :, 64:66]
    b = raw.reshape(O, nb, 54)
    t = tq1_0_codes(b).reshape(O, nb, 2, 4, 32)                       # [.., n, j, l]
    qs = (t[:, :, :, 0] | (t[:, :, :, 1] << 2) | (t[:, :, :, 2] << 4) | (t[:, :, :, 3] << 6)).astype(np.uint8)
    return qs.reshape(O, nb, 64), b[:, :, 52:54]


def _as_blocks(type_name: str, raw: np.ndarray, O: int, I: int) -> np.ndarray:
    """TQ1_0 / TQ2_0 blocks uint8 [O, row_bytes] -> Q2_K blocks uint8 [O, I / 256 * 84] of the same values
    (ggml-common.h's block_q2_K: scales[16], qs[64], d, dmin; here every scale byte 0x11 and dmin = d)."""
    nb = I // 256
    qs, d = tq_codes(type_name, raw, O, nb)
    out = np.empty((O, nb, 84), np.uint8)
    out[..., :16] = 0x11
    out[..., 16:80] = qs
    out[..., 80:82] = d
    out[..., 82:84] = d
    return out.reshape(O, nb * 84)


@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _pack(blk, out, fields):
    """blk uint8 [T, 16, nb, block bytes] -> out uint8 [T, nb, record], both C-contiguous. Per field (src byte,
    count, width, dst byte): item k (``width`` bytes at src + width k) of row r goes to dst + width (16 k + r), i.e.
    the 16 rows' items side by side: code bytes as 4-byte groups (width 4), an f16 per row (count 1, width 2),
    per-sub-block scales (width 1). Width-4 items are stored as uint32 words (every width-4 dst is 4-aligned),
    width-2 items as uint16 words, and all indices are unsigned, so that Numba emits no negative-index wraparound
    per byte: 2-10x the byte-by-byte copy with signed indices (docs/cpu_kernels.md "Repack speed at load")."""
    T, R, nb, bsz = blk.shape
    rec = out.shape[2]
    src8 = blk.reshape(-1)
    out8 = out.reshape(-1)
    out32 = out8.view(np.uint32)
    out16 = out8.view(np.uint16)
    rowb = np.uint64(nb * bsz)
    nf = fields.shape[0]
    for tb in prange(T * nb):
        t = np.uint64(tb // nb)
        ob = np.uint64(tb) * np.uint64(rec)
        xb0 = t * np.uint64(16) * rowb + np.uint64(tb % nb) * np.uint64(bsz)
        for r in range(R):
            ur = np.uint64(r)
            xb = xb0 + ur * rowb
            for f in range(nf):
                src, cnt, w, dst = (np.uint64(fields[f, 0]), fields[f, 1], np.uint64(fields[f, 2]),
                                    np.uint64(fields[f, 3]))
                s = xb + src
                if w == 4:
                    d = ((ob + dst) >> np.uint64(2)) + ur
                    for k in range(cnt):
                        s4 = s + np.uint64(4 * k)
                        out32[d + np.uint64(16 * k)] = (np.uint32(src8[s4])
                                                        | (np.uint32(src8[s4 + np.uint64(1)]) << np.uint32(8))
                                                        | (np.uint32(src8[s4 + np.uint64(2)]) << np.uint32(16))
                                                        | (np.uint32(src8[s4 + np.uint64(3)]) << np.uint32(24)))
                elif w == 2:   # f16 scales: uint16 words (every width-2 dst is even)
                    d = ((ob + dst) >> np.uint64(1)) + ur
                    for k in range(cnt):
                        s2 = s + np.uint64(2 * k)
                        out16[d + np.uint64(16 * k)] = (np.uint16(src8[s2])
                                                        | (np.uint16(src8[s2 + np.uint64(1)]) << np.uint16(8)))
                else:
                    d = ob + dst + w * ur
                    for k in range(cnt):
                        uk = np.uint64(k)
                        for i in range(w):
                            ui = np.uint64(i)
                            out8[d + w * np.uint64(16) * uk + ui] = src8[s + w * uk + ui]


def _q6_k_at(n, h, gg, part):
    """Byte offset in a Q6_K record of the 64-byte line that ``_emit_q6_k`` loads for half n, l-half h, group
    gg: part 0 / 1 the ql groups 16n + 4h + gg / + 8, part 2 the qh group 8n + 4h + gg; part 3 (gg = kk) the
    16-row scales of sub-block 8n + 2kk + h. The lines lie in the order the kernel reads them: read in ggml's
    order (ql, then qh, then the scales) a record streamed from memory at 6-7 GB/s against 15-19 in load order
    (docs/cpu_kernels.md, "Q6_K in load order")."""
    if part == 3:
        return 832 * (2 * n + h) + 768 + 16 * gg
    return 832 * (2 * n + h) + 192 * gg + 64 * part


def _q6_k_fields():
    """``_FIELDS`` of Q6_K (ggml-common.h block_q6_K: ql[128], qh[64], scales[16], d): one field a line."""
    out = []
    for n in range(2):
        for h in range(2):
            for gg in range(4):
                g = 16 * n + 4 * h + gg
                out += [(4 * g, 1, 4, _q6_k_at(n, h, gg, 0)), (4 * (g + 8), 1, 4, _q6_k_at(n, h, gg, 1)),
                        (128 + 4 * (8 * n + 4 * h + gg), 1, 4, _q6_k_at(n, h, gg, 2))]
            out += [(192 + 8 * n + 2 * kk + h, 1, 1, _q6_k_at(n, h, kk, 3)) for kk in range(4)]
    return out + [(208, 1, 2, 3328)]


#: the types whose kernel reads a second code plane (Q5_K's qh, Q3_K's hmask, the IQ2 types' sign bits: 8 lines)
#: beside the first 8 code lines, line by line: the plane's first line (in 64-byte lines) in ggml's field order
_PLANE = {"Q5_K": 32, "Q3_K": 16, "IQ2_XXS": 16, "IQ2_XS": 16, "IQ2_S": 16}


@njit(inline="always", **_JIT)
def _il(o, pl):
    """Byte ``o`` of a record in the field order of the module table -> its byte in the stored record, whose
    plane starts at line ``pl`` (``_PLANE``; 0: no plane, stored as the table says): code lines 0-7 and the
    plane's 8 lines interleaved (line 2l, plane line l at 2l + 1), in the order the kernel reads them, then code
    lines 8 .. pl - 1; the scales and d stay where they are. Read in field order (code line l, then plane line
    pl + l) a Q6_K record streamed from memory at half its rate in load order (docs/cpu_kernels.md, "Q6_K in
    load order", "Code planes in load order")."""
    if pl == 0:
        return o
    line = o >> 6
    if line < 8:
        line = 2 * line
    elif line < pl:
        line = line + 8
    elif line < pl + 8:
        line = 2 * (line - pl) + 1
    return 64 * line + (o & 63)


def _planed(fields, pl):
    """``_FIELDS`` with each width-4 field (a 64-byte line an item) split into lines placed by ``_il``."""
    out = []
    for src, cnt, w, dst in fields:
        if w != 4:
            out.append((src, cnt, w, dst))
            continue
        out += [(src + 4 * k, 1, 4, _il.py_func(dst + 64 * k, pl)) for k in range(cnt)]
    return out


#: per type: the (src byte, count, width, dst byte) fields of ``_pack`` (ggml-common.h block_* layouts)
_FIELDS = {"Q4_0": [(2, 4, 4, 0), (0, 1, 2, 256)],
           "Q4_1": [(4, 4, 4, 0), (0, 1, 2, 256), (2, 1, 2, 288)],
           "Q8_0": [(2, 8, 4, 0), (0, 1, 2, 512)],
           "Q5_0": [(6, 4, 4, 0), (2, 1, 4, 256), (0, 1, 2, 320)],
           "Q4_K": [(16, 32, 4, 0), (0, 1, 2, 2304), (2, 1, 2, 2336)],
           "Q6_K": _q6_k_fields(),
           "MXFP4": [(1, 4, 4, 0), (0, 1, 1, 256)],
           "NVFP4": [(4, 8, 4, 0), (0, 4, 1, 512)],
           "IQ4_NL": [(2, 4, 4, 0), (0, 1, 2, 256)],
           "IQ4_XS": [(8, 32, 4, 0), (0, 1, 2, 2176)],
           "Q2_K": [(16, 16, 4, 0), (0, 16, 1, 1024), (80, 1, 2, 1280), (82, 1, 2, 1312)],
           "Q3_K": _planed([(32, 16, 4, 0), (0, 8, 4, 1024), (108, 1, 2, 1792)], _PLANE["Q3_K"]),
           "Q5_1": [(8, 4, 4, 0), (4, 1, 4, 256), (0, 1, 2, 320), (2, 1, 2, 352)],
           "Q5_K": _planed([(48, 32, 4, 0), (16, 8, 4, 2048), (0, 1, 2, 2816), (2, 1, 2, 2848)], _PLANE["Q5_K"])}


@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _pack_grid(blk, kind, cmap, ksig, out):
    """blk uint8 [T, 16, nb, block bytes] of IQ2_XXS (kind 13), IQ3_XXS (14), IQ3_S (15), IQ2_XS (16) or IQ2_S
    (17) -> out uint8 [T, nb, record] (zeroed by the caller): each weight's level code ``cmap[grid index, j]``
    and sign bit put where the module doc's records say, the 4-bit scales as 2s + 1 (``dequantize_row_iq2_xxs``
    / ``iq3_xxs`` / ``iq3_s`` / ``iq2_xs`` / ``iq2_s``'s fields, ggml-common.h ``block_iq*``)."""
    T, R, nb, _ = blk.shape
    iq2 = kind == 13 or kind >= 16
    nc = 1536 if iq2 else 2048
    od = nc + (256 if kind >= 16 else 128)     # d after the scales: 16 per 256 (IQ2_XS, IQ2_S) or 8
    for tb in prange(T * nb):
        t = tb // nb
        b = tb % nb
        for r in range(R):
            x = blk[t, r, b]
            out[t, b, od + 2 * r] = x[0]
            out[t, b, od + 1 + 2 * r] = x[1]
            for ib in range(8):
                aux = np.int64(0)   # IQ2_XXS / IQ3_XXS: the u32 of 4 x 7-bit ksigns indices and the scale >> 28
                if kind == 13 or kind == 14:
                    o = 6 + 8 * ib if kind == 13 else 66 + 4 * ib
                    aux = (np.int64(x[o]) | (np.int64(x[o + 1]) << 8) | (np.int64(x[o + 2]) << 16)
                           | (np.int64(x[o + 3]) << 24))
                    out[t, b, nc + 16 * ib + r] = 2 * (aux >> 28) + 1
                elif kind == 15:    # a scale nibble per 32
                    out[t, b, nc + 16 * ib + r] = 2 * ((np.int64(x[106 + ib // 2]) >> (4 * (ib % 2))) & 15) + 1
                else:               # IQ2_XS, IQ2_S: a scale nibble per 16
                    sc = np.int64(x[66 + ib if kind == 16 else 74 + ib])
                    out[t, b, nc + 32 * ib + r] = 2 * (sc & 15) + 1
                    out[t, b, nc + 32 * ib + 16 + r] = 2 * (sc >> 4) + 1
                for l in range(4):   # 8 weights each: one IQ2 grid entry, two IQ3 entries
                    k8 = 4 * ib + l
                    if kind == 15:
                        sg = np.int64(x[74 + k8])
                    elif kind == 17:
                        sg = np.int64(x[34 + k8])
                    elif kind == 16:
                        sg = np.int64(ksig[(np.int64(x[3 + 2 * k8]) >> 1) & 127])
                    else:
                        sg = np.int64(ksig[(aux >> (7 * l)) & 127])
                    gi = np.int64(0)
                    if kind == 13:
                        gi = np.int64(x[2 + 8 * ib + l])
                    elif kind == 16:   # 9-bit index | 7-bit ksigns index << 9
                        gi = (np.int64(x[2 + 2 * k8]) | (np.int64(x[3 + 2 * k8]) << 8)) & 511
                    elif kind == 17:   # 8 low bits, 2 high bits from qh
                        gi = np.int64(x[2 + k8]) | (((np.int64(x[66 + ib]) >> (2 * l)) & 3) << 8)
                    for jj in range(8):
                        e = 32 * ib + 8 * l + jj
                        if iq2:
                            code = cmap[gi, jj]
                        else:
                            k = 2 * l + jj // 4
                            g4 = np.int64(x[2 + 8 * ib + k])
                            if kind == 15:
                                g4 |= ((np.int64(x[66 + ib]) >> k) & 1) << 8
                            code = cmap[g4, jj % 4]
                        neg = (sg >> jj) & 1
                        if iq2:   # Q2_K's qs (element 128n + 32j + l'), sign bit ib of hmask byte l'
                            lp = e & 31
                            q = 64 * (8 * (e >> 7) + (lp >> 2)) + 4 * r + (lp & 3)
                            out[t, b, _il(q, 16)] |= code << (2 * ((e >> 5) & 3))
                            out[t, b, _il(1024 + 64 * (lp >> 2) + 4 * r + (lp & 3), 16)] |= neg << ib
                        else:     # IQ4_XS's nibbles: c | sign << 3
                            w = e & 31
                            q = 256 * ib + 64 * ((w >> 2) & 3) + 4 * r + (w & 3)
                            out[t, b, q] |= (code | (neg << 3)) << (4 * (w >> 4))


@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _pack_iq1(blk, m, cmap, out):
    """blk uint8 [T, 16, nb, 50] of IQ1_S (m = 0) or [T, 16, nb, 56] of IQ1_M (m = 1) -> out uint8 [T, nb,
    record] (zeroed by the caller): each weight's level code grid + 1 (``cmap``: 0, 1, 2) as Q2_K's qs; IQ1_S's
    3-bit scale and delta sign per 32 as a nibble s | neg << 3 [ib / 2][row] (ib even: low nibble); IQ1_M's 3-bit
    scales per 16 as nibbles [ib][row] (low: first half) and its delta signs per 8 as bits [8-group / 8][row]
    (bit: 8-group % 8); then d's f16 bits (IQ1_M: gathered from the top nibbles of its four u16 scales,
    ``iq1m_scale_t``). Fields as ``dequantize_row_iq1_s`` / ``iq1_m`` read them (ggml-common.h ``block_iq1_*``)."""
    T, R, nb, _ = blk.shape
    od = 1088 if m == 0 else 1216
    for tb in prange(T * nb):
        t = tb // nb
        b = tb % nb
        for r in range(R):
            x = blk[t, r, b]
            if m == 0:
                out[t, b, od + 2 * r] = x[0]
                out[t, b, od + 1 + 2 * r] = x[1]
            else:
                db = np.int64(0)
                for k in range(4):
                    sk = np.int64(x[48 + 2 * k]) | (np.int64(x[49 + 2 * k]) << 8)
                    db |= (sk >> 12) << (4 * k)
                out[t, b, od + 2 * r] = db & 255
                out[t, b, od + 1 + 2 * r] = db >> 8
            for ib in range(8):
                qh = np.int64(0)
                if m == 0:
                    qh = np.int64(x[34 + 2 * ib]) | (np.int64(x[35 + 2 * ib]) << 8)
                    out[t, b, 1024 + 16 * (ib // 2) + r] |= (((qh >> 12) & 7) | ((qh >> 15) << 3)) << (4 * (ib % 2))
                else:
                    for h in range(2):
                        u = 2 * ib + h
                        sk = np.int64(x[48 + 2 * (u // 4)]) | (np.int64(x[49 + 2 * (u // 4)]) << 8)
                        out[t, b, 1024 + 16 * ib + r] |= ((sk >> (3 * (u % 4))) & 7) << (4 * h)
                for l in range(4):   # 8-group q8 of the block: one grid entry
                    q8 = 4 * ib + l
                    if m == 0:
                        gi = np.int64(x[2 + q8]) | (((qh >> (3 * l)) & 7) << 8)
                    else:
                        nib = (np.int64(x[32 + q8 // 2]) >> (4 * (q8 % 2))) & 15
                        gi = np.int64(x[q8]) | ((nib & 7) << 8)
                        out[t, b, 1152 + 16 * (q8 // 8) + r] |= (nib >> 3) << (q8 % 8)
                    for jj in range(8):
                        e = 32 * ib + 8 * l + jj
                        lp = e & 31
                        q = 64 * (8 * (e >> 7) + (lp >> 2)) + 4 * r + (lp & 3)
                        out[t, b, q] |= cmap[gi, jj] << (2 * ((e >> 5) & 3))


def pack(type_name: str, raw: np.ndarray, O: int, I: int) -> np.ndarray:
    """GGUF blocks uint8 [O, row_bytes] -> tile records uint8 [O/16, (I / block) * RECORD] (layout above)."""
    if type_name in AS_BLOCKS:
        raw, type_name = _as_blocks(type_name, raw, O, I), AS_BLOCKS[type_name]
    bs, rec, nc, bsz = SPEC[type_name]
    nb = I // bs
    T = O // ROWS
    blk = read_only(np.ascontiguousarray(raw).reshape(T, ROWS, nb, bsz))   # C, read-only: one compile per kernel
    out = np.empty((T, nb, rec), np.uint8)
    if type_name in ("IQ2_XXS", "IQ3_XXS", "IQ3_S", "IQ2_XS", "IQ2_S"):
        from coli.types import iq_tables

        out[:] = 0
        cmap = np.searchsorted(_levels(type_name), iq_tables.grid(type_name)).astype(np.uint8)
        _pack_grid(blk, KIND[type_name], cmap, iq_tables.ksigns(), out)
        return out.reshape(T, nb * rec)
    if type_name in ("IQ1_S", "IQ1_M"):
        from coli.types import iq_tables

        out[:] = 0
        cmap = (iq_tables.grid("IQ1_S") + 1).astype(np.uint8)   # {-1, 0, 1} -> 0, 1, 2 (IQ1_M shares the grid)
        _pack_iq1(blk, int(type_name == "IQ1_M"), cmap, out)
        return out.reshape(T, nb * rec)
    _pack(blk, out, np.array(_FIELDS[type_name], np.int64))
    if type_name == "NVFP4":   # UE4M3 bytes: 0x7F (0 in ggml_ue4m3_to_fp32) as 0x00, bit 7 (ignored) cleared
        out[:, :, nc:] = _ue4m3_byte(out[:, :, nc:])
        return out.reshape(T, nb * rec)
    # the unpacked sub-block scales, computed in the record's [sub-block][row] order from the 12 (Q4_K, Q5_K, Q3_K)
    # or 6 (IQ4_XS) scale bytes transposed to [byte][row] first: every elementwise op writes 16 contiguous bytes
    # (3-4x the same formulas on [row][sub-block] and a transposing copy)
    if type_name in ("Q4_K", "Q5_K"):  # ggml's 6-bit scales and mins unpacked (get_scale_min_k4), [sub-block][row]
        q = np.ascontiguousarray(blk[..., 4:16].transpose(0, 2, 3, 1))                # [T, nb, 12, 16 rows]
        o = out[:, :, nc:nc + 256].reshape(T, nb, 2, 8, ROWS)
        sc, mn = o[:, :, 0], o[:, :, 1]
        np.bitwise_and(q[:, :, 0:4], 63, out=sc[:, :, :4])
        np.bitwise_and(q[:, :, 4:8], 63, out=mn[:, :, :4])
        hi = q[:, :, 0:8] >> 6
        hi <<= 4
        np.bitwise_and(q[:, :, 8:12], 15, out=sc[:, :, 4:])
        sc[:, :, 4:] |= hi[:, :, 0:4]
        np.right_shift(q[:, :, 8:12], 4, out=mn[:, :, 4:])
        mn[:, :, 4:] |= hi[:, :, 4:8]
    elif type_name == "IQ4_XS":  # ls - 32 of each 32-weight sub-block (dequantize_row_iq4_xs), int8 [ib][row]
        q = np.ascontiguousarray(blk[..., 2:8].transpose(0, 2, 3, 1))                 # [T, nb, 6, 16 rows]
        o = out[:, :, nc:nc + 128].reshape(T, nb, 4, 2, ROWS)                         # [ib // 2][ib % 2][row]
        np.bitwise_and(q[:, :, 2:6], 15, out=o[:, :, :, 0])                           # scales_l nibbles
        np.right_shift(q[:, :, 2:6], 4, out=o[:, :, :, 1])
        hi = np.empty((T, nb, 2, 4, ROWS), np.uint8)                                  # scales_h bits 2 ib, 2 ib + 1
        for j in range(4):
            np.right_shift(q[:, :, 0:2], 2 * j, out=hi[:, :, :, j])
        hi &= 3
        hi <<= 4
        o = o.reshape(T, nb, 8, ROWS)
        o |= hi.reshape(T, nb, 8, ROWS)
        o -= 32
    elif type_name == "Q3_K":  # the 16 6-bit scales minus 32 (lowbit.q3_k_scales), int8 [sub-block][row]
        q = np.ascontiguousarray(blk[..., 96:108].transpose(0, 2, 3, 1))              # [T, nb, 12, 16 rows]
        o = out[:, :, nc:nc + 256].reshape(T, nb, 16, ROWS)
        hi = np.empty((T, nb, 4, 4, ROWS), np.uint8)     # scale k's bits 4-5: bits 2 (k // 4) of byte 8 + k % 4
        for j in range(4):
            np.right_shift(q[:, :, 8:12], 2 * j, out=hi[:, :, j])
        hi &= 3
        hi <<= 4
        np.bitwise_and(q[:, :, 0:8], 15, out=o[:, :, :8])
        np.right_shift(q[:, :, 0:8], 4, out=o[:, :, 8:])
        o |= hi.reshape(T, nb, 16, ROWS)
        o -= 32
    return out.reshape(T, nb * rec)


def scales(type_name: str, rec: np.ndarray, O: int, I: int):
    """(d f32 [O, nblocks], minimum f32 [O, nblocks] or None) read back from tile records: Q4_1's m, Q4_K's and
    Q2_K's dmin (the finite checks, tests). MXFP4: its E8M0 scales as ggml's ``e8m0_to_fp32_half`` (the kernels'
    d, the table being doubled); IQ4_XS and the grid i-quants: the super-block's f16 d (the sub-block scales are
    integers). TQ1_0 / TQ2_0: Q2_K's (d and dmin both the file's d). NVFP4: its UE4M3 scales per 16, f32 [O, I/16]
    (as ggml_ue4m3_to_fp32, halved: the table is doubled)."""
    type_name = AS_BLOCKS.get(type_name, type_name)
    bs, rb, nc, _ = SPEC[type_name]
    nb = I // bs
    r = rec.reshape(O // ROWS, nb, rb)

    def f16(a):
        return np.ascontiguousarray(a).view(np.float16).astype(np.float32).transpose(0, 2, 1).reshape(O, nb)

    if type_name == "MXFP4":   # E8M0 exponents: every byte is a finite power of two (ggml_e8m0_to_fp32_half)
        e = np.ascontiguousarray(r[:, :, nc:nc + 16].transpose(0, 2, 1)).reshape(O, nb)
        return gq.MXFP4.e8m0_to_fp32_half(e).astype(np.float32), None
    if type_name == "NVFP4":   # UE4M3 scales per 16, f32 [O, I/16] (ggml_ue4m3_to_fp32: every byte finite)
        u = np.ascontiguousarray(r[:, :, nc:nc + 64].reshape(O // ROWS, nb, 4, ROWS).transpose(0, 3, 1, 2))
        return _UE4M3[u.reshape(O, nb * 4)], None
    o = nc + _SCALE_AT.get(type_name, 0)
    d = f16(r[:, :, o:o + 32])
    m = f16(r[:, :, o + 32:o + 64]) if type_name in _MINS else None
    return d, m


def f16_scales_finite(type_name: str, rec: np.ndarray, O: int, I: int) -> bool:
    """True when every f16 d (and m / dmin) in the tile records ``rec`` (uint8 [O / 16, nblocks * record]) is
    finite, read from the f16s' high bytes (IEEE binary16: exponent bits 0x7C of the high byte all ones = NaN or
    infinity) without converting them: the finite checks' fast path (``coli.finite``; ``scales`` gives the rows and
    values when this is False). False for a type whose tile scales are not f16 (MXFP4's E8M0)."""
    type_name = AS_BLOCKS.get(type_name, type_name)
    if type_name not in _F16_D:
        return False
    bs, rb, nc, _ = SPEC[type_name]
    o = nc + _SCALE_AT.get(type_name, 0)
    hi = rec.reshape(O // ROWS, I // bs, rb)[:, :, o + 1:o + (64 if type_name in _MINS else 32):2]
    return not bool(((hi & 0x7C) == 0x7C).any())


#: where the f16 d [16] starts after a record's code bytes (the sub-block scales, Q5_0's fifth bits before it)
_SCALE_AT = {"Q5_0": 64, "Q4_K": 256, "Q6_K": 256, "IQ4_XS": 128, "Q2_K": 256, "Q3_K": 256, "Q5_1": 64, "Q5_K": 256,
             "IQ2_XXS": 128, "IQ3_XXS": 128, "IQ3_S": 128, "IQ2_XS": 256, "IQ2_S": 256, "IQ1_S": 64, "IQ1_M": 192}
#: the types with a second f16 (m or dmin) after d
_MINS = ("Q4_1", "Q4_K", "Q2_K", "Q5_1", "Q5_K")
#: the types whose tile records hold the f16 d [16] (and m / dmin) that ``scales`` reads
_F16_D = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K", "Q5_1", "Q5_K",
          "IQ2_XXS", "IQ3_XXS", "IQ3_S", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")


# --------------------------------------------------------------------------------------------------- kernels
_F16x16 = ir.VectorType(ir.HalfType(), 16)
_I8x16 = ir.VectorType(ir.IntType(8), 16)


def _splat_f(b, s):
    return b.shuffle_vector(b.insert_element(ir.Constant(_F32x16, None), s, ir.Constant(_I32, 0)),
                            ir.Constant(_F32x16, None), ir.Constant(_I32x16, [0] * 16))


def _splat_i(b, s):
    return b.shuffle_vector(b.insert_element(ir.Constant(_I32x16, None), s, ir.Constant(_I32, 0)),
                            ir.Constant(_I32x16, None), ir.Constant(_I32x16, [0] * 16))


def _i32x16(v):
    return ir.Constant(_I32x16, [v] * 16)


class _Rec:
    """One record of ``_emit_tile``'s loop, as the family emitters below read it: the builder ``b``; the record
    index ``k`` (``c(v)``: a constant of its type); the tile's type ``name`` and the offset ``nc`` of its scales in
    the record; the activation rows (``nr``, ``rows``, their f32 lane accumulators ``faccs``, ``xbs``: each row's
    codes of this record); the intrinsics ``op``; shared constants; and the load helpers."""

    def __init__(self, b, name, nc, op, rows, faccs, k, base, xbs, pre=None):
        self.b, self.name, self.nc, self.op, self.rows, self.faccs = b, name, nc, op, rows, faccs
        # ``pre`` (``tile4u_q8_0``): the rows' codes come as x + 128 already, and 128 x each record's code sums
        # from a table (i32*, 16 a record): the +128 conversion and the weight sums leave the record loop
        self.pre = pre
        self.nr = len(rows)
        self.k, self.base, self.xbs = k, base, xbs
        self.m4 = ir.Constant(_I8x64, [15] * 64)
        self.sh4 = ir.Constant(_I8x64, [4] * 64)
        self.i32p = _I32.as_pointer()
        self.zero = ir.Constant(_I32x16, None)
        self.ones = b.bitcast(self.bmask(1), _I32x16)   # for a vpdpbusd that sums signed weight codes
        self.x80 = ir.Constant(_I32, 0x80808080 - (1 << 32))

    def c(self, v):
        return ir.Constant(self.k.type, v)

    def xs(self, i, j):  # activation codes j..j+3 of row i's block, broadcast to 16 lanes
        b = self.b
        return _splat_i(b, b.load(b.bitcast(b.gep(self.xbs[i], [self.c(j)]), self.i32p), align=1))

    def ld(self, o, ty):
        b = self.b
        return b.load(b.bitcast(b.gep(self.base, [self.c(o)]), ty.as_pointer()), align=1)

    def f16x16(self, o):
        return self.b.fpext(self.ld(o, _F16x16), _F32x16)

    def xd(self, i, idx):
        b = self.b
        return _splat_f(b, b.load(b.gep(self.rows[i][1], [idx])))

    def xm(self, i, idx):
        b = self.b
        return _splat_f(b, b.load(b.gep(self.rows[i][2], [idx])))

    def srl(self, v, n):  # a right shift of the 32-bit lanes (byte codes masked after it; no byte shifts on x86)
        b = self.b
        return b.bitcast(b.lshr(b.bitcast(v, _I32x16), _i32x16(n)), _I8x64) if n else v

    def bmask(self, v):
        return ir.Constant(_I8x64, [v] * 64)

    def ssum16(self, i, off):  # the sum of row i's 16 activation codes at off (int32; exact)
        b = self.b
        red = cgutils.get_or_insert_function(b.module, ir.FunctionType(_I32, [_I32x16]),
                                             "llvm.vector.reduce.add.v16i32")
        xsub = b.load(b.bitcast(b.gep(self.xbs[i], [self.c(off)]), _I8x16.as_pointer()), align=1)
        return b.call(red, [b.sext(xsub, _I32x16)])

    def ssum32(self, i):  # the sum of row i's 32 activation codes of this block (int32; exact: ones . x)
        b = self.b
        x = b.load(b.bitcast(self.xbs[i], _I32x8.as_pointer()), align=1)
        s = b.call(self.op.dp, [ir.Constant(_I32x8, None), ir.Constant(_I32x8, [0x01010101] * 8), x])
        red = cgutils.get_or_insert_function(b.module, ir.FunctionType(_I32, [_I32x8]), "llvm.vector.reduce.add.v8i32")
        return b.call(red, [s])

    def xu(self, i, j):  # row i's activation codes j..j+3 made unsigned (x ^ 0x80 = x + 128), broadcast
        b = self.b
        p = b.bitcast(b.gep(self.xbs[i], [self.c(j)]), self.i32p)
        if self.pre is not None:   # the caller's codes are x + 128 already
            return _splat_i(b, b.load(p, align=1))
        return _splat_i(b, b.xor(b.load(p, align=1), self.x80))


def _emit_nvfp4(t):
    """NVFP4: MXFP4's lookup on 64-weight records, a UE4M3 scale per 16 weights."""
    b, k, c, nc, nr, op, faccs = t.b, t.k, t.c, t.nc, t.nr, t.op, t.faccs
    rows, m4, zero, ones, ld, xd, srl, xu = t.rows, t.m4, t.zero, t.ones, t.ld, t.xd, t.srl, t.xu
    # MXFP4's lookup and operand order on a 64-weight record: per sub-block s (16 weights, its own scale)
    # the groups g = 2s, 2s + 1 (low nibbles: weights 16s + 4(g & 1) + 0..3, high: + 8); the weight sum
    # from one vpdpbusd per sub-block on its four looked-up vectors added bytewise (|sum| <= 48)
    tab = ir.Constant(_I8x64, [int(v) for v in _TABLES[0]] * 4)
    scs = []
    for s_ in range(4):   # the 16 rows' UE4M3 bytes u of sub-block s_ -> f32 (as ``_UE4M3``, exact)
        u = b.zext(ld(nc + 16 * s_, _I8x16), _I32x16)
        nrm = b.bitcast(b.add(b.shl(u, _i32x16(20)), _i32x16(119 << 23)), _F32x16)
        sub = b.fmul(b.sitofp(u, _F32x16), ir.Constant(_F32x16, [2.0 ** -10] * 16))
        scs.append(b.select(b.icmp_unsigned("<", u, _i32x16(8)), sub, nrm))
    for p in range(2):   # activation block 2k + p: sub-blocks 2p, 2p + 1
        saccs = [None] * nr
        for s_ in (2 * p, 2 * p + 1):
            wb = None
            parts = [zero] * nr
            for h in range(2):
                v = ld(64 * (2 * s_ + h), _I8x64)
                lo8 = b.call(op.shuf512, [tab, b.and_(v, m4)])
                hi8 = b.call(op.shuf512, [tab, b.and_(srl(v, 4), m4)])
                wb = b.add(lo8, hi8) if wb is None else b.add(wb, b.add(lo8, hi8))
                lo, hi = b.bitcast(lo8, _I32x16), b.bitcast(hi8, _I32x16)
                for i in range(nr):
                    a_ = b.call(op.dp512, [parts[i], xu(i, 16 * s_ + 4 * h), lo])
                    parts[i] = b.call(op.dp512, [a_, xu(i, 16 * s_ + 8 + 4 * h), hi])
            corr = b.shl(b.call(op.dp512, [zero, ones, b.bitcast(wb, _I32x16)]), _i32x16(7))
            for i in range(nr):
                t_ = b.fmul(b.sitofp(b.sub(parts[i], corr), _F32x16), scs[s_])
                saccs[i] = t_ if saccs[i] is None else b.fadd(saccs[i], t_)
        for i in range(nr):
            xdv = xd(i, b.add(b.mul(k, c(2)), c(p)))
            b.store(b.fadd(b.load(faccs[i]), b.fmul(saccs[i], xdv)), faccs[i])


def _emit_lut(t):
    """The 4-bit table types (MXFP4, IQ4_NL, IQ4_XS) and IQ3_XXS, IQ3_S: codes looked up with vpshufb."""
    b, k, c, name, nc, nr, op, faccs = t.b, t.k, t.c, t.name, t.nc, t.nr, t.op, t.faccs
    rows, m4, zero, ones, ld, f16x16, xd, srl, xu = t.rows, t.m4, t.zero, t.ones, t.ld, t.f16x16, t.xd, t.srl, t.xu
    # 4-bit codes looked up in the 16-entry table (vpshufb, the table in every 128-bit lane): signed int8
    # weights w. vpdpbusd takes them as its signed operand and the activations made unsigned (x + 128,
    # x ^ 0x80): dot = sum w x + 128 sum w, the sum w per block and row from one vpdpbusd with ones
    # (weight-side, shared by the batch's rows), subtracted exactly in int32
    tab = ir.Constant(_I8x64, [int(v) for v in _TABLES[_LUT[name]]] * 4)
    nsub = 8 if name in ("IQ4_XS", "IQ3_XXS", "IQ3_S") else 1
    if name == "MXFP4":   # E8M0 -> 2^(e - 128) (ggml_e8m0_to_fp32_half: the table is doubled), bit-exact
        e = b.zext(ld(nc, _I8x16), _I32x16)
        bits = b.select(b.icmp_unsigned("<", e, _i32x16(2)), b.shl(_i32x16(0x00200000), e),
                        b.shl(b.sub(e, _i32x16(1)), _i32x16(23)))
        dv = b.bitcast(bits, _F32x16)
    else:
        dv = f16x16(nc + (128 if nsub == 8 else 0))
    if name == "IQ3_XXS":   # w = d/4 * (2s + 1) * code: the power of two on d (exact), weight-side
        dv = b.fmul(dv, ir.Constant(_F32x16, [0.25] * 16))
    saccs = [ir.Constant(_F32x16, None)] * nr   # IQ4_XS: sum over sub-blocks of (ls - 32) xd isum
    for sb in range(nsub):
        ws, parts = [], [[] for _ in range(nr)]
        for g in range(4):
            v = ld(256 * sb + 64 * g, _I8x64)
            lo = b.bitcast(b.call(op.shuf512, [tab, b.and_(v, m4)]), _I32x16)
            hi = b.bitcast(b.call(op.shuf512, [tab, b.and_(srl(v, 4), m4)]), _I32x16)
            ws.append(b.call(op.dp512, [b.call(op.dp512, [zero, ones, lo]), ones, hi]))
            for i in range(nr):
                a_ = b.call(op.dp512, [zero, xu(i, 32 * sb + 4 * g), lo])
                parts[i].append(b.call(op.dp512, [a_, xu(i, 32 * sb + 16 + 4 * g), hi]))
        corr = b.shl(b.add(b.add(ws[0], ws[1]), b.add(ws[2], ws[3])), _i32x16(7))
        for i in range(nr):
            isum = b.sitofp(b.sub(b.add(b.add(parts[i][0], parts[i][1]), b.add(parts[i][2], parts[i][3])),
                                  corr), _F32x16)
            if nsub == 1:
                b.store(b.fadd(b.load(faccs[i]), b.fmul(isum, b.fmul(dv, xd(i, k)))), faccs[i])
            else:       # Q4_K's shape: d once per super-block, the 6-bit scales (ls - 32) per sub-block
                lsv = b.sitofp(b.sext(ld(nc + 16 * sb, _I8x16), _I32x16), _F32x16)
                sx = b.fmul(lsv, xd(i, b.add(b.mul(k, c(8)), c(sb))))
                saccs[i] = b.fadd(saccs[i], b.fmul(isum, sx))
    if nsub == 8:
        for i in range(nr):
            b.store(b.fadd(b.load(faccs[i]), b.fmul(dv, saccs[i])), faccs[i])


def _emit_iq2(t):
    """IQ2_XXS, IQ2_XS, IQ2_S: Q2_K's planes, level codes looked up, the signs on the activations."""
    b, k, c, name, nc, nr, op, faccs = t.b, t.k, t.c, t.name, t.nc, t.nr, t.op, t.faccs
    m4, zero, xs, ld, f16x16, xd, srl, bmask = t.m4, t.zero, t.xs, t.ld, t.f16x16, t.xd, t.srl, t.bmask
    # Q2_K's planes: per half n and shift j the 2-bit level codes of sub-block ib = 4n + j, looked up
    # (vpshufb) as the unsigned levels 8, 25, 43; the signs go on the broadcast activations instead (a
    # masked negation under the sign plane's bit 4n + j, one vptestmb; |x| <= 127), so vpdpbusd takes the
    # levels as its unsigned operand with no correction term. Then IQ4_XS's arithmetic: the integer
    # sub-block scale 2s + 1 per sub-block, d / 8 once per super-block. A nibble of qs holds the codes of
    # shifts 2h and 2h + 1: one 16-entry table per position looks either up without a shift of its own
    lv = [int(v) for v in _TABLES[3][:4]]
    tabs = [ir.Constant(_I8x64, [lv[q & 3] for q in range(16)] * 4),
            ir.Constant(_I8x64, [lv[q >> 2] for q in range(16)] * 4)]
    # IQ2_XS, IQ2_S: a scale per 16 weights, so the two halves of a sub-block (g < 4, g >= 4) sum apart
    s0 = b.mul(k, c(8))
    zb = ir.Constant(_I8x64, None)
    saccs = [ir.Constant(_F32x16, None)] * nr
    nh = 1 if name == "IQ2_XXS" else 2
    for n in range(2):
        acc = [[[zero] * nh for _ in range(4)] for _ in range(nr)]
        for g in range(8):
            h = (g >> 2) if nh == 2 else 0
            V = ld(_il.py_func(64 * (8 * n + g), 16), _I8x64)
            H = ld(_il.py_func(1024 + 64 * g, 16), _I8x64)
            nib = (b.and_(V, m4), b.and_(srl(V, 4), m4))
            for j in range(4):
                wv = b.bitcast(b.call(op.shuf512, [tabs[j & 1], nib[j >> 1]]), _I32x16)
                mk = b.icmp_unsigned("!=", b.and_(H, bmask(1 << (4 * n + j))), zb)
                for i in range(nr):
                    xv = b.bitcast(xs(i, 128 * n + 32 * j + 4 * g), _I8x64)
                    xv = b.bitcast(b.select(mk, b.sub(zb, xv), xv), _I32x16)
                    acc[i][j][h] = b.call(op.dp512, [acc[i][j][h], wv, xv])
        for j in range(4):
            ib = 4 * n + j
            for h in range(nh):
                lsv = b.sitofp(b.sext(ld(nc + 16 * (nh * ib + h), _I8x16), _I32x16), _F32x16)
                for i in range(nr):
                    sx = b.fmul(lsv, xd(i, b.add(s0, c(ib))))
                    saccs[i] = b.fadd(saccs[i], b.fmul(b.sitofp(acc[i][j][h], _F32x16), sx))
    dv = b.fmul(f16x16(nc + 128 * nh), ir.Constant(_F32x16, [0.125] * 16))
    for i in range(nr):
        b.store(b.fadd(b.load(faccs[i]), b.fmul(dv, saccs[i])), faccs[i])


def _emit_iq1(t):
    """IQ1_S, IQ1_M: Q2_K's planes with the grid codes plus a per-row delta term."""
    b, k, c, name, nc, nr, op, faccs, rows = t.b, t.k, t.c, t.name, t.nc, t.nr, t.op, t.faccs, t.rows
    zero, ones, xs, ld, f16x16, xd, srl, bmask, ssum16, xu = t.zero, t.ones, t.xs, t.ld, t.f16x16, t.xd, t.srl, t.bmask, t.ssum16, t.xu
    # Q2_K's planes with the level codes c = grid + 1 (0, 1, 2); per half n, shift j (sub-block ib = 4n + j)
    # and code group g a weight byte made of 8c (a shift and a mask) and a per-row delta term (constant
    # over the group's dword lane: IQ1_S's delta is per 32, IQ1_M's per 8, a lane holds 4 weights of one
    # 8-group); 8 (grid + delta) = 8c - 8 + sign(delta) is exact in int32 either way:
    # * IQ1_S, and IQ1_M for one activation row (decode): the unsigned byte 8c + 2 [delta > 0] against the
    #   signed activations, then 9 x the scale group's activation code sum off (S: 32 or 16 codes);
    # * IQ1_M for several rows (tile4): the signed byte 8c - 7 or 8c - 9 against the activations made
    #   unsigned (x ^ 0x80), then 128 x the weight sum off (weight-side: shared by the rows, where the
    #   sums S are per row). Measured: each the faster for its case (docs/iquants.md); IQ1_S's GEMM gained
    #   nothing from the second, and with it its decode and batch rows came out of LLVM's fast-math
    #   rounded apart in the last bit (test_a_rows_result_does_not_depend_on_its_batch).
    # Both give the same int32 group dots and the same float steps after them. Then IQ4_XS's arithmetic:
    # the integer scale 2s + 1 per scale group, d / 8 per super-block (a power of two, exact)
    m1 = name == "IQ1_M"
    sgn = m1 and nr > 1
    nh = 2 if m1 else 1
    s0 = b.mul(k, c(8))
    saccs = [ir.Constant(_F32x16, None)] * nr
    m18 = bmask(0x18)
    if sgn:   # bytes -7 (delta +1/8) and -9 (-1/8)
        dplus, dminus = _i32x16(0xF9F9F9F9 - (1 << 32)), _i32x16(0xF7F7F7F7 - (1 << 32))
    else:     # bytes 2 and 0
        dplus, dminus = _i32x16(0x02020202), zero

    def zx16(o):   # 16 bytes (one per row) widened to the row's i32 lane
        return b.zext(ld(o, _I8x16), _I32x16)

    def dterm(v, bit):   # the delta term where bit ``bit`` of the row's byte is clear (delta +1/8) or set
        return b.bitcast(b.select(b.icmp_unsigned("==", b.and_(v, _i32x16(1 << bit)), zero), dplus, dminus),
                         _I8x64)

    for n in range(2):
        # IQ1_S: the nibble s | neg << 3 of sub-blocks 2p, 2p + 1 in byte p; IQ1_M: the delta bits of
        # 8-groups 8p..8p + 7 in byte p
        sb = [zx16(nc + (128 if m1 else 0) + 16 * (2 * n + p)) for p in range(2)]
        dt = [None] * 4
        # IQ1_M: one 16-weight half (its own scale) at a time, so that 4 x nr accumulators are live, not
        # 8 x nr (with 4 activation rows those would not fit the 32 vector registers)
        for h in range(nh):
            acc = [[zero] * 4 for _ in range(nr)]
            wsum = [zero] * 4
            for g in range(4 * h, 4 * h + 4) if m1 else range(8):
                V = ld(64 * (8 * n + g), _I8x64)
                for j in range(4):
                    if g == 0 or (m1 and g % 2 == 0):
                        ib = 4 * n + j
                        dt[j] = dterm(sb[j >> 1], 4 * (ib & 1) + (g >> 1 if m1 else 3))
                    sh = 2 * j - 3   # code bits 2j, 2j + 1 -> bits 3, 4 of the byte (8c)
                    cv = (srl(V, sh) if sh > 0
                          else b.bitcast(b.shl(b.bitcast(V, _I32x16), _i32x16(-sh)), _I8x64))
                    wv = b.bitcast(b.add(b.and_(cv, m18), dt[j]), _I32x16)
                    if sgn:
                        wsum[j] = b.call(op.dp512, [wsum[j], ones, wv])
                    for i in range(nr):
                        xv = xu(i, 128 * n + 32 * j + 4 * g) if sgn else xs(i, 128 * n + 32 * j + 4 * g)
                        acc[i][j] = b.call(op.dp512, [acc[i][j], xv, wv] if sgn else [acc[i][j], wv, xv])
            for j in range(4):
                ib = 4 * n + j
                if m1:
                    scb = b.and_(b.lshr(zx16(nc + 16 * ib), _i32x16(4 * h)), _i32x16(7))
                else:
                    scb = b.and_(b.lshr(sb[j >> 1], _i32x16(4 * (ib & 1))), _i32x16(7))
                scv = b.sitofp(b.add(b.shl(scb, _i32x16(1)), _i32x16(1)), _F32x16)
                corr = b.shl(wsum[j], _i32x16(7)) if sgn else None
                for i in range(nr):
                    if not sgn:
                        ss = ssum16(i, 32 * ib + 16 * h)
                        if not m1:
                            ss = b.add(ss, ssum16(i, 32 * ib + 16))
                        corr = _splat_i(b, b.mul(ss, ir.Constant(_I32, 9)))
                    sx = b.fmul(scv, xd(i, b.add(s0, c(ib))))
                    v = b.sitofp(b.sub(acc[i][j], corr), _F32x16)
                    saccs[i] = b.fadd(saccs[i], b.fmul(v, sx))
    dv = b.fmul(f16x16(nc + (192 if m1 else 64)), ir.Constant(_F32x16, [0.125] * 16))
    for i in range(nr):
        b.store(b.fadd(b.load(faccs[i]), b.fmul(dv, saccs[i])), faccs[i])


def _emit_q2_q3_k(t):
    """Q2_K, Q3_K (and TQ1_0, TQ2_0 as Q2_K blocks): 2-bit codes, Q3_K's high bit."""
    b, k, c, name, nc, nr, op, faccs = t.b, t.k, t.c, t.name, t.nc, t.nr, t.op, t.faccs
    rows, zero, xs, ld, f16x16, srl, bmask, ssum16 = t.rows, t.zero, t.xs, t.ld, t.f16x16, t.srl, t.bmask, t.ssum16
    # per half n and 16-element half h: 4 code groups (l = 4g..4g+3, g = 4h..4h+3) give the 2-bit codes of
    # sub-blocks u = 8n + 2j + h (ggml's shift 2j); Q3_K adds the hmask bit 4n + j as bit 2 and takes its
    # -4 exactly as 4 x the sub-block's activation code sum; Q2_K's mins go through the same sums
    s0 = b.mul(k, c(8))
    q3 = name == "Q3_K"
    pl = _PLANE.get(name, 0)
    saccs = [ir.Constant(_F32x16, None)] * nr
    maccs = [ir.Constant(_F32x16, None)] * nr
    m3 = bmask(3)
    b4 = bmask(4)
    for n in range(2):
        for h in range(2):
            acc = [[zero] * 4 for _ in range(nr)]
            for gg in range(4):
                g = 4 * h + gg
                V = ld(_il.py_func(64 * (8 * n + g), pl), _I8x64)
                H = ld(_il.py_func(1024 + 64 * g, pl), _I8x64) if q3 else None
                for j in range(4):
                    cv = b.and_(srl(V, 2 * j), m3)
                    if q3:
                        hb = 4 * n + j
                        hv = srl(H, hb - 2) if hb >= 2 else b.bitcast(
                            b.shl(b.bitcast(H, _I32x16), _i32x16(2 - hb)), _I8x64)
                        cv = b.or_(cv, b.and_(hv, b4))
                    cv = b.bitcast(cv, _I32x16)
                    for i in range(nr):
                        acc[i][j] = b.call(op.dp512, [acc[i][j], cv, xs(i, 128 * n + 32 * j + 4 * g)])
            for j in range(4):
                u = 8 * n + 2 * j + h
                if q3:
                    scv = b.sitofp(b.sext(ld(nc + 16 * u, _I8x16), _I32x16), _F32x16)
                else:
                    sb = b.zext(ld(nc + 16 * u, _I8x16), _I32x16)
                    scv = b.uitofp(b.and_(sb, _i32x16(15)), _F32x16)
                    mnv = b.uitofp(b.lshr(sb, _i32x16(4)), _F32x16)
                for i in range(nr):
                    xdu = b.load(b.gep(rows[i][1], [b.add(s0, c(4 * n + j))]))
                    ss = ssum16(i, 16 * u)
                    v = acc[i][j]
                    if q3:
                        v = b.sub(v, _splat_i(b, b.shl(ss, ir.Constant(_I32, 2))))
                    else:
                        maccs[i] = b.fadd(maccs[i], b.fmul(mnv, _splat_f(b, b.fmul(xdu, b.sitofp(ss, _F32)))))
                    saccs[i] = b.fadd(saccs[i], b.fmul(b.sitofp(v, _F32x16), b.fmul(scv, _splat_f(b, xdu))))
    dv = f16x16(nc + 256)
    dmv = None if q3 else f16x16(nc + 288)
    for i in range(nr):
        f = b.fmul(dv, saccs[i])
        if not q3:
            f = b.fsub(f, b.fmul(dmv, maccs[i]))
        b.store(b.fadd(b.load(faccs[i]), f), faccs[i])


def _emit_q6_k(t):
    """Q6_K: 6-bit codes from ql and qh, an int8 scale per 16 weights."""
    b, k, c, nc, nr, op, faccs = t.b, t.k, t.c, t.nc, t.nr, t.op, t.faccs
    xbs, m4, sh4, zero, xs, ld, f16x16, xd = t.xbs, t.m4, t.sh4, t.zero, t.xs, t.ld, t.f16x16, t.xd
    # per half n and l-half h: code groups g' of ql (A: l, B: l + 32) and qh (H) give the 6-bit codes of 4
    # sub-blocks s = 8n + 2kk + h (kk: ggml's four 32-element quarters of the half); each is an exact
    # int32 dot minus 32 x the sub-block's activation code sum (codes are q + 32, unsigned)
    s0 = b.mul(k, c(8))
    red = cgutils.get_or_insert_function(b.module, ir.FunctionType(_I32, [_I32x16]),
                                         "llvm.vector.reduce.add.v16i32")
    saccs = [ir.Constant(_F32x16, None)] * nr
    m3 = ir.Constant(_I8x64, [3] * 64)
    mc = ir.Constant(_I8x64, [0x0C] * 64)
    m30 = ir.Constant(_I8x64, [0x30] * 64)
    mc0 = ir.Constant(_I8x64, [0xC0] * 64)
    two = ir.Constant(_I8x64, [2] * 64)
    for n in range(2):
        for h in range(2):
            acc = [[zero] * 4 for _ in range(nr)]
            for gg in range(4):
                gp = 4 * h + gg                                  # g' (l0 = 4 g')
                A = ld(_q6_k_at(n, h, gg, 0), _I8x64)
                B = ld(_q6_k_at(n, h, gg, 1), _I8x64)
                H = ld(_q6_k_at(n, h, gg, 2), _I8x64)
                qs = (b.or_(b.and_(A, m4), b.shl(b.and_(H, m3), sh4)),
                      b.or_(b.and_(B, m4), b.shl(b.and_(H, mc), two)),
                      b.or_(b.lshr(A, sh4), b.and_(H, m30)),
                      b.or_(b.lshr(B, sh4), b.lshr(b.and_(H, mc0), two)))
                for kk in range(4):
                    qv = b.bitcast(qs[kk], _I32x16)
                    for i in range(nr):
                        acc[i][kk] = b.call(op.dp512, [acc[i][kk], qv, xs(i, 128 * n + 32 * kk + 4 * gp)])
            for kk in range(4):
                sub = 8 * n + 2 * kk + h
                scv = b.sitofp(b.sext(ld(_q6_k_at(n, h, kk, 3), _I8x16), _I32x16), _F32x16)
                for i in range(nr):
                    xsub = b.load(b.bitcast(b.gep(xbs[i], [c(16 * sub)]), _I8x16.as_pointer()), align=1)
                    ssum = b.call(red, [b.sext(xsub, _I32x16)])
                    v = b.sub(acc[i][kk], _splat_i(b, b.shl(ssum, ir.Constant(_I32, 5))))
                    sx = b.fmul(scv, xd(i, b.add(s0, c(sub // 2))))
                    saccs[i] = b.fadd(saccs[i], b.fmul(b.sitofp(v, _F32x16), sx))
    dv = f16x16(nc + 256)
    for i in range(nr):
        b.store(b.fadd(b.load(faccs[i]), b.fmul(dv, saccs[i])), faccs[i])


def _emit_q4_q5_k(t):
    """Q4_K, Q5_K: nibbles (Q5_K's fifth bit from qh), 6-bit scales and mins per 32 weights."""
    b, k, c, name, nc, nr, op, faccs, m4 = t.b, t.k, t.c, t.name, t.nc, t.nr, t.op, t.faccs, t.m4
    sh4, zero, xs, ld, f16x16, xd, xm, srl, bmask = t.sh4, t.zero, t.xs, t.ld, t.f16x16, t.xd, t.xm, t.srl, t.bmask
    s0 = b.mul(k, c(8))
    saccs = [ir.Constant(_F32x16, None)] * nr
    b16 = bmask(16)
    pl = _PLANE.get(name, 0)

    def bit4(H, bit):  # bit ``bit`` of each byte of H moved to bit 4 (Q5_K's fifth bit)
        if bit >= 4:
            return b.and_(srl(H, bit - 4), b16)
        return b.and_(b.bitcast(b.shl(b.bitcast(H, _I32x16), _i32x16(4 - bit)), _I8x64), b16)

    for j in range(4):
        lo = [[zero, zero] for _ in range(nr)]
        hi = [[zero, zero] for _ in range(nr)]
        for g in range(8):
            v = ld(_il.py_func(512 * j + 64 * g, pl), _I8x64)
            vl, vh = b.and_(v, m4), b.lshr(v, sh4)
            if name == "Q5_K":  # qh byte l: bit 2j the fifth bit of element 64j + l, 2j + 1 of 64j + 32 + l
                H = ld(_il.py_func(2048 + 64 * g, pl), _I8x64)
                vl, vh = b.or_(vl, bit4(H, 2 * j)), b.or_(vh, bit4(H, 2 * j + 1))
            vl, vh = b.bitcast(vl, _I32x16), b.bitcast(vh, _I32x16)
            for i in range(nr):
                lo[i][g & 1] = b.call(op.dp512, [lo[i][g & 1], vl, xs(i, 64 * j + 4 * g)])
                hi[i][g & 1] = b.call(op.dp512, [hi[i][g & 1], vh, xs(i, 64 * j + 32 + 4 * g)])
        for h, parts in ((0, lo), (1, hi)):
            sub = 2 * j + h
            scv = b.uitofp(b.zext(ld(nc + 16 * sub, _I8x16), _I32x16), _F32x16)
            for i in range(nr):
                sx = b.fmul(scv, xd(i, b.add(s0, c(sub))))
                saccs[i] = b.fadd(saccs[i], b.fmul(b.sitofp(b.add(parts[i][0], parts[i][1]), _F32x16), sx))
    maccs = [ir.Constant(_F32x16, None)] * nr
    for sub in range(8):
        mnv = b.uitofp(b.zext(ld(nc + 128 + 16 * sub, _I8x16), _I32x16), _F32x16)
        for i in range(nr):
            maccs[i] = b.fadd(maccs[i], b.fmul(mnv, xm(i, b.add(s0, c(sub)))))
    dv, dmv = f16x16(nc + 256), f16x16(nc + 288)
    for i in range(nr):
        f = b.fadd(b.load(faccs[i]), b.fsub(b.fmul(dv, saccs[i]), b.fmul(dmv, maccs[i])))
        b.store(f, faccs[i])


def _emit_q32(t):
    """The 32-weight types Q4_0, Q4_1, Q5_0, Q5_1 (nibbles, Q5's fifth bits) and Q8_0 (int8 codes)."""
    b, k, name, nc, nr, op, faccs, rows, m4 = t.b, t.k, t.name, t.nc, t.nr, t.op, t.faccs, t.rows, t.m4
    sh4, zero, ones, xs, ld, f16x16, xd, xm, xu = t.sh4, t.zero, t.ones, t.xs, t.ld, t.f16x16, t.xd, t.xm, t.xu
    parts = [[] for _ in range(nr)]
    wsum = None
    if name == "Q8_0":
        # the table types' operand order: the activations made unsigned (x ^ 0x80 = x + 128) against
        # the signed weight codes, and 128 x the row's code sum (a vpdpbusd with ones, weight-side,
        # shared by the rows) taken off exactly in int32: the same int32 block dot as sum(w x), with
        # one vector op per row and group instead of the sign trick's three. ``t.pre``: both come made
        # (``tile4u_q8_0``), and two partial sums a row (8 dependency chains for 4 rows) instead of four
        npart = 2 if t.pre is not None else 4
        wsum = zero
        for g in range(8):
            v = b.bitcast(ld(64 * g, _I8x64), _I32x16)
            if t.pre is None:
                wsum = b.call(op.dp512, [wsum, ones, v])
            for i in range(nr):
                prev = parts[i][g % npart] if g >= npart else zero
                d = b.call(op.dp512, [prev, xu(i, 4 * g), v])
                if g >= npart:
                    parts[i][g % npart] = d
                else:
                    parts[i].append(d)
        if t.pre is None:
            wsum = b.shl(wsum, _i32x16(7))
        else:   # exact int32 sums in another order: the same integers
            wsum = b.load(b.bitcast(b.gep(t.pre, [b.mul(k, ir.Constant(k.type, 16))]), _I32x16.as_pointer()),
                          align=4)
            parts = [[b.add(p[0], p[1])] for p in parts]
    else:
        qh = ld(nc, _I32x16) if name in ("Q5_0", "Q5_1") else None
        for g in range(4):
            v = ld(64 * g, _I8x64)
            lo = b.and_(v, m4)
            hi = b.lshr(v, sh4)
            if qh is not None:  # bits 4g..4g+3 (and 16+4g..) of each row's qh -> bit 4 of its 4 bytes
                def spread(sh):
                    t = b.and_(b.lshr(qh, _i32x16(sh)), _i32x16(15))
                    t = b.and_(b.mul(t, _i32x16(0x00204081)), _i32x16(0x01010101))
                    return b.bitcast(b.shl(t, _i32x16(4)), _I8x64)

                lo = b.or_(lo, spread(4 * g))
                hi = b.or_(hi, spread(16 + 4 * g))
            lo, hi = b.bitcast(lo, _I32x16), b.bitcast(hi, _I32x16)
            for i in range(nr):
                a_ = b.call(op.dp512, [zero, lo, xs(i, 4 * g)])
                parts[i].append(b.call(op.dp512, [a_, hi, xs(i, 16 + 4 * g)]))
    od = nc + (64 if name in ("Q5_0", "Q5_1") else 0)
    dv = f16x16(od)
    mv = f16x16(od + 32) if name in ("Q4_1", "Q5_1") else None
    for i in range(nr):
        pi = parts[i]
        isum = pi[0] if len(pi) == 1 else b.add(b.add(pi[0], pi[1]), b.add(pi[2], pi[3]))
        if wsum is not None:
            isum = b.sub(isum, wsum)
        elif name == "Q5_0":   # the -16 in int32: 16 x the row's code sum (``widen_t16_q5_0``'s Q8_0 tile: same integer)
            isum = b.sub(isum, _splat_i(b, b.shl(t.ssum32(i), ir.Constant(_I32, 4))))
        sc = b.fmul(dv, xd(i, k))
        if name in ("Q8_0", "Q5_0"):
            # d16 * xd[b] kept whole: the kernels compile with fast-math flags, and LLVM's reassociation of
            # isum * d * xd followed each kernel's code around it, so ``tile_q5_0`` and ``tile4u_q8_0`` on the
            # widened tile (the same integers) differed by an ulp; behind the fence every path rounds alike
            fence = cgutils.get_or_insert_function(b.module, ir.FunctionType(_F32x16, [_F32x16]),
                                                   "llvm.arithmetic.fence.v16f32")
            sc = b.call(fence, [sc])
        f = b.fadd(b.load(faccs[i]), b.fmul(b.sitofp(isum, _F32x16), sc))
        if mv is not None:
            f = b.fadd(f, b.fmul(mv, xm(i, k)))
        elif name == "Q4_0":
            mk = b.load(b.gep(rows[i][2], [k]))
            f = b.fsub(f, b.fmul(dv, _splat_f(b, b.fmul(mk, ir.Constant(_F32, 8.0)))))
        b.store(f, faccs[i])


#: tile type -> the emitter of its family's record arithmetic
_EMIT = {n: f for f, names in (
    (_emit_nvfp4, ("NVFP4",)),
    (_emit_lut, tuple(_LUT)),
    (_emit_iq2, ("IQ2_XXS", "IQ2_XS", "IQ2_S")),
    (_emit_iq1, ("IQ1_S", "IQ1_M")),
    (_emit_q2_q3_k, ("Q2_K", "Q3_K")),
    (_emit_q6_k, ("Q6_K",)),
    (_emit_q4_q5_k, ("Q4_K", "Q5_K")),
    (_emit_q32, ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")),
) for n in names}
assert set(_EMIT) == set(KIND), set(KIND) ^ set(_EMIT)


def _emit_tile(b, name, rec_data, nsb, rows, pre=None):
    """The tile arithmetic for one or more activation rows. ``rows``: per row (xq i8*, xd float*, xm float*,
    out float*). Each row gets the same instruction sequence whatever the number of rows (the weight loads and
    nibble splits are shared), so a row's result does not depend on its batch. The loop over the records and
    their prefetch are here; each record's arithmetic is its type family's emitter (``_EMIT``). ``pre``
    (Q8_0 only): xq holds x + 128 and ``pre`` (i32*) 128 x the records' code sums (``tile4u_q8_0``)."""
    bs, rec_bytes, nc, _ = SPEC[name]
    emit = _EMIT[name]
    op = _Ops(b)
    nr = len(rows)
    faccs = [cgutils.alloca_once_value(b, ir.Constant(_F32x16, None)) for _ in range(nr)]
    _i32 = lambda v: ir.Constant(_I32, v)  # noqa: E731
    # llvm.prefetch(address, read, locality 3 = all cache levels, data cache)
    prefetch = cgutils.get_or_insert_function(b.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(),
                                                                                          _I32, _I32, _I32]),
                                              "llvm.prefetch.p0i8")
    with cgutils.for_range(b, nsb) as loop:
        k = loop.index
        c = lambda v: ir.Constant(k.type, v)  # noqa: E731
        base = b.gep(rec_data, [b.mul(k, c(rec_bytes))])
        for q in range(0, rec_bytes, 64):   # the records PREFETCH bytes ahead, a cache line at a time
            b.call(prefetch, [b.gep(base, [c(PREFETCH + q)]), _i32(0), _i32(3), _i32(1)])
        xbs = [b.gep(r[0], [b.mul(k, c(bs))]) for r in rows]
        emit(_Rec(b, name, nc, op, rows, faccs, k, base, xbs, pre))
    for i in range(nr):
        b.store(b.load(faccs[i]), b.bitcast(rows[i][3], _F32x16.as_pointer()), align=4)



def _nsb(b, name, xda_shape_n):   # records per row: the activation blocks of 32 over the record's weights
    per = SPEC[name][0] // 32
    return b.udiv(xda_shape_n, ir.Constant(xda_shape_n.type, per)) if per > 1 else xda_shape_n


def _tile_codegen(name):
    def codegen(context, builder, signature, args):
        ra, xa, xda, xma, oa = _arrays(context, builder, types.void(*signature.args[:5]), args[:5])
        b = builder
        out = b.gep(oa.data, [args[5]])
        _emit_tile(b, name, ra.data, _nsb(b, name, b.extract_value(xda.shape, 0)),
                   [(xa.data, xda.data, xma.data, out)])
        return context.get_dummy_value()

    return codegen


def _tile4_codegen(name):
    def codegen(context, builder, signature, args):
        ra, xa, xda, xma, rw, oa, orw = _arrays(context, builder, types.void(*signature.args[:7]), args[:7])
        b = builder
        off = args[7]
        i8p = ir.IntType(8).as_pointer()

        def row_ptr(arr, i, elt):
            st = b.extract_value(arr.strides, 0)
            p = b.gep(b.bitcast(arr.data, i8p), [b.mul(i, st)])
            return b.bitcast(p, elt.as_pointer())

        def rows_of(n):
            rows = []
            for j in range(n):
                r = b.load(b.gep(rw.data, [ir.Constant(_I32, j)]))
                o = b.load(b.gep(orw.data, [ir.Constant(_I32, j)]))
                rows.append((row_ptr(xa, r, ir.IntType(8)), row_ptr(xda, r, _F32), row_ptr(xma, r, _F32),
                             b.gep(row_ptr(oa, o, _F32), [off])))
            return rows

        nsb = _nsb(b, name, b.extract_value(xda.shape, 1))
        # 2, 3 or 4 rows (the length of ``rows``) share each weight load: a decode step's 2-3 rows of one weight
        # (2-3 sequences, or an expert 2-3 of them chose) read the tile once, as 4 rows always did
        n = b.extract_value(rw.shape, 0)
        with b.if_else(b.icmp_signed("==", n, ir.Constant(n.type, 2))) as (two, more):
            with two:
                _emit_tile(b, name, ra.data, nsb, rows_of(2))
            with more:
                with b.if_else(b.icmp_signed("==", n, ir.Constant(n.type, 3))) as (three, four):
                    with three:
                        _emit_tile(b, name, ra.data, nsb, rows_of(3))
                    with four:
                        _emit_tile(b, name, ra.data, nsb, rows_of(4))
        return context.get_dummy_value()

    return codegen


def _tile_intrinsic(name):
    def typer(typingctx, rec, xq, xd, xm, out, off):
        """16 outputs of one tile: out[off:off+16] = tile rows . the activation row (layout in the module doc).
        rec uint8 [nrec * RECORD] (one tile's records), xq int8 [I], xd/xm f32 [I/32], out f32 1-D, off int64."""
        return types.void(rec, xq, xd, xm, out, off), _tile_codegen(name)

    typer.__name__ = f"tile_{name.lower()}"
    return vnni_intrinsic(typer)


def _tile4_intrinsic(name):
    def typer(typingctx, rec, xq, xd, xm, rows, out, orows, off):
        """The same for 2, 3 or 4 activation rows sharing the tile's loads: out[orows[i], off:off+16] = tile . row
        rows[i] of xq int8 [R, I] / xd, xm f32 [R, I/32] (C-contiguous rows), rows/orows int64 [n] (n = 2, 3, else
        4: the first 4), out f32 2-D. Each row gets the one-row tile's instructions: the same bits."""
        return types.void(rec, xq, xd, xm, rows, out, orows, off), _tile4_codegen(name)

    typer.__name__ = f"tile4_{name.lower()}"
    return vnni_intrinsic(typer)


def _tile4u_q8_0_codegen(context, builder, signature, args):
    ra, xa, xda, rw, oa, orw = _arrays(context, builder, types.void(*signature.args[:6]), args[:6])
    wa = context.make_array(signature.args[7])(context, builder, args[7])
    b = builder
    off = args[6]
    i8p = ir.IntType(8).as_pointer()

    def row_ptr(arr, i, elt):
        st = b.extract_value(arr.strides, 0)
        return b.bitcast(b.gep(b.bitcast(arr.data, i8p), [b.mul(i, st)]), elt.as_pointer())

    rows = []
    for j in range(4):
        r = b.load(b.gep(rw.data, [ir.Constant(_I32, j)]))
        o = b.load(b.gep(orw.data, [ir.Constant(_I32, j)]))
        xdp = row_ptr(xda, r, _F32)
        rows.append((row_ptr(xa, r, ir.IntType(8)), xdp, xdp, b.gep(row_ptr(oa, o, _F32), [off])))
    _emit_tile(b, "Q8_0", ra.data, b.extract_value(xda.shape, 1), rows, pre=wa.data)
    return context.get_dummy_value()


@vnni_intrinsic
def tile4u_q8_0(typingctx, rec, xu, xd, rows, out, orows, off, wsum):
    """``tile4_q8_0`` for a prompt's rows with the +128 work done once outside: out[orows[i], off:off+16] = the
    Q8_0 tile ``rec`` . row rows[i], xu uint8 [R, I] the activation codes + 128 (``xq ^ 0x80``), xd f32
    [R, I/32], rows/orows int64 [4], wsum int32 [I/32 * 16] = ``wsum_q8_0(rec)``. The same int32 block dots
    and f32 steps as ``tile4_q8_0``: the outputs are bit-identical."""
    return types.void(rec, xu, xd, rows, out, orows, off, wsum), _tile4u_q8_0_codegen


def _wsum_q8_0_codegen(context, builder, signature, args):
    ra, wa = _arrays(context, builder, signature, args)
    b = builder
    op = _Ops(b)
    zero = ir.Constant(_I32x16, None)
    ones = b.bitcast(ir.Constant(_I8x64, [1] * 64), _I32x16)
    nrec = b.udiv(b.extract_value(wa.shape, 0), ir.Constant(b.extract_value(wa.shape, 0).type, 16))
    rec_bytes = SPEC["Q8_0"][1]
    with cgutils.for_range(b, nrec) as loop:
        k = loop.index
        base = b.gep(ra.data, [b.mul(k, ir.Constant(k.type, rec_bytes))])
        ws = zero
        for g in range(8):
            v = b.load(b.bitcast(b.gep(base, [ir.Constant(k.type, 64 * g)]), _I32x16.as_pointer()), align=1)
            ws = b.call(op.dp512, [ws, ones, v])
        dst = b.bitcast(b.gep(wa.data, [b.mul(k, ir.Constant(k.type, 16))]), _I32x16.as_pointer())
        b.store(b.shl(ws, _i32x16(7)), dst, align=4)
    return context.get_dummy_value()


@vnni_intrinsic
def wsum_q8_0(typingctx, rec, wsum):
    """128 x the code sums of a Q8_0 tile's records (``tile4u_q8_0``'s table): wsum[16 k + r] = 128 x the sum of
    row r's 32 codes in record k. rec uint8 [nrec * 544] (one tile), wsum int32 [nrec * 16]."""
    return types.void(rec, wsum), _wsum_q8_0_codegen


def _widen_t16_q5_0_codegen(context, builder, signature, args):
    ra, oa, wa = _arrays(context, builder, signature, args)
    b = builder
    op = _Ops(b)
    zero = ir.Constant(_I32x16, None)
    ones = b.bitcast(ir.Constant(_I8x64, [1] * 64), _I32x16)
    m4, x10 = ir.Constant(_I8x64, [15] * 64), ir.Constant(_I8x64, [16] * 64)
    nrec = b.udiv(b.extract_value(wa.shape, 0), ir.Constant(b.extract_value(wa.shape, 0).type, 16))
    _, r5, nc5, _ = SPEC["Q5_0"]
    _, r8, nc8, _ = SPEC["Q8_0"]
    with cgutils.for_range(b, nrec) as loop:
        k = loop.index
        c = lambda v: ir.Constant(k.type, v)  # noqa: E731
        src = b.gep(ra.data, [b.mul(k, c(r5))])
        dst = b.gep(oa.data, [b.mul(k, c(r8))])

        def ld(o, ty):
            return b.load(b.bitcast(b.gep(src, [c(o)]), ty.as_pointer()), align=1)

        def st(v, o):
            b.store(v, b.bitcast(b.gep(dst, [c(o)]), v.type.as_pointer()), align=1)

        qh = ld(nc5, _I32x16)

        def spread(sh):   # bits sh..sh+3 of each row's qh -> bit 4 of its 4 bytes (``_emit_q32``'s steps)
            t = b.and_(b.lshr(qh, _i32x16(sh)), _i32x16(15))
            t = b.and_(b.mul(t, _i32x16(0x00204081)), _i32x16(0x01010101))
            return b.bitcast(b.shl(t, _i32x16(4)), _I8x64)

        ws = zero
        for g in range(4):
            v = ld(64 * g, _I8x64)
            lo = b.sub(b.or_(b.and_(v, m4), spread(4 * g)), x10)   # q - 16: elements 4g..4g+3, Q8_0's group g
            hi = b.sub(b.or_(b.lshr(v, ir.Constant(_I8x64, [4] * 64)), spread(16 + 4 * g)), x10)   # group 4 + g
            st(lo, 64 * g)
            st(hi, 64 * (4 + g))
            ws = b.call(op.dp512, [ws, ones, b.bitcast(lo, _I32x16)])
            ws = b.call(op.dp512, [ws, ones, b.bitcast(hi, _I32x16)])
        st(ld(nc5 + 64, _I32x8), nc8)   # the 16 f16 d
        b.store(b.shl(ws, _i32x16(7)), b.bitcast(b.gep(wa.data, [b.mul(k, c(16))]), _I32x16.as_pointer()), align=4)
    return context.get_dummy_value()


@vnni_intrinsic
def widen_t16_q5_0(typingctx, rec, out, wsum):
    """A Q5_0 tile's records as a Q8_0 tile's, for ``tile4u_q8_0``: out's codes q - 16 (int8, ggml's
    ``dequantize_row_q5_0`` value / d), its d the same f16, and wsum[16 k + r] = 128 x the sum of row r's 32
    codes q - 16 in record k (``wsum_q8_0`` of out). rec uint8 [nrec * 352] (one Q5_0 tile), out uint8
    [nrec * 544], wsum int32 [nrec * 16]. ``tile4u_q8_0`` on them gives ``tile_q5_0``'s int32 block dots
    (sum (q - 16) x) and f32 steps: the outputs are bit-identical."""
    return types.void(rec, out, wsum), _widen_t16_q5_0_codegen


tile_q4_0 = _tile_intrinsic("Q4_0")
tile_q4_1 = _tile_intrinsic("Q4_1")
tile_q8_0 = _tile_intrinsic("Q8_0")
tile_q5_0 = _tile_intrinsic("Q5_0")
tile_q4_k = _tile_intrinsic("Q4_K")
tile_q6_k = _tile_intrinsic("Q6_K")
tile4_q4_0 = _tile4_intrinsic("Q4_0")
tile4_q4_1 = _tile4_intrinsic("Q4_1")
tile4_q8_0 = _tile4_intrinsic("Q8_0")
tile4_q5_0 = _tile4_intrinsic("Q5_0")
tile4_q4_k = _tile4_intrinsic("Q4_K")
tile4_q6_k = _tile4_intrinsic("Q6_K")
tile_mxfp4 = _tile_intrinsic("MXFP4")
tile_iq4_nl = _tile_intrinsic("IQ4_NL")
tile_iq4_xs = _tile_intrinsic("IQ4_XS")
tile_q2_k = _tile_intrinsic("Q2_K")
tile_q3_k = _tile_intrinsic("Q3_K")
tile4_mxfp4 = _tile4_intrinsic("MXFP4")
tile4_iq4_nl = _tile4_intrinsic("IQ4_NL")
tile4_iq4_xs = _tile4_intrinsic("IQ4_XS")
tile4_q2_k = _tile4_intrinsic("Q2_K")
tile4_q3_k = _tile4_intrinsic("Q3_K")
tile_q5_1 = _tile_intrinsic("Q5_1")
tile_q5_k = _tile_intrinsic("Q5_K")
tile4_q5_1 = _tile4_intrinsic("Q5_1")
tile4_q5_k = _tile4_intrinsic("Q5_K")
tile_iq2_xxs = _tile_intrinsic("IQ2_XXS")
tile_iq3_xxs = _tile_intrinsic("IQ3_XXS")
tile4_iq2_xxs = _tile4_intrinsic("IQ2_XXS")
tile4_iq3_xxs = _tile4_intrinsic("IQ3_XXS")
tile_iq3_s = _tile_intrinsic("IQ3_S")
tile4_iq3_s = _tile4_intrinsic("IQ3_S")
tile_iq2_xs = _tile_intrinsic("IQ2_XS")
tile4_iq2_xs = _tile4_intrinsic("IQ2_XS")
tile_iq2_s = _tile_intrinsic("IQ2_S")
tile4_iq2_s = _tile4_intrinsic("IQ2_S")
tile_iq1_s = _tile_intrinsic("IQ1_S")
tile4_iq1_s = _tile4_intrinsic("IQ1_S")
tile_iq1_m = _tile_intrinsic("IQ1_M")
tile4_iq1_m = _tile4_intrinsic("IQ1_M")
tile_nvfp4 = _tile_intrinsic("NVFP4")
tile4_nvfp4 = _tile4_intrinsic("NVFP4")


@njit(inline="always", **_JIT)
def f16_at(rec, i):
    """The little-endian IEEE f16 at bytes rec[i], rec[i+1] as f32 (integer decoding: no half type needed)."""
    h = np.int64(rec[i]) | (np.int64(rec[i + 1]) << 8)
    e = (h >> 10) & 31
    m = h & 1023
    if e == 0:
        v = np.float64(m) * 5.960464477539063e-08           # 2^-24: subnormals and zero
    elif e == 31:
        v = np.inf if m == 0 else np.nan
    else:
        v = np.float64(1024 + m) * 2.0 ** (e - 25)
    return np.float32(-v if h >> 15 else v)


@njit(inline="always", **_JIT)
def _decode_q2_q3_k(rec, kind, r, I, buf):
    """``decode_row`` of Q2_K, Q3_K (kinds 9, 10)."""
    for s in range(I // 256):
        base = s * _REC[kind]
        nc = _NC[kind]
        d = f16_at(rec, base + nc + 256 + 2 * r)
        dm = f16_at(rec, base + nc + 288 + 2 * r) if kind == 9 else np.float32(0.0)
        pl = 16 if kind == 10 else 0   # _PLANE
        for n in range(2):
            for g in range(8):
                for i in range(4):
                    q = np.int64(rec[base + _il(64 * (8 * n + g) + 4 * r + i, pl)])
                    hm = np.int64(rec[base + _il(1024 + 64 * g + 4 * r + i, pl)]) if kind == 10 else np.int64(0)
                    for j in range(4):
                        u = 8 * n + 2 * j + (g >> 2)
                        sc = np.int64(rec[base + nc + 16 * u + r])
                        cq = (q >> (2 * j)) & 3
                        e = 256 * s + 128 * n + 32 * j + 4 * g + i
                        if kind == 9:   # dequantize_row_q2_K: d * (sc & 15) * q - dmin * (sc >> 4)
                            buf[e] = d * np.float32(sc & 15) * np.float32(cq) - dm * np.float32(sc >> 4)
                        else:           # dequantize_row_q3_K: d * (sc - 32) * (q - (hmask bit ? 0 : 4))
                            sc = sc - 256 if sc > 127 else sc
                            cq = cq - (0 if (hm >> (4 * n + j)) & 1 else 4)
                            buf[e] = d * np.float32(sc) * np.float32(cq)


@njit(inline="always", **_JIT)
def _decode_nvfp4(rec, kind, r, I, buf):
    """``decode_row`` of NVFP4 (kind 20): dequantize_row_nvfp4's kvalues_mxfp4[q] * ue4m3(d_s) / 2 per 16 weights,
    exact in f32."""
    for bk in range(I // 64):
        base = bk * _REC[20]
        for s in range(4):
            d = _UE4M3[rec[base + _NC[20] + 16 * s + r]]
            for h in range(2):
                for i in range(4):
                    q = rec[base + 64 * (2 * s + h) + 4 * r + i]
                    e = 64 * bk + 16 * s + 4 * h + i
                    buf[e] = d * np.float32(_TABLES[0][q & 15])
                    buf[e + 8] = d * np.float32(_TABLES[0][q >> 4])


@njit(inline="always", **_JIT)
def _decode_iq1(rec, kind, r, I, buf):
    """``decode_row`` of IQ1_S, IQ1_M (kinds 18, 19): dequantize_row_iq1_s / iq1_m's d * (2s + 1) * (grid + delta),
    delta = +-1/8, as d (2s + 1) (8 (c - 1) +- 1) / 8: every product exact."""
    m1 = kind == 19
    for s in range(I // 256):
        base = s * _REC[kind]
        nc = _NC[kind]
        d = f16_at(rec, base + nc + (192 if m1 else 64) + 2 * r)
        for e in range(256):
            ib = e >> 5
            lp = e & 31
            cq = (np.int64(rec[base + 64 * (8 * (e >> 7) + (lp >> 2)) + 4 * r + (lp & 3)]) >> (2 * (ib & 3))) & 3
            if m1:
                sc = (np.int64(rec[base + nc + 16 * ib + r]) >> (4 * (lp >> 4))) & 7
                neg = (np.int64(rec[base + nc + 128 + 16 * (ib >> 1) + r]) >> (4 * (ib & 1) + (lp >> 3))) & 1
            else:
                nbl = (np.int64(rec[base + nc + 16 * (ib >> 1) + r]) >> (4 * (ib & 1))) & 15
                sc = nbl & 7
                neg = nbl >> 3
            w8 = 8 * cq - 8 + (-1 if neg else 1)
            buf[256 * s + e] = d * np.float32(2 * sc + 1) * np.float32(w8) * np.float32(0.125)


@njit(inline="always", **_JIT)
def _decode_iq2(rec, kind, r, I, buf):
    """``decode_row`` of the IQ2_XXS, IQ2_XS, IQ2_S planes (kinds 13, 16, 17): dequantize_row_iq2_*'s
    d * (0.5 + s) * 0.25 * grid * sign, f32 as gguf; IQ2_XS, IQ2_S a scale per 16."""
    nh = 2 if kind >= 16 else 1
    for s in range(I // 256):
        base = s * _REC[kind]
        nc = _NC[kind]
        d = f16_at(rec, base + nc + 128 * nh + 2 * r)
        for n in range(2):
            for g in range(8):
                for i in range(4):
                    q = np.int64(rec[base + _il(64 * (8 * n + g) + 4 * r + i, 16)])
                    for j in range(4):
                        ib = 4 * n + j
                        u = nh * ib + (g >> 2 if nh == 2 else 0)
                        db = d * (np.float32(0.5) + np.float32((np.int64(rec[base + nc + 16 * u + r]) - 1)
                                                               // 2)) * np.float32(0.25)
                        sb = np.int64(rec[base + _il(1024 + 64 * g + 4 * r + i, 16)]) >> ib
                        v = _TABLES[3][((q >> (2 * j)) & 3) | ((sb & 1) << 2)]
                        buf[256 * s + 128 * n + 32 * j + 4 * g + i] = db * np.float32(v)


@njit(inline="always", **_JIT)
def _decode_iq3(rec, kind, r, I, buf):
    """``decode_row`` of the IQ3_XXS / IQ3_S nibbles (kinds 14, 15): dequantize_row_iq3_xxs's d * (0.5 + s) * 0.5,
    iq3_s's d * (1 + 2s); times grid * sign."""
    kv = _TABLES[2] if kind == 14 else _TABLES[4]
    for s in range(I // 256):
        base = s * _REC[kind]
        nc = _NC[kind]
        d = f16_at(rec, base + nc + 128 + 2 * r)
        for sb in range(8):
            ls = np.int64(rec[base + nc + 16 * sb + r])
            if kind == 14:
                db = d * (np.float32(0.5) + np.float32((ls - 1) // 2)) * np.float32(0.5)
            else:
                db = d * np.float32(ls)
            for g in range(4):
                for i in range(4):
                    q = rec[base + 256 * sb + 64 * g + 4 * r + i]
                    e = 256 * s + 32 * sb + 4 * g + i
                    buf[e] = db * np.float32(kv[q & 15])
                    buf[e + 16] = db * np.float32(kv[q >> 4])


@njit(inline="always", **_JIT)
def _decode_lut(rec, kind, r, I, buf):
    """``decode_row`` of the 4-bit table types MXFP4, IQ4_NL, IQ4_XS (kinds 6-8): per 32, codes as Q4_0's,
    w = d * table[code]."""
    kv = _TABLES[0] if kind == 6 else _TABLES[1]
    nsub = 8 if kind == 8 else 1
    for s in range(I // (32 * nsub)):
        base = s * _REC[kind]
        nc = _NC[kind]
        for sb in range(nsub):
            if kind == 6:      # ggml_e8m0_to_fp32_half
                d = np.float32(2.0 ** (np.int64(rec[base + nc + r]) - 128))
            elif kind == 7:
                d = f16_at(rec, base + nc + 2 * r)
            else:              # dequantize_row_iq4_xs: d * (ls - 32)
                ls = np.int64(rec[base + nc + 16 * sb + r])
                d = f16_at(rec, base + nc + 128 + 2 * r) * np.float32(ls - 256 if ls > 127 else ls)
            for g in range(4):
                for i in range(4):
                    q = rec[base + 256 * sb + 64 * g + 4 * r + i]
                    e = 32 * (s * nsub + sb) + 4 * g + i
                    buf[e] = d * np.float32(kv[q & 15])
                    buf[e + 16] = d * np.float32(kv[q >> 4])


@njit(inline="always", **_JIT)
def _decode_q6_k(rec, kind, r, I, buf):
    """``decode_row`` of Q6_K (kind 5)."""
    for s in range(I // 256):
        base = s * _REC[5]
        d = f16_at(rec, base + _NC[5] + 256 + 2 * r)
        for n in range(2):
            for l in range(32):
                h = l >> 4
                part = base + 832 * (2 * n + h)      # _q6_k_at: (n, h)'s 832 bytes, group gg = (l >> 2) & 3
                o = part + 192 * ((l >> 2) & 3) + 4 * r + (l & 3)
                A = np.int64(rec[o])
                B = np.int64(rec[o + 64])
                H = np.int64(rec[o + 128])
                qv = ((A & 15) | ((H & 3) << 4), (B & 15) | (((H >> 2) & 3) << 4),
                      (A >> 4) | (((H >> 4) & 3) << 4), (B >> 4) | (((H >> 6) & 3) << 4))
                for kk in range(4):
                    sc = np.int64(rec[part + 768 + 16 * kk + r])
                    sc = sc - 256 if sc > 127 else sc
                    buf[256 * s + 128 * n + 32 * kk + l] = d * np.float32(sc) * np.float32(qv[kk] - 32)


@njit(inline="always", **_JIT)
def _decode_q4_q5_k(rec, kind, r, I, buf):
    """``decode_row`` of Q4_K, Q5_K (kinds 4, 12; dequantize_row_q5_K: qh bit 2j / 2j + 1 of byte l is bit 4)."""
    for s in range(I // 256):
        base = s * _REC[kind]
        nc = _NC[kind]
        d = f16_at(rec, base + nc + 256 + 2 * r)
        dm = f16_at(rec, base + nc + 288 + 2 * r)
        pl = 32 if kind == 12 else 0   # _PLANE
        for j in range(4):
            for h in range(2):
                sub = 2 * j + h
                sc = d * np.float32(rec[base + nc + 16 * sub + r])
                mn = dm * np.float32(rec[base + nc + 128 + 16 * sub + r])
                for g in range(8):
                    for i in range(4):
                        q = np.int64(rec[base + _il(512 * j + 64 * g + 4 * r + i, pl)])
                        qv = (q >> 4) if h else (q & 15)
                        if kind == 12:
                            qv |= ((np.int64(rec[base + _il(2048 + 64 * g + 4 * r + i, pl)]) >> (2 * j + h)) & 1) << 4
                        buf[256 * s + 64 * j + 32 * h + 4 * g + i] = sc * np.float32(qv) - mn


@njit(inline="always", **_JIT)
def _decode_q32(rec, kind, r, I, buf):
    """``decode_row`` of the 32-weight types Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 (kinds 0-3, 11)."""
    rb = _REC[kind]
    nc = _NC[kind]
    od = nc + (64 if kind == 3 or kind == 11 else 0)
    for b in range(I // 32):
        base = b * rb
        d = f16_at(rec, base + od + 2 * r)
        if kind == 2:
            for g in range(8):
                for i in range(4):
                    q = np.int64(rec[base + 64 * g + 4 * r + i])
                    buf[b * 32 + 4 * g + i] = d * np.float32(q - 256 if q > 127 else q)
            continue
        qh = np.int64(0)
        if kind == 3 or kind == 11:
            for i in range(4):
                qh |= np.int64(rec[base + nc + 4 * r + i]) << (8 * i)
        if kind == 1 or kind == 11:    # Q4_1, Q5_1: w = d q + m
            m = f16_at(rec, base + od + 32 + 2 * r)
        else:                           # Q4_0, Q5_0: w = d (q - 8) / d (q - 16)
            m = -np.float32(8.0 if kind == 0 else 16.0) * d
        for g in range(4):
            for i in range(4):
                q = np.int64(rec[base + 64 * g + 4 * r + i])
                j = 4 * g + i
                lo = (q & 15) | (((qh >> j) & 1) << 4)
                hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
                buf[b * 32 + j] = d * np.float32(lo) + m
                buf[b * 32 + 16 + j] = d * np.float32(hi) + m


@njit(**_JIT)
def decode_row(rec, kind, r, I, buf):
    """Row r (0..15) of a tile decoded to f32 into buf [I] (ggml's dequantize_row_q4_0 / q4_1 / q8_0 / q5_0 /
    q4_K / q6_K / mxfp4 / iq4_nl / iq4_xs / q2_K / q3_K / iq2_* / iq3_* / iq1_s / iq1_m / nvfp4). rec uint8: the tile's records;
    kind: ``KIND`` (0 Q4_0, 1 Q4_1, 2 Q8_0, 3 Q5_0, 4 Q4_K, 5 Q6_K, 6 MXFP4, 7 IQ4_NL, 8 IQ4_XS, 9 Q2_K, 10 Q3_K,
    11 Q5_1, 12 Q5_K, 13 IQ2_XXS, 14 IQ3_XXS, 15 IQ3_S, 16 IQ2_XS, 17 IQ2_S, 18 IQ1_S, 19 IQ1_M, 20 NVFP4); the
    grid i-quants and NVFP4 bit for bit as gguf.quants."""
    if kind == 9 or kind == 10:
        _decode_q2_q3_k(rec, kind, r, I, buf)
    elif kind == 20:
        _decode_nvfp4(rec, kind, r, I, buf)
    elif kind == 18 or kind == 19:
        _decode_iq1(rec, kind, r, I, buf)
    elif kind == 13 or kind == 16 or kind == 17:
        _decode_iq2(rec, kind, r, I, buf)
    elif kind == 14 or kind == 15:
        _decode_iq3(rec, kind, r, I, buf)
    elif kind >= 6 and kind <= 8:
        _decode_lut(rec, kind, r, I, buf)
    elif kind == 5:
        _decode_q6_k(rec, kind, r, I, buf)
    elif kind == 4 or kind == 12:
        _decode_q4_q5_k(rec, kind, r, I, buf)
    else:
        _decode_q32(rec, kind, r, I, buf)
