"""The i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M): the packed kernel layout decodes to
gguf.quants.dequantize bit for bit, the tables come from gguf.quants, and the generated shader tables hold the
same grids. GEMV/GEMM/int8 parity: tests/test_formats.py (every FORMATS row, these included)."""
from __future__ import annotations

import re
import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from coli import iq_tables
from cpu_kernels import formats as F
from cpu_kernels import iquants
from coli import tensor_types as TT


@pytest.mark.parametrize("name", iq_tables.IQ_TYPES)
def test_packed_layout_equals_gguf_dequantize(name):
    """scale[o, i // G] * q[o, i] == gguf.quants.dequantize(raw) exactly (f32), on random valid blocks
    (coli.tensor_types.random_blocks) with ordinary, tiny and large super-block scales."""
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
    """shaders/iq_grids.glsl is what coli/iq_tables.py generates, and the words the device uploads at each of its
    offsets unpack (as shaders/fmt_iq*.glsl read them) to gguf.quants' grids."""
    from coli.vulkan.shaders import SHADER_DIR

    for fname, text in iq_tables.glsl_tables().items():
        assert (SHADER_DIR / fname).read_text() == text, f"shaders/{fname} is stale: run scripts/build_shaders"
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
    from coli.errors import ColiError

    with pytest.raises(ColiError, match="IQ2_XXS.*multiple of the block size 256"):
        F.prepare("IQ2_XXS", np.zeros(66, np.uint8), (1, 288))
