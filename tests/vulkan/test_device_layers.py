"""Whole decoder layers on the device (coli/vulkan/device_layers.py, --gpu-layers): decode rows and prompt chunks
through the device's layers give the CPU-only run's logits (f32 on both sides; they differ in summation order only),
the device did the work (dispatches, tokens, prompt rows), the KV rows stay in step both ways (CPU rows uploaded,
device rows written back when the CPU needs them), and a failing device hands the layers back to the CPU."""
from __future__ import annotations

import numpy as np
import pytest

from coli.base import settings
from tests.tiny_moe import build_tiny_moe
from tests.vk_util import (IDS, check_greedy_like_cpu, decode_rows, device_engine, greedy_rows, lose_device_on_call,
                           open_test_device, rel_err, requires_vulkan)

pytestmark = requires_vulkan


@pytest.fixture(scope="module")
def engines(device_moe):
    cpu = device_engine(device_moe)
    dev = device_engine(device_moe, COLI_VK_LAYERS=2)
    yield cpu, dev
    cpu.close()
    dev.close()


def test_decode_rows_match_the_cpu(engines):
    cpu, dev = engines
    dl = dev.model.device_layers
    assert dl is not None and dl.first == 2 and dev.tier is None
    d0, t0, p0 = dev.device.dispatches, dl.tokens, dl.prompt_tokens
    ref, _ = decode_rows(cpu, IDS, 5)
    got, cache = decode_rows(dev, IDS, 5)
    assert dl.tokens - t0 == len(IDS) - 5          # every decode row went through the device's layers
    assert dl.prompt_tokens - p0 == 5              # and the prompt's rows
    assert dev.device.dispatches - d0 >= 8 * 2 * (len(IDS) - 5)   # at least 8 a layer (the norms fused)
    if dev.device.timestamps:                         # the device's own time is part of the submit and wait
        assert 0.0 < dl.gpu_s <= dl.submit_s * 1.05 + 1e-3
    assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
    # the decode rows' K/V were written back into the CPU's cache, the prompt's when asked: a CPU forward agrees
    assert dl._hi > dl._lo                          # the prompt's rows are the device's only, until asked
    dl.host_kv(cache)
    _, cref = decode_rows(cpu, IDS, 5)
    for il in (2, 3):
        assert rel_err(cache.layers[il].k[:, :len(IDS)], cref.layers[il].k[:, :len(IDS)]) < 1e-5
        assert rel_err(cache.layers[il].v[:, :len(IDS)], cref.layers[il].v[:, :len(IDS)]) < 1e-5



def test_decode_wait_polls_the_fence_and_the_profile_splits_the_token(engines):
    """A decode token's wait that polls its fence (``Kernels.submit``'s ``spin_s``: COLI_VK_SPIN_US, by default on a
    discrete GPU only) gives the blocking wait's logits bit for bit, each token's poll seeing the fence; with the
    join profile (COLI_VK_JOIN_PROFILE) each token's host time is charged to its parts (one submit, the timestamps
    every token, the row out, the routing history), the parts adding up to no more than the token's time."""
    from coli.vulkan.join_profile import JoinProfile

    _, dev = engines
    dl = dev.model.device_layers
    assert dl.fence_spin_s == 0.0 and not dl.segs       # Lavapipe shares the CPU's cores: no poll unless asked
    ref, _ = decode_rows(dev, IDS, 5)
    n = len(IDS) - 5
    dl.fence_spin_s, s0, t0, dl.prof = 60.0, dl.fence_spun, dl.tokens, JoinProfile()
    try:
        got, _ = decode_rows(dev, IDS, 5)
        P = dl.prof
    finally:
        dl.fence_spin_s, dl.prof = 0.0, None
    assert dl.fence_spun - s0 == dl.tokens - t0 == n
    assert np.array_equal(got, ref)
    assert P.tokens == n and P.n["submit"] == P.n["row out"] == P.n["routing history"] == n
    assert P.n["timestamps"] == (n if dev.device.timestamps else 0)
    assert all(v >= 0 for v in P.s.values()) and sum(P.s.values()) <= P.total_s * 1.0001
    assert "| row out |" in P.table()


def test_rewind_and_new_cache(engines):
    """A forward that rewinds a cache (the engine keeps a common prefix) and a second cache: the device's rows
    are uploaded again from the CPU's, so the logits still match."""
    cpu, dev = engines
    ref, _ = decode_rows(cpu, IDS[:8], 3)
    got, cache = decode_rows(dev, IDS[:8], 3)
    assert rel_err(got, ref) < 1e-4
    other = [7, 8, 9, 10, 11, 12, 13]
    cache.pos = 4            # rewind: rows 4.. of the first sequence are replaced
    m = dev.model
    lg = [m.forward(other[:2], cache)[-1]] + [m.forward([t], cache)[-1] for t in other[2:]]
    cm = cpu.model
    cc = cm.new_cache(64, 64)
    cm.forward(IDS[:4], cc)
    ref2 = [cm.forward(other[:2], cc)[-1]] + [cm.forward([t], cc)[-1] for t in other[2:]]
    assert rel_err(np.array(lg), np.array(ref2)) < 1e-4


def test_prompt_chunks_match_the_cpu(engines):
    """A prompt through the device's layers in chunks (3 rows a chunk here: a chunk boundary inside the prompt):
    every row's logits equal the CPU-only f32 run's within 1e-5 of the largest, one submit a chunk, and decode
    rows after it agree too."""
    cpu, dev = engines
    dl = dev.model.device_layers
    keep = dl.prompt_rows
    dl.prompt_rows = 3
    try:
        cm, m = cpu.model, dev.model
        cc, c = cm.new_cache(64, 64), m.new_cache(64, 64)
        d0, p0, k0 = dev.device.layer_dispatches, dl.prompt_tokens, dl.prompt_chunks
        ref = cm.forward(IDS[:8], cc, all_logits=True)
        got = m.forward(IDS[:8], c, all_logits=True)
        assert got.shape == ref.shape == (8, cm.args.vocab)
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
        assert (dl.prompt_tokens - p0, dl.prompt_chunks - k0) == (8, 3)
        assert dev.device.layer_dispatches - d0 >= 3 * 2 * 12    # every chunk ran each layer's kernels
        last = m.forward(IDS[8:10], c)                           # the last row's logits alone
        assert rel_err(last, cm.forward(IDS[8:10], cc)) < 1e-5
        ref = np.array([cm.forward([t], cc)[-1] for t in IDS[10:]])
        got = np.array([m.forward([t], c)[-1] for t in IDS[10:]])
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
    finally:
        dl.prompt_rows = keep


def test_another_cache_takes_the_prompt_rows_back(engines):
    """A second cache on the device: the first's rows that only the device held are read back into its CPU copy
    first (they equal the CPU-only run's), and the first cache goes on from there (its rows uploaded again)."""
    cpu, dev = engines
    m, cm, dl = dev.model, cpu.model, dev.model.device_layers
    a, ca = m.new_cache(64, 64), cm.new_cache(64, 64)
    m.forward(IDS[:6], a)
    cm.forward(IDS[:6], ca)
    assert (dl._lo, dl._hi) == (0, 6)
    b = m.new_cache(64, 64)
    m.forward(IDS[6:9], b)                        # b takes the device: a's rows come back first
    for il in dl.layers:
        assert rel_err(a.layers[il].k[:, :6], ca.layers[il].k[:, :6]) < 1e-5
        assert rel_err(a.layers[il].v[:, :6], ca.layers[il].v[:, :6]) < 1e-5
    got = np.array([m.forward([t], a)[-1] for t in IDS[6:9]])
    ref = np.array([cm.forward([t], ca)[-1] for t in IDS[6:9]])
    assert rel_err(got, ref) < 1e-5, rel_err(got, ref)


def test_a_paged_slot_keeps_the_rows_only_the_device_held(engines):
    """``coli serve --kv-unified`` (paged cells) with device layers: a second turn reuses its slot's 11 rows
    (the first turn's prompt rows held by the device only) and gives back its blocks past them, and its logits
    are a fresh CPU-only run's (within 1e-5 of the largest)."""
    from coli import slots
    from coli.sampling import Sampler

    class Rec(Sampler):     # keeps each row of logits the sequence samples from
        def sample(self, lg):
            self.rows.append(np.array(lg))
            return super().sample(lg)

    def seq(ids, n):
        s = Rec(temp=0.0, ctx=dev.ctx)
        s.rows = []
        return slots.Sequence(dev, ids, n, s, stop_at_eos=False)

    cpu, dev = engines
    dl = dev.model.device_layers
    b = slots.Batcher(dev, 1, unified=True)
    p0 = dl.prompt_tokens
    r1 = b.run([seq(IDS[:10], 2)])[0]
    assert b.pool.held() == 1 and dl.prompt_tokens - p0 == 10 and dl._hi > dl._lo   # device-only rows
    turn2 = IDS[:10] + r1.ids + IDS[::-1]
    s2 = seq(turn2, 3)
    r2 = b.run([s2])[0]
    assert r2.stats["cached_tokens"] == 11 and b.pool.held() == b.pool.blocks_for(len(b.slots[0].ids))
    b.pool.check()
    c = cpu.model.new_cache(64, 64)
    ref = [cpu.model.forward(turn2, c)[-1]] + [cpu.model.forward([t], c)[-1] for t in r2.ids[:-1]]
    assert rel_err(np.array(s2.sampler.rows), np.array(ref)) < 1e-5, rel_err(np.array(s2.sampler.rows), np.array(ref))


def test_perplexity_and_the_placement_are_reported(device_moe):
    """Perplexity with every layer on the device equals the CPU-only f32 run's (within 0.1 %, here far closer) with
    every scored row on the device; a generate's run line and coli bench's records say how many rows the device ran
    (``prompt rows on the device: N of M``, ``device_rows`` / ``cpu_rows``)."""
    from coli.bench import run_bench

    cpu, dev = device_engine(device_moe), device_engine(device_moe, COLI_VK_LAYERS=-1)
    try:
        dl = dev.model.device_layers
        ids = [1] + IDS * 2
        p0 = dl.prompt_tokens
        a, b = dev.perplexity(ids, all_tokens=True), cpu.perplexity(ids, all_tokens=True)
        assert dl.prompt_tokens - p0 == len(ids)
        assert abs(a.ppl / b.ppl - 1) < 1e-3, (a.ppl, b.ppl)
        assert abs(a.nll - b.nll) < 1e-5
        r = dev.generate(ids=IDS[:5], max_tokens=3, temp=0.0, stop_at_eos=False)
        assert r.stats["device_prompt_rows"] == 5 and r.stats["device_decode_rows"] == 2
        assert "prompt rows on the device: 5 of 5" in dev.stats_line(r.stats)
        assert "prompt rows on the device" not in cpu.stats_line(cpu.generate(ids=IDS[:5], max_tokens=2).stats)
        recs = run_bench(dev, n_prompt=6, n_gen=2, reps=1, warmup=False)
        assert [(x["test"], x["device_rows"], x["cpu_rows"]) for x in recs] == [("pp6", 6, 0), ("tg2", 2, 0)]
        recs = run_bench(cpu, n_prompt=6, n_gen=0, reps=1, warmup=False)
        assert (recs[0]["device_rows"], recs[0]["cpu_rows"]) == (0, 6)
    finally:
        cpu.close()
        dev.close()


def test_plan_counts_budget_and_request(engines, device_moe):
    from coli.vulkan import layer_plan

    cpu, _ = engines
    m = cpu.model
    per, fixed = layer_plan.layer_bytes(m, 3, 64), layer_plan.fixed_bytes(m, 64)
    assert fixed >= m.t["output.weight"].nbytes
    assert layer_plan.plan(m, fixed + 10 * per, 64) == (0, "every layer")
    first, why = layer_plan.plan(m, fixed + int(2.5 * per), 64)
    assert first == 2 and "budget" in why
    first, why = layer_plan.plan(m, fixed + 10 * per, 64, want=1)
    assert first == 3 and "COLI_VK_LAYERS" in why
    assert layer_plan.why_not(m, 0) is None
    # the prompt attention's key-split scratch as COLI_VK_PROMPT_ATTN_SPLIT asks: 16 parts of 512 rows, 8,192 rows
    # of parts (the rule's at most 2,048 were counted whatever the setting)
    a, split = m.args, {"COLI_VK_PROMPT_ATTN_SPLIT": "16"}
    assert (layer_plan.prompt_bytes(m, 512, split) - layer_plan.prompt_bytes(m, 512, {})
            == 4 * (512 * 16 - 2048) * a.n_heads * (a.head_dim + 2))
    assert layer_plan.fixed_bytes(m, 64, 512, split) > layer_plan.fixed_bytes(m, 64, 512, {})


def test_a_cache_smaller_than_the_context(device_moe):
    """The engine's own generate makes a cache of the prompt + tokens, smaller than its context: the prompt's K/V
    rows go to the device at its stride (a fresh engine: no rows left from an earlier run)."""
    cpu, dev = device_engine(device_moe), device_engine(device_moe, COLI_VK_LAYERS=2)
    try:
        m, cm = dev.model, cpu.model
        c, cc = m.new_cache(12, 64), cm.new_cache(12, 64)
        got = [m.forward(IDS[:6], c)[-1]] + [m.forward([x], c)[-1] for x in IDS[6:12]]
        ref = [cm.forward(IDS[:6], cc)[-1]] + [cm.forward([x], cc)[-1] for x in IDS[6:12]]
        assert m.device_layers.tokens == 6
        assert rel_err(np.array(got), np.array(ref)) < 1e-4
        r_dev = dev.generate(ids=IDS[:5], max_tokens=6, temp=0.0, stop_at_eos=False)
        r_cpu = cpu.generate(ids=IDS[:5], max_tokens=6, temp=0.0, stop_at_eos=False)
        assert list(r_dev.ids) == list(r_cpu.ids)
    finally:
        cpu.close()
        dev.close()


def test_routing_history_counts_the_device_layers(engines):
    """The device's routes are read back into the routing history (the tier's warm start ranks by it)."""
    _, dev = engines
    u = dev.model.step.usage
    before = u.counts.copy()
    decode_rows(dev, IDS[:6], 3)
    grew = u.counts.sum(axis=1) - before.sum(axis=1)
    k = dev.model.device_layers.k
    assert (grew == 6 * k).all(), grew        # 3 prompt rows on the CPU + 3 decode rows on the device, every layer


def test_construction_failure_falls_back(device_moe, monkeypatch):
    """A device layer set that fails to load (out of device memory) leaves nothing behind and the tier runs."""
    from coli.vulkan import VulkanError
    from coli.vulkan import device_layers

    calls = []
    real = device_layers.DeviceLayers._upload_layer

    def fail_late(self, il, ctx):
        calls.append(il)
        if len(calls) == 2:
            raise VulkanError("vkAllocateMemory: out of device memory (simulated)")
        return real(self, il, ctx)

    monkeypatch.setattr(device_layers.DeviceLayers, "_upload_layer", fail_late)
    # copied experts: the allocator then holds every byte the tier's handles count (zero-copy, Lavapipe's default,
    # maps them from the RAM cache instead)
    monkeypatch.setenv("COLI_VK_ZERO_COPY", "off")
    e = device_engine(device_moe, COLI_VK_LAYERS=2)
    try:
        assert e.device_layers is None and e.model.device_layers is None and e.tier is not None
        assert e.device._alloc.used_bytes == sum(h.nbytes for h in e.device._handles.values()) > 0
        assert getattr(e.device, "_layer_kernels", None) is None
    finally:
        e.close()


@pytest.mark.parametrize("family,why", [
    ("mimo2", ""), ("mimo2_groups", ""),
    ("glmdsa", ""), ("deepseek3", ""),
    ("deepseek4", ""),
    ("rope_linear", ""), ("mixtral", "")])
def test_layers_qualify_by_what_they_need(family, why):
    """``why_not`` asks what kernels a layer needs, not its class: each layer's reason (runs of layers with one
    reason together), none for the dense llama and the MoE layers; a sliding window and q/k/v of different formats
    no longer refuse a layer, a q/k norm or an FFN activation without a kernel does."""
    from tests.conftest import FIXTURES
    from coli.engine import Engine
    from coli.vulkan import layer_plan

    e = Engine(FIXTURES / "oracles" / f"{family}.gguf", quiet=True, silent=True, save_usage=False, ctx=32)
    try:
        m = e.model
        assert layer_plan.why_not_all(m) == why
        assert layer_plan.plan(m, 1 << 40, 32)[0] == (len(m.layers) if why else 0)
        L = m.layers[0]
        if why or family in ("glmdsa", "deepseek3", "deepseek4"):    # MLA, V4: no window nor q/k norm to vary
            return
        L.attn.window = 4
        assert layer_plan.why_not(m, 0) is None
        L.attn.qk_norm = "rows"
        assert layer_plan.why_not(m, 0) == "q/k norm 'rows' (no device kernel)"
        L.attn.qk_norm = None
        if L.mlp is not None:
            L.mlp.act = "relu2"
            assert layer_plan.why_not(m, 0) == "the FFN activation 'relu2' (no device kernel)"
    finally:
        e.close()


def test_no_layer_says_why_per_layer(capfd, monkeypatch):
    """``--gpu-layers`` on a file none of whose layers qualifies: one line giving each layer's reason (runs of layers
    with one reason together), the expert tier instead. The deepseek4 oracle's layers, with the device's formats
    narrowed to Q8_0 (its F32 and MXFP4 matrices then have no kernel)."""
    from tests.conftest import FIXTURES
    from coli.base import settings
    from coli.engine import Engine
    from coli.vulkan import layer_plan

    monkeypatch.setattr(layer_plan, "device_formats", lambda: ("Q8_0",))
    path = FIXTURES / "oracles" / "deepseek4.gguf"
    e = Engine(path, device="vulkan", env=settings.overlay(None, COLI_VK_LAYERS=-1), quiet=True, save_usage=False,
               ctx=32, usage=None)
    try:
        assert e.device_layers is None and e.tier is not None
    finally:
        e.close()
    err = capfd.readouterr().err
    assert ("[VK] deepseek4.gguf: no decoder layer on the device (layers 0-3: tensor formats F32, MXFP4 (no device "
            "kernel)); the expert tier instead") in err


@pytest.mark.parametrize("family", ["rope_linear", "rope_llama3", "rope_yarn", "rope_yarn_params"])
def test_dense_llama_against_hf(family):
    """A dense llama (SwiGLU FFN, rope scaled by linear / llama3 / yarn tables) with every layer and the head on the
    device: the prompt less 8 rows as one chunk, then 8 decode rows, each row's logits within the CPU path's bound of
    HF transformers' (1e-4 of the largest, tests/oracle_check.py) with HF's argmax; greedy tokens equal to the
    CPU-only run's at the default activations (int8 there, f32 on the device)."""
    from tests.conftest import FIXTURES
    from tests.oracle_check import rel
    from coli.engine import Engine

    path = FIXTURES / "oracles" / f"{family}.gguf"
    oracle = np.load(FIXTURES / "oracles" / f"{family}.npz")
    e = device_engine(path, COLI_VK_LAYERS=-1, ctx=len(oracle["ids"]))
    try:
        dl, m = e.model.device_layers, e.model
        assert dl is not None and dl.first == 0 and dl.head is not None and m.step is None
        ids, ref = oracle["ids"], oracle["logits"]
        n = len(ids) - 8
        d0 = e.device.layer_dispatches
        c = m.new_cache(len(ids), len(ids))
        got = [m.forward(ids[:n], c, all_logits=True)] + [m.forward([int(t)], c) for t in ids[n:]]
        got = np.concatenate(got)
        assert (dl.prompt_tokens, dl.prompt_chunks, dl.tokens) == (n, 1, 8)
        assert e.device.layer_dispatches - d0 >= 8 * 9          # every row's layer and head ran on the device
        r = rel(got, ref)
        assert (r <= 1e-4).all(), r.max()
        assert (got.argmax(1) == ref.argmax(1)).all()
    finally:
        e.close()
    dev = Engine(path, device="vulkan", env=settings.overlay(None, COLI_VK_LAYERS=-1), quiet=True, silent=True,
                 save_usage=False, ctx=64)
    cpu = Engine(path, quiet=True, silent=True, save_usage=False, ctx=64)
    try:
        assert dev.model.device_layers is not None and cpu.cpu_act == dev.cpu_act
        a = dev.generate(ids=ids[:12].tolist(), max_tokens=8, temp=0.0, stop_at_eos=False)
        b = cpu.generate(ids=ids[:12].tolist(), max_tokens=8, temp=0.0, stop_at_eos=False)
        assert a.stats["device_decode_rows"] == 7 and list(a.ids) == list(b.ids)
    finally:
        dev.close()
        cpu.close()


def test_gemma3_sandwich_window_and_two_ropes(model_path):
    """Gemma-3-270M (the real GGUF: q/k Q5_0 with v Q8_0 as three matrices, per-head q/k norms, post-attention and
    post-FFN norms, GeGLU, the local layers' rope base 10000 beside the global layers' 1e6, the embedding scale on
    the CPU) with every layer on the device, its sliding window shortened to 5 positions so that a short prompt
    crosses it, in prompt chunks of 7 rows: every row's logits and 2 decode rows' equal the CPU-only f32 run's within
    1e-5 of the largest (the window changes them by far more); with the last 6 layers on the device, greedy tokens at
    the default activations (int8 on the CPU, f32 on the device) equal the CPU-only run's."""
    from coli.engine import Engine
    from coli.vulkan import device_layers, layer_plan

    path = model_path("gemma3")
    W = 5

    def run(e, ids, n_dec):
        m = e.model
        c = m.new_cache(32, 32)
        lg = [m.forward(ids, c, all_logits=True)]
        for t in range(n_dec):
            lg.append(m.forward([int(lg[-1][-1].argmax())], c))
        return np.concatenate(lg)

    e = Engine(path, cpu_act="f32", quiet=True, silent=True, save_usage=False, ctx=32)
    dev = None
    try:
        m = e.model
        atts = [L.attn for L in m.layers]
        assert {a.window for a in atts} == {512, 0} and len({a.rope_base for a in atts}) == 2
        windows = [W if a.window else 0 for a in atts]
        for a, w in zip(atts, windows):
            a.window = 0
        ids = e.tokenize("The capital of France is Paris, and the capital of Germany is")
        assert len(ids) > 2 * W
        full = run(e, ids, 0)
        for a, w in zip(atts, windows):
            a.window = w
        ref = run(e, ids, 2)
        assert rel_err(full, ref[:len(ids)]) > 1e-2        # the window matters here
        assert layer_plan.why_not_all(m) == ""
        dev = open_test_device()
        dl = device_layers.DeviceLayers(m, dev, 0, 32, head=False)   # the head (262144 rows) on the CPU: seconds
        dl.prompt_rows = 7
        m.device_layers = dl
        d0 = dev.layer_dispatches
        got = run(e, ids, 2)
        assert (dl.prompt_chunks, dl.prompt_tokens, dl.tokens) == (-(-len(ids) // 7), len(ids), 2)
        assert dev.layer_dispatches - d0 >= 18 * 10 * (dl.prompt_chunks + 2)
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
    finally:
        e.model.device_layers = None
        if dev is not None:
            dl.close()
        e.close()
    # the default activations (int8 on the CPU, f32 on the device), the file's window: the CPU-only run's tokens
    e = Engine(path, quiet=True, silent=True, save_usage=False, ctx=32)
    try:
        assert e.cpu_act == "int8"
        ids = e.tokenize("The capital of France is")
        ref = e.generate(ids=ids, max_tokens=4, temp=0.0, stop_at_eos=False)
        dl = device_layers.DeviceLayers(e.model, dev, 12, 32, head=False)   # layers 0-11 on the CPU (int8)
        e.model.device_layers = dl
        got = e.generate(ids=ids, max_tokens=4, temp=0.0, stop_at_eos=False)
        assert dl.tokens == 3 and dl.prompt_tokens == len(ids)
        assert list(got.ids) == list(ref.ids)
    finally:
        e.model.device_layers = None
        if dev is not None:
            dl.close()
            dev.close()
        e.close()


def test_device_failure_hands_layers_back(device_moe, monkeypatch):
    """A device that fails mid-run: one line, the layers back on the CPU, the logits still the CPU's."""

    cpu, dev = device_engine(device_moe), device_engine(device_moe, COLI_VK_LAYERS=1)
    try:
        ref, _ = decode_rows(cpu, IDS[:7], 4)
        dl = dev.model.device_layers
        calls = lose_device_on_call(monkeypatch, dl.K, "submit", 1, after=True)
        got, _ = decode_rows(dev, IDS[:7], 4)
        assert len(calls) == 1 and dev.model.device_layers is None
        assert np.array_equal(got, ref)          # every layer of every row on the CPU: its bits
    finally:
        cpu.close()
        dev.close()


def test_device_failure_after_a_device_prompt(device_moe, monkeypatch):
    """The device fails at a decode row after it ran the prompt and a decode row (whose K/V rows only it held): those
    rows are computed again on the CPU from the kept input rows, and the logits and greedy tokens stay the CPU's."""

    cpu, dev = device_engine(device_moe), device_engine(device_moe, COLI_VK_LAYERS=2)
    try:
        ref, _ = decode_rows(cpu, IDS[:9], 5)
        m, dl = dev.model, dev.model.device_layers
        c = m.new_cache(64, 64)
        got = [m.forward(IDS[:5], c)[-1], m.forward([IDS[5]], c)[-1]]
        assert dl.prompt_tokens == 5 and dl.tokens == 1 and (dl._lo, dl._hi) == (0, 6)
        lose_device_on_call(monkeypatch, dl.K, "submit", 1, after=True)
        got += [m.forward([t], c)[-1] for t in IDS[6:9]]
        assert m.device_layers is None
        got = np.array(got)
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
        assert (got.argmax(1) == ref.argmax(1)).all()
    finally:
        cpu.close()
        dev.close()


@pytest.mark.parametrize("layers", [2, -1])
def test_device_failure_after_a_rewind(device_moe, monkeypatch, layers):
    """Rows only the device holds, a forward from position 3 over them (the engine's kept prefix), then a failed
    device: the CPU computes the device's rows again from the kept input rows, the rewound forward's in place of
    the old ones from position 3 (the last layers: copies of their input rows; every layer: the embedding rows
    themselves), and the logits stay the CPU-only run's."""
    other = [7, 8, 9, 10, 11, 12]
    cpu, dev = device_engine(device_moe), device_engine(device_moe, COLI_VK_LAYERS=layers)
    try:
        cm = cpu.model
        cc = cm.new_cache(64, 64)
        cm.forward(IDS[:3], cc)
        ref = [cm.forward(other[:2], cc)[-1]] + [cm.forward([t], cc)[-1] for t in other[2:]]
        m, dl = dev.model, dev.model.device_layers
        c = m.new_cache(64, 64)
        m.forward(IDS[:5], c)
        m.forward([IDS[5]], c)
        c.pos = 3
        got = [m.forward(other[:2], c)[-1], m.forward([other[2]], c)[-1]]
        assert (dl._lo, dl._hi) == (0, 6) and [(p, len(a)) for p, a in dl._hist] == [(0, 3), (3, 2), (5, 1)]
        lose_device_on_call(monkeypatch, dl.K, "submit", 1, after=True)
        got += [m.forward([t], c)[-1] for t in other[3:]]
        assert m.device_layers is None
        assert rel_err(np.array(got), np.array(ref)) < 1e-5, rel_err(np.array(got), np.array(ref))
    finally:
        cpu.close()
        dev.close()


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "qwen3moe", "qwen2moe"])
def test_families_against_hf(family):
    """Every layer and the head on the device (q/k norms per head for Qwen3-MoE, over the projection for OLMoE,
    NEOX rope there, NORM for Mixtral; Qwen2-MoE's q/k/v biases and sigmoid-gated shared expert): each decode row's logits against HF transformers' (tests/fixtures/oracles,
    docs/oracles.md) within the families' bound, the argmax equal."""
    from tests.conftest import FIXTURES
    from tests.oracle_check import rel

    path = FIXTURES / "oracles" / f"{family}.gguf"
    oracle = np.load(FIXTURES / "oracles" / f"{family}.npz")
    e = device_engine(path, COLI_VK_LAYERS=-1)
    try:
        dl = e.model.device_layers
        assert dl is not None and dl.first == 0 and dl.head is not None
        ids = oracle["ids"]
        cache = e.model.new_cache(len(ids), len(ids))
        got = [e.model.forward(ids[:1], cache)[-1]] + [e.model.forward([int(t)], cache)[-1] for t in ids[1:]]
        got = np.array(got)
        assert dl.tokens == len(ids)          # a one-row prompt is a decode row too
        r = rel(got, oracle["logits"])
        assert (r <= 1e-4).all(), r.max()
        assert (got.argmax(1) == oracle["logits"].argmax(1)).all()
    finally:
        e.close()


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "qwen3moe", "qwen2moe"])
def test_families_prompt_against_the_cpu(family):
    """The oracle prompt as one chunk through every layer and the head on the device: every row's logits equal the
    CPU-only f32 run's within 1e-5 of the largest logit (and HF transformers' within the families' bound)."""
    from tests.conftest import FIXTURES
    from tests.oracle_check import rel

    path = FIXTURES / "oracles" / f"{family}.gguf"
    oracle = np.load(FIXTURES / "oracles" / f"{family}.npz")
    e, cpu = device_engine(path, COLI_VK_LAYERS=-1), device_engine(path)
    try:
        dl = e.model.device_layers
        ids = oracle["ids"]
        d0 = e.device.layer_dispatches
        got = e.logits(ids)
        assert dl.prompt_tokens == len(ids) and dl.prompt_chunks == 1 and dl.tokens == 0
        assert e.device.layer_dispatches - d0 >= 12 * len(e.model.layers)
        ref = cpu.logits(ids)
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
        assert (rel(got, oracle["logits"]) <= 1e-4).all()
    finally:
        e.close()
        cpu.close()


@pytest.fixture
def one_queue_holder(monkeypatch):
    """The clock holder forced onto the device's one queue (Lavapipe has no second): each heat then runs to its
    cap (500 rounds here) before the next submit's work, and the concurrency probe is passed over."""
    from coli.vulkan import layers

    monkeypatch.setattr(layers, "HEAT_ROUNDS", 500)
    monkeypatch.setattr(layers, "clock_queue", lambda dev, env: dev._queue)
    monkeypatch.setattr(layers.ClockHolder, "concurrent", lambda self: True)


def test_clock_holder(device_moe, one_queue_holder):
    """The clock holder (shaders/heat.comp, docs/vulkan.md "Clocks"): the kernel stops when the flag reaches the
    token number or after its rounds; in a run it is started after every decode token, each token's first op
    copies the token number into the flag, and the logits stay the CPU's."""
    from coli.vulkan.layers import Dispatch

    cpu, dev = device_engine(device_moe), device_engine(device_moe, COLI_VK_LAYERS=2)
    try:
        dl = dev.model.device_layers
        assert dl.clock is not None
        ref, _ = decode_rows(cpu, IDS[:8], 4)
        got, _ = decode_rows(dev, IDS[:8], 4)
        assert rel_err(got, ref) < 1e-4
        c = dl.clock
        assert (c.runs, c.skips, c.tick) == (5, 0, 5)     # after the prompt chunk and each decode token
        assert int(c.words.u32(4)[0]) == c.tick - 1      # the 4th token's stop op copied the 4th heat's number
        # the kernel alone: (flag, want) -> (rounds, seen) with a cap of 300 rounds
        K = dl.K
        K_buf = K.buffer(16, host=True)
        for flag, want, rounds, seen in ((7, 7, 0, 1), (9, 3, 0, 1), (2, 3, 300, 0)):
            K_buf.u32(4)[:] = [flag, want, 99, 99]
            a = K_buf.addr
            rec = K.record([Dispatch("heat", (1,), [a, a + 4, a + 8], [300], wait=False)])
            try:
                K.submit(rec)
            finally:
                K.free(rec)
            assert list(K_buf.u32(4)[2:]) == [rounds, seen]
    finally:
        cpu.close()
        dev.close()


def test_the_probe_refuses_queues_that_run_in_turn(device_moe, monkeypatch):
    """``ClockHolder.concurrent``: on one queue the probe's stop op runs only after the heat's cap, so the heat ends
    unseen and ``for_device`` gives no holder (and frees what it made)."""
    from coli.vulkan import layers

    monkeypatch.setattr(layers, "HEAT_ROUNDS", 2000)
    monkeypatch.setattr(layers, "clock_queue", lambda dev, env: dev._queue)
    dev = device_engine(device_moe, COLI_VK_LAYERS=2)
    try:
        made = []
        monkeypatch.setattr(layers.ClockHolder, "close", lambda self, f=layers.ClockHolder.close: (made.append(self),
                                                                                                      f(self))[1])
        assert layers.ClockHolder.for_device(dev.device, dev.model.device_layers.K) is None
        (h,) = made
        assert h.rec is None and list(map(int, h.words.u32(4)[2:])) == [2000, 0]
    finally:
        dev.close()


def test_tier_clock_holder(device_moe, one_queue_holder):
    """The expert tier starts the clock holder at each decode token (forced onto the one queue here); the logits
    stay the CPU's and its close stops it."""
    from coli.engine import Engine

    cpu = device_engine(device_moe)
    dev = Engine(device_moe, cpu_act="f32", device="vulkan", balance=False, quiet=True, silent=True, save_usage=False,
                 ctx=64, usage=str(device_moe) + ".usage")
    try:
        assert dev.tier is not None and dev.model.device_layers is None
        ref, _ = decode_rows(cpu, IDS[:8], 4)
        got, _ = decode_rows(dev, IDS[:8], 4)
        assert rel_err(got, ref) < 1e-4
        c = dev.tier._clock
        assert c and c.runs + c.skips == 4 and c.runs >= 1
    finally:
        cpu.close()
        dev.close()
    assert c.rec is None


@pytest.mark.parametrize("chunk", [256, 24])
def test_gptoss_against_hf(chunk):
    """gpt-oss with every layer and the head on the device: attention sinks (one logit a head in the softmax's
    denominator), the sliding window of its even layers (16 positions, crossed by the 88-row prompt), YaRN rope
    without truncation, q/k/v/o biases, the router's bias and its top-k softmax, the experts' biases and clamped
    SwiGLU on MXFP4 experts: the prompt as one chunk, every row within the CPU path's bound of HF transformers'
    (1e-4 of the largest), then 8 greedy decode rows against HF's logits and tokens (tests/oracle_check.py). With
    ``COLI_VK_ATTN_CHUNK`` 24 the decode attention is split in parts of at most 24 keys (the window's start inside a
    part, the sinks in the join of a head's last part); with 256, on a GPU, in the even parts of a short context."""
    from tests.conftest import FIXTURES
    from tests.oracle_check import check_prompt_and_decode
    from coli.engine import Engine

    path = FIXTURES / "oracles" / "gptoss.gguf"
    oracle = np.load(FIXTURES / "oracles" / "gptoss.npz")
    e = Engine(path, cpu_act="f32", device="vulkan", quiet=True, silent=True, save_usage=False, ctx=128,
               usage=str(path) + ".usage", env=settings.overlay(None, COLI_VK_LAYERS=-1, COLI_VK_ATTN_CHUNK=chunk))
    try:
        m, dl = e.model, e.model.device_layers
        # even parts (attn_dec.comp's u11) where the context outgrows a part, or at any context on a GPU
        assert max(dl.attn_np, 1) >= -(-128 // chunk) and (dl.attn_np > 1) == (chunk < 128 or dl.K.attn_wgs > 0)
        assert dl is not None and dl.first == 0 and dl.head is not None and dl.topk_flags == 2
        assert [d["window"] for d in dl.per] == [16, 0, 16] and all("sinks" in d and "ebias" in d for d in dl.per)
        d0 = e.device.layer_dispatches
        check_prompt_and_decode(m, m.new_cache(128, 128), oracle)
        assert (dl.prompt_tokens, dl.prompt_chunks, dl.tokens) == (len(oracle["ids"]), 1, 8)
        assert e.device.layer_dispatches - d0 >= 9 * 14
    finally:
        e.close()


def test_gptoss_cpu_window_layer_beside_device_layers():
    """gpt-oss with layers 1 and 2 on the device and layer 0 (a 16-position window) on the CPU, whose cache gives
    back the rows before the window (``blocks.KV.slide``) while the device holds its layers' whole context: every
    prompt row and 8 greedy decode rows within 1e-4 of HF's (tests/oracle_check.py), the CPU layer's cache holding
    rows 73 .. only (``window_start(88, 16)``), the device's dispatches counted."""
    from tests.conftest import FIXTURES
    from tests.oracle_check import check_prompt_and_decode
    from coli.models.blocks import window_start

    path = FIXTURES / "oracles" / "gptoss.gguf"
    oracle = np.load(FIXTURES / "oracles" / "gptoss.npz")
    e = device_engine(path, COLI_VK_LAYERS=2, ctx=128)
    try:
        m, dl = e.model, e.model.device_layers
        assert dl is not None and dl.first == 1 and [d["window"] for d in dl.per] == [0, 16]
        d0 = e.device.layer_dispatches
        kv = m.new_cache(128, 128)
        check_prompt_and_decode(m, kv, oracle)
        assert [il for il, _ in kv.windowed] == [0, 2] and kv.layers[0].lo == window_start(88, 16) == 73
        assert kv.layers[2].lo == 0 and dl.tokens == 8 and e.device.layer_dispatches > d0
    finally:
        e.close()


@pytest.mark.parametrize("chunk", [256, 24])
def test_mimo2_against_hf(chunk):
    """MiMo-V2-Flash with every layer and the head on the device: KV heads a layer (1 on the full layers, 2 on the
    sliding ones), V heads 16 wide beside K's 24 (rope_kv.comp / attn_dec.comp / attn_pre.comp's hdv), V times
    the value scale 0.707 before it is cached, sinks and a 16-position window on the sliding layers (crossed by the
    88-row prompt), partial NEOX rope with a base a layer kind, a dense first layer before the MoE layers with the
    sigmoid router and its correction bias: the prompt in chunks of 40 rows, every row within the CPU path's bound
    of HF transformers' (1e-4 of the largest) with HF's argmax, 8 greedy decode rows against HF's logits and tokens
    (tests/oracle_check.py); the CPU-only f32 run's logits within 1e-5 and its greedy tokens; the K/V rows the device
    wrote back equal the CPU's within 1e-5. ``COLI_VK_ATTN_CHUNK`` 24: the decode attention in parts of at
    most 24 keys (a head's last part joins V's 16-wide parts)."""
    from tests.conftest import FIXTURES
    from tests.oracle_check import check_prompt_and_decode
    from coli.engine import Engine

    path = FIXTURES / "oracles" / "mimo2.gguf"
    oracle = np.load(FIXTURES / "oracles" / "mimo2.npz")
    cpu = device_engine(path, ctx=128)
    e = device_engine(path, COLI_VK_LAYERS=-1, COLI_VK_ATTN_CHUNK=chunk, ctx=128)
    try:
        m, dl = e.model, e.model.device_layers
        assert dl is not None and dl.first == 0 and dl.head is not None
        assert max(dl.attn_np, 1) >= -(-128 // chunk) and (dl.attn_np > 1) == (chunk < 128 or dl.K.attn_wgs > 0)
        assert [(d["nkv"], d["hdv"], d["window"], "sinks" in d, "tab" in d) for d in dl.per] == [
            (1, 16, 0, False, False), (2, 16, 16, True, True), (2, 16, 16, True, True), (1, 16, 0, False, True)]
        assert all(abs(d["vscale"] - 0.707) < 1e-6 for d in dl.per) and dl.topk_flags == 1 | 4 | 8
        dl.prompt_rows = 40
        d0 = e.device.layer_dispatches
        c = m.new_cache(128, 128)
        got = check_prompt_and_decode(m, c, oracle)
        assert (dl.prompt_tokens, dl.prompt_chunks, dl.tokens) == (len(oracle["ids"]), 3, 8)
        assert e.device.layer_dispatches - d0 >= 8 * 4 * 8
        ref = greedy_rows(cpu.model, cpu.model.new_cache(128, 128), oracle["ids"], 8)
        rc = cpu.model.new_cache(128, 128)
        cpu.model.forward(oracle["ids"], rc)
        dl.host_kv(c)      # the prompt chunks' K/V rows, held by the device only, into the CPU's cache
        n = len(oracle["ids"])
        for il in range(4):
            for x in ("k", "v"):
                a, b = getattr(c.layers[il], x)[:, :n], getattr(rc.layers[il], x)[:, :n]
                assert a.shape == b.shape and rel_err(a, b) < 1e-5, (il, x)
        check_greedy_like_cpu(m, ref, oracle["ids"], got, 1e-5, 1e-5)
    finally:
        e.close()
        cpu.close()
    dev = Engine(path, device="vulkan", env=settings.overlay(None, COLI_VK_LAYERS=-1), quiet=True, silent=True,
                 save_usage=False, ctx=64)
    cpu = Engine(path, quiet=True, silent=True, save_usage=False, ctx=64)
    try:      # at the default activations (the CPU's int8, the device's f32): the same greedy tokens
        assert dev.model.device_layers is not None and cpu.cpu_act == dev.cpu_act
        ids = oracle["ids"][:12].tolist()
        a = dev.generate(ids=ids, max_tokens=8, temp=0.0, stop_at_eos=False)
        b = cpu.generate(ids=ids, max_tokens=8, temp=0.0, stop_at_eos=False)
        assert a.stats["device_decode_rows"] == 7 and list(a.ids) == list(b.ids)
    finally:
        dev.close()
        cpu.close()


def _ffn_as(src, dest, ftype: str):
    """A copy of the GGUF ``src`` at ``dest`` with its FFN matrices (dense, experts; not the router) as ``ftype``
    (F16 or BF16, through gguf.quants)."""
    import gguf
    from gguf.quants import quantize
    from tests.oracle_check import copy_gguf

    qt = gguf.GGMLQuantizationType[ftype]

    def convert(t):
        a = np.asarray(t.data)
        if t.name.startswith("blk.") and ".ffn_" in t.name and "_norm" not in t.name and "gate_inp" not in t.name \
                and "exp_probs" not in t.name:
            return quantize(np.asarray(a, np.float32), qt), qt
        return a, t.tensor_type

    return copy_gguf(src, dest, convert=convert)


@pytest.mark.parametrize("ftype", ["F32", "F16", "BF16"])
def test_float_ffn_of_any_width(ftype, tmp_path):
    """F32/F16/BF16 FFNs whose hidden width is not a multiple of 32 (the MiMo-V2 oracle with expert groups: experts 16
    wide, ffn_down_exps 16 columns; its FFN matrices as stored, or written as F16 / BF16) run on the device at the
    padded width (gate and up with 16 zero rows, down with 16 zero columns): every layer and the head on the device,
    the prompt in chunks of 40 rows; F32: within 1e-4 of HF transformers' with HF's argmax and HF's 8 greedy decode
    steps; each: the CPU-only f32 run's logits within 1e-5 and its greedy tokens; the plan counts the padded
    bytes."""
    from tests.conftest import FIXTURES
    from tests.oracle_check import check_prompt_and_decode
    from coli.vulkan import layer_plan

    path = FIXTURES / "oracles" / "mimo2_groups.gguf"
    if ftype != "F32":
        path = _ffn_as(path, tmp_path / f"{ftype}.gguf", ftype)
    oracle = np.load(FIXTURES / "oracles" / "mimo2_groups.npz")
    cpu = device_engine(path, ctx=128)
    e = device_engine(path, COLI_VK_LAYERS=-1, ctx=128)
    try:
        m, dl = e.model, e.model.device_layers
        t = m.t["blk.1.ffn_down_exps.weight"]
        assert t.type_name == ftype and int(t.shape[-1]) == 16 and dl is not None and dl.first == 0 and dl.F == 32
        size = {"F32": 4, "F16": 2, "BF16": 2}[ftype]
        assert layer_plan.expert_bytes(m, 1) == 3 * 32 * 32 * size   # gate, up [32, D 32] and down [D, 32] as placed
        dl.prompt_rows = 40
        d0 = e.device.layer_dispatches
        if ftype == "F32":
            got = check_prompt_and_decode(m, m.new_cache(128, 128), oracle)
        else:
            got = m.forward(oracle["ids"], m.new_cache(128, 128), all_logits=True)
        assert dl.prompt_tokens == len(oracle["ids"]) and dl.prompt_chunks == 3
        assert e.device.layer_dispatches - d0 >= 3 * 4 * 8
        ref = greedy_rows(cpu.model, cpu.model.new_cache(128, 128), oracle["ids"], 8)
        check_greedy_like_cpu(m, ref, oracle["ids"], got, 1e-5, 1e-5)
        assert dl.tokens >= 8
    finally:
        e.close()
        cpu.close()


@pytest.mark.parametrize("arch,ftype", [("llama", "F16"), ("qwen3next", "F32")])
def test_float_rows_of_any_width(arch, ftype, tmp_path):
    """Models 50 wide as F16 / F32 (every matrix's rows 50 or 40 inputs: not a multiple of 32, nor of 4, so the prompt
    GEMM reads them one float at a time): a llama-style MoE (5 heads of 10, experts 40 wide) and Qwen3-Next's hybrid
    (3 Gated DeltaNet layers and a gated attention layer, a shared expert) go to the device, every layer and the head
    (they stayed on the CPU: "tensor 'blk.0.attn_q.weight' has 50 columns"): the prompt in chunks of 12 rows and 8
    greedy decode rows give the CPU-only f32 run's logits within 1e-5 and its tokens; the plan counts the rows padded
    to 64 inputs."""
    from tests.tiny_moe import build_tiny_moe
    from coli.vulkan import layer_plan

    shape = ["--heads", "5", "--head-dim", "10"] if arch == "llama" else \
        ["--layers", "4", "--heads", "2", "--head-dim", "32", "--shared-experts", "1", "--seed", "3"]
    path = build_tiny_moe(tmp_path, ["--arch", arch, "--layers", "2", "--d", "50", "--experts", "8", "--top-k", "2",
                                     "--expert-ff", "40", "--vocab", "300", "--type", ftype, "--expert-type", ftype,
                                     *shape], f"odd-{arch}.gguf")
    ids = np.random.default_rng(0).integers(1, 300, 30)
    cpu = device_engine(path, ctx=128)
    e = device_engine(path, COLI_VK_LAYERS=-1, ctx=128)
    try:
        m, dl = e.model, e.model.device_layers
        assert layer_plan.why_not_all(m) == "" and dl is not None and dl.first == 0 and dl.head is not None
        size = {"F32": 4, "F16": 2}[ftype]
        assert layer_plan._padded_bytes(m, "blk.0.ffn_gate_exps.weight") == 8 * 64 * 64 * size  # [E, F 40, d 50]
        # the routers as placed: f32 rows padded to 64 (the plan counted 8 x 50)
        assert [layer_plan.router_bytes(m, d["il"]) for d in dl.per if "router" in d] == \
            [d["router"].nbytes for d in dl.per if "router" in d] and 4 * 8 * 64 == dl.per[0]["router"].nbytes
        dl.prompt_rows = 12
        d0 = e.device.layer_dispatches
        ref = greedy_rows(cpu.model, cpu.model.new_cache(128, 128), ids, 8)
        got = m.forward(ids, m.new_cache(128, 128), all_logits=True)
        assert dl.prompt_tokens == len(ids) and dl.prompt_chunks == 3 and e.device.layer_dispatches > d0
        check_greedy_like_cpu(m, ref, ids, got, 1e-5, 1e-5)
        assert dl.tokens >= 8
    finally:
        e.close()
        cpu.close()


def test_deepseek_router_on_the_device():
    """The DeepSeek routing rule (``blocks.deepseek_route``: sigmoid scores, the correction bias for the choice, 4
    groups of 2 experts scored by their two best, the best 2 kept, renormalised weights times 1.5) on the Mixtral
    oracle's layers in place of its softmax top-k, every layer and the head on the device: the prompt (chunks of 5
    rows) and 4 decode rows give the CPU-only f32 run's logits within 1e-5 of the largest (the rule changes them by
    far more)."""
    from tests.conftest import FIXTURES
    from coli.models.blocks import deepseek_route
    from coli.vulkan import device_layers, layer_plan

    path = FIXTURES / "oracles" / "mixtral.gguf"
    ids = np.load(FIXTURES / "oracles" / "mixtral.npz")["ids"][:16]
    e = device_engine(path)
    dev = dl = None

    def run():
        c = e.model.new_cache(32, 32)
        lg = [e.model.forward(ids[:12], c, all_logits=True)]
        return np.concatenate(lg + [e.model.forward([int(t)], c) for t in ids[12:]])

    try:
        m = e.model
        base = run()
        rng = np.random.default_rng(3)
        for L in m.layers:
            bias = (rng.standard_normal(m.args.n_experts) * 0.3).astype(np.float32)
            L.moe.route = deepseek_route(2, gating="sigmoid", n_group=4, topk_group=2, group_score="top2sum",
                                         norm=True, scale=1.5, bias=bias)
        ref = run()
        assert rel_err(ref, base) > 1e-2
        assert layer_plan.why_not_all(m) == ""
        dev = open_test_device()
        dl = device_layers.DeviceLayers(m, dev, 0, 32)
        dl.prompt_rows = 5
        m.device_layers = dl
        got = run()
        assert (dl.prompt_chunks, dl.prompt_tokens, dl.tokens) == (3, 12, 4) and dl.topk_flags == 1 | 4 | 8
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
    finally:
        e.model.device_layers = None
        if dl is not None:
            dl.close()
        if dev is not None:
            dev.close()
        e.close()


def _padded_q_lora(out, name: str = "deepseek3", arch: str = "deepseek2"):
    """The DeepSeek-V3 oracle (or ``name``'s, of GGUF architecture ``arch``: GLM-5's) with q_lora_rank 20 rewritten by
    gguf's writer with q_lora_rank 32: attn_q_a's 12 new rows and attn_q_b's (and the DSA indexer's
    indexer.attn_q_b's) 12 new columns zero, attn_q_a_norm scaled by sqrt(20 / 32) so that the RMSNorm over 32 values
    gives the 20 values' result (up to eps): the same model for HF's logits, with widths the device's matrix kernels
    take (a multiple of 32)."""
    import gguf
    from tests.conftest import FIXTURES

    src = gguf.GGUFReader(str(FIXTURES / "oracles" / f"{name}.gguf"))
    w = gguf.GGUFWriter(str(out), arch)
    for k, f in src.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        v = 32 if k == f"{arch}.attention.q_lora_rank" else f.contents()
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, v, f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(k, v, f.types[0])
    for t in src.tensors:
        a = np.asarray(t.data, np.float32)
        if t.name.endswith("attn_q_a.weight"):          # [20, D] -> [32, D]
            a = np.concatenate([a, np.zeros((12, a.shape[1]), np.float32)])
        elif t.name.endswith("attn_q_a_norm.weight"):
            a = np.concatenate([a * np.float32(np.sqrt(20 / 32)), np.zeros(12, np.float32)])
        elif t.name.endswith("attn_q_b.weight"):        # [H (dn + dr), 20] -> [.., 32] (and the indexer's)
            a = np.concatenate([a, np.zeros((a.shape[0], 12), np.float32)], 1)
        w.add_tensor(t.name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("family", ["deepseek2_lite", "deepseek2_yarn", "deepseek3_q32"])
def test_mla_against_hf(family, tmp_path):
    """DeepSeek-V2/V3's MLA on the device (shaders/mla.comp: the kv_a latent normed into the device's latent cache
    with its rope key, q (or q_a, its norm, q_b) absorbed through attn_k_b, attention over the latent cache, attn_v_b,
    the output projection), with the DeepSeek router and the shared experts: every layer (layer 0's dense FFN beside
    the MoE layers') and the head on the device, the 96-row prompt in chunks of 40 rows (the first in the expanded
    form, the two after it absorbed: MLAMixer._mla_expand's count for r 24, dn 16, dr 8, dv 24), every row
    within the CPU path's bound of HF transformers' (1e-4 of the largest) with HF's argmax, 8 greedy decode rows
    against HF's logits and tokens (tests/oracle_check.py); the CPU-only run's logits within 1e-5 and its tokens.
    V2-Lite's shape (no q_lora), its YaRN rope, and DeepSeek-V3 (q_lora, sigmoid router with groups; its
    q_lora_rank padded from 20 to 32 with zeros, :func:`_padded_q_lora`, for the device's matrix widths)."""
    from tests.conftest import FIXTURES
    from tests.oracle_check import check_prompt_and_decode
    from coli.engine import Engine

    name = "deepseek3" if family == "deepseek3_q32" else family
    path = _padded_q_lora(tmp_path / "q32.gguf") if family == "deepseek3_q32" else FIXTURES / "oracles" / f"{name}.gguf"
    oracle = np.load(FIXTURES / "oracles" / f"{name}.npz")
    cpu = device_engine(path, ctx=128)
    e = device_engine(path, COLI_VK_LAYERS=-1, ctx=128)
    try:
        m, dl = e.model, e.model.device_layers
        dl.prompt_rows = 40
        assert dl is not None and dl.first == 0 and dl.head is not None and dl.mla is not None
        assert all("mla" in d for d in dl.per) and ["tab" in d for d in dl.per] == [False, True, True]
        assert (dl.mla[5] == 32) == (family == "deepseek3_q32")
        d0, u0 = e.device.layer_dispatches, m.step.usage.counts.copy()
        got = check_prompt_and_decode(m, m.new_cache(128, 128), oracle)
        assert (dl.prompt_tokens, dl.prompt_chunks, dl.tokens) == (len(oracle["ids"]), 3, 8)
        assert dl.mla_expanded == 1
        assert e.device.layer_dispatches - d0 >= 8 * 3 * 7
        grew = (m.step.usage.counts - u0).sum(1)     # the routes of the MoE layers only (layer 0 has none)
        assert grew.tolist() == [0] + [(len(oracle["ids"]) + 8) * m.args.top_k] * 2, grew
        ref = greedy_rows(cpu.model, cpu.model.new_cache(128, 128), oracle["ids"], 8)
        check_greedy_like_cpu(m, ref, oracle["ids"], got, 1e-5, 1e-5)
    finally:
        e.close()
        cpu.close()


@pytest.mark.parametrize("family", ["deepseek3", "glmdsa"])
def test_q_lora_of_any_width(family):
    """MLA's q_lora_rank of 20 (the DeepSeek-V3 and GLM-5 oracles as converted: F32 attn_q_b, and GLM-5's indexer
    q_b, 20 columns) on the device at 32: attn_q_a placed with 12 zero rows, its norm over the first 20 values of
    each row (rmsnorm.comp's row stride), q_b with 12 zero columns: every layer and the head on the device, the
    prompt in chunks of 40 rows within 1e-4 of HF transformers' with HF's argmax and HF's 8 greedy decode steps, the
    CPU-only f32 run's logits within 1e-5 and its greedy tokens."""
    from tests.conftest import FIXTURES
    from tests.oracle_check import check_prompt_and_decode

    path = FIXTURES / "oracles" / f"{family}.gguf"
    oracle = np.load(FIXTURES / "oracles" / f"{family}.npz")
    cpu = device_engine(path, ctx=128)
    e = device_engine(path, COLI_VK_LAYERS=-1, ctx=128)
    try:
        m, dl = e.model, e.model.device_layers
        assert int(m.t["blk.0.attn_q_b.weight"].shape[-1]) == 20 and dl is not None and dl.first == 0
        assert dl.mla[5] == 32 and all(d["ql"] == 20 for d in dl.per)
        dl.prompt_rows = 40
        d0 = e.device.layer_dispatches
        got = check_prompt_and_decode(m, m.new_cache(128, 128), oracle)
        assert (dl.prompt_tokens, dl.prompt_chunks, dl.tokens) == (len(oracle["ids"]), 3, 8)
        assert e.device.layer_dispatches - d0 >= 8 * len(m.layers) * 7
        ref = greedy_rows(cpu.model, cpu.model.new_cache(128, 128), oracle["ids"], 8)
        check_greedy_like_cpu(m, ref, oracle["ids"], got, 1e-5, 1e-5)
    finally:
        e.close()
        cpu.close()


def test_mla_latent_rows_move_both_ways():
    """The device's latent cache and the CPU's stay in step: rows the CPU wrote (a prompt with the device layers
    off) are uploaded before the next decode rows on the device (their logits within 1e-5 of the CPU-only run's);
    rows a device prompt chunk wrote come back on ``host_kv`` (the latent and the rope key within 1e-5 of the
    CPU's)."""
    from tests.conftest import FIXTURES

    path = FIXTURES / "oracles" / "deepseek2_lite.gguf"
    ids = np.load(FIXTURES / "oracles" / "deepseek2_lite.npz")["ids"][:44]
    cpu = device_engine(path, ctx=64)
    e = device_engine(path, COLI_VK_LAYERS=-1, ctx=64)
    try:
        m, dl = e.model, e.model.device_layers
        cc = cpu.model.new_cache(64, 64)
        ref = np.concatenate([cpu.model.forward(ids[:40], cc)] + [cpu.model.forward([int(t)], cc) for t in ids[40:]])
        c = m.new_cache(64, 64)
        m.device_layers = None          # the prompt on the CPU
        out = [m.forward(ids[:40], c)]
        m.device_layers = dl
        out += [m.forward([int(t)], c) for t in ids[40:]]
        assert dl.tokens == 4 and dl.prompt_tokens == 0
        assert rel_err(np.concatenate(out), ref) < 1e-5
        c2 = m.new_cache(64, 64)
        m.forward(ids, c2)
        assert dl.prompt_tokens == 44
        assert not c2.layers[2].lat[:44].any()      # the device's only, until asked for
        dl.host_kv(c2)
        for il in (1, 2):
            for part in ("lat", "kr"):
                a, b = getattr(c2.layers[il], part)[:44], getattr(cc.layers[il], part)[:44]
                assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), (il, part)
    finally:
        e.close()
        cpu.close()


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_mla_synthetic_q8_0_past_one_key_tile(tmp_path, form):
    """MLA on the device with Q8_0 projections and attn_k_b / attn_v_b (scripts/make_synthetic_moe.py --arch
    deepseek2: 2 layers, d 256, a latent of 64 + 32 rope dims, 2 shared experts, every layer and the head on the
    device): a 300-row prompt and 4 decode rows give the CPU-only f32 run's logits within 1e-5 of the largest. The
    prompt in three chunks of 100 rows in the expanded form (mla.comp mode 7's keys and values of every position
    so far, the later chunks' over latent rows an earlier chunk wrote, and attn_pre.comp over them from the chunk's
    first position: MLAMixer._mla_expand's choice for each at this shape), or in one chunk absorbed (the expanded
    buffers taken away: mode 2's keys past its first tile of 256, its running max and rescaled sums)."""
    path = build_tiny_moe(tmp_path, ["--arch", "deepseek2", "--layers", "2", "--d", "256", "--heads", "4", "--experts",
                                     "8", "--top-k", "2", "--expert-ff", "128", "--vocab", "300", "--kv-lora-rank",
                                     "64", "--nope", "32", "--rope-dims", "32", "--v-dim", "32"], "ds2.gguf")
    ids = np.random.default_rng(0).integers(0, 300, 304)
    cpu = device_engine(path, ctx=320)
    e = device_engine(path, COLI_VK_LAYERS=-1, ctx=320)

    def run(m):
        c = m.new_cache(320, 320)
        return np.concatenate([m.forward(ids[:300], c, all_logits=True)]
                              + [m.forward([int(t)], c) for t in ids[300:]])

    try:
        dl = e.model.device_layers
        assert dl.first == 0 and dl.head is not None and dl.mla == (4, 64, 32, 32, 32, 0)
        assert {e.model.t[f"blk.0.{n}.weight"].type_name for n in ("attn_q", "attn_kv_a_mqa", "attn_k_b")} == {"Q8_0"}
        assert dl.mla_keys == 320
        if form == "absorbed":
            dl.mla_keys = 0
        else:
            dl.prompt_rows = 100
        ref, got = run(cpu.model), run(e.model)
        expanded = form == "expanded"
        assert (dl.prompt_tokens, dl.prompt_chunks, dl.tokens) == (300, 3 if expanded else 1, 4)
        assert dl.mla_expanded == (3 if expanded else 0)
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
    finally:
        e.close()
        cpu.close()


@pytest.mark.parametrize("arch, experts", [("gptoss", "MXFP4"), ("qwen3next", "Q8_0")])
def test_synthetic_families_every_layer(tmp_path, arch, experts):
    """scripts/make_synthetic_moe.py --arch gptoss / qwen3next, tiny (4 layers, d 256, 4 heads of 64, 8 experts
    top-2): every layer and the head on the device (gpt-oss's windowed layers with sinks, biases and MXFP4 experts;
    Qwen3-Next's three DeltaNet layers then its gated attention, the gated shared expert): a 140-row prompt (past
    gpt-oss's 128-position window) and 4 decode rows give the CPU-only f32 run's logits within 5e-5 of the largest
    (the DeltaNet bound of test_device_deltanet.py), and the device ran every row."""
    path = build_tiny_moe(tmp_path, ["--arch", arch, "--layers", "4", "--d", "256", "--heads", "4", "--kv-heads", "2",
                                     "--head-dim", "64", "--experts", "8", "--top-k", "2", "--expert-ff", "128",
                                     "--vocab", "300"], f"{arch}.gguf")
    ids = np.random.default_rng(1).integers(0, 300, 144)
    cpu = device_engine(path, ctx=160)
    e = device_engine(path, COLI_VK_LAYERS=-1, ctx=160)

    def run(m):
        c = m.new_cache(160, 160)
        return np.concatenate([m.forward(ids[:140], c, all_logits=True)] + [m.forward([int(t)], c) for t in ids[140:]])

    try:
        dl = e.model.device_layers
        assert dl.first == 0 and dl.head is not None
        assert e.model.t["blk.0.ffn_up_exps.weight"].type_name == experts
        if arch == "gptoss":
            assert [d["il"] for d in dl.per if d.get("window")] == [0, 2] and all("sinks" in d for d in dl.per)
        else:
            assert [d["il"] for d in dl.per if "dn" in d] == [0, 1, 2]
        ref, got = run(cpu.model), run(e.model)
        assert (dl.prompt_tokens, dl.tokens) == (140, 4)
        assert rel_err(got, ref) < 5e-5, rel_err(got, ref)
    finally:
        e.close()
        cpu.close()
