"""The family-parity harness: every model family's HF oracle (a tiny random HF model converted by llama.cpp's
converter, tests/fixtures/oracles/NAME.{gguf,npz}, tests/oracles/make.py; docs/oracles.md) through the same
checks. What a family does that the others do not (its own mechanisms, the pieces its oracle must see, its bad
files) is in its own file (tests/models/test_deepseek2.py, test_kimi.py, test_glmdsa.py, test_gptoss.py, test_mimo2.py,
test_deepseek4.py, test_qwen3next.py, test_qwen35moe.py).

Per family: the prompt in one call and 8 greedy decode steps within 1e-4 of the largest |logit| of HF's, argmax
and tokens equal (and with experts streamed from the file where the family has that row); ``Engine.generate`` gives
HF's tokens and ``Engine.logits`` HF's logits; the prompt one token at a time equals it in one call (logits and the
caches' recurrent states and rows); a used cache carries its state and a fresh one restarts, ``nbytes`` is
``cache_bytes``; ``keep_kv`` turns (one extending the last, one sharing only a prefix) give another engine's tokens;
the routing equals HF's at every MoE layer and position; the Lavapipe tier gives the CPU's tokens and logits with
the device computing expert pairs; a Q8_0 copy equals its f32 dequantization; ``coli run`` prints the library's
text."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from conftest import FIXTURES
from oracle_check import (capture_routes, check_prompt_and_decode, check_routes, copy_gguf, oracle_engine,
                          q8_matrices, rel)

DIR = FIXTURES / "oracles"


@dataclass(frozen=True)
class Family:
    """One oracle fixture and the checks that apply to it."""
    name: str                  # tests/fixtures/oracles/{name}.gguf / .npz
    module: str                # the family file under coli/models/ the GGUF's architecture picks
    rewindable: bool           # every layer cache indexed by position (keep_kv rewinds it; else fresh); pageable
    rows: int = 40             # prompt tokens of the one-at-a-time check
    rows_tol: float = 1e-5     # its bound (1e-4 where a block's f32 GEMM and a row's GEMV sum in other orders)
    routes: bool = False       # the npz has HF's expert_ids / expert_weights over ids + gen_ids[:-1]
    device: tuple = ()         # the Lavapipe check's balance settings (none: not run for this family)
    device_rows: int = 40      # its prompt tokens
    streamed: bool = False     # also with expert_cache=1 (experts loaded from the file on demand)
    q8_twin: bool = False      # the Q8_0 copy against its f32 dequantization
    cli: bool = False          # ``coli run -m FILE``
    mla_split: int = 0         # MLA: the prompt cut there for the two forms' check (0: no MLA layer)

    def __str__(self):
        return self.name


FAMILIES = [
    Family("deepseek2_lite", "deepseek2", True, routes=True, device=(None,), mla_split=80),
    Family("deepseek2_qlora", "deepseek2", True, routes=True, device=(None,), mla_split=80),
    Family("deepseek2_yarn", "deepseek2", True, routes=True, mla_split=80),
    Family("deepseek3", "deepseek2", True, routes=True, mla_split=80),
    Family("kimi", "kimi", False, routes=True, device=(None,), mla_split=80),
    # 40 rows: past the indexer's top-k (24); the first 20 rows see every key (the expanded form)
    Family("glmdsa", "glmdsa", True, routes=True, device=(None,), mla_split=20),
    Family("gptoss", "gptoss", True, rows=88, streamed=True, device=(None,)),
    Family("mimo2", "mimo2", True, rows=88, streamed=True, device=(True,)),
    Family("mimo2_groups", "mimo2", True, rows=88),
    Family("deepseek4", "deepseek4", False, rows=96, streamed=True, device=(True,)),
    Family("qwen3next", "qwen3next", False, rows=96, rows_tol=1e-4, device=(False, True), device_rows=96,
           q8_twin=True, cli=True),
    Family("qwen35moe", "qwen35moe", False, rows=96, rows_tol=1e-4, device=(False, True), device_rows=96,
           q8_twin=True, cli=True),
]


def _engine(path, tmp_path, **kw):
    return oracle_engine(path, tmp_path, **{"ctx": 256, **kw})


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """``engines(name, **options)`` -> an engine on the fixture, kept for the module (loading is the slow part)."""
    tmp, made = tmp_path_factory.mktemp("family"), {}

    def get(name, **kw):
        key = (name, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = _engine(DIR / f"{name}.gguf", tmp, **kw)
        return made[key]

    yield get
    for e in made.values():
        e.close()


def _oracle(f: Family):
    return np.load(DIR / f"{f.name}.npz")


def _greedy(eng, ids, n, **kw) -> list:
    return list(eng.generate(ids=list(ids), max_tokens=n, temp=0.0, stop_at_eos=False, **kw).ids)


@pytest.mark.parametrize("f, expert_cache", [(f, None) for f in FAMILIES] + [(f, 1) for f in FAMILIES if f.streamed],
                         ids=str)
def test_prompt_and_decode_match_hf(engines, f, expert_cache):
    m = engines(f.name, expert_cache=expert_cache).model
    assert type(m).__module__ == f"coli.models.{f.module}"
    kv = m.new_cache(128)
    # the layers' answer (no cache built) is the cache's; here the position-indexed caches are the pageable ones
    assert kv.rewindable == f.rewindable == kv.pageable() == m.pageable()
    check_prompt_and_decode(m, kv, _oracle(f))
    assert kv.nbytes() == type(m).cache_bytes(m.args, 128)


@pytest.mark.parametrize("f", FAMILIES, ids=str)
def test_generate_gives_hf_tokens_and_logits(engines, f):
    """The engine's path (the prompt in prefill steps, the state carried between them): HF's greedy tokens, and
    ``Engine.logits`` HF's prompt logits."""
    d, eng = _oracle(f), engines(f.name)
    assert _greedy(eng, d["ids"].tolist(), len(d["gen_ids"])) == d["gen_ids"].tolist()
    assert (rel(eng.logits(d["ids"]), d["logits"]) <= 1e-4).all()


@pytest.mark.parametrize("f", FAMILIES, ids=str)
def test_prompt_in_one_call_equals_one_at_a_time(engines, f):
    """The prompt's first ``rows`` tokens in one call and one at a time: every row's logits within ``rows_tol``,
    argmax equal; the caches at the same position with their recurrent states (convolution rows, DeltaNet / KDA
    state), position-indexed rows (K, V, latent, rope key; a sliding-window layer's from the first row both still hold) and
    window rings (DeepSeek-V4's) within 1e-4 of the largest."""
    m = engines(f.name).model
    ids = _oracle(f)["ids"][:f.rows]
    c1, c2 = m.new_cache(128), m.new_cache(128)
    whole = m.forward(ids, c1, all_logits=True)
    single = np.concatenate([m.forward(ids[i:i + 1], c2) for i in range(len(ids))])
    assert (rel(single, whole) <= f.rows_tol).all(), rel(single, whole).max()
    assert (single.argmax(1) == whole.argmax(1)).all()
    assert c1.pos == c2.pos == len(ids)
    compared = 0
    for a, b in zip(c1.layers, c2.layers):
        for attr in ("conv", "state", "k", "v", "lat", "kr", "win"):
            x, y = getattr(a, attr, None), getattr(b, attr, None)
            if attr in ("k", "v") and getattr(a, "window", 0):   # a window layer holds rows from its lo on: the
                lo = max(a.lo, b.lo)                              # one-at-a-time cache gave back more of them
                x, y = x[:, lo:len(ids)], y[:, lo:len(ids)]
            if isinstance(x, np.ndarray) and x.size:
                x, y = x.astype(np.float64), y.astype(np.float64)
                assert np.abs(x - y).max() <= 1e-4 * np.abs(x).max(), (attr, np.abs(x - y).max() / np.abs(x).max())
                compared += 1
    assert compared > 0


@pytest.mark.parametrize("f", [f for f in FAMILIES if f.mla_split], ids=str)
def test_mla_chunks_of_either_form_match_hf(engines, f, monkeypatch):
    """The prompt in two calls cut at ``mla_split``: every MLA layer takes the expanded form for the first (a chunk
    from position 0: fewer multiply-adds; glm-dsa's while every key is chosen) and the absorbed one for the rest
    (16 rows after 80: more multiply-adds; glm-dsa's past the indexer's top-k); both calls' logits within 1e-4
    of HF's, argmax equal."""
    from coli.models import mla

    forms = []
    expanded, absorbed = mla.MLA.expanded, mla.mla_attend
    monkeypatch.setattr(mla.MLA, "expanded", lambda *a: forms.append("expanded") or expanded(*a))
    monkeypatch.setattr(mla, "mla_attend", lambda *a: forms.append("absorbed") or absorbed(*a))
    m, d = engines(f.name).model, _oracle(f)
    n_mla = sum(isinstance(getattr(L.attn, "mla", L.attn), mla.MLA) for L in m.layers)
    c, k = m.new_cache(128), f.mla_split
    for a, b, form in ((0, k, "expanded"), (k, len(d["ids"]), "absorbed")):
        forms.clear()
        got = m.forward(d["ids"][a:b], c, all_logits=True)
        assert forms == [form] * n_mla, forms
        assert (rel(got, d["logits"][a:b]) <= 1e-4).all(), (form, rel(got, d["logits"][a:b]).max())
        assert (got.argmax(1) == d["logits"][a:b].argmax(1)).all()


@pytest.mark.parametrize("f", FAMILIES, ids=str)
def test_cache_carries_and_a_fresh_one_restarts(engines, f):
    """The state belongs to the cache: a fresh cache gives the first run's logits again, the used one does not
    (the same tokens on the carried state are > 1e-2 off); ``nbytes`` is ``Model.cache_bytes`` (what sizes --ctx)."""
    m = engines(f.name).model
    ids = _oracle(f)["ids"][:20]
    for ctx in (20, 200):
        assert m.new_cache(ctx).nbytes() == type(m).cache_bytes(m.args, ctx)
    c = m.new_cache(200)
    first = m.forward(ids, c, all_logits=True)
    again_used = m.forward(ids, c, all_logits=True)
    fresh = m.forward(ids, m.new_cache(200), all_logits=True)
    assert (rel(fresh, first) <= 1e-5).all()
    assert rel(again_used, first).max() > 1e-2


@pytest.mark.parametrize("f", FAMILIES, ids=str)
def test_keep_kv_turns_equal_fresh_runs(engines, f, tmp_path):
    """Conversation turns reusing the cache (``keep_kv``): one extending the previous turn, then one sharing only a
    30-token prefix (past glm-dsa's index_topk and gpt-oss's window: the cache is rewound, or a fresh one starts
    where it cannot be): the tokens of another engine's runs without ``keep_kv``."""
    ids = _oracle(f)["ids"].tolist()
    with _engine(DIR / f"{f.name}.gguf", tmp_path) as eng:
        g1 = _greedy(eng, ids[:50], 4, keep_kv=True)
        assert eng._kv.rewindable == f.rewindable
        t2 = ids[:50] + g1 + ids[50:60]
        g2 = _greedy(eng, t2, 6, keep_kv=True)
        t3 = ids[:30] + ids[70:88]
        g3 = _greedy(eng, t3, 6, keep_kv=True)
    ref = engines(f.name)
    assert _greedy(ref, t2, 6) == g2
    assert _greedy(ref, t3, 6) == g3


@pytest.mark.parametrize("f", [f for f in FAMILIES if f.routes], ids=str)
def test_routing_matches_hf_layer_by_layer(engines, f):
    """coli's experts and weights at every MoE layer and position over the prompt and the decoded tokens equal
    HF's (compared per expert id; the family files check the router's settings against the config)."""
    m = engines(f.name).model
    d = _oracle(f)
    check_routes(capture_routes(m, np.concatenate([d["ids"], d["gen_ids"][:-1]])), d["expert_ids"],
                 d["expert_weights"])


@pytest.mark.parametrize("f, balance", [(f, b) for f in FAMILIES for b in f.device], ids=str)
def test_device_tier_gives_the_cpus_tokens(engines, f, balance, tmp_path):
    """``device="vulkan"`` (Lavapipe): the routed experts run on the device (expert pairs and dispatches > 0), the
    greedy tokens and logits equal the CPU-only run's, and the logits of the prompt are HF's within 1e-4."""
    from tests.vk_util import HAVE_LOADER

    if not HAVE_LOADER:  # only a machine without the loader skips (tests/vk_util.py's rule)
        pytest.skip("libvulkan.so.1 not found (apt install libvulkan1 mesa-vulkan-drivers)")
    d, cpu = _oracle(f), engines(f.name)
    prompt = d["ids"][:f.device_rows].tolist()
    want = _greedy(cpu, prompt, 8)
    want_lg = cpu.logits(prompt + want[:-1])
    with _engine(DIR / f"{f.name}.gguf", tmp_path, device="vulkan", balance=balance) as dev:
        assert dev.tier is not None and dev.tier.on, "the Vulkan loader exists but the tier is off"
        got = _greedy(dev, prompt, 8)
        got_lg = dev.logits(prompt + got[:-1])
        hf_lg = dev.logits(d["ids"])
        assert dev.tier.device_pairs > 0 and dev.device.dispatches > 0
    assert got == want
    if len(prompt) == len(d["ids"]):
        assert got == d["gen_ids"].tolist()
    assert (rel(got_lg, want_lg) <= 1e-4).all(), rel(got_lg, want_lg).max()
    assert (rel(hf_lg, d["logits"]) <= 1e-4).all(), rel(hf_lg, d["logits"]).max()


@pytest.mark.parametrize("f", [f for f in FAMILIES if f.q8_twin], ids=str)
def test_quantized_file_equals_its_dequantized_twin(f, tmp_path):
    """Every matrix with rows of a multiple of 32 (the attention / DeltaNet projections, experts, shared expert,
    head) quantized to Q8_0 by gguf.quants, against the same file with those tensors dequantized by gguf.quants
    to F32: logits of the prompt (GEMM) and of 8 decode steps (grouped GEMV kernels on Q8_0 rows) within 1e-5."""
    import gguf

    Q8 = gguf.GGMLQuantizationType.Q8_0

    def dequant(t):
        if t.tensor_type == Q8:
            shape = tuple(int(x) for x in reversed(t.shape))
            return gguf.quants.dequantize(np.asarray(t.data), Q8).reshape(shape).astype(np.float32), None
        return np.asarray(t.data), t.tensor_type

    q8 = copy_gguf(DIR / f"{f.name}.gguf", tmp_path / f"{f.name}-q8.gguf", convert=q8_matrices)
    f32 = copy_gguf(q8, tmp_path / f"{f.name}-dq.gguf", convert=dequant)
    d = _oracle(f)
    out = []
    for path in (q8, f32):
        with _engine(path, tmp_path) as eng:
            m = eng.model
            assert sum(ti.type_name == "Q8_0" for ti in m.t.values()) >= (30 if path == q8 else 0)
            c = m.new_cache(128)
            rows = [m.forward(d["ids"], c, all_logits=True)]
            rows += [m.forward([int(t)], c) for t in d["gen_ids"]]
            out.append(np.concatenate(rows))
    assert (rel(out[0], out[1]) <= 1e-5).all(), rel(out[0], out[1]).max()


@pytest.mark.parametrize("f", [f for f in FAMILIES if f.cli], ids=str)
def test_cli_run(engines, f, capsys, tmp_path):
    """``coli run -m FILE`` on the fixture prints the library's greedy text (exit 0)."""
    from coli.cli import main

    path = str(DIR / f"{f.name}.gguf")
    want = engines(f.name).generate("The capital of France", max_tokens=6, temp=0.0).text
    rc = main(["run", "-m", path, "--cpu-act", "f32", "--temp", "0", "-p", "The capital of France", "-n", "6",
               "--no-display-prompt", "--usage", str(tmp_path / "u.coli_usage"), "-q"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.rstrip("\n") == want and want
