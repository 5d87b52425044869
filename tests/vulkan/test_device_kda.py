"""Kimi-Linear's KDA layers on the device (shaders/deltanet.comp's KDA flag: Gated DeltaNet's conv and delta rule
with a decay a key channel and the sigmoid-gated norm; mode 3 the low-rank ssm_f_b / ssm_g_b products), beside its
NoPE MLA layer (shaders/mla.comp): the oracle against HF transformers and the CPU-only run, the states moving both
ways."""
from __future__ import annotations

import numpy as np

from tests.vk_util import check_greedy_like_cpu, decode_rows, device_engine, greedy_rows, rel_err, requires_vulkan
from tests.vulkan.test_device_deltanet import _count_chunked

pytestmark = requires_vulkan


def _no_cpu_kda(monkeypatch):
    """Make the CPU's KDA mixer fail: what runs after this ran on the device."""
    from coli.models import kimi

    def refuse(self, *a, **k):
        raise AssertionError("the CPU ran a KDA layer")

    monkeypatch.setattr(kimi.KDA, "__call__", refuse)


def test_kda_layers_against_hf(monkeypatch):
    """Every layer and the head on the device: three KDA layers (q/k/v through the conv over the device's conv
    state, the per-channel decay exp(ssm_a softplus(ssm_f_b ssm_f_a x + dt)), the delta rule over its recurrent
    state, rmsnorm * sigmoid(ssm_g_b ssm_g_a x)) and the NoPE MLA layer, the leading dense FFN and the sigmoid-routed
    MoE with its shared expert. The 96-row prompt in chunks of 80 (a 64-row block and a 16-row tail, then 16) with
    the delta rule in the chunked form (shaders/dn_chunk.comp's KDA flag) within the CPU path's bound of HF
    transformers' (1e-4 of the largest logit) at every row with HF's argmax, HF's 8 greedy decode rows and tokens;
    the CPU-only f32 run's logits within 2e-5 and its greedy tokens. The CPU's KDA is made to fail meanwhile: the
    device did that work."""
    from tests.conftest import FIXTURES
    from tests.oracle_check import check_prompt_and_decode
    from coli.vulkan import layer_plan

    path = FIXTURES / "oracles" / "kimi.gguf"
    oracle = np.load(FIXTURES / "oracles" / "kimi.npz")
    cpu = device_engine(path, ctx=128)
    e = device_engine(path, COLI_VK_LAYERS=-1, ctx=128)
    try:
        ref = greedy_rows(cpu.model, cpu.model.new_cache(128, 128), oracle["ids"], 8)
        m, dl = e.model, e.model.device_layers
        assert layer_plan.why_not_all(m) == ""
        assert dl is not None and dl.first == 0 and dl.head is not None and dl.kda and dl.mla is not None
        assert [d["il"] for d in dl.per if "dn" in d] == [0, 1, 3] and [d["il"] for d in dl.per if "mla" in d] == [2]
        dl.prompt_rows = 80
        _no_cpu_kda(monkeypatch)
        chunked = _count_chunked(monkeypatch)
        d0 = e.device.layer_dispatches
        got = check_prompt_and_decode(m, m.new_cache(128, 128), oracle)
        assert (dl.prompt_tokens, dl.prompt_chunks, dl.tokens) == (len(oracle["ids"]), 2, 8)
        assert sorted(chunked) == [16] * 3 + [80] * 3      # each chunk length recorded once, every KDA layer chunked
        assert dl.mla_expanded >= 1      # the chunk from position 0 in MLA's expanded form (the NoPE rope part copied)
        assert e.device.layer_dispatches - d0 >= (2 + 8) * 4 * 6
        check_greedy_like_cpu(m, ref, oracle["ids"], got, 2e-5, 2e-5)
    finally:
        e.close()
        cpu.close()


def test_kda_states_move_both_ways():
    """The KDA states and the MLA latent rows stay in step between the CPU's cache and the device's: a prompt on the
    CPU, decode rows on the device (the CPU's states and latent rows uploaded), then decode rows on the CPU from what
    the device wrote back; a device prompt in chunks of 7 rows with the delta rule row by row
    (``COLI_VK_DN_PROMPT=rows``: deltanet.comp mode 4), then decode rows on the CPU: every row's logits within 1e-5
    of the CPU-only run's."""
    from tests.conftest import FIXTURES

    path = FIXTURES / "oracles" / "kimi.gguf"
    ids = [int(t) for t in np.load(FIXTURES / "oracles" / "kimi.npz")["ids"][:24]]
    cpu = device_engine(path, ctx=64)
    e = device_engine(path, COLI_VK_LAYERS=-1, ctx=64)
    m = e.model
    dl = m.device_layers
    try:
        ref, _ = decode_rows(cpu, ids, 16)
        a = m.new_cache(64, 64)
        m.device_layers = None          # the prompt on the CPU
        out = [m.forward(ids[:16], a)]
        m.device_layers = dl
        out += [m.forward([t], a) for t in ids[16:20]]
        assert dl.tokens == 4 and dl.prompt_tokens == 0
        dl.host_kv(a)                   # the states and latent rows the device advanced, into the CPU's cache
        m.device_layers = None          # the rest on the CPU from them
        out += [m.forward([t], a) for t in ids[20:]]
        assert rel_err(np.concatenate(out), ref) < 1e-5
        m.device_layers, dl.prompt_rows, dl.dn_prompt = dl, 7, "rows"
        assert not dl._dn_chunked()
        c = m.new_cache(64, 64)
        out = [m.forward(ids[:16], c)]
        assert dl.prompt_tokens == 16 and dl.prompt_chunks == 3
        dl.host_kv(c)
        m.device_layers = None
        out += [m.forward([t], c) for t in ids[16:]]
        assert rel_err(np.concatenate(out), ref) < 1e-5
    finally:
        m.device_layers = dl
        e.close()
        cpu.close()


def test_kda_qualification():
    """A KDA layer qualifies by what shaders/deltanet.comp takes: a head wider than its shared rows is refused with
    its width, and the run of device layers starts after it."""
    from tests.conftest import FIXTURES
    from coli.engine import Engine
    from coli.vulkan import layer_plan

    e = Engine(FIXTURES / "oracles" / "kimi.gguf", quiet=True, silent=True, save_usage=False, ctx=32)
    try:
        m = e.model
        assert layer_plan.why_not_all(m) == "" and layer_plan.plan(m, 1 << 40, 32)[0] == 0
        m.layers[1].attn.d = 512
        assert layer_plan.why_not(m, 1) == "a DeltaNet key head of 512 dims (the device's takes 256 at most)"
        assert layer_plan.plan(m, 1 << 40, 32)[0] == 2
    finally:
        e.close()
