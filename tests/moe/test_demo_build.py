"""The demo MoE file (coli/demo.py): its metadata, tensors, expert bytes, noise, router and atomic build.

The default demo and the noise-0 'same' demo are taken from the user's cache (built there on first use,
~15 s and ~5 s; CI's set-up prebuilds them), so these tests read real files. References: the source GGUF's
own bytes, gguf's reader and ``gguf.quants`` (de)quantizers.
"""
from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

from coli import demo  # noqa: E402
from coli.base.errors import ColiError  # noqa: E402
from coli.fetch import model_path  # noqa: E402

E, K, NOISE = 8, 2, 0.05
D, FF, N_LAYER = 576, 1536, 30
FFN = ("gate", "up", "down")


@pytest.fixture(scope="module")
def src():
    return gguf.GGUFReader(model_path("smollm2", quiet=True))


@pytest.fixture(scope="module")
def moe():
    return gguf.GGUFReader(demo.demo_model_path(quiet=True))


@pytest.fixture(scope="module")
def same():
    return gguf.GGUFReader(demo.demo_model_path(noise=0, expert_type="same", quiet=True))


@pytest.fixture(scope="module")
def dense_run(src):
    """The dense model's router inputs and logits on the 69 calibration tokens (NumPy forward)."""
    return demo._dense_forward(src, demo.CALIBRATION_IDS, want_logits=True)


def _tensors(r):
    return {t.name: t for t in r.tensors}


def _field_bytes(f) -> bytes:
    """A KV's value bytes as stored in the file (every part after the key name)."""
    return b"".join(bytes(p) for p in f.parts[3:])


def test_file_name_encodes_parameters():
    assert demo.demo_file_name() == f"smollm2-moe-v{demo.VERSION}-e8k2-Q8_0-n0.05-s0.gguf"
    names = {demo.demo_file_name(n, t, e, k, s) for n, t, e, k, s in
             [(0.05, "Q8_0", 8, 2, 0), (0, "same", 8, 2, 0), (0.05, "F16", 4, 2, 0), (0.05, "Q8_0", 8, 2, 1),
              (0.1, "Q8_0", 8, 2, 0), (0.05, "Q8_0", 8, 1, 0), (0.05, "Q4_0", 8, 2, 0)]}
    assert len(names) == 7


@pytest.mark.parametrize("kw, field", [(dict(top_k=9), "top_k"), (dict(n_experts=0), "n_experts"),
                                       (dict(expert_type="Q4_K"), "expert_type"), (dict(noise=-0.1), "noise"),
                                       (dict(noise=float("nan")), "noise"), (dict(seed=-1), "seed")])
def test_bad_parameters_name_the_field(kw, field):
    with pytest.raises(ColiError, match=field):
        demo.demo_model_path(quiet=True, **kw)


def test_metadata_copied_and_expert_keys(src, moe):
    f = moe.fields
    assert f["general.architecture"].contents() == "llama"
    assert f["llama.expert_count"].contents() == E
    assert f["llama.expert_used_count"].contents() == K
    assert "coli demo MoE" in f["general.name"].contents()
    assert f["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    for key, sf in src.fields.items():
        if key.startswith("GGUF.") or key in ("general.name", "general.file_type"):
            continue
        assert key in f, key
        assert list(f[key].types) == list(sf.types), key
        assert _field_bytes(f[key]) == _field_bytes(sf), key  # tokens, merges, chat template, rope ... exact
    assert set(f) - set(src.fields) == {"llama.expert_count", "llama.expert_used_count"}


def test_tensors_names_types_shapes(src, moe):
    st, mt = _tensors(src), _tensors(moe)
    dense_ffn = {f"blk.{L}.ffn_{k}.weight" for L in range(N_LAYER) for k in FFN}
    new = set()
    for L in range(N_LAYER):
        r = mt[f"blk.{L}.ffn_gate_inp.weight"]
        assert r.tensor_type.name == "F32" and r.data.shape == (E, D) and r.shape.tolist() == [D, E]
        for k, shape in (("gate", [D, FF, E]), ("up", [D, FF, E]), ("down", [FF, D, E])):
            t = mt[f"blk.{L}.ffn_{k}_exps.weight"]
            assert t.tensor_type.name == "Q8_0" and t.shape.tolist() == shape
            O, I = shape[1], shape[0]
            assert t.data.shape == (E, O, I // 32 * 34)
            new.add(t.name)
        new.add(f"blk.{L}.ffn_gate_inp.weight")
    assert set(mt) == (set(st) - dense_ffn) | new
    for name, t in st.items():  # every other tensor: same type, shape and bytes
        if name in dense_ffn:
            continue
        m = mt[name]
        assert m.tensor_type == t.tensor_type and m.shape.tolist() == t.shape.tolist(), name
        assert np.array_equal(np.asarray(m.data).view(np.uint8), np.asarray(t.data).view(np.uint8)), name
    assert mt["token_embd.weight"].tensor_type.name == "Q8_0"
    assert mt["blk.0.attn_q.weight"].tensor_type.name == "Q4_1"


def test_same_noise0_experts_are_the_dense_bytes(src, same):
    st, mt = _tensors(src), _tensors(same)
    assert same.fields["general.file_type"].contents() == src.fields["general.file_type"].contents()
    for L in range(N_LAYER):
        for k in FFN:
            d, x = st[f"blk.{L}.ffn_{k}.weight"], mt[f"blk.{L}.ffn_{k}_exps.weight"]
            assert x.tensor_type.name == "Q4_1" == d.tensor_type.name
            assert x.data.shape == (E, *d.data.shape)
            for e in range(E):
                assert np.array_equal(x.data[e], d.data), (L, k, e)


@pytest.mark.parametrize("L", [0, 17, 29])
def test_noise_experts_relative_rms_and_independent(src, moe, L):
    st, mt = _tensors(src), _tensors(moe)
    for k in FFN:
        d = st[f"blk.{L}.ffn_{k}.weight"]
        W = dequantize(d.data, d.tensor_type)
        X = dequantize(mt[f"blk.{L}.ffn_{k}_exps.weight"].data, gguf.GGMLQuantizationType.Q8_0)  # [E, O, I]
        assert X.shape == (E, *W.shape)
        rms_w = np.sqrt(np.mean(W.astype(np.float64) ** 2))
        rel = [np.sqrt(np.mean((X[e] - W) ** 2)) / rms_w for e in range(E)]
        assert all(0.5 * NOISE <= r <= 2 * NOISE for r in rel), (k, rel)
        for a in range(E):  # independent draws: two experts differ by about sqrt(2) * noise
            for b in range(a + 1, E):
                r = np.sqrt(np.mean((X[a] - X[b]) ** 2)) / rms_w
                assert 0.5 * NOISE <= r <= 3 * NOISE, (k, a, b, r)


def test_expert_is_the_documented_formula(src, moe):
    """Expert e of layer L is quantize_Q8_0(W + noise * rms_row(W) * N(0,1) from rng([seed, L, e, m]))."""
    st, mt = _tensors(src), _tensors(moe)
    for L, e, m in [(3, 5, 2), (22, 0, 0)]:
        d = st[f"blk.{L}.ffn_{FFN[m]}.weight"]
        W = dequantize(d.data, d.tensor_type).astype(np.float32)
        rms = np.sqrt(np.mean(W.astype(np.float64) ** 2, axis=1, keepdims=True)).astype(np.float32)
        z = np.random.default_rng([0, L, e, m]).standard_normal(W.shape, dtype=np.float32)
        want = quantize(W + np.float32(NOISE) * rms * z, gguf.GGMLQuantizationType.Q8_0)
        assert np.array_equal(mt[f"blk.{L}.ffn_{FFN[m]}_exps.weight"].data[e], want)


def test_router_decisive_and_input_dependent(dense_run, moe):
    """On the dense model's real router inputs: logit std ROUTER_LOGIT_STD, top-1 weight well above 1/E,
    and the top-2 choice changes across the 69 calibration tokens in every layer."""
    states, _ = dense_run
    mt = _tensors(moe)
    for L, u in enumerate(states):
        R = np.asarray(mt[f"blk.{L}.ffn_gate_inp.weight"].data)
        logits = u @ R.T
        assert abs(float(np.std(logits)) - demo.ROUTER_LOGIT_STD) < 1e-3 * demo.ROUTER_LOGIT_STD
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        assert p.max(1).mean() > 0.4, L  # uniform would be 1/8
        top = np.argsort(-logits, axis=1)[:, :K]
        assert len({tuple(sorted(t)) for t in top}) >= 8, L
        assert len(np.unique(top[:, 0])) >= 4, L


def test_dense_forward_matches_llama_cpp_nll(dense_run):
    """The calibration forward pass is the real model: NLL of the reference text (its first 21 tokens, no
    BOS; causal, so the 69-token run's first 21 rows) is within 3% of llama.cpp's 1.315-1.321 on this file."""
    ids = demo.CALIBRATION_IDS[:21]
    logits = dense_run[1][:21]
    lp = logits - logits.max(1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(1, keepdims=True))
    nll = -float(np.mean([lp[i, ids[i + 1]] for i in range(len(ids) - 1)]))
    assert 1.315 * 0.97 <= nll <= 1.321 * 1.03, nll


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    """A build stopped midway (KeyboardInterrupt: a BaseException, the hardest case for cleanup) leaves
    no file at the final path and no temp file."""
    exc = KeyboardInterrupt
    calls = {"n": 0}
    real = gguf.GGUFWriter.write_tensor_data

    def failing(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 15:  # in layer 1, after layer 0's experts: the temp file holds data by now
            raise exc("interrupted")
        return real(self, *a, **kw)

    smollm2 = model_path("smollm2", quiet=True)  # the real cached source, not a download into tmp_path
    monkeypatch.setattr("coli.fetch.model_path", lambda name, quiet=False: smollm2)
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", failing)
    monkeypatch.setenv("COLI_CACHE", str(tmp_path))
    dest = tmp_path / "demo" / demo.demo_file_name(expert_type="same", n_experts=2)
    with pytest.raises(exc, match="interrupted"):
        # noise 0.05 with type 'same' requantizes to Q4_1; 2 experts keep it quick
        demo.demo_model_path(expert_type="same", n_experts=2, quiet=True)
    assert calls["n"] == 15
    assert not dest.exists()
    assert sorted(p.name for p in dest.parent.iterdir()) == [".build.lock"]  # no temp file left


def test_source_not_dense_llama_is_refused(tmp_path):
    p = tmp_path / "qwen2.gguf"
    w = gguf.GGUFWriter(p, "qwen2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ColiError, match=r"qwen2\.gguf: general\.architecture"):
        demo.build_demo_moe(p, tmp_path / "out.gguf", quiet=True)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["qwen2.gguf"]


def test_a_killed_builds_temp_file_is_removed_by_the_next_build(tmp_path, monkeypatch):
    """A build killed with SIGKILL leaves its temp file (147 MB for the default demo); the next build removes it
    under the builders' lock, whatever its age (only files an hour old were removed, so it stayed)."""
    smollm2 = model_path("smollm2", quiet=True)
    monkeypatch.setattr("coli.fetch.model_path", lambda name, quiet=False: smollm2)
    monkeypatch.setenv("COLI_CACHE", str(tmp_path))
    folder = tmp_path / "demo"
    folder.mkdir()
    name = demo.demo_file_name()
    (folder / f".{name}.k1ll3d.tmp").write_bytes(b"\0" * 4096)                     # this variant's, fresh
    (folder / f".{demo.demo_file_name(n_experts=4)}.x.tmp").write_bytes(b"\0")    # another variant's
    seen = []

    def build(src, dest, **kw):
        seen.append(sorted(p.name for p in folder.iterdir()))
        dest.write_bytes(b"GGUF")

    monkeypatch.setattr(demo, "build_demo_moe", build)
    assert demo.demo_model_path(quiet=True) == folder / name
    assert seen == [[".build.lock"]]


def test_a_second_builder_says_it_waits(tmp_path):
    """A process that finds another one building the demo says so on stderr, then finds the file built."""
    import fcntl
    import os
    import select
    import subprocess
    import sys
    import time

    from conftest import ROOT

    folder = tmp_path / "demo"
    folder.mkdir()
    dest = folder / demo.demo_file_name()
    with open(folder / ".build.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        p = subprocess.Popen([sys.executable, "-c", "from coli.demo import demo_model_path; print(demo_model_path())"],
                             cwd=ROOT, env=dict(os.environ, COLI_CACHE=str(tmp_path), PYTHONPATH=str(ROOT)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        t0, err = time.time(), ""
        while "waiting" not in err and time.time() - t0 < 120:
            if select.select([p.stderr], [], [], 1.0)[0]:
                err += p.stderr.readline()
        dest.write_bytes(b"GGUF")  # what the other builder finishes with
    out, rest = p.communicate(timeout=120)
    assert err == f"coli demo: waiting for another process building the demo (lock {folder / '.build.lock'})\n"
    assert p.returncode == 0 and out.strip() == str(dest), rest
