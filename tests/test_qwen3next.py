"""The ``qwen3next`` family (coli/models/qwen3next.py, coli/models/deltanet.py) against HF transformers' Qwen3-Next.

Fixture tests/fixtures/oracles/qwen3next.{gguf,npz} (scripts/oracles/make.py qwen3next; docs/families.md): a tiny
random Qwen3NextForCausalLM (Gated DeltaNet layers 0-2, gated attention layer 3, 8 experts top-2 + the gated shared
expert) converted by llama.cpp's converter; HF's logits for a 96-token prompt without a cache and for 8 greedy
decode steps with HF's cache (conv and recurrent states carried). The helpers here serve tests/test_qwen35moe.py too.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import FIXTURES
from oracle_check import rel as _rel

ORACLES = FIXTURES / "oracles"
TOL = 1e-4


def _engine_path(path, tmp_path, **kw):
    from coli.engine import Engine

    kw.setdefault("cpu_act", "f32")
    return Engine(path, usage=str(tmp_path / "none.coli_usage"), save_usage=False, quiet=True, **kw)


def _engine(name, tmp_path, **kw):
    return _engine_path(ORACLES / f"{name}.gguf", tmp_path, **kw)




def _check_prompt_and_decode(name, tmp_path):
    """The prompt in one forward call, then the 8 generated tokens fed one at a time on the same cache: every row
    within TOL of HF's (``logits`` without a cache, ``gen_logits`` with HF's cache), argmax equal."""
    d = np.load(ORACLES / f"{name}.npz")
    ids, gen = d["ids"], d["gen_ids"]
    with _engine(name, tmp_path) as eng:
        m = eng.model
        cache = m.new_cache(256)
        lg = m.forward(ids, cache, all_logits=True)
        steps = [lg[-1]]
        for t in gen[:-1]:
            steps.append(m.forward([int(t)], cache)[0])
        steps = np.stack(steps)
    err_p, err_g = _rel(lg, d["logits"]), _rel(steps, d["gen_logits"])
    assert (err_p <= TOL).all(), (name, "prompt", err_p.max(), int(err_p.argmax()))
    assert (err_g <= TOL).all(), (name, "decode", err_g.max(), int(err_g.argmax()))
    assert (lg.argmax(-1) == d["logits"].argmax(-1)).all() and (steps.argmax(-1) == gen).all()
    return float(err_p.max()), float(err_g.max())


def _check_generate(name, tmp_path):
    """``Engine.generate`` (greedy; the prompt in 64-row prefill steps, state carried between them) gives HF's
    8 tokens, and ``Engine.logits`` HF's prompt logits."""
    d = np.load(ORACLES / f"{name}.npz")
    with _engine(name, tmp_path) as eng:
        r = eng.generate(ids=[int(i) for i in d["ids"]], max_tokens=len(d["gen_ids"]), temp=0.0, stop_at_eos=False)
        lg = eng.logits(d["ids"])
    assert list(r.ids) == [int(t) for t in d["gen_ids"]]
    assert (_rel(lg, d["logits"]) <= TOL).all()


def _check_one_call_equals_rows(name, tmp_path):
    """The 96-token prompt in one call equals the same tokens fed one at a time (logits of every row; the final
    conv and recurrent states and KV rows), the prefill's projections-then-recurrence against decode's steps. Within
    TOL and argmax equal, not bitwise: a block runs the f32 GEMM, a row the GEMV (another summation order)."""
    d = np.load(ORACLES / f"{name}.npz")
    ids = d["ids"]
    with _engine(name, tmp_path) as eng:
        m = eng.model
        c1, c2 = m.new_cache(128), m.new_cache(128)
        whole = m.forward(ids, c1, all_logits=True)
        rows = np.concatenate([m.forward([int(t)], c2) for t in ids])
    assert (_rel(rows, whole) <= TOL).all(), _rel(rows, whole).max()
    assert (rows.argmax(-1) == whole.argmax(-1)).all()
    assert c1.pos == c2.pos == len(ids)
    n_rec = 0
    for a, b in zip(c1.layers, c2.layers):
        if hasattr(a, "state"):
            n_rec += 1
            for x, y in ((a.conv, b.conv), (a.state, b.state)):
                assert np.abs(x - y).max() <= TOL * np.abs(x).max()
        else:
            T = len(ids)
            assert np.abs(a.k[:, :T] - b.k[:, :T]).max() <= TOL * np.abs(a.k[:, :T]).max()
    assert n_rec == sum(m.args.recurrent) > 0


def _check_cache(name, tmp_path):
    """The states belong to the cache: a fresh cache gives the first run's logits again, a used one does not (the
    state carries); ``nbytes`` of a cache is ``Model.cache_bytes`` (what --ctx sizing uses); a cache with
    recurrent layers is not rewindable, and ``keep_kv`` generate turns still give a fresh run's tokens, whether
    the new prompt extends the previous turn or changes it."""
    d = np.load(ORACLES / f"{name}.npz")
    ids = [int(i) for i in d["ids"]]
    with _engine(name, tmp_path, ctx=200) as eng:
        m = eng.model
        c = m.new_cache(200)
        assert c.nbytes() == type(m).cache_bytes(m.args, 200) and not c.rewindable
        first = m.forward(ids[:20], c, all_logits=True)
        again_used = m.forward(ids[:20], c, all_logits=True)  # the same tokens on the carried state
        fresh = m.forward(ids[:20], m.new_cache(200), all_logits=True)
        assert (_rel(fresh, first) <= 1e-5).all()  # a state left over is > 1e-2 off (below)
        assert _rel(again_used, first).max() > 1e-2
        turn1 = eng.generate(ids=ids[:40], max_tokens=4, temp=0.0, stop_at_eos=False, keep_kv=True)
        ext = ids[:40] + list(turn1.ids) + ids[40:50]  # extends the first turn: its state is reused
        turn2 = eng.generate(ids=ext, max_tokens=4, temp=0.0, stop_at_eos=False, keep_kv=True)
        other = ids[:10] + ids[60:80]  # shares only a prefix: the state cannot be rewound, a fresh cache runs
        turn3 = eng.generate(ids=other, max_tokens=4, temp=0.0, stop_at_eos=False, keep_kv=True)
        ref2 = eng.generate(ids=ext, max_tokens=4, temp=0.0, stop_at_eos=False)
        ref3 = eng.generate(ids=other, max_tokens=4, temp=0.0, stop_at_eos=False)
    assert list(turn2.ids) == list(ref2.ids) and list(turn3.ids) == list(ref3.ids)


def _check_cli(name, capsys, tmp_path):
    """``coli run -m FILE`` on the fixture prints the library's greedy text (exit 0)."""
    from coli.cli import main
    from coli.engine import Engine

    path = str(ORACLES / f"{name}.gguf")
    with Engine(path, cpu_act="f32", save_usage=False, quiet=True) as eng:
        want = eng.generate("The capital of France", max_tokens=6, temp=0.0).text
    rc = main(["run", "-m", path, "--cpu-act", "f32", "--temp", "0", "-p", "The capital of France", "-n", "6",
               "--no-display-prompt", "--usage", str(tmp_path / "u.coli_usage"), "-q"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.rstrip("\n") == want and want


def _check_device(name, tmp_path, balance):
    """The tier on Lavapipe: the same greedy tokens as the CPU-only run, the device computed expert pairs."""
    d = np.load(ORACLES / f"{name}.npz")
    ids = [int(i) for i in d["ids"]]
    with _engine(name, tmp_path, threads=1) as eng:
        cpu = list(eng.generate(ids=ids, max_tokens=8, temp=0.0, stop_at_eos=False).ids)
    with _engine(name, tmp_path, threads=1, device="vulkan", balance=balance) as eng:
        dev = list(eng.generate(ids=ids, max_tokens=8, temp=0.0, stop_at_eos=False).ids)
        tier = eng.tier
        assert tier is not None and tier.on and tier.device_pairs > 0
    assert dev == cpu == [int(t) for t in d["gen_ids"]]


def _copy_gguf(src_path, dest, convert):
    """A copy of a GGUF with every key as is and each tensor through ``convert(tensor) -> (array, raw_dtype)``,
    or a list of ``(name, array, raw_dtype)`` to write instead (gguf-py's reader and writer)."""
    import gguf

    src = gguf.GGUFReader(src_path)
    w = gguf.GGUFWriter(str(dest), src.fields["general.architecture"].contents())
    for f in src.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vt = gguf.GGUFValueType(f.types[0])
        sub = gguf.GGUFValueType(f.types[-1]) if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), vt, sub_type=sub)
    for t in src.tensors:
        res = convert(t)
        for name, arr, raw in ([(t.name, *res)] if isinstance(res, tuple) else res):
            w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def _q8_matrices(t):
    """A ``_copy_gguf`` converter: every F32/F16 matrix with rows of a multiple of 32 (not token_embd) quantized to
    Q8_0 by gguf.quants, the rest as is."""
    import gguf

    a = np.asarray(t.data)
    if a.ndim >= 2 and a.shape[-1] % 32 == 0 and "token_embd" not in t.name and t.tensor_type in (0, 1):
        return gguf.quants.quantize(a.astype(np.float32), gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    return a, t.tensor_type


def _check_quantized(name, tmp_path):
    """Every matrix with rows of a multiple of 32 (the DeltaNet and attention projections, experts, shared expert,
    head) quantized to Q8_0 by gguf.quants, against the same file with those tensors dequantized by gguf.quants
    to F32: logits of the prompt (GEMM) and of 8 decode steps (grouped GEMV kernels on Q8_0 rows) within 1e-5."""
    import gguf

    Q8 = gguf.GGMLQuantizationType.Q8_0

    def dequant(t):
        if t.tensor_type == Q8:
            shape = tuple(int(x) for x in reversed(t.shape))
            return gguf.quants.dequantize(np.asarray(t.data), Q8).reshape(shape).astype(np.float32), None
        return np.asarray(t.data), t.tensor_type

    q8 = _copy_gguf(ORACLES / f"{name}.gguf", tmp_path / f"{name}-q8.gguf", _q8_matrices)
    f32 = _copy_gguf(q8, tmp_path / f"{name}-dq.gguf", dequant)
    d = np.load(ORACLES / f"{name}.npz")
    out = []
    for path in (q8, f32):
        with _engine_path(path, tmp_path) as eng:
            m = eng.model
            assert sum(ti.type_name == "Q8_0" for ti in m.t.values()) >= (30 if path == q8 else 0)
            c = m.new_cache(128)
            rows = [m.forward(d["ids"], c, all_logits=True)]
            rows += [m.forward([int(t)], c) for t in d["gen_ids"]]
            out.append(np.concatenate(rows))
    assert (_rel(out[0], out[1]) <= 1e-5).all(), _rel(out[0], out[1]).max()


@pytest.fixture(scope="module")
def lavapipe():
    from coli.vulkan import open_device
    from tests.vk_util import HAVE_LOADER

    if not HAVE_LOADER:  # only a machine without the loader skips (tests/vk_util.py's rule)
        pytest.skip("libvulkan.so.1 not found (apt install libvulkan1 mesa-vulkan-drivers)")
    dev = open_device("probe", quiet=True)
    assert dev is not None, "the Vulkan loader is installed but no device opens (Lavapipe expected)"
    dev.close()
    return True


NAME = "qwen3next"


def test_logits_prompt_and_decode(tmp_path):
    _check_prompt_and_decode(NAME, tmp_path)


def test_generate_tokens(tmp_path):
    _check_generate(NAME, tmp_path)


def test_prompt_in_one_call_equals_one_at_a_time(tmp_path):
    _check_one_call_equals_rows(NAME, tmp_path)


def test_cache_carries_and_resets(tmp_path):
    _check_cache(NAME, tmp_path)


def test_cli_run(capsys, tmp_path):
    _check_cli(NAME, capsys, tmp_path)


def test_quantized_file_equals_its_dequantized_twin(tmp_path):
    _check_quantized(NAME, tmp_path)


@pytest.mark.parametrize("balance", [False, True])
def test_device_tier_tokens_equal_cpu(lavapipe, tmp_path, balance):
    _check_device(NAME, tmp_path, balance)


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

    legacy = _copy_gguf(ORACLES / f"{NAME}.gguf", tmp_path / "legacy.gguf", fuse)
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
    w = gguf.GGUFWriter(str(tmp_path / "mtp.gguf"), NAME)
    for f in src.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vt = gguf.GGUFValueType(f.types[0])
        sub = gguf.GGUFValueType(f.types[-1]) if vt == gguf.GGUFValueType.ARRAY else None
        val = f.contents()
        if f.name == f"{NAME}.block_count":
            val = n + 1
        elif f.name == f"{NAME}.attention.recurrent_layers":
            val = list(val) + [False]
        w.add_key_value(f.name, val, vt, sub_type=sub)
    w.add_uint32(f"{NAME}.nextn_predict_layers", 1)
    for t in src.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for t in src.tensors:
        if t.name.startswith(f"blk.{n - 1}."):
            w.add_tensor(t.name.replace(f"blk.{n - 1}.", f"blk.{n}."), np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    d = np.load(ORACLES / f"{NAME}.npz")
    out = []
    for path in (ORACLES / f"{NAME}.gguf", tmp_path / "mtp.gguf"):
        with _engine_path(path, tmp_path) as eng:
            assert eng.model.args.n_layers == n
            out.append(eng.logits(d["ids"]))
    assert (_rel(out[1], out[0]) <= 1e-5).all()
