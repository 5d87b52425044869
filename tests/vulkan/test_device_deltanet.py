"""Gated DeltaNet layers on the device (coli/vulkan/device_layers.py, shaders/deltanet.comp): Qwen3-Next's and
Qwen3.5-MoE's hybrid stacks (DeltaNet layers and gated full attention) whole on the device against HF transformers
and the CPU-only run, the DeltaNet states moving between the CPU's cache and the device's both ways."""
from __future__ import annotations

import numpy as np
import pytest

from tests.vk_util import (check_greedy_like_cpu, decode_rows, device_engine, greedy_rows, lose_device_on_call,
                           rel_err, requires_vulkan)

pytestmark = requires_vulkan


def _no_cpu_deltanet(monkeypatch):
    """Make the CPU's DeltaNet mixer fail: what runs after this ran on the device."""
    from coli.models import deltanet

    def refuse(self, *a, **k):
        raise AssertionError("the CPU ran a DeltaNet layer")

    monkeypatch.setattr(deltanet.GatedDeltaNet, "__call__", refuse)


def _count_chunked(monkeypatch) -> list:
    """Count the prompt chunks' layers whose delta rule took the chunked form (``DeltaNetMixer._dn_chunk_ops``)."""
    from coli.vulkan import layer_families

    calls, real = [], layer_families.DeltaNetMixer._dn_chunk_ops

    def count(self, d, R, x):
        calls.append(R)
        return real(self, d, R, x)

    monkeypatch.setattr(layer_families.DeltaNetMixer, "_dn_chunk_ops", count)
    return calls


@pytest.mark.parametrize("family,rows,bv,tol", [("qwen3next", 80, 16, 7e-5), ("qwen35moe", 40, 4, 5e-5)])
def test_deltanet_layers_against_hf(family, rows, bv, tol, monkeypatch):
    """Every layer and the head on the device: three DeltaNet layers (the conv over the device's conv state, the
    delta rule over its recurrent state in the chunked form, shaders/dn_chunk.comp, the gated norm; Qwen3-Next's
    ssm_ba in HF's grouped head order, Qwen3.5's ssm_beta / ssm_alpha with tiled value heads) and the gated
    full-attention layer (partial NEOX rope, q/k norms, the sigmoid output gate), the MoE with the gated shared
    expert. The 96-row prompt in chunks of 80 rows (a 64-row block and a 16-row tail, then 16) or 40 (a block's
    ragged rows only, the state carried from chunk to chunk; state columns in 4 workgroups a head: COLI_VK_DN_BV 4)
    within the CPU path's bound of HF transformers' (1e-4 of the largest) at every row with HF's argmax, HF's 8
    greedy decode rows and tokens (tests/oracle_check.py); the CPU-only f32 run's logits within ``tol`` (the prompt
    rows: lmm.comp's blocked sums and the chunked form's products against the CPU's recurrence row by row; measured
    5.1e-5 for Qwen3-Next's 64-row block, 6.4e-5 from HF, where the row-by-row form gives 2.8e-5 and 4.1e-5 and the
    CPU run is 2.1e-5 from HF; Qwen3.5 1.4e-5) and 2e-5 (the decode rows), and its greedy tokens. The CPU's DeltaNet
    is made to fail meanwhile: the device did that work."""
    from tests.conftest import FIXTURES
    from tests.oracle_check import check_prompt_and_decode
    from coli.vulkan import layer_plan

    path = FIXTURES / "oracles" / f"{family}.gguf"
    oracle = np.load(FIXTURES / "oracles" / f"{family}.npz")
    cpu = device_engine(path, ctx=128)
    e = device_engine(path, COLI_VK_LAYERS=-1, ctx=128)
    try:
        ref = greedy_rows(cpu.model, cpu.model.new_cache(128, 128), oracle["ids"], 8)
        m, dl = e.model, e.model.device_layers
        assert layer_plan.why_not_all(m) == ""
        assert dl is not None and dl.first == 0 and dl.head is not None and dl.dn is not None
        rec = list(m.args.recurrent)    # qwen3next: layers 0-2 DeltaNet, 3 attention; qwen35moe: 0 and 2, 1 and 3
        assert sum(rec) >= 2 and not all(rec)
        assert [d["il"] for d in dl.per if "dn" in d] == [il for il in range(4) if rec[il]]
        assert [d["il"] for d in dl.per if "gated" in d] == [il for il in range(4) if not rec[il]]
        dl.prompt_rows, dl.dn_bv = rows, bv
        _no_cpu_deltanet(monkeypatch)
        chunked = _count_chunked(monkeypatch)
        d0 = e.device.layer_dispatches
        got = check_prompt_and_decode(m, m.new_cache(128, 128), oracle)
        n = -(-len(oracle["ids"]) // rows)
        assert (dl.prompt_tokens, dl.prompt_chunks, dl.tokens) == (len(oracle["ids"]), n, 8)
        # each distinct chunk length recorded once, with every DeltaNet layer in the chunked form
        lengths = {min(rows, len(oracle["ids"]) - i * rows) for i in range(n)}
        assert sorted(chunked) == sorted(r for r in lengths for _ in range(sum(rec)))
        assert e.device.layer_dispatches - d0 >= (n + 8) * 4 * 6
        check_greedy_like_cpu(m, ref, oracle["ids"], got, tol, 2e-5)
    finally:
        e.close()
        cpu.close()


def test_deltanet_states_move_both_ways(monkeypatch):
    """The DeltaNet states and the attention's K/V stay in step between the CPU's cache and the device's: a prompt on
    the CPU, decode rows on the device (the CPU's states uploaded), two caches taking turns (each one's states
    loaded again in one staging submit, the other's written back at each turn), then decode rows on the CPU from
    the states the device wrote back; a device prompt in chunks of 7 rows with the delta rule row by row
    (``COLI_VK_DN_PROMPT=rows``: deltanet.comp mode 4) on a fresh cache (its zero states recorded as fills: none
    staged), its states the device's only (the CPU's still a fresh cache's zeros) until ``host_kv``, then decode
    rows on the CPU from its states and K/V rows: every row's logits within 1e-5 of the CPU-only run's."""
    from tests.conftest import FIXTURES

    path = FIXTURES / "oracles" / "qwen3next.gguf"
    ids = [int(t) for t in np.load(FIXTURES / "oracles" / "qwen3next.npz")["ids"][:24]]
    cpu = device_engine(path, ctx=64)
    e = device_engine(path, COLI_VK_LAYERS=-1, ctx=64)
    try:
        ref, _ = decode_rows(cpu, ids, 16)
        m, dl = e.model, e.model.device_layers
        a, b = m.new_cache(64, 64), m.new_cache(64, 64)
        m.device_layers = None          # the prompts on the CPU
        out_a, out_b = [m.forward(ids[:16], a)], [m.forward(ids[:16], b)]
        m.device_layers = dl
        dn = [il for il in range(4) if m.args.recurrent[il]]
        staged = lambda: getattr(dl.dev, "staged_bytes", 0)  # noqa: E731
        s0 = staged()
        for t in ids[16:20]:            # the two caches in turn on the device
            out_a.append(m.forward([t], a))
            out_b.append(m.forward([t], b))
        assert dl.tokens == 8 and dl.prompt_tokens == 0
        # each turn uploads the other cache's states (every layer's in one staging submit)
        assert staged() - s0 == 8 * sum(a.layers[il].nbytes() for il in dn)
        m.device_layers = None          # the rest of a on the CPU, from the states the device wrote back
        out_a += [m.forward([t], a) for t in ids[20:]]
        assert rel_err(np.concatenate(out_a), ref) < 1e-5
        assert rel_err(np.concatenate(out_b), ref[:len(out_b)]) < 1e-5
        m.device_layers, dl.prompt_rows, dl.dn_prompt = dl, 7, "rows"
        assert not dl._dn_chunked() and dl._dn_rec_mode() == 4
        chunked = _count_chunked(monkeypatch)
        c = m.new_cache(64, 64)
        s0 = staged()
        out = [m.forward(ids[:16], c)]
        assert dl.prompt_tokens == 16 and dl.prompt_chunks == 3 and chunked == []
        # a fresh cache's zero states: fills recorded, none staged (the chunk's own first buffers are: 56 bytes)
        assert staged() - s0 < min(c.layers[il].nbytes() for il in dn)
        assert not any(c.layers[il].state.any() or c.layers[il].conv.any() for il in dn)
        dl.host_kv(c)
        assert all(c.layers[il].state.any() and c.layers[il].conv.any() for il in dn)
        m.device_layers = None
        out += [m.forward([t], c) for t in ids[16:]]
        assert rel_err(np.concatenate(out), ref) < 1e-5
    finally:
        m.device_layers = dl
        e.close()
        cpu.close()


def test_deltanet_qualification():
    """A DeltaNet layer qualifies by what the device's kernels take: a key head wider than shaders/deltanet.comp's
    shared rows is refused with its width."""
    from tests.conftest import FIXTURES
    from coli.engine import Engine
    from coli.vulkan import layer_plan

    e = Engine(FIXTURES / "oracles" / "qwen3next.gguf", quiet=True, silent=True, save_usage=False, ctx=32)
    try:
        m = e.model
        assert layer_plan.why_not_all(m) == "" and layer_plan.plan(m, 1 << 40, 32)[0] == 0
        m.layers[1].linear_attn.dk = 512
        assert layer_plan.why_not(m, 1) == "a DeltaNet key head of 512 dims (the device's takes 256 at most)"
        assert layer_plan.plan(m, 1 << 40, 32)[0] == 2
    finally:
        e.close()


@pytest.mark.parametrize("fail_at", ["decode", "prompt"])
def test_deltanet_device_failure_after_a_device_prompt(monkeypatch, fail_at):
    """The device fails at a decode row after it ran a prompt (chunks of 7) and decode rows, or at the prompt's
    second chunk: the CPU's cache still holds a fresh cache's DeltaNet states and no K/V row (every row is the
    device's only), so the CPU computes the rows before the failed call again from the kept input rows over those
    states (``recompute_on_cpu``; none for the prompt: its whole forward runs again on the CPU, over the states the
    first chunk did not write back) and goes on from there: every row's logits within 1e-5 of the CPU-only run's,
    the greedy ids equal."""
    from tests.conftest import FIXTURES

    path = FIXTURES / "oracles" / "qwen3next.gguf"
    ids = [int(t) for t in np.load(FIXTURES / "oracles" / "qwen3next.npz")["ids"][:22]]
    cpu = device_engine(path, ctx=64)
    e = device_engine(path, COLI_VK_LAYERS=-1, ctx=64)
    try:
        ref, _ = decode_rows(cpu, ids, 16)
        m, dl = e.model, e.model.device_layers
        dl.prompt_rows = 7
        c = m.new_cache(64, 64)
        if fail_at == "prompt":
            lose_device_on_call(monkeypatch, dl.K, "submit", 2, after=True)
            got = [m.forward(ids[:16], c)]
            assert m.device_layers is None and dl.prompt_chunks == 1
        else:
            got = [m.forward(ids[:16], c)] + [m.forward([t], c) for t in ids[16:18]]
            assert (dl.prompt_chunks, dl.tokens) == (3, 2) and (dl._lo, dl._hi) == (0, 18)
            lose_device_on_call(monkeypatch, dl.K, "submit", 1, after=True)
        got += [m.forward([t], c) for t in ids[16 + len(got) - 1:]]
        assert m.device_layers is None
        got = np.concatenate(got)
        assert rel_err(got, ref) < 1e-5, rel_err(got, ref)
        assert (got.argmax(1) == ref.argmax(1)).all()
    finally:
        e.close()
        cpu.close()
