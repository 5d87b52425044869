"""The engine on the real dense models and the demo MoE (values from llama.cpp on the same files)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import CAPITALS, FIXTURES, LLAMA_CPP_NLL, ROOT

FIXTURE_OLMOE = FIXTURES / "oracles" / "olmoe.gguf"


@pytest.mark.parametrize("name", ["smollm2", "gemma3", "qwen25"])
def test_nll_matches_llama_cpp(name, model_path, engine):
    """Teacher-forced NLL (BOS as the metadata says, every token after the first scored) within 3% of llama.cpp."""
    eng = engine(model_path(name))
    ids = eng.tokenize(CAPITALS)
    if name == "gemma3":
        assert ids[0] == eng.tokenizer.bos_id  # Gemma needs BOS; the file says add_bos_token
    nll, n = eng.nll(ids)
    lo, hi = LLAMA_CPP_NLL[name]
    assert lo * 0.97 <= nll <= hi * 1.03, (name, nll)
    assert n == len(ids) - 1


def test_qwen_says_paris(model_path, engine):
    """Qwen2.5's greedy continuation of "The capital of France is" begins with " Paris" (llama.cpp:
    " Paris. Paris is located in")."""
    eng = engine(model_path("qwen25"))
    r = eng.generate("The capital of France is", max_tokens=6)
    assert r.text.startswith(" Paris"), r.text


def test_logits_fresh_state_and_exact_ids(model_path, engine):
    """``logits`` runs exactly the ids given from a fresh cache: the same call twice gives the same bytes, and
    a prefix's logits equal the first rows of the longer call's (causality). f32 activations: with int8
    activations (rounded per 32, as llama.cpp) a 1e-6 difference in summation order can flip a rounding and
    move logits by ~1, so only the f32 path has this exact invariant."""
    eng = engine(model_path("smollm2"), cpu_act="f32")
    ids = eng.tokenize(CAPITALS)
    a = eng.logits(ids)
    b = eng.logits(ids)
    assert a.shape == (len(ids), eng.args.vocab) and a.dtype == np.float32
    assert np.array_equal(a, b)
    c = eng.logits(ids[:7])
    assert np.allclose(c, a[:7], atol=1e-3 * np.abs(a[:7]).max())


def test_demo_same_equals_dense(model_path, demo_same_path, engine):
    """The demo MoE with zero perturbation and the dense model's own Q4_1 blocks gives the dense SmolLM2's
    logits within 1e-4 of the largest (Mixtral renormalises top-k weights to 1)."""
    dense = engine(model_path("smollm2"), cpu_act="f32")
    moe = engine(demo_same_path, cpu_act="f32")
    ids = dense.tokenize(CAPITALS)
    a = dense.logits(ids)
    b = moe.logits(ids)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()
    assert moe.args.n_experts == 8 and moe.args.top_k == 2


def test_streaming_cache_one_equals_full(demo_path, engine, tmp_path):
    """``--expert-cache 1`` (raised to top-k: a pool of top-k experts a layer shared by the layers, evicting
    across them) gives the tokens of a cache that holds every expert, and the routing history counts sum to
    tokens x top-k x MoE layers."""
    from coli.engine import Engine

    full = Engine(demo_path, expert_cache=8, usage=tmp_path / "full.coli_usage", cpu_act="f32")
    small = Engine(demo_path, expert_cache=1, usage=tmp_path / "small.coli_usage", cpu_act="f32")
    try:
        assert small.expert_slots == small.args.top_k
        r1 = full.generate("Once upon a time", max_tokens=12)
        r2 = small.generate("Once upon a time", max_tokens=12)
        assert r1.ids == r2.ids
        assert r2.stats["disk_loads"] > r1.stats["disk_loads"]  # the small cache had to reload experts
        c = small.cache   # one pool for the layers: top-k slots a layer x layers, never exceeded
        L = small.model.moe_layers
        assert c.capacity == small.args.top_k * len(L) * c.source.held_nbytes(L[0])
        assert c.evictions > 0 and c.held == c.nbytes() <= c.capacity
        u = small.usage
        fwd = len(r2.prompt_ids) + len(r2.ids) - 1
        assert u.tokens == fwd
        assert int(u.counts.sum()) == fwd * small.args.top_k * len(small.model.moe_layers)
    finally:
        full.close()
        small.close()
    doc = json.loads((tmp_path / "small.coli_usage").read_text())
    ent = doc["models"][demo_path.name]
    assert sum(map(sum, ent["counts"])) == ent["tokens"] * 2 * 30


def test_usage_accumulates_across_runs(demo_path, tmp_path):
    from coli.engine import Engine

    p = tmp_path / "u.coli_usage"
    for n in (1, 2):
        with Engine(demo_path, usage=p, expert_cache=8) as eng:
            eng.generate("Hello", max_tokens=3)
            first = eng.usage.tokens
    doc = json.loads(p.read_text())
    assert doc["models"][demo_path.name]["tokens"] == first and first > 3


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "coli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_cli_empty_prompt(model_path):
    r = _cli("run", "-m", str(model_path("smollm2")), "-p", "")
    assert r.returncode == 2 and "prompt" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_prompt_longer_than_context(model_path):
    r = _cli("run", "-m", str(model_path("smollm2")), "-p", "word " * 200, "--ctx", "64", "-n", "4")
    assert r.returncode == 2 and "context" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_missing_file(tmp_path):
    r = _cli("run", "-m", str(tmp_path / "nope.gguf"), "-p", "hi")
    assert r.returncode == 2 and "nope.gguf" in r.stderr and "Traceback" not in r.stderr


def test_unsupported_architecture(tmp_path):
    import gguf

    p = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(p), "bert")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    r = _cli("run", "-m", str(p), "-p", "hi")
    assert r.returncode == 2 and "bert" in r.stderr and "general.architecture" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_run_generates(model_path):
    r = _cli("run", "-m", str(model_path("qwen25")), "-p", "The capital of France is", "-n", "4")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is Paris")
    assert "decode" in r.stderr and "tok/s" in r.stderr


def test_bench_json_fields(model_path):
    r = _cli("bench", "-m", str(model_path("smollm2")), "-p", "8", "-n", "4", "-r", "1", "--json")
    assert r.returncode == 0, r.stderr
    recs = json.loads(r.stdout)
    assert [x["test"] for x in recs] == ["pp8", "tg4"]
    for x in recs:
        for k in ("n_prompt", "n_gen", "n_threads", "avg_ts", "stddev_ts"):
            assert k in x
        assert x["avg_ts"] > 0


def test_sampling_rules(model_path, engine):
    """Sampling invariants: temp 0 and top-k 1 are greedy; a seed repeats; the nucleus keeps the argmax."""
    from coli.sampling import Sampler

    eng = engine(model_path("smollm2"))
    rng = np.random.default_rng(0)
    lg = rng.standard_normal(1000).astype(np.float32) * 3
    best = int(np.argmax(lg))

    def sample(lg, temp, top_k, top_p, rng):
        return Sampler(temp=temp, top_k=top_k, top_p=top_p, rng=rng).sample(lg)

    assert sample(lg, 0.0, 40, 0.95, rng) == best
    assert sample(lg, 1.0, 1, 1.0, rng) == best
    assert sample(lg, 1.0, 0, 1e-9, rng) == best
    a = eng.generate("Once upon a time", max_tokens=8, temp=0.9, seed=7).ids
    b = eng.generate("Once upon a time", max_tokens=8, temp=0.9, seed=7).ids
    assert a == b
    picks = {sample(lg, 1.0, 5, 1.0, np.random.default_rng(s)) for s in range(200)}
    assert picks <= set(np.argsort(-lg)[:5].tolist()) and len(picks) > 1


def test_cli_perplexity_and_info(model_path, engine, tmp_path):
    p = model_path("smollm2")
    f = tmp_path / "t.txt"
    f.write_text(CAPITALS)
    r = _cli("perplexity", "-m", str(p), "-f", str(f), "--all-tokens")
    assert r.returncode == 0, r.stderr
    nll = float(r.stdout.split("NLL ")[1].split()[0])
    eng = engine(p)
    assert abs(nll - eng.nll(eng.tokenize(CAPITALS))[0]) < 1e-3
    r = _cli("info", str(p))
    assert r.returncode == 0 and "llama" in r.stdout and "Q4_1" in r.stdout
    r = _cli("perplexity", "-m", str(p), "-f", str(tmp_path / "missing.txt"))
    assert r.returncode == 2 and "missing.txt" in r.stderr and "Traceback" not in r.stderr


def test_unsupported_tensor_type(tmp_path, model_path):
    """A weight in a GGUF type coli has no kernel for (Q8_1, llama.cpp's activation blocks) is refused naming the
    tensor and the type."""
    import gguf

    p = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_block_count(1); w.add_context_length(64); w.add_embedding_length(256); w.add_feed_forward_length(256)
    w.add_head_count(4); w.add_head_count_kv(4); w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("default")
    w.add_token_list(["a", "b", "ab"] + [f"<t{i}>" for i in range(253)]); w.add_token_types([1] * 256)
    w.add_token_merges(["a b"])
    f32 = lambda *s: np.ones(s, np.float32)
    w.add_tensor("token_embd.weight", f32(256, 256)); w.add_tensor("output_norm.weight", f32(256))
    for n in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{n}.weight", f32(256))
    for n in ("attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        w.add_tensor(f"blk.0.{n}.weight", f32(256, 256))
    # Q8_1: 40 bytes per 32 weights
    w.add_tensor("blk.0.attn_q.weight", np.zeros((256, 320), np.uint8), raw_shape=(256, 320),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    r = _cli("run", "-m", str(p), "-p", "ab")
    assert r.returncode == 2, r.stderr
    assert "blk.0.attn_q.weight" in r.stderr and "Q8_1" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("flag,value", [("--ctx", "-1"), ("--expert-cache", "-1"), ("-n", "-5"),
                                        ("--top-p", "2"), ("--ctx", "100000000"),
                                        ("--trace", "/nonexistent-coli/x.json"), ("--usage", "/nonexistent-coli/u"),
                                        ("--io-threads", "0"), ("--io-threads", "-1"), ("--io-threads", "1000")])
def test_cli_bad_numbers(flag, value, demo_path):
    r = _cli("run", "-m", str(demo_path), "-p", "hi", "-n", "2", flag, value)
    assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


def test_perplexity_windows_and_bad_text(model_path, engine, tmp_path):
    """A text longer than the context is scored in windows of ``ctx`` tokens; non-UTF-8 input is an error."""
    from coli.engine import Engine

    p = model_path("smollm2")
    with Engine(p, ctx=8, cpu_act="f32", save_usage=False) as e8:
        ids = e8.tokenize(CAPITALS)
        nll, n = e8.nll(ids)
        ref = [engine(p, cpu_act="f32").nll(ids[s : s + 8]) for s in range(0, len(ids), 8) if len(ids[s : s + 8]) > 1]
    assert n == sum(k for _, k in ref) and abs(nll - sum(a * k for a, k in ref) / n) < 1e-6
    f = tmp_path / "bin.txt"
    f.write_bytes(bytes(range(256)) * 4)
    r = _cli("perplexity", "-m", str(p), "-f", str(f))
    assert r.returncode == 2 and "UTF-8" in r.stderr and "Traceback" not in r.stderr


def test_cli_bench_bad_reps(model_path):
    r = _cli("bench", "-m", str(model_path("smollm2")), "-r", "0")
    assert r.returncode == 2 and "-r" in r.stderr and "Traceback" not in r.stderr


def test_device_runs_keep_the_cpus_default_activations(model_path):
    """Invariant (docs/contracts.md): a run with the device tier keeps the CPU's default activations
    (int8 where VNNI) and the device rounds its own the same way (Device.act)."""
    import cpu_kernels
    from coli.engine import Engine

    with Engine(FIXTURE_OLMOE, device="vulkan", save_usage=False) as eng:
        assert eng.cpu_act == cpu_kernels.DEFAULT_ACT
        assert eng.device is None or eng.device.act == eng.cpu_act


def test_streamed_text_equals_the_decoded_text(model_path, engine):
    """What ``on_text`` receives, joined, is the detokenized result: multi-byte characters that span tokens
    (CJK, emoji) arrive whole, never as replacement characters."""
    eng = engine(model_path("smollm2"))
    pieces = []
    r = eng.generate("Party time 🎉🎉🎉🎉", max_tokens=16, on_text=pieces.append)
    assert sum("\ufffd" in eng.detokenize([t]) for t in r.ids) > 0  # the emoji really span tokens here
    assert "".join(pieces) == r.text
    assert all("\ufffd" not in p for p in pieces[:-1])  # only a character cut by max_tokens ends unfinished


def test_a_character_cut_by_max_tokens_is_left_out(model_path, engine):
    """Generation cut by max_tokens inside a multi-byte character (SmolLM2 writes 🎉 as byte tokens): the text
    ends before it, with no U+FFFD (llama-cli writes the bytes as they come; coli prints text); it was U+FFFD."""
    eng = engine(model_path("smollm2"))
    full = eng.generate("Party time 🎉🎉🎉🎉", max_tokens=16)
    raw = [eng.tokenizer.piece_bytes(t) for t in full.ids]
    k = next(k for k in range(1, len(raw)) if b"".join(raw[:k]).decode("utf-8", "replace").endswith("\ufffd"))
    r = eng.generate("Party time 🎉🎉🎉🎉", max_tokens=k)   # greedy: the first k tokens of ``full``
    assert r.ids == full.ids[:k] and r.finish_reason == "length"
    assert r.text == b"".join(raw[:k]).decode("utf-8", "ignore") and "\ufffd" not in r.text


def _numba_signatures() -> int:
    """Signatures (compiled or loaded from the disk cache) over every Numba dispatcher of coli's modules."""
    from numba.core.dispatcher import Dispatcher

    return sum(len(v.signatures) for name, mod in list(sys.modules.items())
               if mod is not None and name.startswith(("cpu_kernels", "coli", "scheduler"))
               for v in list(vars(mod).values()) if isinstance(v, Dispatcher))


def test_a_calls_cache_holds_what_it_writes(model_path, engine, monkeypatch):
    """A generate's KV cache holds its prompt plus ``max_tokens`` positions, ``logits``' its ids, a ``keep_kv``
    generate's (kept for later turns) the whole context; a generate longer than any before adds no Numba
    signature and keeps the RoPE tables (built once for the context); the tokens and logits are bit-equal to a
    context-sized cache's (attention reads the positions before ``pos`` alone). docs/engine.md "KV cache"."""
    from coli.engine import engine_threads

    eng = engine(model_path("smollm2"))
    m = eng.model
    made = []
    new_cache = m.new_cache
    monkeypatch.setattr(m, "new_cache", lambda ctx, rope_ctx=0: made.append(ctx) or new_cache(ctx, rope_ctx))
    ids = eng.tokenize(CAPITALS)[:10]
    eng.generate(ids=ids, max_tokens=2, temp=0.0, stop_at_eos=False, keep_kv=True)
    assert made == [eng.ctx]
    eng.generate(ids=ids, max_tokens=4, temp=0.0, stop_at_eos=False)   # drops the kept cache
    assert made[-1] == len(ids) + 4 and eng._kv is None
    ropes, sigs = dict(m._ropes), _numba_signatures()
    r = eng.generate(ids=ids, max_tokens=12, temp=0.0, stop_at_eos=False)
    assert made[-1] == len(ids) + 12
    assert _numba_signatures() == sigs
    assert m._ropes.keys() == ropes.keys() and all(m._ropes[k] is v for k, v in ropes.items())
    with engine_threads(eng):   # the same greedy decode in a cache of the whole context
        kv = new_cache(eng.ctx, eng.ctx)
        lg, toks = m.forward(ids, kv), []
        for i in range(12):
            toks.append(int(np.argmax(lg[-1])))
            if i < 11:
                lg = m.forward([toks[-1]], kv)
        whole = m.forward(ids, new_cache(eng.ctx, eng.ctx), all_logits=True)
    assert r.ids == toks
    assert np.array_equal(eng.logits(ids), whole)
    assert made[-1] == len(ids)


def test_the_heap_is_trimmed_after_the_load(model_path, engine):
    """``trim_heap`` (glibc's ``malloc_trim(0)``, called once an Engine is loaded and once its first generate ends)
    gives freed heap pages back: 192 MiB of 64 KiB blocks written through glibc's malloc and freed but the last (which
    pins the heap's top, so free alone gives nothing back) leave the resident set by at least 150 MiB at the trim.
    Off glibc it is None."""
    import ctypes
    import os

    from coli.engine import trim_heap

    if not os.confstr("CS_GNU_LIBC_VERSION"):     # musl: no malloc_trim
        assert trim_heap() is None
        return
    eng = engine(model_path("smollm2"))
    assert eng.heap_trimmed is not None
    eng.generate("The capital of France is", max_tokens=2)
    assert eng.heap_trimmed_first is not None        # trimmed again once the first generate ended
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(3072)]
    for b in blocks:
        ctypes.memset(b, 1, 64 << 10)
    for b in blocks[:-1]:
        libc.free(b)
    try:
        assert trim_heap() >= 150 << 20
    finally:
        libc.free(blocks[-1])
