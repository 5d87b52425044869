"""Checks shared by the family oracle tests (HF transformers' logits of a tiny random model converted with
llama.cpp's converter: tests/fixtures/oracles, docs/oracles.md)."""
from __future__ import annotations

import numpy as np


def rel(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per row (last axis) max |got - ref| over the reference's largest |logit|: the families' oracle measure."""
    return np.abs(got - ref).max(axis=-1) / np.abs(ref).max()


def check_prompt_and_decode(m, kv, oracle, tol: float = 1e-4) -> np.ndarray:
    """``oracle["ids"]`` through ``m.forward`` into the cache ``kv``: every prompt row within ``tol`` of
    ``oracle["logits"]`` with the same argmax; then greedy decode from the last row: each step within ``tol`` of
    ``oracle["gen_logits"]`` and the ids equal to HF's ``gen_ids``. Returns the prompt's logits."""
    got = m.forward(oracle["ids"], kv, all_logits=True)
    r = rel(got, oracle["logits"])
    assert (r <= tol).all(), r.max()
    assert (got.argmax(1) == oracle["logits"].argmax(1)).all()
    last, gen = got[-1], []
    for i, want in enumerate(oracle["gen_logits"]):
        assert rel(last, want) <= tol, (i, rel(last, want))
        tok = int(last.argmax())
        gen.append(tok)
        last = m.forward([tok], kv)[0]
    assert gen == oracle["gen_ids"].tolist()
    return got
