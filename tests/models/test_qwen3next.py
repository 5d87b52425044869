"""The ``qwen3next`` family (coli/models/qwen3next.py, coli/models/deltanet.py) against HF transformers' Qwen3-Next.

Fixture tests/fixtures/oracles/qwen3next.{gguf,npz} (tests/oracles/make.py qwen3next; docs/families.md): a tiny
random Qwen3NextForCausalLM (Gated DeltaNet layers 0-2, gated attention layer 3, 8 experts top-2 + the gated shared
expert) converted by llama.cpp's converter; HF's logits for a 96-token prompt without a cache and for 8 greedy
decode steps with HF's cache (conv and recurrent states carried). The checks every family shares (those logits and
tokens, the prompt one token at a time with its states, the cache carrying its state, keep_kv turns, the device
tier with and without the balancer, a Q8_0 twin, ``coli run``) are tests/models/test_family_parity.py's; here, older and
broken files.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import FIXTURES
from oracle_check import Typed, copy_gguf, rel as _rel

ORACLES = FIXTURES / "oracles"
NAME = "qwen3next"


def _engine_path(path, tmp_path, **kw):
    from coli.engine import Engine

    kw.setdefault("cpu_act", "f32")
    return Engine(path, usage=str(tmp_path / "none.coli_usage"), save_usage=False, quiet=True, **kw)


def test_legacy_fused_ssm_in(tmp_path):
    """An older conversion's fused ``ssm_in`` (rows in HF's ``in_proj_qkvz`` order: per key head q, k, v, z; what
    llama.cpp's legacy ``build_qkvz`` path reads) instead of ``attn_qkv`` + ``attn_gate``: the same logits as the
    fixture within 1e-5 (two engines need not run a prefill step's expert pairs in the same batches: loaded runs
    differed by up to 3e-6 from row 64 on, the second 64-row step), and the same tokens."""
    import gguf

    from coli.gguf_file import open_gguf

    g = open_gguf(ORACLES / f"{NAME}.gguf")
    a = g.arch
    Hk, Hv = int(g.get(f"{a}.ssm.group_count")), int(g.get(f"{a}.ssm.time_step_rank"))
    dk, dv = int(g.get(f"{a}.ssm.state_size")), int(g.get(f"{a}.ssm.inner_size")) // Hv
    src = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(ORACLES / f"{NAME}.gguf").tensors}
    rv = Hv // Hk * dv

    def fuse(t):
        if t.name.endswith("attn_gate.weight"):
            return []
        if not t.name.endswith("attn_qkv.weight"):
            return np.asarray(t.data), t.tensor_type
        qkv, z = src[t.name], src[t.name.replace("attn_qkv", "attn_gate")]
        q, k, v = qkv[:Hk * dk], qkv[Hk * dk:2 * Hk * dk], qkv[2 * Hk * dk:]
        per = [np.concatenate([q[h * dk:(h + 1) * dk], k[h * dk:(h + 1) * dk], v[h * rv:(h + 1) * rv],
                               z[h * rv:(h + 1) * rv]]) for h in range(Hk)]
        return [(t.name.replace("attn_qkv", "ssm_in"), np.concatenate(per), t.tensor_type)]

    legacy = copy_gguf(ORACLES / f"{NAME}.gguf", tmp_path / "legacy.gguf", convert=fuse)
    assert "blk.0.ssm_in.weight" in open_gguf(legacy).tensors and "blk.0.attn_qkv.weight" not in open_gguf(legacy).tensors
    d = np.load(ORACLES / f"{NAME}.npz")
    out = []
    for path in (ORACLES / f"{NAME}.gguf", legacy):
        with _engine_path(path, tmp_path) as eng:
            out.append((eng.logits(d["ids"]),
                        list(eng.generate(ids=[int(i) for i in d["ids"]], max_tokens=8, temp=0.0, stop_at_eos=False).ids)))
    assert (_rel(out[1][0], out[0][0]) <= 1e-5).all()  # a wrong regrouping is > 1e-2 off
    assert out[1][1] == out[0][1] == [int(t) for t in d["gen_ids"]]


def test_missing_ssm_key_and_bad_shape(tmp_path):
    """A file without ``qwen3next.ssm.state_size`` or with a DeltaNet tensor of the wrong shape: one ColiError
    naming the key / tensor."""
    from coli.base.errors import ColiError
    from coli.gguf_file import open_gguf
    from coli.models import model_class

    g = open_gguf(ORACLES / f"{NAME}.gguf")
    cls = model_class(g)
    del g.meta["qwen3next.ssm.state_size"]
    with pytest.raises(ColiError, match=r"qwen3next\.ssm\.state_size"):
        cls.args_from(g)
    g = open_gguf(ORACLES / f"{NAME}.gguf")
    args = cls.args_from(g)
    args.ssm = dict(args.ssm, dv=args.ssm["dv"] * 2)
    with pytest.raises(ColiError, match=r"blk\.0\.attn_qkv\.weight"):
        cls(g, args)


def test_mtp_layers_loaded_not_run(tmp_path):
    """A file converted with its MTP head (``nextn_predict_layers`` = 1: one more block after the trunk, here a copy
    of the last layer's tensors, flagged non-recurrent) runs the trunk only: the fixture's logits (within 1e-5, as
    for the legacy twin)."""
    import gguf

    src = gguf.GGUFReader(ORACLES / f"{NAME}.gguf")
    n = int(src.fields[f"{NAME}.block_count"].contents())
    recurrent = list(src.fields[f"{NAME}.attention.recurrent_layers"].contents())
    last = {t.name.replace(f"blk.{n - 1}.", f"blk.{n}."): (np.asarray(t.data), t.tensor_type)
            for t in src.tensors if t.name.startswith(f"blk.{n - 1}.")}
    copy_gguf(ORACLES / f"{NAME}.gguf", tmp_path / "mtp.gguf",
              {f"{NAME}.block_count": n + 1, f"{NAME}.attention.recurrent_layers": recurrent + [False],
               f"{NAME}.nextn_predict_layers": Typed(1, gguf.GGUFValueType.UINT32)}, last)
    d = np.load(ORACLES / f"{NAME}.npz")
    out = []
    for path in (ORACLES / f"{NAME}.gguf", tmp_path / "mtp.gguf"):
        with _engine_path(path, tmp_path) as eng:
            assert eng.model.args.n_layers == n
            out.append(eng.logits(d["ids"]))
    assert (_rel(out[1], out[0]) <= 1e-5).all()
