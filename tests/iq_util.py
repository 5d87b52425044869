"""Random valid i-quant blocks (gguf.quants cannot quantize the i-quants): every bit random except the f16
super-block scale ``d``, set to a finite positive value, so every grid index, sign and sub-block scale occurs.
Layouts: coli/iq_tables.py and cpu_kernels/iquants.py (ggml-common.h block_iq*)."""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from coli.iq_tables import IQ_TYPES


def random_iq_blocks(name: str, O: int, I: int, rng, d_range=(1e-3, 2e-2)) -> np.ndarray:
    """uint8 [O, I/256*type_size]: valid ``name`` blocks; I a multiple of 256."""
    assert name in IQ_TYPES and I % 256 == 0, (name, I)
    nb = I // 256
    ts = GGML_QUANT_SIZES[QT[name]][1]
    raw = rng.integers(0, 256, (O, nb, ts), dtype=np.uint8)
    d = rng.uniform(*d_range, (O, nb)).astype(np.float16).view(np.uint16)
    if name == "IQ1_M":  # d's 16 bits go in the top nibbles of the four u16 scales (iq1m_scale_t)
        sc = np.ascontiguousarray(raw[:, :, 48:56]).view("<u2") & np.uint16(0x0FFF)
        for k in range(4):
            sc[..., k] |= ((d >> np.uint16(4 * k)) & np.uint16(0xF)) << np.uint16(12)
        raw[:, :, 48:56] = sc.view(np.uint8).reshape(O, nb, 8)
    else:
        raw[:, :, 0:2] = d.view(np.uint8).reshape(O, nb, 2)
    return raw.reshape(O, -1)
