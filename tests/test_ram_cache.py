"""The RAM expert cache: bytes read only for routed experts, LRU with pins, byte counters equal the slices."""
from __future__ import annotations

import numpy as np

from conftest import FIXTURES


def _source():
    from coli.gguf_file import open_gguf
    from scheduler.ram_cache import ExpertSource

    p = FIXTURES / "oracles" / "olmoe.gguf"
    g = open_gguf(p)
    layers = {il: tuple(g.tensors[f"blk.{il}.{n}.weight"] for n in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
              for il in range(2)}
    return ExpertSource(p, layers), layers


def test_read_raw_equals_the_file_slices():
    src, layers = _source()
    for e in (0, 5, 7):
        raw = src.read_raw(1, e)
        for (tn, arr, shape), t in zip(raw, layers[1]):
            assert tn == t.type_name and shape == tuple(t.shape[1:])
            assert np.array_equal(arr, t.raw[e])
    assert src.reads == 3 and src.bytes_read == 3 * src.expert_nbytes(1)
    src.close()


def test_lru_with_pins():
    from scheduler.ram_cache import RAMCache

    src, _ = _source()
    c = RAMCache(src, slots=3, pins={0: {4}}, io_threads=2)
    for e in (4, 1, 2, 3, 5):  # 4 is pinned: it survives although it is the least recently used
        c.put(0, e, c.fetch(0, e).result())
    assert set(c.lru[0]) == {4, 3, 5}
    assert c.get(0, 1) is None and c.get(0, 4) is not None and c.hits == 1
    assert c.loads == 5 and src.bytes_read == 5 * src.expert_nbytes(0)
    assert not c.in_ram(1, 4)  # other layers untouched: nothing read for experts nobody routed
    c.close()
