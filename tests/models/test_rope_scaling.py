"""Rope scaling (coli/models/rope_scaling.py) against HF transformers.

Fixtures (tests/fixtures/oracles/rope_*.{gguf,npz,config.json}, made by tests/oracles/make.py rope): one-layer
dense llama models with HF ``rope_parameters`` linear (factor 4), YaRN (factor 4, original context 64),
YaRN with beta_fast 8 / beta_slow 0.5 / attention_factor 1.25 / theta 500, and llama3 (factor 8, the
``rope_freqs`` tensor), run by HF over 96 positions (past the original 64); each GGUF is llama.cpp's
converter's. Checked here: the inverse frequencies
and the cos/sin factor equal HF's rotary-embedding buffers; coli's logits are within 1e-4 of the largest
|logit| at every position with argmax equal; the same file without its scaling gives other logits (the keys
matter); an unknown key or type is refused naming it.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, ROOT

from coli.base.errors import ColiError

NAMES = ["rope_linear", "rope_yarn", "rope_yarn_params", "rope_llama3"]
DIR = FIXTURES / "oracles"


def _engine(path, **kw):
    from coli.engine import Engine

    return Engine(path, cpu_act="f32", save_usage=False, **kw)


@pytest.mark.parametrize("name", NAMES)
def test_frequencies_match_hf(name):
    from coli.gguf_file import open_gguf
    from coli.models import rope_scaling

    d = np.load(DIR / f"{name}.npz")
    g = open_gguf(DIR / f"{name}.gguf")
    n_rot = g.get("llama.rope.dimension_count")
    rs = rope_scaling.from_gguf(g, n_rot)
    want = {"rope_linear": ("linear", 4.0), "rope_yarn": ("yarn", 4.0), "rope_yarn_params": ("yarn", 4.0),
            "rope_llama3": ("linear", 1.0)}  # llama3: no type key (llama.cpp's default "linear", factor 1) + rope_freqs
    assert (rs.kind, rs.factor) == want[name]
    assert (rs.freq_factors is not None) == (name == "rope_llama3")
    inv = rs.inv_freq(n_rot, g.get("llama.rope.freq_base"))
    np.testing.assert_allclose(inv, d["inv_freq"], rtol=2e-6)
    assert rs.mscale == pytest.approx(float(d["attention_scaling"]), rel=1e-6)
    # the table is cos/sin of position x inv_freq, times the factor
    cos, sin = rs.table(96, n_rot, g.get("llama.rope.freq_base"))
    ang = np.arange(96)[:, None] * d["inv_freq"].astype(np.float64)[None, :]
    np.testing.assert_allclose(cos, np.cos(ang) * float(d["attention_scaling"]), atol=2e-5)
    np.testing.assert_allclose(sin, np.sin(ang) * float(d["attention_scaling"]), atol=2e-5)


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_hf(name, tmp_path):
    d = np.load(DIR / f"{name}.npz")
    ref = d["logits"]
    with _engine(DIR / f"{name}.gguf", usage=tmp_path / "u") as eng:
        got = eng.logits(d["ids"])
    err = np.abs(got - ref).max(axis=1) / np.abs(ref).max()
    assert (err <= 1e-4).all(), (name, float(err.max()))
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).all()


@pytest.mark.parametrize("name", ["rope_linear", "rope_yarn", "rope_llama3"])
def test_scaling_changes_the_logits(name, tmp_path):
    """The issue's example: the same weights without the scaling (what coli computed before it read the keys)
    are far from HF, past the first position."""
    from coli.models.rope_scaling import RopeScaling

    d = np.load(DIR / f"{name}.npz")
    ref = d["logits"]
    with _engine(DIR / f"{name}.gguf", usage=tmp_path / "u") as eng:
        for layer in eng.model.layers:  # each attention block holds its layer's rule
            layer.attn.rope_scaling = RopeScaling()
        got = eng.logits(d["ids"])
    err = np.abs(got - ref).max(axis=1) / np.abs(ref).max()
    assert err[0] <= 1e-4  # position 0: rope is the identity, scaled or not
    assert err[1:].max() > 1e-2, float(err[1:].max())


class _G:
    def __init__(self, meta, tensors=None):
        self.path = Path("x.gguf")
        self.arch = "llama"
        self.meta = {"llama.context_length": 256, **meta}
        self.tensors = tensors or {}

    def get(self, k, default=None):
        return self.meta.get(k, default)


@pytest.mark.parametrize("meta,needle", [
    ({"llama.rope.scaling.type": "longrope"}, "llama.rope.scaling.type"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.yarn_log_multiplier": 0.1},
     "llama.rope.scaling.yarn_log_multiplier"),
    ({"llama.rope.scaling.alpha": 1000.0}, "llama.rope.scaling.alpha"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.yarn_ext_factor": 0.5},
     "llama.rope.scaling.yarn_ext_factor"),
    ({"llama.rope.scaling.factor": -2.0}, "llama.rope.scaling.factor"),
    ({"llama.rope.scaling.factor": "four"}, "llama.rope.scaling.factor"),
])
def test_unimplemented_keys_are_refused(meta, needle):
    from coli.models import rope_scaling

    with pytest.raises(ColiError, match=needle.replace(".", r"\.")):
        rope_scaling.from_gguf(_G(meta), 16)


def test_defaults_follow_llama_cpp():
    """No type with a factor is linear (llama.cpp's default string); the old ``rope.scale_linear`` key is read;
    type none ignores the factor; YaRN without ``original_context_length`` takes ``context_length``."""
    from coli.models import rope_scaling

    assert rope_scaling.from_gguf(_G({}), 16).is_identity
    assert rope_scaling.from_gguf(_G({"llama.rope.scaling.factor": 2.0}), 16).kind == "linear"
    assert rope_scaling.from_gguf(_G({"llama.rope.scale_linear": 2.0}), 16).factor == 2.0
    assert rope_scaling.from_gguf(_G({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 8.0}),
                                  16).is_identity
    y = rope_scaling.from_gguf(_G({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}), 16)
    assert y.orig_ctx == 256 and y.beta_fast == 32.0 and y.beta_slow == 1.0


def _copy_gguf(src: Path, dst: Path, extra: dict):
    import gguf

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(k, f.contents(), f.types[0])
    for k, v in extra.items():
        w.add_key_value(k, v, gguf.GGUFValueType.STRING if isinstance(v, str) else gguf.GGUFValueType.FLOAT32)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def test_cli_refuses_an_unknown_key(tmp_path):
    p = tmp_path / "longrope.gguf"
    _copy_gguf(DIR / "rope_linear.gguf", p, {"llama.rope.scaling.attn_factor_long": 1.5})
    r = subprocess.run([sys.executable, "-m", "coli", "run", "-m", str(p), "-p", "hi", "-n", "1"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert "llama.rope.scaling.attn_factor_long" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1

