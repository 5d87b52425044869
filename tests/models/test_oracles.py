"""MoE oracles: tiny random OLMoE / Qwen2-MoE / Qwen3-MoE / Mixtral built with HF transformers
(tests/oracles/make.py moe); coli's logits within 1e-4 of the largest |logit| at every position, argmax equal."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import FIXTURES

ARCHS = ["mixtral", "qwen2moe", "qwen3moe", "olmoe"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cache", [None, 1])
def test_oracle_logits(arch, cache, tmp_path):
    from coli.engine import Engine

    d = np.load(FIXTURES / "oracles" / f"{arch}.npz")
    ref = d["logits"]
    with Engine(FIXTURES / "oracles" / f"{arch}.gguf", cpu_act="f32", expert_cache=cache,
                usage=tmp_path / "u", save_usage=False) as eng:
        got = eng.logits(d["ids"])
    assert got.shape == ref.shape
    scale = np.abs(ref).max()
    err = np.abs(got - ref).max(axis=1) / scale
    assert (err <= 1e-4).all(), (arch, err.max())
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).all()
