"""CPU kernels of NVFP4 (a row of ``cpu_kernels.formats.FORMATS``): the G = 16 kernels of ``cpu_kernels.iquants``.

Block (ggml-common.h ``block_nvfp4``, QK_NVFP4 = 64; decoding as ggml-quants.c ``dequantize_row_nvfp4``, mirrored
by ``gguf.quants.NVFP4``; layout details in ``coli/types/nvfp4.py``): 36 bytes per 64 weights, four UE4M3 sub-block
scales ``d[4]`` then ``qs[32]``; weight ``16s + j`` (j < 8) is ``kvalues_mxfp4[qs[8s + j] & 15] * ue4m3(d[s])``,
weight ``16s + 8 + j`` the high nibble's, with ``ue4m3`` ggml's ``ggml_ue4m3_to_fp32`` (halved, as ``kvalues_mxfp4``
is E2M1 doubled; 0x00 and 0x7F decode to 0, bit 7 is ignored).

Kernel layout (``pack``, at prepare time): the nibbles expanded to their int8 ``kvalues_mxfp4`` (|code| <= 12)
in element order and one f32 scale per 16 weights (the UE4M3 byte through ``SCALE``, ggml_ue4m3_to_fp32 as
``gguf.quants.NVFP4.ue4m3_to_fp32`` computes it), i.e. the i-quants' G = 16 layout: ``scale * code`` is the reference's f32
value bit for bit (every UE4M3 value times a code up to 12 is exact in f32). So NVFP4 runs ``iquants.gemv_g16``,
``gemm_g16`` and, with int8 activations, ``gemv_i8_g16`` (a vpdpbusd row with two scales per 32: ggml's
``ggml_vec_dot_nvfp4_q8_0`` arithmetic, ``dy * d * sumi`` per sub-block), the int8 GEMM tiles of prompt chunks
(``gemm_i8.gemm_g16`` / ``tiles``) and the grouped expert kernels as ``FC_G16`` (``cpu_kernels/experts.py``). Memory: 1.25 bytes per weight against 0.5625 in the file (2.2x, as
MXFP4's 2.1x); a nibble-gather kernel does not vectorize in Numba (docs/cpu_kernels.md, MXFP4).

On CPUs with AVX-512 VNNI, with int8 activations and O a multiple of 16, NVFP4 takes its t16 tile instead
(``cpu_kernels.tiles``: the file's nibbles and UE4M3 bytes, 16 rows interleaved, 1.000x the file, the codes looked
up and the scales decoded in registers); this layout stays for f32 activations, other row counts and CPUs without
VNNI.

Public API: ``pack(raw, O, I)``, ``SCALE`` (UE4M3 byte -> f32 scale). Importing this module adds the NVFP4 row
to ``FORMATS`` through ``add_rows`` (``formats.py`` imports it at its end).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from coli.base.memory import read_only
from coli.types import nvfp4 as _nv

from . import iquants as _iq
from . import tiles as _tiles
from .formats import _row, add_rows

#: UE4M3 byte -> its f32 block scale, halved (ggml_ue4m3_to_fp32): the t16 tile's table (``tiles._UE4M3``, the
#: formula its kernel uses, asserted bit for bit against gguf.quants.NVFP4.ue4m3_to_fp32 on every byte at import)
#: indexed by the byte as the tile rewrites it
SCALE = np.ascontiguousarray(_tiles._UE4M3[_tiles._ue4m3_byte(np.arange(256, dtype=np.uint8))])
_KV = np.ascontiguousarray(_nv.KVALUES)


@njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _u_nvfp4(raw, kv, lut, q, s):
    """NVFP4 blocks uint8 [O, nb*36] -> int8 kvalues in element order q [O, nb*64], f32 scales s [O, nb*4]."""
    O = raw.shape[0]
    nb = raw.shape[1] // 36
    for o in prange(O):
        for b in range(nb):
            base = b * 36
            for k in range(4):
                s[o, b * 4 + k] = lut[raw[o, base + k]]
                e = b * 64 + k * 16
                for j in range(8):
                    v = raw[o, base + 4 + k * 8 + j]
                    q[o, e + j] = kv[v & 15]
                    q[o, e + 8 + j] = kv[v >> 4]


def pack(raw: np.ndarray, O: int, I: int):
    """NVFP4 raw uint8 [O, I/64*36] -> (q int8 [O, I], scale f32 [O, I/16]): w = scale[o, i // 16] * q[o, i]."""
    q = np.empty((O, I), np.int8)
    s = np.empty((O, I // 16), np.float32)
    _u_nvfp4(read_only(np.ascontiguousarray(raw).reshape(O, I // 64 * 36)), _KV, SCALE, q, s)
    return q, s


add_rows([_row("NVFP4", 64, 36, pack, _iq.gemv_g16, _iq.gemm_g16, "nvfp4", True, _iq.gemv_i8_g16)])
