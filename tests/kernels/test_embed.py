"""The compiled embedding lookup (cpu_kernels/embed.py) against the formats' NumPy reference (gguf.quants'
dequantize, through ``coli.models.base.dequantize``): the same f32 bits for every type it decodes, its non-finite
row check, and ``Model.embed`` on the tiny oracle files."""
from __future__ import annotations

import numpy as np
import pytest

from coli import finite
from coli.types import table as tensor_types
from coli.models.base import dequantize
from cpu_kernels import embed

from conftest import FIXTURES


def _table(name, V, D, seed, edit=None):
    """A read-only table uint8 [V, row bytes] of random blocks (read-only as a model file's mapped table, so the
    kernel compiles once for the tests and the engine)."""
    raw = tensor_types.random_blocks(name, V, D, np.random.default_rng(seed)).copy()
    if edit is not None:
        edit(raw)
    raw.flags.writeable = False
    return raw


@pytest.mark.parametrize("name", sorted(embed.KINDS))
def test_rows_are_the_reference_bit_for_bit(name):
    V, D = 40, 96
    raw = _table(name, V, D, 5)
    long = np.random.default_rng(2).integers(0, V, 2 * embed.PAR_ROWS + 3)    # the threads' path
    for ids in (np.array([3, 0, 39, 3, 17], np.int64), long):
        h, bad = embed.rows(name, raw, ids, D)
        ref = dequantize(name, raw[ids], D)
        assert h.dtype == np.float32 and h.shape == (len(ids), D)
        assert np.array_equal(h.view(np.uint32), ref.view(np.uint32))
        assert bad == -1


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("name, value", [("F32", np.nan), ("F16", np.inf), ("BF16", -np.inf), ("Q8_0", np.nan),
                                         ("Q4_1", np.inf), ("Q5_0", np.nan)])
def test_the_first_non_finite_row_is_the_references(name, value):
    """A non-finite value (a float type's element, a block format's f16 scale) in table rows 4 and 9: the index
    (into ``ids``) of the first row read that holds one, as ``finite.first_bad_row`` of the reference's rows."""
    V, D = 12, 64

    def poison(raw):
        for r in (4, 9):
            if name == "F32":
                raw[r].view(np.float32)[5] = value
            elif name == "BF16":
                raw[r].view(np.uint16)[5] = np.array([value], np.float32).view(np.uint32)[0] >> 16
            else:   # F16's element 5 / the second block's d (bytes 0-1 of each block)
                off = 10 if name == "F16" else embed._BLOCK_BYTES[embed.KINDS[name]]
                raw[r, off:off + 2] = np.array([value], np.float16).view(np.uint8)

    raw = _table(name, V, D, 1, poison)
    many = [0, 1, 2, 3, 5, 6, 7, 8, 10, 11] * (embed.PAR_ROWS // 10 + 1)   # the threads' path: rows 9, 4 late
    for ids in ([1, 2, 9, 4], [4], [0, 1, 2], many + [9, 0, 4], many):
        ids = np.array(ids, np.int64)
        h, bad = embed.rows(name, raw, ids, D)
        ref = dequantize(name, raw[ids], D)
        r = finite.first_bad_row(ref)
        assert bad == (-1 if r is None else r)
        assert np.array_equal(h.view(np.uint32), ref.view(np.uint32))


def test_an_id_outside_the_table_is_an_index_error():
    raw = _table("Q8_0", 8, 32, 0)
    for bad in (8, -1):
        for n in (1, embed.PAR_ROWS):       # serial, threads
            with pytest.raises(IndexError, match=f"token id {bad} is outside the embedding table of 8 rows"):
                embed.rows("Q8_0", raw, np.array([0] * n + [bad], np.int64), 32)


def test_other_types_and_layouts_are_left_to_the_reference():
    raw = tensor_types.random_blocks("Q6_K", 4, 256, np.random.default_rng(0))
    assert embed.rows("Q6_K", raw, np.array([1]), 256) is None
    q8 = tensor_types.random_blocks("Q8_0", 4, 64, np.random.default_rng(0))
    assert embed.rows("Q8_0", q8[:, :34], np.array([1]), 32) is None          # not C-contiguous
    assert embed.rows("Q8_0", q8.reshape(-1), np.array([1]), 64) is None      # not [vocab, row bytes]


@pytest.mark.parametrize("name", ["qwen3moe", "rope_llama3", "qwen2moe"])
def test_model_embed_equals_the_reference(name):
    from coli.engine import Engine

    with Engine(FIXTURES / "oracles" / f"{name}.gguf", threads=1) as eng:
        m = eng.model
        ti = m.tok_embd
        ids = np.arange(0, m.args.vocab, 7, dtype=np.int64)
        got = m.embed(ids)
        ref = dequantize(ti.type_name, ti.raw[ids], ti.shape[-1])
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
