"""The ``qwen35moe`` family (coli/models/qwen35moe.py: the Qwen3-Next layer with Qwen3.5's tensor layout) against
HF transformers' ``Qwen3_5MoeForConditionalGeneration``.

Fixture tests/fixtures/oracles/qwen35moe.{gguf,mmproj.gguf,npz,config.json} (tests/oracles/make.py qwen35moe;
docs/families.md): a tiny random model with DeltaNet and gated-attention layers alternating, 2 key heads shared by
6 value heads (the converter's tiled value-head order is what coli must undo: the grouped order is > 1 off), 6
experts top-3 (router margins >= 1e-2 between the 3rd and 4th) + the gated shared expert, f16 weights; the text
GGUF and the vision projector GGUF written by llama.cpp's converter; HF's logits for 96 prompt tokens and 8 cached
greedy steps. The checks every family shares are tests/models/test_family_parity.py's; here, the value-head order and
the vision projector file.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import FIXTURES

ORACLES = FIXTURES / "oracles"
NAME = "qwen35moe"


def test_value_head_order_matters(tmp_path):
    """The fixture tells the value-head orders apart: the same file run with Qwen3-Next's grouped order (the
    DeltaNet blocks' ``tiled`` switched off) is far from HF's logits."""
    from coli.engine import Engine

    d = np.load(ORACLES / f"{NAME}.npz")
    with Engine(ORACLES / f"{NAME}.gguf", cpu_act="f32", usage=str(tmp_path / "u"), save_usage=False,
                quiet=True) as eng:
        m = eng.model
        blocks = [L.linear_attn for L in m.layers if L.linear_attn is not None]
        assert blocks and all(b.tiled for b in blocks)
        for b in blocks:
            b.tiled = False
        lg = m.forward(d["ids"][:32], m.new_cache(64), all_logits=True)
    assert (np.abs(lg - d["logits"][:32]).max(-1) / np.abs(d["logits"]).max()).max() > 1e-2


def test_vision_projector_file_refused(capsys, tmp_path):
    """The converter's ``--mmproj`` file (the vision tower, ``general.architecture`` clip): one ColiError naming
    the file and what it is; ``coli run`` exits 2 with one line on stderr, no traceback."""
    from coli.cli import main
    from coli.base.errors import ColiError
    from coli.gguf_file import open_gguf
    from coli.models import model_class

    path = ORACLES / f"{NAME}.mmproj.gguf"
    with pytest.raises(ColiError, match=r"qwen35moe\.mmproj\.gguf: a vision/audio projector file .*qwen3vl_merger"):
        model_class(open_gguf(path))
    rc = main(["run", "-m", str(path), "-p", "hi", "-n", "1", "--usage", str(tmp_path / "u"), "-q"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "projector" in err and "Traceback" not in err
